"""The machine's own dynamic linker: the ld.so.conf.d drop-in, ldconfig, legacy links."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

from . import log
from .config import Machine
from .log import Failure, die
from .problems import Problem
from .run import Result, Started, find_program, run, start
from .tree import write_atomically
from .verify import resolve_in_driver_root

HEADER = "# Written by unbounded-nvidia-setup on every boot; do not edit.\n"


def driver_libdir(machine: Machine) -> str:
    """The driver root's library directory as the machine sees it: the drop-in's line."""
    return f"{machine.config.driver_root.rstrip('/')}/{machine.libdir}"


def dropin_text(machine: Machine) -> str:
    return f"{HEADER}{driver_libdir(machine)}\n"


def install_dropin(machine: Machine) -> None:
    """Write the drop-in (the caller knows beforehand whether it is new: a write that
    fails after its rename has already put it there)."""
    path = machine.ldconf_dropin
    try:
        if write_atomically(path, dropin_text(machine).encode()):
            log.info(f"wrote {path}")
    except OSError as e:
        die(f"cannot write {path}: {e.strerror}", hint="/etc must be writable for root")


def system_libdirs(machine: Machine) -> list[str]:
    """The library directories a package or an older agent writes to, as the machine sees
    them: Debian's libc.conf and <multiarch>.conf lines, then ldconfig's built-in ones."""
    ma = machine.multiarch
    return [f"/usr/lib/{ma}", f"/lib/{ma}", f"/usr/local/lib/{ma}", "/usr/local/lib",
            "/usr/lib", "/lib", "/usr/lib64", "/lib64"]


_MAX_HOPS = 8


def _leads_into(directory: str, links: dict[str, str], name: str, prefix: str) -> bool:
    """Whether link `name` of `directory` (machine path; `links`: its links, name -> target)
    leads into `prefix`, directly or through other links beside it (a SONAME link that an
    older agent's ldconfig pointed at its link into the staging). Targets are read, never
    followed on disk: the staging may not be mounted, and then every such link dangles."""
    for _ in range(_MAX_HOPS):
        target = posixpath.normpath(posixpath.join(directory, links[name]))
        if target.startswith(prefix):
            return True
        if posixpath.dirname(target) != directory or posixpath.basename(target) not in links:
            return False
        name = posixpath.basename(target)
    return False


def _legacy_in(machine: Machine) -> Iterator[tuple[Path, int, dict[str, str]]]:
    """Each system library dir (opened: what is judged is what is removed, whatever
    becomes of its path meanwhile), with its legacy links and their targets."""
    prefix = machine.staging_parent.rstrip("/") + "/"
    seen: set[tuple[int, int]] = set()
    for directory in system_libdirs(machine):
        path = machine.at(directory)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:  # merged /usr: /lib/<multiarch> is /usr/lib/…
                continue
            seen.add((st.st_dev, st.st_ino))
            links: dict[str, str] = {}
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        links[entry.name] = os.readlink(entry.name, dir_fd=fd)
            yield path, fd, {name: links[name] for name in sorted(links)
                             if _leads_into(directory, links, name, prefix)}
        except OSError:
            continue
        finally:
            os.close(fd)


def legacy_links(machine: Machine) -> list[Path]:
    """Links an older agent left in the system library dirs: links into the staging
    mounts, and the SONAME links beside them that lead to those. They are never a driver
    file of this tool's root; they dangle wherever the staging is hidden, and in a
    directory searched before the drop-in (Debian's aarch64-linux-gnu.conf sorts first)
    they shadow the driver root."""
    return [path / name for path, _, found in _legacy_in(machine) for name in found]


def remove_legacy_links(machine: Machine) -> None:
    """Each removed relative to its directory's descriptor, and only while it still
    leads where it did when it was judged."""
    for path, fd, found in _legacy_in(machine):
        for name, target in found.items():
            try:
                if os.readlink(name, dir_fd=fd) != target:
                    continue
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as e:
                die(f"cannot remove legacy link {path / name}: {e.strerror}",
                    hint="remove it by hand")
            log.info(f"removed legacy link {path / name} (led into {machine.staging_parent})")


def start_ldconfig(machine: Machine, *, rollback: bool = False) -> Started:
    """ldconfig as this tool runs it. `-i`: glibc's aux cache keys a file's SONAME by
    (inode, ctime in seconds, size, device), and a new tmpfs /run hands out the same keys
    again, so a trusted aux cache can give one library another's SONAME. `-X`: the
    driver root's SONAME links were built from the files' own DT_SONAME and verified;
    ldconfig only builds the cache and may not rewrite them (docs/architecture.md). The
    aux cache it writes is read from the files, so a later plain ldconfig (dpkg's
    libc-bin trigger) makes the same links as ours. `rollback`: the one that puts the old
    root's cache back after a failure gets its slice of the time kept for the rollback."""
    ldconfig = find_program(machine.config.ldconfig, "ldconfig")
    argv = [ldconfig, "-i", "-X"]
    if not machine.is_live:
        argv += ["-r", str(machine.root)]
    # 0 in the config: no limit of its own, only the command's budget.
    own = machine.config.ldconfig_timeout_seconds or None
    return start(argv, limit=machine.limit(own, rollback=rollback))


def check_ldconfig(result: Result) -> None:
    if not result.ok:
        die(f"ldconfig failed ({result.why()})", hint="check /etc/ld.so.conf.d and disk space")


def run_ldconfig(machine: Machine, *, rollback: bool = False) -> None:
    with start_ldconfig(machine, rollback=rollback) as started:
        check_ldconfig(started.wait())


# `ldconfig -p`: "\tlibcuda.so.1 (libc6,x86-64) => /run/nvidia/driver/lib/.../libcuda.so.1"
_CACHE_LINE = re.compile(r"\t(\S+) \(([^)]*)\)(?: .*)? => (/.*)")
_CACHE_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}
CACHE = "/etc/ld.so.cache"
CACHE_QUERY_SECONDS = 30.0  # `ldconfig -p` only reads one file: it takes about 1 ms


def cache_entries(machine: Machine) -> dict[str, str] | str:
    """SONAME -> path, as the machine's dynamic linker finds it in /etc/ld.so.cache (the
    first entry of the machine's architecture, as ld.so takes it); or why it cannot tell.
    Read with `ldconfig -p -C`, which changes nothing."""
    try:
        ldconfig = find_program(machine.config.ldconfig, "ldconfig")
        # A run's end-state proof asks this too: within what is left of its budget.
        result = run([ldconfig, "-p", "-C", str(machine.at(CACHE))],
                     limit=machine.limit(CACHE_QUERY_SECONDS), quiet=True)
    except Failure as e:
        return e.message
    if not result.ok:
        return f"`ldconfig -p` cannot read it ({result.why()})"
    flag = _CACHE_ARCH[machine.arch]
    entries: dict[str, str] = {}
    for line in result.stdout.splitlines():
        m = _CACHE_LINE.fullmatch(line)
        if m and flag in m.group(2).split(","):
            entries.setdefault(m.group(1), m.group(3))
    return entries


def cache_problems(machine: Machine, sonames: dict[str, str | None]) -> list[Problem]:
    """The linker cache resolves every SONAME of the driver root's library directory
    (`sonames`: file name -> DT_SONAME) to that SONAME's link in the root, and the link
    leads to the file that carries it."""
    cache = machine.at(CACHE)
    entries = cache_entries(machine)
    if isinstance(entries, str):
        return [Problem("ldcache-stale", f"{cache}: {entries}", str(cache))]
    libdir = driver_libdir(machine)
    real = os.path.realpath(machine.at(libdir))
    problems = []
    for name, soname in sorted(sonames.items()):
        if not soname:
            continue
        want = f"{libdir}/{soname}"
        have = entries.get(soname)
        if have != want:
            where = f"resolves {soname} to {have}" if have else f"does not list {soname}"
            problems.append(Problem("ldcache-stale", f"{cache} {where}, not {want}",
                                    str(cache)))
        elif resolve_in_driver_root(os.path.join(real, soname)) != os.path.join(real, name):
            problems.append(Problem("ldcache-stale", f"{cache} resolves {soname} to "
                                    f"{want}, which does not lead to {name}", str(cache)))
    return problems
