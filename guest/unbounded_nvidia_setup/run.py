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

# What of a program's stderr reaches the journal at the default verbosity (relay()): at
# most this many lines, each cut at this many characters, so a program that floods its
# stderr cannot flood the journal (about 10 KB at most; the rest is at debug level, -v).
RELAY_LINES = 20
RELAY_LINE_CHARS = 500
# How much of the cause the one-line error quotes.
CAUSE_CHARS = 400

# logrus's text format, as Go programs (nvidia-ctk) write it:
#   time="2026-12-02T04:35:42Z" level=error msg="failed to ...: Driver Not Loaded"
ERROR_LEVELS = ("error", "fatal", "panic")
WARNING_LEVELS = ("warning", "warn")


def _logrus(line: str) -> tuple[str, str] | None:
    """(level, msg as written) of a logrus line, or None when the line is not one. With
    str methods, not a regular expression: every line nvidia-ctk writes goes through
    here on every boot, and compiling the expression cost more than all the parsing."""
    at = line.find("level=")
    while at > 0 and not line[at - 1].isspace():
        at = line.find("level=", at + 1)
    if at < 0:
        return None
    level, blank, rest = line[at + 6:].partition(" ")
    if not blank or not (level.isascii() and level.isalpha() and level.islower()):
        return None
    rest = rest.lstrip()
    if not rest.startswith("msg="):
        return None
    msg = rest[4:]
    if msg.startswith('"'):  # Go's quoting: up to the first quote not escaped
        i = 1
        while i < len(msg):
            if msg[i] == "\\":
                i += 2
            elif msg[i] == '"':
                return level, msg[:i + 1]
            else:
                i += 1
    return level, "" if not msg or msg[0].isspace() else msg.split(None, 1)[0]


def _without_time(line: str) -> str:
    """A logrus line less its leading time="...": journald stamps each line itself."""
    if line.startswith('time="'):
        end = line.find('"', 6)
        if end > 0 and line[end + 1:end + 2].isspace():
            return line[end + 1:].lstrip()
    return line


def logrus_level(line: str) -> str | None:
    """The level of a logrus line, or None when the line is not one."""
    found = _logrus(line)
    return found[0] if found else None


