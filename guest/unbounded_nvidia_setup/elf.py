"""What this tool needs to know about an ELF file: class, machine, type and DT_SONAME."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

ELF_MAGIC = b"\x7fELF"
_MACHINES = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}


class CorruptElf(Exception):
    """ELF magic, but the headers cannot be parsed: a damaged or truncated file."""


@dataclass(frozen=True)
class ElfInfo:
    bits: int
    machine: str  # x86_64, aarch64, or pyelftools' EM_* name for anything else
    kind: str  # ET_DYN, ET_EXEC, ...
    soname: str | None


def read_elf(stream: BinaryIO) -> ElfInfo | None:
    """None when the file is not ELF at all; CorruptElf when it is ELF but damaged."""
    if stream.read(4) != ELF_MAGIC:
        return None
    stream.seek(0)
    from elftools.elf.dynamic import DynamicSegment
    from elftools.elf.elffile import ELFFile

    # pyelftools reports damage with whatever its parser hit (ELFError, struct errors,
    # IndexError …): at this boundary all of them mean "damaged file".
    try:
        elf = ELFFile(stream)
        machine = _MACHINES.get(elf["e_machine"], str(elf["e_machine"]))
        info = ElfInfo(bits=elf.elfclass, machine=machine, kind=str(elf["e_type"]), soname=None)
        if info.bits != 64 or machine not in _MACHINES.values():
            return info  # skipped by the caller; no need to parse further
        soname = None
        for segment in elf.iter_segments():
            if isinstance(segment, DynamicSegment):
                for tag in segment.iter_tags("DT_SONAME"):
                    soname = str(getattr(tag, "soname", "")) or None
                break
    except Exception as e:
        raise CorruptElf(str(e) or type(e).__name__) from e
    return ElfInfo(bits=info.bits, machine=machine, kind=info.kind, soname=soname)
