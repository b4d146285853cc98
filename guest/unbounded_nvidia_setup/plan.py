"""Pure planning: from what discovery found to the exact content of the driver root.

Nothing here touches the filesystem, so every selection rule is testable without root.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .discover import (
    SAFE_NAME,
    VDPAU,
    VERSION_SUFFIX,
    Inspected,
    Link,
    Staged,
    is_library_name,
)
from .log import die

LIBRARY_MODE = 0o644
EXECUTABLE_MODE = 0o755
REQUIRED = ("libcuda.so", "libnvidia-ml.so")
# Unversioned linker names, as `-lcuda` and NVML loaders expect them.
# SONAME links the host's ldconfig keeps on the active driver's files.
ACTIVE_LINKS = ("libcuda.so.1", "libnvidia-ml.so.1")
LINKER_NAMES = {"libcuda.so": "libcuda.so.1", "libnvidia-ml.so": "libnvidia-ml.so.1"}

# One manifest entry per path below the root: ("d",), ("l", target) or
# ("f", size, mtime_ns, mode). Comparing two manifests is how the fast path and the
# verification decide, without reading file content.
Entry = tuple[str] | tuple[str, str] | tuple[str, int, int, int]
Manifest = dict[str, Entry]


def name_version(name: str) -> str | None:
    m = VERSION_SUFFIX.search(name)
    return m.group(1) if m else None


def driver_version(module: str | None, libraries: Iterable[Staged], links: Iterable[Link]) -> str:
    """The kernel module's version; else what a staging dir's libcuda.so.1 (or
    libnvidia-ml.so.1) points at, since the host's ldconfig keeps those links on the active
    driver; else the only libcuda.so.<ver>."""
    if module:
        return module
    linked = {v for link in links
              if link.name in ACTIVE_LINKS and (v := name_version(link.target.name))}
    if len(linked) > 1:
        die(f"cannot tell the driver version: the staging's {' and '.join(ACTIVE_LINKS)} "
            f"links point at {', '.join(sorted(linked))} and the kernel module version is "
            "not readable", hint="fix the host's driver installation (run ldconfig there)")
    if linked:
        return linked.pop()
    found = {v for lib in libraries
             if lib.name.startswith("libcuda.so.") and (v := name_version(lib.name))}
    if len(found) == 1:
        return found.pop()
    if not found:
        die("no libcuda.so.<version> in any staging dir",
            hint="the host must stage its NVIDIA driver libraries (incomplete driver state)")
    die(f"cannot tell the driver version: staging holds {', '.join(sorted(found))} and "
        "the kernel module version is not readable",
        hint="remove the stale driver on the host, or make /proc/driver/nvidia/version "
             "readable in the machine")


def stale_versions(version: str, libraries: Iterable[Staged]) -> set[str]:
    """Every other version seen on libcuda/libnvidia-ml files belongs to a stale driver."""
    seen = {v for lib in libraries
            if lib.name.startswith(("libcuda.so.", "libnvidia-ml.so."))
            and (v := name_version(lib.name))}
    return seen - {version}


def drop_stale(libraries: Iterable[Staged], stale: set[str]) -> list[Staged]:
    """Leave out every file named for a stale version, before anything is opened."""
    suffixes = tuple(f".{v}" for v in stale)
    return [lib for lib in libraries if not (suffixes and lib.name.endswith(suffixes))]


def _usable(item: Inspected, arch: str, kinds: tuple[str, ...]) -> bool:
    elf = item.elf
    return elf is not None and elf.bits == 64 and elf.machine == arch and elf.kind in kinds


def _stem(name: str) -> str:
    return name.split(".so", 1)[0]


# The longest name a Linux filesystem holds (NAME_MAX): a SONAME becomes a link name.
NAME_MAX = 255
# Names the root's own links take in the library dir (libcuda.so.1 -> libcuda.so.<ver>,
# libcuda.so -> libcuda.so.1): no staged regular file and no other SONAME may stand there.
RESERVED_NAMES = frozenset((*ACTIVE_LINKS, *LINKER_NAMES))
HOST_DRIVER_BROKEN = "the host's driver installation is broken: reinstall the driver on the host"


def soname_problem(item: Inspected, extra_prefixes: tuple[str, ...] = ()) -> str | None:
    """What keeps a library's DT_SONAME from being the name of its link in the root, or
    None when nothing does (a library without a DT_SONAME has no link). The SONAME
    becomes a link name next to the library, so it must be a plain name
    (`../../etc/x` would put a link outside the root), fit in a directory entry, be a
    driver library name (verify.py allows nothing else in the root: `libnvidia-x` would
    be a foreign file), be a name of this same library (`libc.so.6` or `libcuda.so.1` in
    libnvidia-x.so.<ver> would put a foreign link in the root or shadow the real one),
    and not be one of the root's own link names (RESERVED_NAMES). No NVIDIA library
    breaks any of these."""
    soname = item.elf.soname if item.elf else None
    if soname is None:
        return None
    if SAFE_NAME.fullmatch(soname) is None or soname in (".", ".."):
        return "is not a plain file name"
    if len(os.fsencode(soname)) > NAME_MAX:
        return f"is longer than a file name can be ({NAME_MAX} bytes)"
    if _stem(soname) != _stem(item.name):
        return "is not a name of this library"
    if not is_library_name(soname, extra_prefixes):
        return "is not a library name (no .so in it)"
    if soname in LINKER_NAMES:
        return f"is the linker name the driver root links to {LINKER_NAMES[soname]}"
    return None


def _describe_soname(soname: str | None) -> str:
    return "no DT_SONAME" if soname is None else f"DT_SONAME {soname!r}"


def check_required(inspected: Iterable[Inspected], version: str, arch: str) -> None:
    """Refuse, naming the file, when a staged libcuda.so.<ver> or libnvidia-ml.so.<ver>
    (top level of a staging dir) cannot be the driver's: no 64-bit shared object of this
    architecture under that name (a 32-bit or foreign copy beside a good one is skipped,
    as a host staging its i386 dir too has one), or one whose DT_SONAME is not
    libcuda.so.1 / libnvidia-ml.so.1. The root's required link libcuda.so.1 is made
    from that SONAME, and every loader asks for that name: such a driver is not usable,
    and leaving the file out would only say "missing" about a file that is there."""
    items = list(inspected)
    for base, soname in zip(REQUIRED, ACTIVE_LINKS, strict=True):
        name = f"{base}.{version}"
        found = sorted((i for i in items if i.name == name and i.staged.subdir == ""),
                       key=lambda i: i.staged.index)
        usable = [i for i in found if _usable(i, arch, ("ET_DYN",))]
        for item in usable:
            assert item.elf is not None
            if item.elf.soname != soname:
                die(f"incomplete driver state: {name} is not usable: staging file "
                    f"{item.staged.path} has {_describe_soname(item.elf.soname)}, not "
                    f"{soname}", hint=HOST_DRIVER_BROKEN)
        if found and not usable:
            die(f"incomplete driver state: {name} is not usable: staging file "
                f"{found[0].staged.path} {_not_usable(found[0], arch)}",
                hint=HOST_DRIVER_BROKEN)


def _not_usable(item: Inspected, arch: str) -> str:
    elf = item.elf
    if elf is None:
        return "is not an ELF file"
    if elf.bits != 64 or elf.machine != arch:
        return f"is a {elf.bits}-bit {elf.machine} ELF file, not 64-bit {arch}"
    return f"is {elf.kind}, not a shared library (ET_DYN)"


class LeftOut(NamedTuple):
    """A staged library planning leaves out of the root, and why: the caller logs it and
    `check` reports it (the host's driver installation is damaged, though the rest of the
    driver works). A NamedTuple: a frozen dataclass costs ~3M instructions to create, on
    every boot's import (callgrind)."""

    path: str
    reason: str


