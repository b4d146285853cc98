"""Discovery: devices, the kernel module version, staging dirs, and driver files in them.

Locators here decide by name first and open nothing they do not need: a host library
directory holds thousands of files, a few dozen of them NVIDIA's.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from . import log
from .config import Machine
from .elf import CorruptElf, ElfInfo, read_elf
from .log import die

LIBRARY_PREFIXES = (
    "libnvidia-", "libcuda", "libnvcuvid", "libnvoptix", "libEGL_nvidia", "libGLX_nvidia",
    "libGLESv1_CM_nvidia", "libGLESv2_nvidia", "libvdpau_nvidia",
)
# Libraries that share a driver prefix but come with the container toolkit or the CUDA
# toolkit, not with the driver: a host library dir often holds them too.
NOT_DRIVER_PREFIXES = ("libnvidia-container", "libcudart")
HELPERS = (
    "nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server", "nvidia-imex", "nvidia-imex-ctl",
)
VDPAU = "vdpau"
# Real driver file names are plain; anything else (spaces, newlines, control characters)
# would go into every GPU pod's mount list, so it is never a driver file.
SAFE_NAME = re.compile(r"[A-Za-z0-9._+-]+")
VERSION_SUFFIX = re.compile(r"\.so\.(\d+\.\d+(?:\.\d+)?)$")
_MODULE_VERSION = re.compile(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s")
_GPU_NODE = re.compile(r"nvidia(\d+|ctl)")
_MAX_LINKS = 40


def has_gpu(machine: Machine) -> bool:
    """A GPU is present iff /dev/nvidiactl or /dev/nvidia<N> is a character device."""
    try:
        names = os.listdir(machine.at("/dev"))
    except OSError:
        return False
    for name in names:
        if _GPU_NODE.fullmatch(name):
            try:
                if stat.S_ISCHR(os.stat(machine.at(f"/dev/{name}")).st_mode):
                    return True
            except OSError:
                continue
    return False


def module_version(machine: Machine) -> str | None:
    """The loaded kernel module's version, when the machine can read it."""
    try:
        text = machine.at("/proc/driver/nvidia/version").read_text(errors="replace")
        if m := _MODULE_VERSION.search(text):
            return m.group(1)
    except OSError:
        pass
    try:
        text = machine.at("/sys/module/nvidia/version").read_text(errors="replace").strip()
        if re.fullmatch(r"\d+\.\d+(?:\.\d+)?", text):
            return text
    except OSError:
        pass
    return None


def _natural(path: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path))


def staging_dirs(machine: Machine) -> list[Path]:
    """Every staging dir, in natural order. Anything else at a staging path is an error:
    the host agent bind-mounts directories there, never files or links."""
    dirs = []
    for found in sorted(glob.glob(str(machine.at(machine.config.staging_glob))), key=_natural):
        path = Path(found)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            die(f"staging path {path} is a symlink, not a directory",
                hint="the host must bind-mount its driver library directory there")
        if not stat.S_ISDIR(st.st_mode):
            die(f"staging path {path} is not a directory",
                hint="the host must bind-mount its driver library directory there")
        dirs.append(path)
    return dirs


def is_populated(directory: Path) -> bool:
    try:
        with os.scandir(directory) as it:
            return any(True for _ in it)
    except PermissionError as e:
        die(f"cannot read staging dir {directory}: {e.strerror}",
            hint="the host must mount it readable for root")
    except OSError:
        return False


def populated_staging(machine: Machine) -> list[Path]:
    """The staging dirs that hold anything: a host that mounted these meant a GPU node."""
    return [d for d in staging_dirs(machine) if is_populated(d)]


def resolve_under_root(root: str, start: str, path: str) -> str | None:
    """`start/path` resolved as the kernel would in a chroot at `root` (`start` lies under
    it): absolute link targets start again at `root`, `..` stops there. None when it
    dangles or loops. Uses only lstat and readlink: nothing is opened. Plain strings, not
    pathlib: this runs for every staged name and, through searchorder, for every directory of
    the linker's search order on every boot, and pathlib's cost per component was most of
    that time."""
    top = root.rstrip("/")
    parts = deque(path.split("/"))
    current, hops = start.rstrip("/"), 0
    while parts:
        part = parts.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if current != top:
                current = current.rsplit("/", 1)[0]
            continue
        candidate = f"{current}/{part}"
        try:
            st = os.lstat(candidate)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_LINKS:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = top
            parts.extendleft(reversed(target.split("/")))
            continue
        if parts and not stat.S_ISDIR(st.st_mode):
            return None
        current = candidate
    return current or "/"


def resolve_inside_staging(root: Path, base: Path, relative: str) -> Path | None:
    """`base/relative` resolved with absolute link targets taken under `root`
    (:func:`resolve_under_root`). None when it dangles, loops, or ends outside `base`: a link
    escaping its staging dir is ignored."""
    found = resolve_under_root(str(root), str(base), relative)
    inside = str(base).rstrip("/") + "/"
    return Path(found) if found is not None and found.startswith(inside) else None


@dataclass(frozen=True)
class Staged:
    """A file in a staging dir, after links within the dir were resolved."""

    index: int  # which staging dir, in order
    path: Path  # the real file
    subdir: str  # where it goes below the library dir: "" or "vdpau"

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class Link:
    """A symlink among the driver files of a staging dir, e.g. libcuda.so.1 -> libcuda.so.X."""

    index: int
    name: str
    subdir: str
    target: Path  # the real file it resolves to


