"""Metrics for node_exporter's textfile collector: `unbounded_nvidia_setup.prom`.

Rendered by hand: prometheus_client costs ~65 ms to import, on every boot of every GPU
node, for a few lines of text (it is the tests' parsing oracle instead). Only `os`,
`stat` and `time` here: nothing this module does may cost the boot path measurably.

One file, two writers: a `run` writes everything; `check --metrics` writes the state and
check families and carries the last run's families over from the file it replaces. A
run that failed before it could prove its end state carries the last check's over.
Writers serialize on an flock of a lock file of root's beside it (mode 0600: no other
user can open it, so none can hold it), so a carry-over never loses a newer run.

The directory belongs to node_exporter's package and may be writable by others, so
nothing in it is trusted: the directory is opened without following a symlink, every
name is used relative to that descriptor, our file is never opened for writing (a FIFO
or a symlink by its name is replaced by the rename, never written through), and the
file read for the carry-over is read only when it is a regular file. Writing metrics
never changes how a command ends: a failure is one warning line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import log, outcome
from .gpus import METRICS, NodeGpus
from .outcome import RELOAD, RUN
from .problems import PROBLEM_CODES

if TYPE_CHECKING:
    from pathlib import Path

    from .config import Machine
    from .state import Report

FILE = "unbounded_nvidia_setup.prom"
_TMP = f".{FILE}.tmp"  # not *.prom: node_exporter never reads a half-written file
LOCK = f".{FILE}.lock"
PREFIX = "unbounded_nvidia_setup_"
_RUN_PREFIX = f"{PREFIX}run_"
_RELOAD_PREFIX = f"{PREFIX}reload_"
_LOCK_WAIT = 2.0  # seconds; another writer holds the flock only for a few syscalls
_CARRY_MAX = 1 << 16



class RunRecord:
    """What a `run` did, filled in as it goes; written once, however the run ends. A
    plain class: @dataclass generates its methods with exec() at import, ~1 ms of the
    boot path."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.machine: Machine | None = None  # None until the config was read
        self.swapped = False
        self.report: Report | None = None  # the end state the run proved (check's report)
        self.no_gpu = False  # proved without check: no GPU, and nothing of ours left
        self.checked_at = 0.0
        self.command = RUN  # or RELOAD
        self.error: str | None = None  # the failure's one line
        self.gpus = NodeGpus()  # what NVML said of the GPUs (degrade.py), if asked
        # A run that never got the lock (exit 75) did nothing: the outcome on record is the
        # lock holder's to write, not replaced by "another run holds the lock".
        self.held_lock = False

    def finish(self, exit_code: int) -> None:
        if self.machine is None:
            return
        if self.held_lock:
            outcome.write(self.machine, outcome.ended(self.machine, self.command, exit_code,
                                                      self.error, self.gpus))
        now = time.time()
        lines = list(_run_lines(exit_code, time.monotonic() - self.started, now, self.swapped,
                                "reload_" if self.command == RELOAD else "run_"))
        check = None
        if self.report is not None:
            check = _report_lines(self.report, self.checked_at)
        elif self.no_gpu:
            check = list(_check_lines(False, None, None, {}, [], self.checked_at, gpus={}))
        # A reload's outcome is its own families: a reload that fails changed nothing, so
        # the run's families (and the critical alert on them) keep saying how the state
        # that is live came to be (docs/alerts.yml).
        if self.command == RELOAD:
            write(self.machine, run=None, reload=lines, check=check)
        else:
            write(self.machine, run=lines, check=check)


def write_check(machine: Machine, report: Report, checked_at: float) -> bool:
    """Write the check's families; whether its problems (check_ok and the count of each
    code) differ from the check's the file held before, True when that cannot be told:
    the drift check's tick says nothing in the journal when they do not (cli.check)."""
    lines = _report_lines(report, checked_at)
    previous = write(machine, run=None, check=lines)
    return previous is None or _problems(previous.splitlines()) != _problems(lines)


def _problems(lines: list[str]) -> list[str]:
    return sorted(line for line in lines
                  if line.startswith((f"{PREFIX}check_problems{{", f"{PREFIX}check_ok ")))


def _report_lines(report: Report, checked_at: float) -> list[str]:
    return list(_check_lines(report.gpu, report.driver_version, report.module_version,
                             report.sections.get("driver_root", {}),
                             [p.code for p in report.causes()[0]], checked_at,
                             len(report.left_out), report.sections.get("gpus", {})))


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(round(value, 6))


def _label(value: str | None) -> str:
    text = value or ""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _gauge(name: str, help_text: str, value: object) -> Iterator[str]:
    yield from _family(name, "gauge", help_text)
    yield f"{PREFIX}{name} {value}"


def _run_lines(code: int, duration: float, now: float, swapped: bool,
               family: str = "run_") -> Iterator[str]:
    what = "reload (systemctl reload: the spec only)" if family == "reload_" else "run"
    yield from _gauge(f"{family}success", f"1 when the last {what} succeeded, else 0.",
                      int(code == 0))
    yield from _gauge(f"{family}exit_code", f"Exit status of the last {what}.", code)
    yield from _gauge(f"{family}timestamp_seconds", f"Unix time at which the last {what} "
                      "ended.", _number(now))
    yield from _gauge(f"{family}duration_seconds", f"How long the last {what} took.",
                      _number(duration))
    if family == "run_":
        yield from _gauge("run_swapped", "1 when the last run swapped in a new driver root "
                          "generation.", int(swapped))