def _reserved(item: Inspected) -> tuple[bool, LeftOut | None]:
    """A regular file under one of the root's own link names: left out. A plain copy of
    the link's target (libcuda.so.1 copied instead of linked) is the same library as the
    one chosen for that SONAME, and nothing is wrong; anything else there is a mistake
    worth reporting."""
    if item.staged.subdir or item.name not in RESERVED_NAMES:
        return False, None
    soname = item.elf.soname if item.elf else None
    if soname == LINKER_NAMES.get(item.name, item.name):
        return True, None
    return True, LeftOut(str(item.staged.path), "the driver root has its own link there, "
                         f"and this file has {_describe_soname(soname)}")


class Selection(NamedTuple):
    chosen: list[Inspected]
    left_out: list[LeftOut]


def select_libraries(inspected: Iterable[Inspected], links: Iterable[Link], version: str,
                     arch: str, extra_prefixes: tuple[str, ...] = ()) -> Selection:
    """One file per SONAME: the one named for the driver version, else the one the staging
    dir's SONAME link points at; a choice still open is an error. A library whose SONAME
    cannot be its link's name (soname_problem), or a regular file under one of the root's
    own link names, is left out and named in `left_out`; the required libraries were
    checked before (check_required), so this never leaves out libcuda or libnvidia-ml."""
    groups: dict[tuple[str, str], list[Inspected]] = defaultdict(list)
    left_out: list[LeftOut] = []
    for item in inspected:
        if _usable(item, arch, ("ET_DYN",)):
            reserved, why = _reserved(item)
            if why is not None:
                left_out.append(why)
            if reserved:
                continue
            if problem := soname_problem(item, extra_prefixes):
                assert item.elf is not None
                left_out.append(LeftOut(str(item.staged.path),
                                        f"its DT_SONAME {item.elf.soname!r} {problem}"))
                continue
            assert item.elf is not None
            groups[(item.staged.subdir, item.elf.soname or item.name)].append(item)
    linked = {(link.subdir, link.name, link.target) for link in links}
    chosen = []
    for (subdir, soname), items in sorted(groups.items()):
        items.sort(key=lambda i: i.staged.index)
        exact = [i for i in items if i.name.endswith(f".{version}")]
        pool = exact or [i for i in items if (subdir, soname, i.staged.path) in linked] or items
        if len({i.name for i in pool}) > 1:
            names = ", ".join(sorted({str(i.staged.path) for i in pool}))
            die(f"ambiguous driver files for {soname}: {names}",
                hint="remove the extra copies on the host or fix its SONAME links")
        chosen.append(pool[0])  # same name in several staging dirs: the first dir wins
    return Selection(chosen, left_out)


