"""One time budget for a command that changes state (`run`, `clean`): every wait takes
what is left of it, so whatever hangs ends in the tool's own words before systemd's
TimeoutStartSec kills the run (docs/architecture.md, "The time budget").

`check` and `status` have no budget: they never wait for the lock, and their one external
program (`ldconfig -p`) keeps its own fixed limit."""

from __future__ import annotations

import time
from dataclasses import dataclass

KEY = "run_timeout_seconds"
# The last eighth of the budget is kept back for putting the previous state back after a
# failure: the waits before it stop earlier, so a rollback never starts with nothing left.
RESERVE_SHARE = 1 / 8
# The rollback's ldconfig may use half of what is kept back; the other half is for what
# follows it (the metrics file, whose flock waits up to 2 s, and exiting). An ldconfig
# that hung forward usually hangs again: it gets a bounded slice, not the whole reserve.
ROLLBACK_LDCONFIG_SHARE = 1 / 2
# Less than this cannot hold a run even when nothing waits (the interpreter, discovery,
# the copy and the end-state check take a few hundred milliseconds).
MIN_SECONDS = 1.0


@dataclass(frozen=True)
class Limit:
    """How long one wait may take: `seconds` (None: no limit), and whether the run's
    budget set it rather than the wait's own setting (the message then says so: the
    operator must know which key to look at)."""

    seconds: float | None
    by_budget: bool = False
    total: float = 0.0  # the budget, for the message
    part: str = "the run's time budget"  # which part of it, for the message

    def text(self) -> str:
        """The limit for a message: `5 s`; budget slices in tenths (`4.4 s`)."""
        if self.seconds is None:
            return "no limit"
        return f"{round(self.seconds, 1) if self.by_budget else self.seconds:g} s"

    def because(self) -> str:
        """What to append to a message about this limit running out."""
        if not self.by_budget:
            return ""
        return f": {self.part} ({KEY}: {self.total:g}) ran out"


def cap(own: float | None, left: float, total: float,
        part: str = "the run's time budget") -> Limit:
    """The wait's own limit (None: none), or what is left of the budget (`part` of it)
    when that ends first. Pure: the arithmetic of every wait."""
    if own is not None and own <= left:
        return Limit(own)
    return Limit(max(0.0, left), by_budget=True, total=total, part=part)


@dataclass(frozen=True)
class Budget:
    """`total` seconds from a start; `ends` is the time.monotonic() by which the command
    has ended."""

    total: float
    ends: float

    @classmethod
    def starting(cls, total: float, start: float) -> Budget:
        return cls(total, start + total)

    @property
    def reserve(self) -> float:
        return self.total * RESERVE_SHARE

    def left_at(self, now: float, *, rollback: bool = False) -> float:
        """Seconds a wait starting at `now` may take. Forward waits stop where the reserve
        begins; the rollback's ldconfig may use its slice of the reserve, and no more
        than leaves the rest of the reserve for what follows it."""
        if not rollback:
            return self.ends - self.reserve - now
        kept_after = self.reserve * (1 - ROLLBACK_LDCONFIG_SHARE)
        return min(self.reserve * ROLLBACK_LDCONFIG_SHARE, self.ends - kept_after - now)

    def limit(self, own: float | None, *, rollback: bool = False) -> Limit:
        left = self.left_at(time.monotonic(), rollback=rollback)
        if rollback:
            return cap(own, left, self.total, "the rollback's share of the run's time budget")
        return cap(own, left, self.total)

    def exhausted(self) -> bool:
        """True once nothing is left for a forward step."""
        return self.left_at(time.monotonic()) <= 0
