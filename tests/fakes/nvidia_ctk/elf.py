"""debug/elf as discover.getSoname uses it: the DT_SONAME of a shared object."""

from __future__ import annotations

import os
import struct
from typing import Any


class ElfError(Exception):
    pass


SHT_DYNAMIC = 6
DT_SONAME = 14


def read_dt_soname(path: str) -> str:
    """The library's DT_SONAME; its base name when it has none (discover.getSoname)."""
    with open(path, "rb") as f:
        ident = f.read(16)
        if len(ident) < 16 or ident[:4] != b"\x7fELF":
            raise ElfError(f"bad magic number {list(ident[:4])} in record at byte 0x0")
        elf_class, encoding = ident[4], ident[5]
        if elf_class not in (1, 2) or encoding not in (1, 2):
            raise ElfError(f"unknown ELF class {elf_class} or data encoding {encoding}")
        end = "<" if encoding == 1 else ">"
        is64 = elf_class == 2
        header_fmt = end + ("HHIQQQIHHHHHH" if is64 else "HHIIIIIHHHHHH")
        section_fmt = end + ("IIQQQQIIQQ" if is64 else "IIIIIIIIII")
        dyn_fmt = end + ("qQ" if is64 else "iI")
        header = struct.unpack(header_fmt, _read_exact(f, struct.calcsize(header_fmt)))
        shoff, shentsize, shnum = header[5], header[10], header[11]
        sections = []
        for index in range(shnum):
            f.seek(shoff + index * shentsize)
            sections.append(
                struct.unpack(section_fmt, _read_exact(f, struct.calcsize(section_fmt)))
            )
        dynamic = next((s for s in sections if s[1] == SHT_DYNAMIC), None)
        if dynamic is None:
            return os.path.basename(path)
        link = dynamic[6]
        if link >= len(sections):
            raise ElfError("invalid dynamic section link")
        strtab = sections[link]
        f.seek(strtab[4])
        strings = _read_exact(f, strtab[5])
        f.seek(dynamic[4])
        raw = _read_exact(f, dynamic[5])
        entry_size = struct.calcsize(dyn_fmt)
        sonames: list[str] = []
        for offset in range(0, len(raw) - entry_size + 1, entry_size):
            tag, value = struct.unpack_from(dyn_fmt, raw, offset)
            if tag == DT_SONAME:
                name_end = strings.find(b"\0", value)
                sonames.append(strings[value : name_end if name_end >= 0 else None].decode())
    if len(sonames) > 1:
        raise ElfError(f"multiple SONAMEs detected for {path}: {sonames}")
    return sonames[0] if sonames else os.path.basename(path)


def _read_exact(f: Any, size: int) -> bytes:
    data: bytes = f.read(size)
    if len(data) != size:
        raise ElfError("unexpected EOF")
    return data