@dataclass(frozen=True)
class PlannedFile:
    dest: str  # relative to the driver root
    source: Inspected
    mode: int


@dataclass(frozen=True)
class Plan:
    version: str
    files: tuple[PlannedFile, ...]
    links: tuple[tuple[str, str], ...]  # (path relative to the root, relative target)
    left_out: tuple[LeftOut, ...] = ()  # staged libraries planning did not take

    def sonames(self, directory: str) -> set[str]:
        """DT_SONAMEs of the files planned directly in `directory` (the library directory
        the drop-in names): what the machine's linker will look up in the root."""
        return {soname for f in self.files if f.dest.rpartition("/")[0] == directory
                and f.source.elf is not None and (soname := f.source.elf.soname)}

    def manifest(self) -> Manifest:
        result: Manifest = {}
        for f in self.files:
            result[f.dest] = ("f", f.source.size, f.source.mtime_ns, f.mode)
        for path, target in self.links:
            result[path] = ("l", target)
        for path in list(result):
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                result["/".join(parts[:i])] = ("d",)
        return dict(sorted(result.items()))


def make_plan(libraries: list[Inspected], helpers: list[Inspected],
              firmware: list[tuple[str, Inspected]], version: str, arch: str,
              libdir: str, left_out: Iterable[LeftOut] = ()) -> Plan:
    files: dict[str, PlannedFile] = {}
    links: dict[str, str] = {}

    def add(dest: str, source: Inspected, mode: int) -> None:
        # discover.scan lets no file whose own name is not plain through, whatever links
        # to it: that name would reach every GPU pod's spec. Refused here too, whoever calls.
        if not SAFE_NAME.fullmatch(source.name):
            die(f"staged file {source.staged.path} would enter the driver root as {dest!r}, "
                "not a plain file name", hint="rename it on the host")
        if dest in files:
            die(f"two staged files would both become {dest}: {files[dest].source.staged.path} "
                f"and {source.staged.path}", hint="remove one of them on the host")
        files[dest] = PlannedFile(dest, source, mode)

    for lib in libraries:
        where = f"{libdir}/{VDPAU}" if lib.staged.subdir == VDPAU else libdir
        add(f"{where}/{lib.name}", lib, LIBRARY_MODE)
    for lib in libraries:
        where = f"{libdir}/{VDPAU}" if lib.staged.subdir == VDPAU else libdir
        soname = lib.elf.soname if lib.elf else None
        # `libraries` are select_libraries' choice, whose SONAMEs passed soname_problem;
        # a name that would leave the directory is refused here too, whoever calls.
        if (not soname or soname == lib.name or not SAFE_NAME.fullmatch(soname)
                or soname in (".", "..")):
            continue
        taken = files.get(f"{where}/{soname}")
        if taken is None:
            links[f"{where}/{soname}"] = lib.name
        elif (taken.source.elf.soname if taken.source.elf else None) != soname:
            # The loader asking for the SONAME would open that other library: two files
            # claim one SONAME, as in select_libraries.
            die(f"ambiguous driver files for {soname}: {lib.staged.path} has that DT_SONAME "
                f"and {taken.source.staged.path}, a file of that name, has "
                f"{_describe_soname(taken.source.elf.soname if taken.source.elf else None)}",
                hint="remove the extra copies on the host or fix its SONAME links")
    for name, soname in LINKER_NAMES.items():
        if f"{libdir}/{soname}" in links or f"{libdir}/{soname}" in files:
            links.setdefault(f"{libdir}/{name}", soname)

    missing = [f"{base}.{version}" for base in REQUIRED
               if f"{libdir}/{base}.{version}" not in files]
    if missing:
        die(f"incomplete driver state: {' and '.join(missing)} not in any staging dir "
            f"(driver {version})",
            hint="the host must stage the complete driver userspace matching its kernel module")

    for helper in sorted(helpers, key=lambda h: h.staged.index):
        if _usable(helper, arch, ("ET_EXEC", "ET_DYN")) and f"usr/bin/{helper.name}" not in files:
            add(f"usr/bin/{helper.name}", helper, EXECUTABLE_MODE)
    for fw_version, blob in sorted(firmware, key=lambda f: f[1].staged.index):
        dest = f"lib/firmware/nvidia/{version}/{blob.name}"
        if fw_version == version and dest not in files:
            add(dest, blob, LIBRARY_MODE)
    return Plan(version, tuple(sorted(files.values(), key=lambda f: f.dest)),
                tuple(sorted(links.items())), tuple(left_out))
