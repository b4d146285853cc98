"""Files and trees replaced in one rename: the driver root on disk (read its manifest,
build a new generation, swap it in), and the files beside it (the drop-in, the CDI spec,
the previous spec put back, the run's record)."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from . import log
from .discover import open_regular
from .log import die
from .plan import Manifest, Plan, PlannedFile

GENERATION_PREFIX = ".driver."
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_CHUNK = 1 << 30


def manifest(root: Path) -> Manifest | None:
    """What is below `root`, in the form Plan.manifest() uses; None if `root` is not a
    real directory."""
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return None
    except FileNotFoundError:
        return None
    result: Manifest = {}
    owner = os.geteuid()  # a file owned by anyone else was not made by this tool
    for directory, dirs, files in os.walk(root):
        rel = os.path.relpath(directory, root)
        for name in dirs + files:
            path = os.path.join(directory, name)
            key = name if rel == "." else f"{rel}/{name}"
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                result[key] = ("l", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                result[key] = ("d",)
            elif stat.S_ISREG(st.st_mode) and st.st_uid == owner:
                result[key] = ("f", st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
            else:
                result[key] = ("?", str(stat.S_IFMT(st.st_mode)))
    return dict(sorted(result.items()))


def describe_difference(want: Manifest, have: Manifest | None) -> str:
    if have is None:
        return "missing"
    for key in sorted(set(want) | set(have)):
        if key not in have:
            return f"{key} missing"
        if key not in want:
            return f"{key} unexpected"
        if want[key] != have[key]:
            return f"{key} differs"
    return "identical"


def remove_tree(path: Path) -> None:
    """Remove a generation (or whatever stands at its path) without following links. A
    failure is logged, not raised: what is left is a leftover the next run removes, and
    the run's state is whole either way."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warn(f"cannot remove {e.filename or path}: {e.strerror}; the next run retries")