def _check_lines(gpu: bool, driver_version: str | None, module_version: str | None,
                 root: dict[str, Any], codes: list[str], checked_at: float,
                 left_out: int = 0, gpus: dict[str, Any] | None = None) -> Iterator[str]:
    yield from _family("driver_info", "gauge", "Driver version of the driver root and "
                       "version of the loaded kernel module (empty when unknown).")
    yield (f'{PREFIX}driver_info{{driver_version="{_label(driver_version)}",'
           f'module_version="{_label(module_version)}"}} 1')
    yield from _gauge("gpu_present", "1 when the machine has NVIDIA devices.", int(gpu))
    for name, help_text, value in METRICS:
        yield from _gauge(name, help_text, value(gpus or {}))
    yield from _gauge("driver_root_files", "Regular files in the driver root.",
                      root.get("files", 0))
    yield from _gauge("driver_root_bytes", "Bytes in the driver root's files.",
                      root.get("bytes", 0))
    yield from _gauge("staging_left_out_files", "Staged driver libraries the last check's "
                      "plan left out of the root (a damaged host driver installation; not a "
                      "problem: `check --json` lists them).", left_out)
    yield from _gauge("check_ok", "1 when the last check found no problem.", int(not codes))
    yield from _gauge("check_timestamp_seconds", "Unix time of the last check (a run's "
                      "end-state check included).", _number(checked_at))
    yield from _family("check_problems", "gauge", "Problems of each code the last check "
                       "found (docs/problems.md).")
    counts = dict.fromkeys(PROBLEM_CODES, 0)
    for code in codes:
        counts[code] = counts.get(code, 0) + 1
    for code, count in counts.items():
        yield f'{PREFIX}check_problems{{code="{_label(code)}"}} {count}'


def _group(name: str) -> str:
    if name.startswith(_RUN_PREFIX):
        return "run"
    return "reload" if name.startswith(_RELOAD_PREFIX) else "check"


def _carried(text: str, group: str) -> list[str]:
    """The lines of the previous file's families of `group` (run, reload or check)."""
    kept = []
    for line in text.splitlines():
        parts = line.split()
        name = parts[2] if line.startswith("# ") and len(parts) > 2 else line.split("{")[0]
        if name.startswith(PREFIX) and _group(name) == group:
            kept.append(line)
    return kept


def write(machine: Machine, *, run: list[str] | None, check: list[str] | None,
          reload: list[str] | None = None) -> str | None:
    """Replace the file with `run`, `reload` and `check` lines, keeping the previous
    file's lines for whichever is None; the previous file's text when it was read for
    that (None: not read, or not written). Never raises: metrics must not change a
    command's outcome."""
    directory = machine.metrics_dir
    if directory is None:
        return None
    try:
        dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # no node_exporter here: no file, no message
    except OSError as e:
        why = "it is a symlink" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
        log.warn(f"metrics not written: cannot open {directory} ({why}); "
                 "set metrics_dir to a real directory, or to '' to turn metrics off")
        return None
    try:
        return _write_in(dirfd, directory, {"run": run, "reload": reload, "check": check})
    except OSError as e:
        log.warn(f"metrics not written to {directory}/{FILE}: {e.strerror}; "
                 "node_exporter keeps the previous values")
        return None
    finally:
        os.close(dirfd)


def _write_in(dirfd: int, directory: Path,
              groups: dict[str, list[str] | None]) -> str | None:
    lock = _lock(dirfd, directory / LOCK)
    try:
        return _write_locked(dirfd, groups)
    finally:
        os.close(lock)


def _write_locked(dirfd: int, groups: dict[str, list[str] | None]) -> str | None:
    previous = None
    if any(lines is None for lines in groups.values()):
        previous = _read_previous(dirfd)
        groups = {g: _carried(previous, g) if lines is None else lines
                  for g, lines in groups.items()}
    data = "".join(f"{line}\n" for g in ("run", "reload", "check")
                   for line in groups[g] or []).encode()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_TMP, dir_fd=dirfd)  # a writer killed mid-way; we hold the flock
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(_TMP, flags, 0o644, dir_fd=dirfd)
    try:
        try:
            os.fchmod(fd, 0o644)  # whatever the umask: node_exporter runs as its own user
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(_TMP, FILE, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        os.unlink(_TMP, dir_fd=dirfd)
        raise
    os.fsync(dirfd)
    return previous


def _lock(dirfd: int, path: Path) -> int:
    """flock our lock file, bounded. Not the directory: any user can open that and hold an
    flock on it for ever (issue 37). The file is ours and 0600, so no other user can
    open, let alone hold it."""
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(LOCK, flags, 0o600, dir_fd=dirfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} is not a file of ours that only we can open "
                      "(remove it)")
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise OSError(errno.EWOULDBLOCK, f"another writer holds {path} for more "
                              f"than {_LOCK_WAIT:g} s") from None
            time.sleep(0.05)


def _read_previous(dirfd: int) -> str:
    """The current file's text; empty unless it is a regular file (O_NONBLOCK: opening a
    FIFO by that name must not wait for a writer)."""
    try:
        fd = os.open(FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dirfd)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, _CARRY_MAX).decode(errors="replace")
    finally:
        os.close(fd)