def logrus_message(line: str) -> str | None:
    """The text of a logrus line's msg (its Go quoting undone where JSON reads it the
    same), or None when the line is not one."""
    found = _logrus(line)
    if found is None:
        return None
    msg = found[1]
    if not msg.startswith('"'):
        return msg
    # Only a failure's cause is unquoted, and a healthy run does not import json for it.
    import json

    try:
        text = json.loads(msg)
    except ValueError:  # a Go-only escape (\x00, \a): the text between the quotes
        return msg[1:-1]
    return text if isinstance(text, str) else msg[1:-1]


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def relay(program: str, stderr: str, *, failed: bool) -> None:
    """A program's own words in the journal, at the tool's default verbosity: its error
    and warning lines (logrus `level=error`, `level=warning`), and when it failed also
    its lines in no known format (a dynamic linker's `symbol lookup error`, a Go panic).
    Bounded (RELAY_LINES, RELAY_LINE_CHARS, then a "(N more lines)" note); error lines
    are kept first when the bound bites. A failure's lines go out at warning level: the
    run's one error-level line (which quotes the first of them) stays the only one. A
    success's warnings go out at notice level: nvidia-ctk warns on every healthy
    generate (no nvidia-imex, no fabric manager socket, ...), and a healthy boot must
    not carry warnings that nobody can act on. A line repeated is relayed once. Every
    other line (repeats too), and what the bound leaves out, is logged at debug level
    (-v), in the program's order."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    # journald stamps each line itself: logrus's own time= adds only width, and without
    # it a repeated warning (the real 1.20 says "Failed to load ldcache" five times in
    # one generate) is relayed once, with how often it came.
    bare = [_without_time(line) for line in lines]
    times: dict[str, int] = {}
    errors: list[int] = []
    others: list[int] = []
    for index, line in enumerate(bare):
        level = logrus_level(line)
        if level in ERROR_LEVELS or level in WARNING_LEVELS or (level is None and failed):
            times[line] = times.get(line, 0) + 1
            if times[line] == 1:
                (errors if level in ERROR_LEVELS else others).append(index)
    chosen = set((errors + others)[:RELAY_LINES])
    more = len(errors) + len(others) - len(chosen)
    priority = log.WARNING if failed else log.NOTICE
    name = os.path.basename(program)
    for index, line in enumerate(lines):
        if index in chosen:
            count = times[bare[index]]
            again = f" ({count} times)" if count > 1 else ""
            log.log(priority, f"{name}: {_cut(bare[index], RELAY_LINE_CHARS)}{again}")
        else:
            log.debug(f"{name}: {line}")
    if more:
        log.log(priority, f"{name}: ({more} more lines; -v logs all of them)")


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    # Killed at its limit (Started.wait(expire=True)): `why` says so.
    timed_out: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def cause(self) -> str:
        """What the program said went wrong, in one line: the message of its first logrus
        error line (Go programs log the cause before the generic line they end with, or
        wrap it into that one), else its last line of output (ldconfig's last word, a
        dynamic linker's `symbol lookup error`)."""
        lines = [line for line in (self.stderr or self.stdout).splitlines() if line.strip()]
        for line in lines:
            if logrus_level(line) in ERROR_LEVELS:
                message = logrus_message(line)
                if message:
                    return _cut(message, CAUSE_CHARS)
        return _cut(lines[-1].strip(), CAUSE_CHARS) if lines else "no output"

    def why(self) -> str:
        """How the program failed, in one line (its cause, or the signal)."""
        if self.timed_out is not None:
            return self.timed_out
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name}"
        return f"exit status {self.returncode}: {self.cause()}"


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

    def __init__(self, argv: list[str], limit: Limit, quiet: bool = False,
                 speaks: bool = False) -> None:
        """`speaks`: the program's errors and warnings go to the journal at the default
        verbosity (relay()); otherwise its stderr is logged at debug level only."""
        (log.debug if quiet else log.info)(f"running: {shlex.join(argv)}")
        self.argv = argv
        self.limit = limit
        self.speaks = speaks
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

    def wait(self, *, expire: bool = False) -> Result:
        """Its result; past its limit it is killed and the run fails, or, with `expire`,
        the result says it did not finish (`timed_out`) and the caller decides."""
        if self.result is not None:
            return self.result
        remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            out, err = self.proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            out, err = self.kill()
            # What it said before it was killed may say where it hung.
            self._log_stderr(err, failed=True)
            why = f"{self.argv[0]} did not finish within {self.limit.text()}{self.limit.because()}"
            if expire:
                self.result = Result(self.argv, -signal.SIGKILL, out, err, why)
                return self.result
            # Cut short by the run's budget, the program may only be slow: the budget is
            # raised with the unit's timeout, or systemd kills the run mid-way again.
            die(why, hint="check the program; " + (
                    "raise run_timeout_seconds only together with the unit's TimeoutStartSec"
                    if self.limit.by_budget else "the timeout is configurable"))
        self._log_stderr(err, failed=self.proc.returncode != 0)
        self.result = Result(self.argv, self.proc.returncode, out, err)
        return self.result

    def lines(self, bound: float | None) -> tuple[str, str | None]:
        """What it writes to stdout, read as it comes, and why it stopped early (None: it
        ended with exit status 0). Once it has written a line, each next line must follow
        within `bound` seconds (None: no bound), and all of it within its limit: else it
        is killed. For a child that says what it is about to do before it does it."""
        assert self.proc.stdout is not None and self.proc.stderr is not None
        import selectors

        pipes = {self.proc.stdout.fileno(): bytearray(), self.proc.stderr.fileno(): bytearray()}
        out = pipes[self.proc.stdout.fileno()]
        why: str | None = None
        with selectors.DefaultSelector() as sel:
            for fd in pipes:
                sel.register(fd, selectors.EVENT_READ)
            next_line: float | None = None
            while sel.get_map():
                now = time.monotonic()
                ends = [t for t in (self.deadline, next_line) if t is not None]
                timeout = max(0.0, min(ends) - now) if ends else None
                ready = sel.select(timeout)
                if not ready:
                    if next_line is not None and (self.deadline is None
                                                  or next_line <= self.deadline):
                        why = f"no answer within {bound:g} s"
                    else:
                        why = f"did not finish within {self.limit.text()}{self.limit.because()}"
                    break
                for key, _ in ready:
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    pipes[key.fd] += data
                    if key.fd == self.proc.stdout.fileno() and bound is not None:
                        next_line = time.monotonic() + bound
        err = pipes[self.proc.stderr.fileno()].decode(errors="replace")
        if why is not None:
            self.kill()
            self.result = Result(self.argv, -signal.SIGKILL, out.decode(errors="replace"),
                                 err, why)
        else:
            self.proc.wait()
            self.result = Result(self.argv, self.proc.returncode,
                                 out.decode(errors="replace"), err)
            if not self.result.ok:
                why = self.result.why()
        self._log_stderr(err, failed=why is not None)
        return self.result.stdout, why

    def _log_stderr(self, err: str, *, failed: bool) -> None:
        if self.speaks:
            relay(self.argv[0], err, failed=failed)
            return
        for line in err.splitlines():
            log.debug(f"{os.path.basename(self.argv[0])}: {line}")

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


def start(argv: list[str], *, limit: Limit, speaks: bool = False) -> Started:
    """Start `argv`; its whole process group is killed when `limit` passes. `speaks`: its
    errors and warnings reach the journal (relay())."""
    return Started(argv, limit, speaks=speaks)


def run(argv: list[str], *, limit: Limit, quiet: bool = False) -> Result:
    """Run `argv` to completion; kill its whole process group when `limit` passes.
    `quiet`: a query that changes nothing, logged at debug level only (`check` output)."""
    with Started(argv, limit, quiet) as started:
        return started.wait()
