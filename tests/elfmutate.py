"""Mutations of a 64-bit little-endian ELF shared object's bytes (for tests/stagingfuzz.py):
its layout, DT_SONAME strings, dynamic tags, header fields, truncation."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

# Dynamic tags and segment types the mutations edit.
DT_NULL, DT_NEEDED, DT_STRTAB, DT_SONAME, DT_DEBUG = 0, 1, 5, 14, 21
PT_NULL, PT_DYNAMIC = 0, 2


# --------------------------------------------------------------------------------------
# ELF layout (64-bit little-endian: every file mutated here is x86_64)


@dataclass(frozen=True)
class Dyn:
    offset: int  # file offset of the entry
    tag: int
    value: int


@dataclass(frozen=True)
class Layout:
    phoff: int
    phentsize: int
    phnum: int
    dynamic_ph: int | None  # file offset of the PT_DYNAMIC program header
    dynamic: tuple[Dyn, ...]
    strtab: int | None  # file offset of the dynamic string table

    def first(self, tag: int) -> Dyn | None:
        return next((d for d in self.dynamic if d.tag == tag), None)


def layout(data: bytes) -> Layout:
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads: list[tuple[int, int, int]] = []
    dynamic_ph = dyn = None
    for i in range(phnum):
        at = phoff + i * phentsize
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, at)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic_ph, dyn = at, (p_offset, p_filesz)
    entries: list[Dyn] = []
    if dyn is not None:
        for at in range(dyn[0], dyn[0] + dyn[1] - 15, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            entries.append(Dyn(at, tag, value))
            if tag == DT_NULL:
                break
    strtab = None
    for d in entries:
        if d.tag == DT_STRTAB:
            strtab = next((off + d.value - va for va, off, size in loads
                           if va <= d.value < va + size), None)
    return Layout(phoff, phentsize, phnum, dynamic_ph, tuple(entries), strtab)


def put(data: bytearray, offset: int, fmt: str, *values: int) -> None:
    struct.pack_into(fmt, data, offset, *values)


def set_soname(data: bytes, soname: bytes) -> bytes | None:
    """DT_SONAME pointing at `soname`, appended after the file's end (the string table
    offset reaches there: a reader finds it as it finds any SONAME). A library without a
    DT_SONAME gets one in a spare DT_NULL slot."""
    lay = layout(data)
    if lay.strtab is None:
        return None
    out = bytearray(data)
    entry = lay.first(DT_SONAME)
    if entry is None:
        nulls = [d for d in lay.dynamic if d.tag == DT_NULL]
        spare = lay.dynamic[-1].offset + 16
        if not nulls or spare + 16 > len(data) or struct.unpack_from("<q", data, spare)[0]:
            return None
        put(out, nulls[0].offset, "<qQ", DT_SONAME, 0)
        put(out, spare, "<qQ", DT_NULL, 0)
        entry = Dyn(nulls[0].offset, DT_SONAME, 0)
    put(out, entry.offset + 8, "<Q", len(out) - lay.strtab)
    return bytes(out + soname + b"\0")


def with_soname(soname: bytes, *, terminated: bool = True) -> Callable[[bytes], bytes | None]:
    def mutate(data: bytes) -> bytes | None:
        out = set_soname(data, soname)
        return out if out is None or terminated else out[:-1]
    return mutate


def retag(data: bytes, old: int, new: int) -> bytes | None:
    lay = layout(data)
    entry = lay.first(old)
    if entry is None:
        return None
    out = bytearray(data)
    put(out, entry.offset, "<q", new)
    return bytes(out)


def soname_value(data: bytes, value: int) -> bytes | None:
    entry = layout(data).first(DT_SONAME)
    if entry is None:
        return None
    out = bytearray(data)
    put(out, entry.offset + 8, "<Q", value)
    return bytes(out)


def soname_of_needed(data: bytes) -> bytes | None:
    """DT_SONAME pointing at the string of a DT_NEEDED entry (libc.so.6, ...)."""
    needed = layout(data).first(DT_NEEDED)
    return None if needed is None else soname_value(data, needed.value)


def two_sonames(data: bytes) -> bytes | None:
    """A DT_NEEDED entry turned into a second DT_SONAME."""
    return retag(data, DT_NEEDED, DT_SONAME)


def header(fmt: str, offset: int, value: int) -> Callable[[bytes], bytes | None]:
    def mutate(data: bytes) -> bytes | None:
        out = bytearray(data)
        put(out, offset, fmt, value)
        return bytes(out)
    return mutate


def dynamic_field(offset_in_ph: int, value: int) -> Callable[[bytes], bytes | None]:
    """p_offset (8) or p_filesz (32) of the PT_DYNAMIC program header."""
    def mutate(data: bytes) -> bytes | None:
        at = layout(data).dynamic_ph
        if at is None:
            return None
        out = bytearray(data)
        put(out, at + offset_in_ph, "<Q", value)
        return bytes(out)
    return mutate


def no_dynamic(data: bytes) -> bytes | None:
    at = layout(data).dynamic_ph
    if at is None:
        return None
    out = bytearray(data)
    put(out, at, "<I", PT_NULL)
    return bytes(out)


def truncate(where: Callable[[bytes], int | None]) -> Callable[[bytes], bytes | None]:
    def mutate(data: bytes) -> bytes | None:
        at = where(data)
        return None if at is None or not 0 <= at < len(data) else data[:at]
    return mutate


def soname_string_at(data: bytes) -> int | None:
    lay = layout(data)
    entry = lay.first(DT_SONAME)
    return None if entry is None or lay.strtab is None else lay.strtab + entry.value + 2