def remove_leftovers(parent: Path) -> None:
    """Generations a crashed run left behind next to the live root."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(GENERATION_PREFIX):
            log.info(f"removing leftover {parent / name}")
            remove_tree(parent / name)


def ensure_parent(root: Path, parent: Path) -> None:
    """Create the root's parent; refuse when any part of it below `root` is a symlink,
    since a link there could point the whole driver root anywhere."""
    current = root
    for part in parent.relative_to(root).parts:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            try:
                os.mkdir(current, 0o755)
            except OSError as e:
                _die_for(e, current.parent)
            continue
        if stat.S_ISLNK(st.st_mode):
            die(f"{current} is a symlink", hint="remove it; the driver root must be created "
                "in a real directory")
        if not stat.S_ISDIR(st.st_mode):
            die(f"{current} is not a directory", hint="remove it")


def _copy(src: PlannedFile, dest: Path, as_root: bool) -> None:
    want = src.source
    try:
        fd_in = open_regular(want.staged.path)
    except (OSError, ValueError) as e:
        die(f"staged file {want.staged.path} vanished or changed type: {e}",
            hint="the host changed its driver files during setup; retry")
    try:
        st = os.fstat(fd_in)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (
                want.dev, want.ino, want.size, want.mtime_ns):
            die(f"staged file {want.staged.path} changed during setup",
                hint="the host is updating its driver; the unit retries")
        fd_out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        try:
            copied = _copy_fd(fd_in, fd_out, want.size)
            after = os.fstat(fd_in)
            if copied != want.size or (after.st_size, after.st_mtime_ns) != (
                    want.size, want.mtime_ns):
                die(f"staged file {want.staged.path} changed while being copied",
                    hint="the host is updating its driver; the unit retries")
            if as_root:
                os.fchown(fd_out, 0, 0)
            os.fchmod(fd_out, src.mode)
            os.utime(fd_out, ns=(want.mtime_ns, want.mtime_ns))
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _copy_fd(fd_in: int, fd_out: int, size: int) -> int:
    """Copy in the kernel: copy_file_range (reflinks where the filesystem can), sendfile
    where it cannot cross filesystems. Bytes never pass through Python."""
    copied = 0
    use_range = True
    while True:
        try:
            if use_range:
                n = os.copy_file_range(fd_in, fd_out, _CHUNK)
            else:
                n = os.sendfile(fd_out, fd_in, None, _CHUNK)
        except OSError as e:
            if use_range and e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                         errno.EOPNOTSUPP):
                use_range = False
                continue
            raise
        if n == 0:
            return copied
        copied += n
        if copied > size:  # the source grew; the caller reports it
            return copied


def build(plan: Plan, parent: Path) -> Path:
    """A complete new generation in `parent` (the live root's directory, so the swap is a
    rename on one filesystem). On any error nothing is left behind."""
    new = generation_path(parent)
    try:
        os.mkdir(new, 0o700)
    except OSError as e:
        _die_for(e, parent)
    try:
        for path in sorted({str(Path(f.dest).parent) for f in plan.files}
                           | {str(Path(p).parent) for p, _ in plan.links}):
            (new / path).mkdir(mode=0o755, parents=True, exist_ok=True)
        as_root = os.geteuid() == 0
        # Largest first keeps both cores busy to the end.
        files = sorted(plan.files, key=lambda f: -f.source.size)
        _in_parallel([functools.partial(_copy, f, new / f.dest, as_root) for f in files],
                     workers=max(2, os.cpu_count() or 1))
        for path, target in plan.links:
            os.symlink(target, new / path)
        for directory, _, _ in os.walk(new):
            os.chmod(directory, 0o755)
    except OSError as e:
        remove_tree(new)
        _die_for(e, parent)
    except BaseException:
        remove_tree(new)
        raise
    return new


def generation_path(parent: Path) -> Path:
    """A fresh name for a generation next to the live root (`.driver.<random>`)."""
    return parent / f"{GENERATION_PREFIX}{os.urandom(6).hex()}"


def _in_parallel(jobs: list[Callable[[], None]], workers: int) -> None:
    """Run `jobs` on `workers` threads, in order; after the first failure no new job
    starts, and that failure is raised once the running ones are done. (Plain threads:
    concurrent.futures would import logging on the boot path.)"""
    pending = list(reversed(jobs))
    failures: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if failures or not pending:
                    return
                job = pending.pop()
            try:
                job()
            except BaseException as e:  # re-raised in the caller's thread
                with lock:
                    failures.append(e)

    threads = [threading.Thread(target=worker) for _ in range(min(workers, len(jobs)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def _die_for(e: OSError, parent: Path) -> NoReturn:
    if e.errno == errno.ENOSPC:
        die(f"no space left in {parent} to build the driver root",
            hint="free space on that filesystem (it needs room for the driver files twice "
                 "during a swap)")
    if e.errno == errno.EROFS:
        die(f"{parent} is read-only", hint="the driver root must live on a writable tmpfs")
    die(f"cannot build the driver root in {parent}: {e.strerror}", hint="check the filesystem")


def _renameat2_exchange(a: Path, b: Path) -> None:
    # Imported here: a first boot swaps nothing in (a plain rename), and ctypes costs
    # ~7M instructions to import.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                      _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(b))


def swap(new: Path, live: Path) -> Path | None:
    """Make `new` the live root in one step. Returns where the old generation now is (the
    caller deletes it once the spec is installed, or swaps it back), None if there was none."""
    try:
        if not os.path.lexists(live):
            os.rename(new, live)
            return None
        _renameat2_exchange(new, live)
    except OSError as e:
        remove_tree(new)
        die(f"cannot swap the driver root at {live} atomically: {e.strerror}",
            hint="/run/nvidia must be a local filesystem such as tmpfs, and the driver root "
                 "not a mount point")
    return new


def unswap(live: Path, old: Path | None) -> None:
    """Undo swap(): the old generation goes live again (or the root goes away when there
    was none before), the rejected one is deleted."""
    try:
        if old is not None:
            _renameat2_exchange(old, live)
            remove_tree(old)
            return
        doomed = generation_path(live.parent)
        os.rename(live, doomed)
    except OSError as e:
        die(f"cannot put the previous driver root back at {live}: {e.strerror}",
            hint="check the filesystem of /run/nvidia, then restart the unit")
    remove_tree(doomed)


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
