"""How the last `run` ended, for `check` and `status`: its exit status, its error line and
the GPUs it found lost.

A failed restart keeps the previous driver root and spec live (reconcile.Undo), so the
files alone look `ready` while containerd and kubelet are down and the unit retries:
`check` must say that the last run failed, and why, in the run's own words (issue 27).
The record is one small file on /run, replaced by rename at the end of every run (a
boot starts without one), and read as a fact beside the files, like the unit's state: it
never makes `check` skip a check of the files themselves. Its lines are `key value`
(json would be one more import on every boot's path for five values):

    command run
    exit_code 1
    finished_at 1796400000.123
    error nvidia-ctk cdi generate failed (exit status 1: ...)
    lost 2 /dev/nvidia2 GPU-1b2c... 0000:37:00.0
"""

from __future__ import annotations

import time

from . import log
from .atomic import write_atomically
from .config import Machine

RUN, RELOAD = "run", "run --spec-only"


# Plain classes, not frozen dataclasses: both are made on every boot's path, where a
# dataclass costs about 3M instructions to create (docs/performance.md).
class LostGpu:
    """A GPU that NVML reported lost (NVML_ERROR_GPU_IS_LOST): its NVML index, and what
    the kernel module lists for it (None where it lists nothing)."""

    __slots__ = ("bus_id", "device", "index", "uuid")

    def __init__(self, index: int, device: str | None = None, uuid: str | None = None,
                 bus_id: str | None = None) -> None:
        self.index = index
        self.device = device  # /dev/nvidia<minor>
        self.uuid = uuid
        self.bus_id = bus_id

    def _key(self) -> tuple[int, str | None, str | None, str | None]:
        return self.index, self.device, self.uuid, self.bus_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LostGpu) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "LostGpu({!r}, {!r}, {!r}, {!r})".format(*self._key())


class Outcome:
    __slots__ = ("command", "error", "exit_code", "finished_at", "lost")

    def __init__(self, command: str, exit_code: int, finished_at: float,
                 error: str | None = None, lost: tuple[LostGpu, ...] = ()) -> None:
        self.command = command
        self.exit_code = exit_code
        self.finished_at = finished_at
        self.error = error
        self.lost = lost

    @property
    def failed(self) -> bool:
        return self.exit_code != 0

    def __repr__(self) -> str:
        return (f"Outcome({self.command!r}, {self.exit_code}, {self.finished_at!r}, "
                f"{self.error!r}, {self.lost!r})")


def render(outcome: Outcome) -> str:
    lines = [f"command {outcome.command}", f"exit_code {outcome.exit_code}",
             f"finished_at {outcome.finished_at:.3f}"]
    if outcome.error:
        lines.append(f"error {log.one_line(outcome.error)}")
    lines += [" ".join(["lost", str(g.index), g.device or "-", g.uuid or "-", g.bus_id or "-"])
              for g in outcome.lost]
    return "\n".join(lines) + "\n"


def parse(text: str) -> Outcome | None:
    """None when the text is not a record this tool wrote."""
    fields: dict[str, str] = {}
    lost: list[LostGpu] = []
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "lost":
            parts = value.split(" ")
            if len(parts) != 4 or not parts[0].isdigit():
                return None
            device, uuid, bus = (None if p == "-" else p for p in parts[1:])
            lost.append(LostGpu(int(parts[0]), device, uuid, bus))
        else:
            fields[key] = value
    try:
        return Outcome(fields["command"], int(fields["exit_code"]),
                       float(fields["finished_at"]), fields.get("error"), tuple(lost))
    except (KeyError, ValueError):
        return None


def write(machine: Machine, outcome: Outcome) -> None:
    """Never raises: how the run ended was decided before this. A record that cannot be
    replaced is removed if it can be: `check` then names no run rather than an older
    one (a failure this run may have mended)."""
    try:
        write_atomically(machine.last_run, render(outcome).encode(), sync=False)
    except OSError as e:
        log.warn(f"cannot record how this run ended in {machine.last_run}: {e.strerror}; "
                 "`check` reports no last run")
        try:
            remove(machine)
        except OSError as e:
            log.warn(f"cannot remove the older record {machine.last_run}: {e.strerror}; "
                     "`check` may name an older run's outcome until the next run")


def read(machine: Machine) -> Outcome | None:
    """The last run's outcome; None without one (no run since boot)."""
    try:
        return parse(machine.last_run.read_text(errors="replace"))
    except OSError:
        return None


def remove(machine: Machine) -> None:
    machine.last_run.unlink(missing_ok=True)


def when(outcome: Outcome) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(outcome.finished_at))
