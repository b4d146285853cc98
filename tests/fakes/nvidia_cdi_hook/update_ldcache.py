"""update-ldcache and internal/ldconfig: drop-ins for the folders, then the host's ldconfig."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import signal
import stat
import sys
import time
import uuid
from collections.abc import Sequence

from .logger import HookError, go_err
from .oci import in_root

LDSOCONF, LDSOCONFD = "/etc/ld.so.conf", "/etc/ld.so.conf.d"
LDCONFIG_ARGV = ["ldconfig", "-f", LDSOCONF, "-C", "/etc/ld.so.cache"]
ARCH = {"x86_64": "x86_64", "aarch64": "aarch64"}.get(os.uname().machine, "")
DEBIAN_DIRS = (*((f"/lib/{ARCH}-linux-gnu", f"/usr/lib/{ARCH}-linux-gnu") if ARCH else ()),
               "/lib", "/usr/lib")
NON_DEBIAN_DIRS = ("/lib", "/usr/lib", *(("/lib64", "/usr/lib64") if ARCH else ()),
                   *(("/libx32", "/usr/libx32") if ARCH == "x86_64" else ()))

MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


def is_file(path: str) -> bool:
    """os.Stat succeeds and it is no directory (isDebianLike, isMusl)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


def prepare_root(root: str, ldconfig: str) -> tuple[int, int]:
    """Ldconfig.prepareRoot up to pivot_root: the root's /proc, the host ldconfig, the
    scratch dir, the mount-point rule. Returns descriptors of the root and the ldconfig copy."""
    real = os.path.realpath(root)
    if real == "/":  # the real hook fails so, after writing to the host
        raise HookError("error running pivot_root: pivot_root .: device or resource busy")
    what = f"failed to open root: open {root}"
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        what = "error mounting /proc: mkdirat proc"
        with contextlib.suppress(FileExistsError):
            os.mkdir("proc", 0o755, dir_fd=fd)
        what = f"error mounting host ldconfig: error reading host ldconfig: stat {ldconfig}"
        os.stat(ldconfig)
        what = "error mounting host ldconfig: error creating hook scratch folder"
        for part in ("run", "run/nvidia-ctk-hook", f"run/nvidia-ctk-hook/{uuid.uuid4()}"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
    except OSError as exc:
        raise HookError(f"{what}: {go_err(exc)}") from exc
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        points = {MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m[1], 8)), line.split()[4])
                  for line in f}
    if real not in points:  # pivot_root(".", "."): EBUSY on the root mount, else EINVAL
        below = max((p for p in points if real.startswith(p.rstrip("/") + "/")), key=len)
        text = os.strerror(errno.EBUSY if below == "/" else errno.EINVAL)
        raise HookError(f"error running pivot_root: pivot_root .: {go_err(text)}")
    try:  # SafeExec: a memfd copy (runc's exeseal), so the file's own mode does not matter
        with open(ldconfig, "rb") as f:
            ldconfig_fd = os.memfd_create("ldconfig", os.MFD_CLOEXEC)
            os.write(ldconfig_fd, f.read())
    except OSError:
        ldconfig_fd = os.open(ldconfig, os.O_PATH)
    return fd, ldconfig_fd


def configured_dirs(system: Sequence[str]) -> set[str]:
    """getLdsoconfDirectories: system dirs + ld.so.conf lines, following 'include ' globs."""
    dirs, seen, queue = set(system), set(), [LDSOCONF]
    while queue:
        if (name := queue.pop(0)) in seen or not name:
            continue
        seen.add(name)
        try:
            with open(name, "rb") as f:
                text = f.read().decode(errors="surrogateescape")
        except (FileNotFoundError, IsADirectoryError):
            continue
        for line in (raw.strip() for raw in text.split("\n")):
            if not line.startswith("include "):
                dirs.update([line] if line and not line.startswith("#") else [])
            elif glob.has_magic(pattern := line[len("include "):]):
                queue += sorted(glob.glob(pattern, include_hidden=True))
            elif os.path.lexists(pattern):
                queue.append(pattern)
    return dirs


def write_dirs(fd: int, dirs: Sequence[str]) -> None:
    """outputListToFile: a line per dir, first occurrence only; closes the file."""
    os.write(fd, "".join(f"{d}\n" for d in dict.fromkeys(dirs)).encode(errors="surrogateescape"))
    os.close(fd)


def create_dropin(pattern: str, dirs: Sequence[str]) -> None:
    """createLdsoconfdFile: os.CreateTemp(/etc/ld.so.conf.d, pattern), then chmod 0644."""
    if not dirs:
        return
    try:
        os.makedirs(LDSOCONFD, 0o755, exist_ok=True)
    except OSError as exc:
        reason = "not a directory" if isinstance(exc, FileExistsError) else go_err(exc)
        raise HookError(f"failed to write {pattern} drop-in: failed to create ld.so.conf.d: "
                        f"mkdir {LDSOCONFD}: {reason}") from exc
    prefix, _, suffix = pattern.partition("*")
    while True:
        name = f"{LDSOCONFD}/{prefix}{int.from_bytes(os.urandom(4), 'little')}{suffix}"
        with contextlib.suppress(FileExistsError):
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            break
    os.fchmod(fd, 0o644)
    write_dirs(fd, dirs)


def update_in_root(folders: Sequence[str], ldconfig_fd: int) -> None:
    """Ldconfig.UpdateLDCache after the pivot (chrooted here); ends by executing ldconfig."""
    system = DEBIAN_DIRS if is_file("/etc/debian_version") else NON_DEBIAN_DIRS
    try:
        with open(os.open(LDSOCONF, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
            f.write(f"include {LDSOCONFD}/*.conf\n")
    except FileExistsError:
        pass
    except OSError as exc:
        raise HookError(f"failed to ensure ld.so.conf file: failed to create top-level "
                        f"ld.so.conf file: open {LDSOCONF}: {go_err(exc)}") from exc
    known = configured_dirs(system)
    filtered = [d for d in dict.fromkeys(folders) if d not in known]
    create_dropin("00-nvcr-*.conf", filtered)
    create_dropin("zz-nvcr-*.conf", system)
    if is_file("/etc/alpine-release"):
        path = f"/etc/ld-musl-{ARCH}.path"
        write_dirs(os.open(path, os.O_CREAT | os.O_APPEND | os.O_RDWR, 0o644), [*filtered, *system])
    try:
        os.execve(ldconfig_fd, LDCONFIG_ARGV, {})
    except OSError as exc:
        raise HookError(go_err(exc)) from exc


def update_ldcache(folders: Sequence[str], ldconfig_path: str, root: str) -> int:
    """reexec.Command of the child above; urfave/cli prints a failed child's 'exit status N'
    and exits N (255 when it was killed)."""
    trimmed = ldconfig_path.removesuffix(".real")  # config.NormalizeLDConfigPath
    ldconfig = trimmed + ".real" if os.path.exists(trimmed + ".real") else trimmed
    try:
        root_fd, ldconfig_fd = prepare_root(root, ldconfig)
    except HookError as exc:
        code, message = 1, str(exc)
    else:
        code, message = in_root(root_fd, lambda: update_in_root(folders, ldconfig_fd))
        os.close(root_fd)
        os.close(ldconfig_fd)
    if message:
        sys.stderr.write(f"{time.strftime('%Y/%m/%d %H:%M:%S')} Error updating ldcache: "
                         f"{message}\n")
    if code < 0:
        sys.stderr.write(f"signal: {go_err(signal.strsignal(-code) or str(-code))}\n")
    elif code:
        sys.stderr.write(f"exit status {code}\n")
    return 255 if code < 0 else code
