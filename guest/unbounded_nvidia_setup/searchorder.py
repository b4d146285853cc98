"""The machine's linker search order, read from /etc/ld.so.conf as glibc's ldconfig reads
it, and the directories in it that come before the driver root's.

ldconfig lists a SONAME found in several directories once per directory, in search order,
and ld.so loads the first (docs/architecture.md, "The linker's search order"). A directory
named before the drop-in's that holds one of the driver's SONAMEs therefore shadows the
driver root: that is what a CUDA forward-compat package's `000_cuda.conf` does.

glibc's rules (elf/ldconfig.c, parse_conf and parse_conf_include), checked against the
real ldconfig's own listing in tests/test_ldshadow.py: `#` starts a comment anywhere;
`include` and `hwcap` need a blank after them; `include` takes blank-separated glob
patterns, relative ones to the including file's directory, expanded in byte order of the
names (ldconfig sets LC_COLLATE=C) without names that start with a dot; a directory line
loses a `=type` suffix, trailing blanks and slashes; a directory that does not exist is
left out, and one named again (by any path) keeps its first place. Paths are resolved
under --root, as ldconfig -r does in its chroot.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .config import LDCONF_DROPIN, Machine
from .discover import open_regular, resolve_under_root
from .elf import CorruptElf, read_elf
from .linker import driver_libdir, dropin_text
from .problems import Problem

CONF = "/etc/ld.so.conf"
# glibc follows includes without a limit (a file that includes itself runs it out of
# memory); real configurations nest one or two deep.
_MAX_DEPTH = 8
_MAX_CONF = 1 << 20
_SPACE = " \t\n\v\f\r"  # C isspace
_BLANKS = (" ", "\t")  # C isblank


@dataclass(frozen=True)
class ConfDir:
    """A directory of the search order, as the machine sees it, and where it is named."""

    path: str
    conf: str
    line: int


@dataclass(frozen=True)
class Shadow:
    """A directory searched before the driver root's that holds driver SONAMEs."""

    where: ConfDir
    sonames: tuple[str, ...]
    directory: str  # `where.path` resolved, as the machine sees it (merged /usr: /usr/lib/...)


def parse_line(line: str) -> tuple[str, list[str]] | None:
    """One line of a conf file: ("dir", [path]), ("include", patterns), or None."""
    text = line.split("#", 1)[0].lstrip(_SPACE)
    if not text:
        return None
    if text.startswith("include") and text[7:8] in _BLANKS:
        return "include", [p for p in text[8:].replace("\t", " ").split(" ") if p]
    if text[:5].lower() == "hwcap" and text[5:6] in _BLANKS:
        return None  # glibc ignores it (with a warning)
    path = text.split("=", 1)[0].rstrip(_SPACE).rstrip("/")
    return ("dir", [path]) if path else None


def walk(read: Callable[[str], str | None], expand: Callable[[str], list[str]],
         conf: str = CONF, depth: int = 0) -> Iterator[ConfDir]:
    """Every directory line, in order, following includes; nothing checked on disk but
    through `read` (a conf file's text, None when unreadable) and `expand` (the files
    an absolute glob matches, in order)."""
    text = read(conf)
    if text is None or depth > _MAX_DEPTH:
        return
    for number, line in enumerate(text.split("\n"), 1):
        parsed = parse_line(line)
        if parsed is None:
            continue
        kind, words = parsed
        if kind == "dir":
            yield ConfDir(words[0], conf, number)
            continue
        for pattern in words:
            if not pattern.startswith("/"):
                pattern = posixpath.join(posixpath.dirname(conf), pattern)
            for included in expand(pattern):
                yield from walk(read, expand, included, depth + 1)


def glob_matches(path: str, pattern: str) -> bool:
    """Whether glob(3) would return `path` for `pattern`: component by component, and a
    leading dot only matched by a leading dot."""
    names, parts = path.split("/"), pattern.split("/")
    return len(names) == len(parts) and all(
        fnmatch.fnmatchcase(n, p) and (not n.startswith(".") or p.startswith("."))
        for n, p in zip(names, parts, strict=True))


def resolve_machine_path(root: str, path: str) -> str | None:
    """`path` (as the machine sees it) resolved as the kernel would in a chroot at `root`,
    as ldconfig -r does. None when it dangles or loops."""
    return resolve_under_root(root, root, path)


def _read(machine: Machine, path: str) -> str | None:
    """A conf file's text, or None: never anything but a regular file (ldconfig blocks on
    a FIFO named *.conf). The drop-in reads as the run writes it, so the order is the
    one ldconfig follows once the drop-in is there, before the run wrote it too."""
    if path == LDCONF_DROPIN:
        return dropin_text(machine)
    target = resolve_machine_path(str(machine.root), path)
    if target is None:
        return None
    try:
        fd = open_regular(Path(target))
    except (OSError, ValueError):
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(_MAX_CONF).decode(errors="surrogateescape")


