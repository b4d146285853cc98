"""The one way this tool runs other programs: logged, bounded in time, never a traceback."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass

from . import log
from .log import die


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


def run(argv: list[str], *, timeout: float) -> Result:
    """Run `argv` to completion; kill its whole process group when `timeout` passes."""
    log.info(f"running: {shlex.join(argv)}")
    try:
        proc = subprocess.Popen(
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
    try:
        out, err = proc.communicate(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        die(f"{argv[0]} did not finish within {timeout:g} s",
            hint="check the program; the timeout is configurable")
    for line in err.splitlines():
        log.debug(f"{os.path.basename(argv[0])}: {line}")
    return Result(argv=argv, returncode=proc.returncode, stdout=out, stderr=err)
