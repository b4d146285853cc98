"""How the last `run` ended, for `check` and `status`: its exit status, its error line and
the GPUs it found lost.

A failed restart keeps the previous driver root and spec live (reconcile.Undo), so the
files alone look `ready` while containerd and kubelet are down and the unit retries:
`check` must say that the last run failed, and why, in the run's own words (issue 27).
A failed reload is different: it changed nothing and stopped nothing, so what is live is
still what the run before it left, and the record keeps that run's outcome beside the
reload's (issue 31: a degraded node never gets worse by itself).
The record is one small file on /run, replaced by rename at the end of every run (a
boot starts without one), and read as a fact beside the files, like the unit's state: it
never makes `check` skip a check of the files themselves. Its lines are `key value`
(json would be one more import on every boot's path for a few values):

    command run
    exit_code 0
    finished_at 1796400000.123
    error nvidia-ctk cdi generate failed (exit status 1: ...)
    unusable 2 15 /dev/nvidia2 GPU-1b2c... 0000:37:00.0
    node_error 8                  (NVML failed for the attached devices as a whole)
    serves_none 1                 (no GPU usable: no spec installed)
    kernel 4-1a2b3c4d             (gpus.fingerprint when the GPUs were last asked)
    attempts 2                    (reloads since then that left the node as degraded)
    reload_exit_code 1            (the last reload, when it failed)
    reload_finished_at 1796400300.5
    reload_error nvidia-ctk cdi generate did not finish within 120 s

An older record's `lost <index> <device> <uuid> <bus>` line reads as `unusable` with 15.
"""

from __future__ import annotations

import time

from . import log
from .atomic import write_atomically
from .config import Machine

RUN, RELOAD = "run", "run --spec-only"


GPU_IS_LOST = 15  # nvml.GPU_IS_LOST, without importing nvml on every boot


# Plain classes, not frozen dataclasses: both are made on every boot's path, where a
# dataclass costs about 3M instructions to create (docs/performance.md).
class UnusableGpu:
    """A GPU whose own NVML lookup by index failed: its NVML index, the return code, and
    what the kernel module lists for it (None where it lists nothing)."""

    __slots__ = ("bus_id", "code", "device", "index", "uuid")

    def __init__(self, index: int, code: int = GPU_IS_LOST, device: str | None = None,
                 uuid: str | None = None, bus_id: str | None = None) -> None:
        self.index = index
        self.code = code
        self.device = device  # /dev/nvidia<minor>
        self.uuid = uuid
        self.bus_id = bus_id

    def _key(self) -> tuple[int, int, str | None, str | None, str | None]:
        return self.index, self.code, self.device, self.uuid, self.bus_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnusableGpu) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "UnusableGpu({!r}, {!r}, {!r}, {!r}, {!r})".format(*self._key())


class Gpus:
    """What the run that generated the live spec found of the GPUs: those NVML could not
    use, an error of all attached devices, whether any GPU is served, the kernel's view
    then (gpus.fingerprint) and how many reloads since left the node as it is."""

    __slots__ = ("attempts", "kernel", "node_error", "serves_none", "unusable")

    def __init__(self, unusable: tuple[UnusableGpu, ...] = (), node_error: int | None = None,
                 serves_none: bool = False, kernel: str | None = None,
                 attempts: int = 0) -> None:
        self.unusable = unusable
        self.node_error = node_error
        self.serves_none = serves_none
        self.kernel = kernel
        self.attempts = attempts

    @property
    def degraded(self) -> bool:
        return bool(self.unusable) or self.serves_none

    def __repr__(self) -> str:
        return (f"Gpus({self.unusable!r}, {self.node_error!r}, {self.serves_none!r}, "
                f"{self.kernel!r}, {self.attempts!r})")


class Outcome:
    __slots__ = ("command", "error", "exit_code", "finished_at", "gpus", "reload_error",
                 "reload_exit_code", "reload_finished_at")

    def __init__(self, command: str, exit_code: int, finished_at: float,
                 error: str | None = None, gpus: Gpus | None = None) -> None:
        self.command = command
        self.exit_code = exit_code
        self.finished_at = finished_at
        self.error = error
        self.gpus = gpus or Gpus()
        # The last reload, when it failed after this outcome (it changed nothing).
        self.reload_exit_code: int | None = None
        self.reload_finished_at: float | None = None
        self.reload_error: str | None = None

    @property
    def failed(self) -> bool:
        return self.exit_code != 0

    @property
    def unusable(self) -> tuple[UnusableGpu, ...]:
        return self.gpus.unusable

    @property
    def last_attempt(self) -> float:
        """When NVML was last asked for this node's GPUs (a run, or a reload since)."""
        return max(self.finished_at, self.reload_finished_at or 0.0)

    def __repr__(self) -> str:
        return (f"Outcome({self.command!r}, {self.exit_code}, {self.finished_at!r}, "
                f"{self.error!r}, {self.gpus!r})")


def render(outcome: Outcome) -> str:
    lines = [f"command {outcome.command}", f"exit_code {outcome.exit_code}",
             f"finished_at {outcome.finished_at:.3f}"]
    if outcome.error:
        lines.append(f"error {log.one_line(outcome.error)}")
    gpus = outcome.gpus
    lines += [" ".join(["unusable", str(g.index), str(g.code), g.device or "-", g.uuid or "-",
                        g.bus_id or "-"]) for g in gpus.unusable]
    if gpus.node_error is not None:
        lines.append(f"node_error {gpus.node_error}")
    if gpus.serves_none:
        lines.append("serves_none 1")
    if gpus.kernel:
        lines.append(f"kernel {gpus.kernel}")
    if gpus.attempts:
        lines.append(f"attempts {gpus.attempts}")
    if outcome.reload_exit_code is not None:
        lines.append(f"reload_exit_code {outcome.reload_exit_code}")
        lines.append(f"reload_finished_at {outcome.reload_finished_at or 0.0:.3f}")
        if outcome.reload_error:
            lines.append(f"reload_error {log.one_line(outcome.reload_error)}")
    return "\n".join(lines) + "\n"


def _gpu(key: str, value: str) -> UnusableGpu | None:
    parts = value.split(" ")
    if key == "lost":  # an older record's line: NVML's GPU_IS_LOST
        parts = [parts[0], str(GPU_IS_LOST), *parts[1:]]
    if len(parts) != 5 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    device, uuid, bus = (None if p == "-" else p for p in parts[2:])
    return UnusableGpu(int(parts[0]), int(parts[1]), device, uuid, bus)


def parse(text: str) -> Outcome | None:
    """None when the text is not a record this tool wrote."""
    fields: dict[str, str] = {}
    unusable: list[UnusableGpu] = []
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("lost", "unusable"):
            gpu = _gpu(key, value)
            if gpu is None:
                return None
            unusable.append(gpu)
        else:
            fields[key] = value
    try:
        node = fields.get("node_error")
        gpus = Gpus(tuple(unusable), int(node) if node is not None else None,
                    fields.get("serves_none") == "1", fields.get("kernel"),
                    int(fields.get("attempts", "0")))
        outcome = Outcome(fields["command"], int(fields["exit_code"]),
                          float(fields["finished_at"]), fields.get("error"), gpus)
        if "reload_exit_code" in fields:
            outcome.reload_exit_code = int(fields["reload_exit_code"])
            outcome.reload_finished_at = float(fields.get("reload_finished_at", "0"))
            outcome.reload_error = fields.get("reload_error")
    except (KeyError, ValueError):
        return None
    return outcome


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