@dataclass
class Scan:
    libraries: list[Staged] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    helpers: list[Staged] = field(default_factory=list)
    firmware: list[tuple[str, Staged]] = field(default_factory=list)  # (version, file)
    # (path, why) of driver-named entries left out before planning: the caller says so
    ignored: list[tuple[str, str]] = field(default_factory=list)


def is_library_name(name: str, extra_prefixes: tuple[str, ...] = ()) -> bool:
    return (
        ".so" in name
        and name.startswith(LIBRARY_PREFIXES + extra_prefixes)
        and not name.startswith(NOT_DRIVER_PREFIXES)
    )


def _entries(directory: Path) -> list[str]:
    return [os.fsdecode(name) for name in _raw_entries(directory)]


def _raw_entries(directory: Path) -> list[bytes]:
    try:
        return os.listdir(os.fsencode(directory))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        return []
    except OSError as e:
        die(f"cannot read staging dir {directory}: {e.strerror}",
            hint="check the host's staging mount")


def plain_target(result: Scan, base: Path, relative: str, target: Path) -> bool:
    """Whether the file `path` resolves to has a plain name (SAFE_NAME), as `path` has: a
    file enters the root under its own name, never under its link's, and nvidia-ctk
    writes that name into every GPU pod's mounts and create-symlinks --link arguments
    (one with a newline or `::` fails every pod). Otherwise `path` is left out, named in
    `result.ignored`, and so is the file: the root's links are made from the SONAMEs of
    the files it holds, so none is left dangling."""
    if SAFE_NAME.fullmatch(target.name):
        return True
    result.ignored.append((str(base / relative), f"links to {target.name!r}, not a plain "
                           "file name: the link and its file are left out"))
    return False


def scan(machine: Machine, dirs: list[Path]) -> Scan:
    """Find driver libraries, their links, helpers and firmware by name."""
    extra = machine.config.extra_library_prefixes
    # A host lib dir holds thousands of other names: listed as bytes and matched on their
    # first bytes, they cost little more than the kernel's readdir; only candidates are
    # decoded.
    prefixes = tuple(os.fsencode(p) for p in LIBRARY_PREFIXES + extra)
    root = Path(os.path.realpath(machine.root))
    result = Scan()
    seen: set[Path] = set()
    for index, directory in enumerate(dirs):
        base = Path(os.path.realpath(directory))
        for subdir in ("", VDPAU):
            candidates = [n for n in _raw_entries(base / subdir) if n.startswith(prefixes)]
            for name in map(os.fsdecode, candidates):
                if not is_library_name(name, extra):
                    continue
                relative = f"{subdir}/{name}" if subdir else name
                if not SAFE_NAME.fullmatch(name):
                    result.ignored.append((str(base / relative), "not a plain file name"))
                    continue
                target = resolve_inside_staging(root, base, relative)
                if target is None:
                    log.debug(f"ignoring {base / relative}: dangling, looping or outside "
                              f"{directory}")
                    continue
                if not plain_target(result, base, relative, target):
                    continue
                target_subdir = VDPAU if target.parent == base / VDPAU else ""
                if target.name != name:
                    result.links.append(Link(index, name, subdir, target))
                if target not in seen and is_library_name(target.name, extra):
                    seen.add(target)
                    result.libraries.append(Staged(index, target, target_subdir))
        for name in HELPERS:
            target = resolve_inside_staging(root, base, name)
            if target is not None and plain_target(result, base, name, target):
                result.helpers.append(Staged(index, target, ""))
        for version in _entries(base / "nvidia"):
            for name in _entries(base / "nvidia" / version):
                if name.startswith("gsp") and name.endswith(".bin"):
                    relative = f"nvidia/{version}/{name}"
                    target = resolve_inside_staging(root, base, relative)
                    if (target is not None and SAFE_NAME.fullmatch(name)
                            and plain_target(result, base, relative, target)):
                        result.firmware.append((version, Staged(index, target, "")))
    return result


@dataclass(frozen=True)
class Inspected:
    """A staged file that was opened: what it is, and the identity to copy it by."""

    staged: Staged
    elf: ElfInfo | None
    size: int
    mtime_ns: int
    dev: int
    ino: int

    @property
    def name(self) -> str:
        return self.staged.name


def open_regular(path: Path) -> int:
    """Open a staged file for reading without following a final link, and without ever
    opening anything that is not a regular file: opening a device node runs its driver's
    open (a watchdog starts counting, a tape rewinds), a FIFO can block or wake a writer.
    The name is opened with O_PATH (which does none of that), checked with fstat, and
    only a regular file is reopened for reading through /proc/self/fd: the same inode,
    not the name again. Raises OSError, or ValueError when it is not a regular file."""
    handle = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(handle)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        try:
            return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # no /proc: open the name again, then compare
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            again = os.fstat(fd)
            if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                raise ValueError("replaced while being opened") from None
            return fd
    finally:
        os.close(handle)


def inspect(staged: Staged) -> Inspected | None:
    """Open one staged file and read its ELF headers. None when it is not a regular file
    (FIFO, socket, device, directory); CorruptElf propagates with the path added."""
    try:
        fd = open_regular(staged.path)
    except (OSError, ValueError) as e:
        log.debug(f"ignoring {staged.path}: {getattr(e, 'strerror', None) or e}")
        return None
    with os.fdopen(fd, "rb", buffering=4096) as f:
        st = os.fstat(fd)
        try:
            info = read_elf(f)
        except CorruptElf as e:
            die(f"damaged ELF file {staged.path}: {e}",
                hint="the host's driver installation is broken: reinstall the driver on the "
                     "host")
    return Inspected(staged, info, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
