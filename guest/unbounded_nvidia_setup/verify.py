"""Invariants of a driver root, checked on every new generation and by `check`."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from .discover import HELPERS, VDPAU, is_library_name, open_regular
from .elf import CorruptElf, ElfInfo, read_elf
from .plan import (
    ACTIVE_LINKS,
    EXECUTABLE_MODE,
    LIBRARY_MODE,
    LINKER_NAMES,
    REQUIRED,
    Plan,
    name_version,
)
from .problems import Problem


def root_version(root: Path, libdir: str) -> set[str]:
    """Driver versions of the libcuda.so.<ver> files in a root."""
    try:
        names = os.listdir(root / libdir)
    except OSError:
        return set()
    return {v for n in names if n.startswith("libcuda.so.") and (v := name_version(n))}


_MAX_LINKS = 40


def resolve_in_driver_root(path: str) -> str:
    """os.path.realpath(path), for a path whose directory is already real (a driver root
    walked from its real path: os.walk does not descend into links). A link whose target
    is a plain name is followed next to itself with one lstat, as the kernel does;
    realpath would lstat every component of the path for every link, which was most of
    the end-state check's cost on the boot path. Anything else is left to realpath."""
    for _ in range(_MAX_LINKS):
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                return path
            target = os.readlink(path)
        except OSError:
            return path  # dangling, as realpath gives it
        if "/" in target or target in ("", ".", ".."):
            return os.path.realpath(path)
        path = os.path.join(os.path.dirname(path), target)
    return os.path.realpath(path)


def library_sonames(directory: Path) -> dict[str, str | None]:
    """DT_SONAME of every regular file in `directory` (None: no SONAME, not ELF, or
    damaged). Read from the files themselves on every call: a SONAME link is right only
    if its target really carries that SONAME, whatever any cache says."""
    result: dict[str, str | None] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return result
    for name in names:
        try:
            info = elf_at(directory / name)
        except (OSError, ValueError):
            continue
        result[name] = info.soname if info else None
    return result


def elf_at(path: Path) -> ElfInfo | None:
    """The ELF header of the regular file at `path` (None: not ELF, or damaged). Raises
    OSError or ValueError when it is no regular file (open_regular)."""
    with os.fdopen(open_regular(path), "rb", buffering=4096) as f:
        try:
            return read_elf(f)
        except CorruptElf:
            return None


def changed_copies(plan: Plan, new: Path) -> list[Path]:
    """The staged files whose copy in the generation `new` has other ELF headers than the
    file had when it was inspected: rewritten in place during the run, under the same
    inode, size and mtime, which is all the copy's identity check compares."""
    changed = []
    for planned in plan.files:
        try:
            info = elf_at(new / planned.dest)
        except (OSError, ValueError):
            changed.append(planned.source.staged.path)
            continue
        if info != planned.source.elf:
            changed.append(planned.source.staged.path)
    return changed


def link_problems(directory: Path,
                  sonames: dict[str, str | None] | None = None) -> list[Problem]:
    """Every SONAME link in a library directory names a file whose DT_SONAME is that
    link's name (a linker name such as libcuda.so: the SONAME it stands for), and every
    library whose SONAME differs from its file name has its SONAME link. This is what
    ldconfig rewrote wrongly from a stale aux cache (docs/architecture.md)."""
    problems: list[Problem] = []
    if sonames is None:
        sonames = library_sonames(directory)
    real = os.path.realpath(directory)
    for name in sorted(os.listdir(directory)) if sonames else []:
        path = directory / name
        if not path.is_symlink() or name in ACTIVE_LINKS:
            continue  # libcuda.so.1 and libnvidia-ml.so.1: the required-library check
        target = resolve_in_driver_root(os.path.join(real, name))
        if os.path.dirname(target) != real:
            continue  # escaping or dangling: reported as such
        want = LINKER_NAMES.get(name, name)
        have = sonames.get(os.path.basename(target))
        if have != want:
            problems.append(Problem("root-wrong-link",
                                    f"{path} points to {os.path.basename(target)}, whose "
                                    f"DT_SONAME is {have or 'missing'}, not {want}", str(path)))
    for name, soname in sorted(sonames.items()):
        if soname and soname != name and soname not in ACTIVE_LINKS and not os.path.lexists(
                directory / soname):
            problems.append(Problem("root-missing-link",
                                    f"{directory / soname} is missing: nothing loads "
                                    f"{name} by its SONAME", str(directory / soname)))
    return problems


