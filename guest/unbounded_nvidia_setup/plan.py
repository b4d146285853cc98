"""Pure planning: from what discovery found to the exact content of the driver root.

Nothing here touches the filesystem, so every selection rule is testable without root.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from . import log
from .discover import SAFE_NAME, VDPAU, VERSION_SUFFIX, Inspected, Link, Staged
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


def own_soname(item: Inspected) -> bool:
    """False when a library's DT_SONAME is not a plain name of that same library. The
    SONAME becomes a link name in the root, so `../../etc/x` would put a link outside it;
    and a SONAME naming another library (`libc.so.6`, `libcuda.so.1` in
    libnvidia-x.so.<ver>) would put a foreign link in the root or shadow the real one.
    No NVIDIA library does either."""
    soname = item.elf.soname if item.elf else None
    return soname is None or (SAFE_NAME.fullmatch(soname) is not None
                              and soname not in (".", "..")
                              and _stem(soname) == _stem(item.name))


def select_libraries(inspected: Iterable[Inspected], links: Iterable[Link], version: str,
                     arch: str) -> list[Inspected]:
    """One file per SONAME: the one named for the driver version, else the one the staging
    dir's SONAME link points at; a choice still open is an error. A library whose SONAME
    is not its own (see own_soname) is left out with a warning."""
    groups: dict[tuple[str, str], list[Inspected]] = defaultdict(list)
    for item in inspected:
        if _usable(item, arch, ("ET_DYN",)):
            if not own_soname(item):
                assert item.elf is not None
                log.warn(f"ignoring {item.staged.path}: its DT_SONAME "
                         f"{item.elf.soname!r} is not a name of this library")
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
    return chosen


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
              libdir: str) -> Plan:
    files: dict[str, PlannedFile] = {}
    links: dict[str, str] = {}

    def add(dest: str, source: Inspected, mode: int) -> None:
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
        if (soname and soname != lib.name and own_soname(lib)
                and f"{where}/{soname}" not in files):
            links[f"{where}/{soname}"] = lib.name
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
                tuple(sorted(links.items())))
