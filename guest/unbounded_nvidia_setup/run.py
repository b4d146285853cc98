"""The one way this tool runs other programs: logged, bounded in time, never a traceback."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from . import log
from .budget import Limit
from .log import die

# After the SIGKILL of a program's group, what is left in its pipes is read for this long.
# A descendant that made a session of its own (a daemonised helper) escaped the group
# kill and may hold the pipes open for ever: end-of-file is not waited for beyond this.
# Reading what a dead program left in a pipe takes microseconds; this is room, not need.
KILL_GRACE_SECONDS = 0.5


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def why(self) -> str:
        """How the program failed, in one line (its last line of stderr, or the signal)."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        lines = [line for line in (self.stderr or self.stdout).splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "no output"
        return f"exit status {self.returncode}: {last}"


def find_program(name: str, config_key: str) -> str:
    """A program name from the config, found on PATH, or an absolute path that exists."""
    path = name if name.startswith("/") else shutil.which(name)
    if path is None or not os.access(path, os.X_OK):
        die(f"{name} not found" + ("" if name.startswith("/") else " on PATH"),
            hint=f"install it or set '{config_key}' in the config to its absolute path")
    return path


class Started:
    """A program started in the background; wait() collects it. Used as a context
    manager, a program not waited for (the caller failed meanwhile) is killed."""

    def __init__(self, argv: list[str], limit: Limit, quiet: bool = False) -> None:
        (log.debug if quiet else log.info)(f"running: {shlex.join(argv)}")
        self.argv = argv
        self.limit = limit
        self.killed = False
        self.deadline = None if limit.seconds is None else time.monotonic() + limit.seconds
        self.result: Result | None = None
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as e:
            die(f"cannot run {argv[0]}: {e.strerror}", hint="check that it is installed")

    def wait(self) -> Result:
        if self.result is not None:
            return self.result
        remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            out, err = self.proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            self.kill()
            # Cut short by the run's budget, the program may only be slow: the budget is
            # raised with the unit's timeout, or systemd kills the run mid-way again.
            die(f"{self.argv[0]} did not finish within {self.limit.text()}"
                f"{self.limit.because()}", hint="check the program; " + (
                    "raise run_timeout_seconds only together with the unit's TimeoutStartSec"
                    if self.limit.by_budget else "the timeout is configurable"))
        for line in err.splitlines():
            log.debug(f"{os.path.basename(self.argv[0])}: {line}")
        self.result = Result(self.argv, self.proc.returncode, out, err)
        return self.result

    def kill(self) -> tuple[str, str]:
        """Kill the program and its process group; return what it wrote (once: a second
        call returns nothing and signals nothing, so a reaped pid is never signalled)."""
        if self.killed:
            return "", ""
        self.killed = True
        # The whole group: a program's own children must not outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            out, err = self.proc.communicate(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired as e:
            # A descendant outside the group still holds the pipes: keep what was read
            # (bytes here, even in text mode), close them, and reap the killed program.
            out, err = _decoded(e.stdout), _decoded(e.stderr)
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=KILL_GRACE_SECONDS)
        return out or "", err or ""

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.result is None:
            self.kill()


def _decoded(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def start(argv: list[str], *, limit: Limit) -> Started:
    """Start `argv`; its whole process group is killed when `limit` passes."""
    return Started(argv, limit)


def run(argv: list[str], *, limit: Limit, quiet: bool = False) -> Result:
    """Run `argv` to completion; kill its whole process group when `limit` passes.
    `quiet`: a query that changes nothing, logged at debug level only (`check` output)."""
    with Started(argv, limit, quiet) as started:
        return started.wait()
