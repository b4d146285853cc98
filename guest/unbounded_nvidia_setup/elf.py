"""What this tool needs to know about an ELF file: class, machine, type and DT_SONAME.

Read with `struct` from the ELF header, the program headers and the dynamic segment: a
few hundred bytes per file. This runs for every driver file on every boot, where
pyelftools cost ~30 ms to import and ~1 ms per file to set up its parsers (measured with
`make bench`); tests/test_elf.py checks the answers against pyelftools and readelf.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import BinaryIO

ELF_MAGIC = b"\x7fELF"
_MACHINES = {62: "x86_64", 183: "aarch64"}
_TYPES = {1: "ET_REL", 2: "ET_EXEC", 3: "ET_DYN", 4: "ET_CORE"}
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_STRTAB, _DT_SONAME = 0, 5, 14
_MAX_PHNUM = 256
_PHENTSIZE = 56
_MAX_NAME = 4096
# The dynamic segment is read whole: Debian's NVIDIA 535 and 550 libraries' are under
# 600 bytes. A sparse file can claim gigabytes and still fit before its end (issue 37):
# anything over this is no driver library.
_MAX_DYNAMIC = 1 << 16


class CorruptElf(Exception):
    """ELF magic, but the headers cannot be parsed: a damaged or truncated file."""


@dataclass(frozen=True)
class ElfInfo:
    bits: int
    machine: str  # x86_64, aarch64, or EM_<number> for anything else
    kind: str  # ET_DYN, ET_EXEC, ...
    soname: str | None


def _read(stream: BinaryIO, end: int, offset: int, size: int, what: str) -> bytes:
    """`size` bytes at `offset`. Offsets and sizes come from the file itself: one past its
    `end` is refused before seeking or reading, since seek() cannot take 2**63 and
    read() would allocate whatever size a damaged header asks for."""
    if offset + size > end:
        raise CorruptElf(f"{what} at offset {offset} runs past the end of the file")
    stream.seek(offset)
    data = stream.read(size)
    if len(data) != size:
        raise CorruptElf(f"{what} at offset {offset} runs past the end of the file")
    return data


def read_elf(stream: BinaryIO) -> ElfInfo | None:
    """None when the file is not ELF at all; CorruptElf when it is ELF but damaged."""
    ident = stream.read(16)
    if ident[:4] != ELF_MAGIC:
        return None
    if len(ident) < 16 or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        raise CorruptElf("bad ELF identification")
    bits = 32 if ident[4] == 1 else 64
    order = "<" if ident[5] == 1 else ">"
    end = stream.seek(0, io.SEEK_END)
    e_type, e_machine = struct.unpack(order + "HH", _read(stream, end, 16, 4, "ELF header"))
    info = ElfInfo(bits, _MACHINES.get(e_machine, f"EM_{e_machine}"),
                   _TYPES.get(e_type, f"ET_{e_type}"), None)
    if bits != 64 or e_machine not in _MACHINES:
        return info  # skipped by the caller; no need to read further
    e_phoff, = struct.unpack(order + "Q", _read(stream, end, 32, 8, "ELF header"))
    e_phentsize, e_phnum = struct.unpack(order + "HH", _read(stream, end, 54, 4, "ELF header"))
    if e_phnum == 0:
        return info
    # Elf64_Phdr is 56 bytes; glibc refuses any other entry size too ("ELF file's
    # phentsize not the expected size"), and a larger stride reads garbage as headers.
    if e_phentsize != _PHENTSIZE or e_phnum > _MAX_PHNUM:
        raise CorruptElf("bad program header table")
    table = _read(stream, end, e_phoff, e_phentsize * e_phnum, "program header table")
    loads: list[tuple[int, int, int]] = []
    dynamic: tuple[int, int] | None = None
    for i in range(e_phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            order + "IIQQQQ", table, i * e_phentsize)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return info
    if dynamic[0] + dynamic[1] <= end and dynamic[1] > _MAX_DYNAMIC:
        raise CorruptElf(f"dynamic segment of {dynamic[1]} bytes, more than any driver "
                         f"library's ({_MAX_DYNAMIC})")
    entries = _read(stream, end, dynamic[0], dynamic[1] - dynamic[1] % 16, "dynamic segment")
    strtab = soname = None
    for d_tag, d_val in struct.iter_unpack(order + "qQ", entries):
        if d_tag == _DT_NULL:
            break
        if d_tag == _DT_STRTAB:
            strtab = d_val
        elif d_tag == _DT_SONAME:
            # Readers disagree on which of two counts (glibc's ldconfig and this tool did,
            # in the staging fuzz): no library has two, so neither is trusted.
            if soname is not None:
                raise CorruptElf("more than one DT_SONAME")
            soname = d_val
    if soname is None:
        return info
    if strtab is None:
        raise CorruptElf("DT_SONAME without DT_STRTAB")
    # DT_STRTAB is an address: find the loaded segment that holds it.
    for vaddr, offset, filesz in loads:
        if vaddr <= strtab < vaddr + filesz:
            at = offset + strtab - vaddr + soname
            if at >= end:
                raise CorruptElf(f"DT_SONAME string at offset {at} is past the end of the file")
            stream.seek(at)
            name = stream.read(_MAX_NAME).split(b"\0", 1)
            if len(name) < 2:
                raise CorruptElf("DT_SONAME string is not terminated")
            return ElfInfo(bits, info.machine, info.kind,
                           name[0].decode("utf-8", "surrogateescape"))
    raise CorruptElf("DT_STRTAB is outside every loaded segment")
