"""Files replaced in one rename: the drop-in, the CDI spec, and the previous spec put back."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644, sync: bool = True) -> bool:
    """Replace `path` with `data` in one rename; False when it already held exactly that.
    The temp name ends in `.tmp` so no reader that globs *.conf, *.yaml or *.json takes it."""
    try:
        if path.read_bytes() == data and stat.S_IMODE(os.stat(path).st_mode) == mode:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    # A run killed between writing and renaming left its temp file: remove it (we hold
    # the lock, so no other writer's is among them).
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        leftover.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    if sync:
        dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
    return True
