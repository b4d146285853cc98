"""One run at a time: an flock on /run/unbounded-nvidia-setup.lock."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import log
from .config import Machine
from .log import EXIT_TEMPFAIL, die

_POLL = 0.1


@contextmanager
def locked(machine: Machine) -> Iterator[None]:
    """Hold the lock exclusively (`run`, `clean`) or exit 75 after lock_timeout_seconds, or
    sooner when the command's time budget ends first. Readers (`check`, `status`) never
    wait: shared_or_busy."""
    path = machine.lock_file
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except PermissionError:
        die(f"cannot open the lock file {path}: permission denied", hint="run as root")
    except OSError as e:
        die(f"cannot open the lock file {path}: {e.strerror}", hint="check that /run is writable")
    try:
        # Within the command's time budget: a wait that ate all of it would leave the run
        # nothing to work with, and systemd's kill no chance to say why.
        limit = machine.limit(machine.config.lock_timeout_seconds)
        deadline = time.monotonic() + (limit.seconds or 0.0)
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    die(f"another unbounded-nvidia-setup holds {path} for more than "
                        f"{limit.text()}{limit.because()}", hint="wait for it to finish, "
                        f"or find it with `fuser {path}`", code=EXIT_TEMPFAIL)
                if not waiting:
                    log.status(f"Waiting for another run holding {path}")
                    waiting = True
                time.sleep(_POLL)
        yield
    finally:
        os.close(fd)


@contextmanager
def shared_or_busy(machine: Machine) -> Iterator[bool]:
    """For `check` and `status`: one non-blocking try at the shared lock. Yields False
    holding it (no run can change the state while they read it), or True without it when
    a run or `clean` holds it exclusively: the caller is told at once that a setup is in
    progress instead of waiting behind it for up to `lock_timeout_seconds`. Reading
    unlocked is safe because a run replaces the root, the spec and the drop-in by rename,
    so every file read is a whole old or a whole new one; neither changes anything."""
    path = machine.lock_file
    fd = _open_for_probe(path)
    if fd is None:  # no lock file (nothing ever ran) or not readable: nobody to wait for
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield True
            return
        yield False
    finally:
        os.close(fd)


def _open_for_probe(path: Path) -> int | None:
    """The lock file opened read-only, never created: an unprivileged `check` can still
    see a run in progress, and a `check` under --root leaves no file behind. Only a
    regular file of root's counts: its directory is world-writable, and a FIFO there
    must not block `check` (O_NONBLOCK), nor a stranger's file say a run is going on
    (issue 37)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
        os.close(fd)
        return None
    return fd