def _allowed(rel: str, libdir: str, is_dir: bool, extra: tuple[str, ...]) -> bool:
    parts = rel.split("/")
    if is_dir:
        return rel in ("lib", libdir, f"{libdir}/{VDPAU}", "usr", "usr/bin", "lib/firmware",
                       "lib/firmware/nvidia") or (
            len(parts) == 4 and rel.startswith("lib/firmware/nvidia/"))
    directory, name = os.path.dirname(rel), parts[-1]
    if directory in (libdir, f"{libdir}/{VDPAU}"):
        return is_library_name(name, extra)
    if directory == "usr/bin":
        return name in HELPERS
    return (len(parts) == 5 and rel.startswith("lib/firmware/nvidia/")
            and re.fullmatch(r"gsp.*\.bin", name) is not None)


def root_problems(root: Path, libdir: str, version: str | None,
                  extra_prefixes: tuple[str, ...] = (),
                  sonames: dict[str, str | None] | None = None) -> list[Problem]:
    """Problems with the driver root at `root` (assumed to be a directory). `sonames`:
    library_sonames() of its `libdir` when the caller has read them already."""
    problems: list[Problem] = []
    real_root = os.path.realpath(root)
    check_owner = os.geteuid() == 0
    for directory, dirs, files in os.walk(root):
        # os.walk does not descend into links: every directory here is real below the root.
        rel_dir = os.path.relpath(directory, root)
        real_dir = real_root if rel_dir == "." else os.path.join(real_root, rel_dir)
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                resolved = resolve_in_driver_root(os.path.join(real_dir, name))
                if target.startswith("/"):
                    problems.append(Problem("root-absolute-link",
                                            f"{path} is an absolute link to {target}", path))
                elif resolved != real_root and not resolved.startswith(real_root + "/"):
                    problems.append(Problem("root-escaping-link",
                                            f"{path} points outside the driver root", path))
                elif not os.path.exists(path):
                    problems.append(Problem("root-dangling-link",
                                            f"{path} points to {target}, which does not exist",
                                            path))
                if not _allowed(rel, libdir, False, extra_prefixes):
                    problems.append(Problem("root-foreign-file",
                                            f"{path} is not an NVIDIA driver file", path))
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if not (is_dir or stat.S_ISREG(st.st_mode)) or not _allowed(
                    rel, libdir, is_dir, extra_prefixes):
                problems.append(Problem("root-foreign-file",
                                        f"{path} is not an NVIDIA driver file", path))
                continue
            if check_owner and (st.st_uid, st.st_gid) != (0, 0):
                problems.append(Problem("root-bad-owner",
                                        f"{path} is owned by {st.st_uid}:{st.st_gid}, not root",
                                        path))
            mode = stat.S_IMODE(st.st_mode)
            allowed_modes = (EXECUTABLE_MODE,) if is_dir else (LIBRARY_MODE, EXECUTABLE_MODE)
            if mode not in allowed_modes:
                problems.append(Problem("root-bad-mode", f"{path} has mode {mode:04o}", path))
    for libraries, known in ((root / libdir, sonames), (root / libdir / VDPAU, None)):
        if libraries.is_dir() and not libraries.is_symlink():
            problems += link_problems(libraries, known)
    versions = {version} if version else root_version(root, libdir)
    if len(versions) > 1:
        problems.append(Problem("root-mixed-versions",
                                f"{root} holds libcuda of several drivers: "
                                f"{', '.join(sorted(versions))}", str(root)))
    for ver in sorted(versions) or ["<version>"]:
        for base in REQUIRED:
            library = root / libdir / f"{base}.{ver}"
            link = root / libdir / f"{base}.1"
            if not library.is_file() or library.is_symlink():
                code = "root-library-not-regular" if os.path.lexists(library) else (
                    "root-missing-library")
                problems.append(Problem(code, f"{library} is not a regular file", str(library)))
            elif not link.is_symlink() or resolve_in_driver_root(os.path.join(
                    real_root, libdir, link.name)) != os.path.join(real_root, libdir, library.name):
                problems.append(Problem("root-missing-link",
                                        f"{link} does not point to {library.name}", str(link)))
    return problems