def _expand(machine: Machine, pattern: str) -> list[str]:
    found = {"/" + p for p in glob.glob(pattern.lstrip("/"), root_dir=machine.root)}
    if glob_matches(LDCONF_DROPIN, pattern):
        found.add(LDCONF_DROPIN)
    return sorted(found, key=os.fsencode)


@dataclass(frozen=True)
class _Located:
    entry: ConfDir
    key: object  # what makes two lines name one directory (_locate)
    real: str | None  # the directory resolved under the root; None: not there yet


def _locate(machine: Machine, path: str) -> tuple[object, str | None]:
    """(identity, resolved path). The identity is what makes two lines name one
    directory, as ldconfig compares them (device and inode); None for a directory that
    does not exist, which ldconfig leaves out. The driver root's own directory counts as
    there before the run builds it."""
    real = resolve_machine_path(str(machine.root), path)
    try:
        st = os.stat(real) if real is not None else None
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        return (st.st_dev, st.st_ino), real
    return ("driver-libdir" if path == driver_libdir(machine) else None), None


def _ordered(machine: Machine) -> Iterator[_Located]:
    seen = set()
    for entry in walk(lambda p: _read(machine, p), lambda p: _expand(machine, p)):
        key, real = _locate(machine, entry.path)
        if key is not None and key not in seen:
            seen.add(key)
            yield _Located(entry, key, real)


def search_order(machine: Machine) -> list[ConfDir]:
    """The directories ldconfig searches before its built-in ones, in its order, with
    the drop-in as the run writes it (the driver root's directory counts as there)."""
    return [located.entry for located in _ordered(machine)]


def _holds(machine: Machine, directory: str, soname: str) -> bool:
    """`directory/soname` (`directory` resolved under the root) is a library of the
    machine's architecture with that DT_SONAME: what ldconfig lists for that directory
    and ld.so would load. Most SONAMEs are not there: one lstat says so."""
    path = f"{directory}/{soname}"
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False
    target = (resolve_machine_path(str(machine.root), os.path.relpath(path, machine.root))
              if is_link else path)
    if target is None:
        return False
    try:
        fd = open_regular(Path(target))
    except (OSError, ValueError):
        return False
    with os.fdopen(fd, "rb", buffering=4096) as f:
        try:
            info = read_elf(f)
        except CorruptElf:
            return False
    return (info is not None and info.bits == 64 and info.machine == machine.arch
            and info.soname == soname)


def shadows(machine: Machine, sonames: Iterable[str],
            leftovers: Iterable[Path] = ()) -> list[Shadow]:
    """Directories searched before the driver root's that hold any of `sonames` (the
    driver root's SONAMEs). Empty when the driver root is not in the search order at
    all: then nothing comes before it (the linker cache check says it is missing).
    `leftovers`, an older agent's links (linker.legacy_links), are no package's copies:
    `run` removes them and `check` names them as such."""
    wanted = sorted(set(sonames))
    skip = {os.path.join(os.path.realpath(p.parent), p.name) for p in leftovers}
    driver, _ = _locate(machine, driver_libdir(machine))
    found: list[Shadow] = []
    for located in _ordered(machine):
        if located.key == driver:
            return found
        if located.real is None:
            continue
        canonical = os.path.realpath(located.real) if skip else located.real
        held = tuple(s for s in wanted if f"{canonical}/{s}" not in skip
                     and _holds(machine, located.real, s))
        if held:
            real = posixpath.normpath("/" + os.path.relpath(located.real, machine.root))
            found.append(Shadow(located.entry, held, real))
    return []


def first_copy(shadow: Shadow) -> str:
    """The shadowing file as the machine sees it, by its directory's own path (where a
    package puts it; `/lib` is a link to `usr/lib`): what `dpkg -S` is asked about."""
    return f"{shadow.directory}/{shadow.sonames[0]}"


def describe(machine: Machine, shadow: Shadow) -> str:
    """The copy first, then where the search order takes it from. It never says to
    remove the conf file: Debian's own <multiarch>.conf names the machine's libraries."""
    others = shadow.sonames[1:]
    names = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return (f"{machine.at(first_copy(shadow))} is another copy of {shadow.sonames[0]}"
            + (f" (with {names})" if others else "")
            + f", in {shadow.where.path}, which {machine.at(shadow.where.conf)} line "
              f"{shadow.where.line} puts before the driver root's {driver_libdir(machine)} "
              "in the linker's search order")


def todo(shadow: Shadow) -> str:
    copy = first_copy(shadow)
    return (f"find the package that installed it (`dpkg -S {copy}`) and remove that "
            "package, or the file if no package owns it (pods get the driver's libraries "
            "through CDI, not from this machine's linker)")


def problems(machine: Machine, sonames: Iterable[str],
             leftovers: Iterable[Path] = ()) -> list[Problem]:
    # `path` stays the conf file, as within schema 1 it always was; the message names the
    # copy, which is what the operator removes.
    return [Problem("ldcache-shadowed", describe(machine, s), str(machine.at(s.where.conf)))
            for s in shadows(machine, sonames, leftovers)]
