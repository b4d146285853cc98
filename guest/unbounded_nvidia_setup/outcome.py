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
    unusable 2 15 /dev/nvidia2 GPU-1b2c... 0000:37:00.0 nvmlDeviceGetHandleByIndex_v2 -
    unusable 3 10 /dev/nvidia3 GPU-9f0e... 0000:47:00.0 nvmlDeviceGetMigMode 10
                                  (gpus.Gpu.record: index, code (10: no answer),
                                   device, uuid, bus id, the call, the seconds given)
    node_error 8                  (NVML failed for the attached devices as a whole)
    serves_none 1                 (no GPU usable: no spec installed)
    kernel 4-1a2b3c4d             (gpus.fingerprint when the GPUs were last asked)
    attempts 2                    (reloads since then that left the node as degraded)
    reload_exit_code 1            (the last reload, when it failed)
    reload_finished_at 1796400300.5
    reload_error nvidia-ctk cdi generate did not finish within 120 s

An older record's `lost <index> <device> <uuid> <bus>` line reads as `unusable` with 15,
and its `unusable` lines without the call and seconds as calls not known.
"""

from __future__ import annotations

import time

from . import log
from .config import Machine
from .gpus import Gpu, NodeGpus
from .tree import write_atomically

RUN, RELOAD = "run", "run --spec-only"


class Outcome:
    __slots__ = ("command", "error", "exit_code", "finished_at", "gpus", "reload_error",
                 "reload_exit_code", "reload_finished_at")

    def __init__(self, command: str, exit_code: int, finished_at: float,
                 error: str | None = None, gpus: NodeGpus | None = None) -> None:
        self.command = command
        self.exit_code = exit_code
        self.finished_at = finished_at
        self.error = error
        self.gpus = gpus or NodeGpus()
        # The last reload, when it failed after this outcome (it changed nothing).
        self.reload_exit_code: int | None = None
        self.reload_finished_at: float | None = None
        self.reload_error: str | None = None

    @property
    def failed(self) -> bool:
        return self.exit_code != 0

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
    lines += outcome.gpus.record()
    if outcome.reload_exit_code is not None:
        lines.append(f"reload_exit_code {outcome.reload_exit_code}")
        lines.append(f"reload_finished_at {outcome.reload_finished_at or 0.0:.3f}")
        if outcome.reload_error:
            lines.append(f"reload_error {log.one_line(outcome.reload_error)}")
    return "\n".join(lines) + "\n"


def parse(text: str) -> Outcome | None:
    """None when the text is not a record this tool wrote."""
    fields: dict[str, str] = {}
    unusable: list[Gpu] = []
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("lost", "unusable"):
            gpu = Gpu.from_record(key, value)
            if gpu is None:
                return None
            unusable.append(gpu)
        else:
            fields[key] = value
    try:
        node = fields.get("node_error")
        gpus = NodeGpus(unusable, int(node) if node is not None else None,
                        serves=fields.get("serves_none") != "1", kernel=fields.get("kernel"),
                        attempts=int(fields.get("attempts", "0")))
        outcome = Outcome(fields["command"], int(fields["exit_code"]),
                          float(fields["finished_at"]), fields.get("error"), gpus)
        if "reload_exit_code" in fields:
            outcome.reload_exit_code = int(fields["reload_exit_code"])
            outcome.reload_finished_at = float(fields.get("reload_finished_at", "0"))
            outcome.reload_error = fields.get("reload_error")
    except (KeyError, ValueError):
        return None
    return outcome


def ended(machine: Machine, command: str, exit_code: int, error: str | None,
          gpus: NodeGpus) -> Outcome:
    """The record a run or reload that ended so leaves. A failed run keeps the previous
    spec live, and with it the GPUs its run left out. A failed reload changed nothing:
    the record stays the previous one's, with the reload's failure beside it, and it
    counts towards the drift check's backoff (drift.py) like a reload that leaves a
    degraded node degraded."""
    now = time.time()
    if exit_code == 0 and not (command == RELOAD and gpus.degraded):
        return Outcome(command, exit_code, now, None, gpus)
    previous = read(machine)  # only where it matters: not on every boot
    if exit_code != 0 and previous is not None:
        if command == RELOAD and not previous.failed:
            previous.reload_exit_code, previous.reload_finished_at = exit_code, now
            previous.reload_error = error
            previous.gpus.attempts += previous.gpus.degraded
            return previous
        return Outcome(command, exit_code, now, error, previous.gpus)
    if exit_code != 0:
        return Outcome(command, exit_code, now, error)
    return Outcome(command, exit_code, now, None,
                   gpus.counted_after(previous.gpus if previous is not None else None))


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
    from .gpus import read_small  # a regular file's first 16 KiB: a record is ~1 KiB

    text = read_small(machine.last_run)
    return parse(text) if text else None


def remove(machine: Machine) -> None:
    machine.last_run.unlink(missing_ok=True)


def when(outcome: Outcome) -> str:
    return when_at(outcome.finished_at)


def when_at(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
