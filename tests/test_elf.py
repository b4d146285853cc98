"""The struct-based ELF reader against pyelftools, on real objects: gcc-built ones, the
real NVIDIA driver files (amd64 and arm64), this machine's own libraries, and every
truncation of a real shared object."""

from __future__ import annotations

import glob
import io
import os
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSegment
from elftools.elf.elffile import ELFFile

from unbounded_nvidia_setup.elf import CorruptElf, ElfInfo, read_elf

import elfbuild
import elfmutate
import realdriver


def reference(data: bytes) -> tuple[int, str | None] | None:
    """(class, DT_SONAME) as pyelftools reads them; None when not ELF."""
    if data[:4] != b"\x7fELF":
        return None
    elf = ELFFile(io.BytesIO(data))
    soname = None
    for segment in elf.iter_segments():
        if isinstance(segment, DynamicSegment):
            for tag in segment.iter_tags("DT_SONAME"):
                soname = str(getattr(tag, "soname", ""))
    return elf.elfclass, soname


def mine(data: bytes) -> ElfInfo | None:
    return read_elf(io.BytesIO(data))


def corpus(tmp_path: Path) -> list[Path]:
    files = []
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1", None):
        out = tmp_path / f"{soname}.so"
        elfbuild.compile_so(out, soname)
        files.append(out)
    elfbuild.compile_exe(tmp_path / "exe")
    elfbuild.aarch64_so(tmp_path / "arm.so", "libcuda.so.1")
    elfbuild.elf32_so(tmp_path / "32.so", "libcuda.so.1")
    files += [tmp_path / "exe", tmp_path / "arm.so", tmp_path / "32.so"]
    for arch in ("amd64", "arm64"):
        try:
            drv = realdriver.fetch_real_driver(arch)
        except realdriver.RealDriverUnavailable:
            if os.environ.get("CI"):
                raise
            continue
        files += drv.libraries + drv.helpers
    files += [Path(p) for p in sorted(glob.glob("/usr/lib/x86_64-linux-gnu/lib*.so.*"))[:200]
              if not os.path.islink(p)]
    return files


def test_same_answers_as_pyelftools(tmp_path: Path) -> None:
    checked = 0
    for path in corpus(tmp_path):
        data = path.read_bytes()
        want = reference(data)
        got = mine(data)
        if want is None:
            assert got is None, path
            continue
        assert got is not None and got.bits == want[0], path
        if got.bits == 64 and got.machine in ("x86_64", "aarch64"):
            assert got.soname == want[1], path
        checked += 1
    assert checked > 20


def test_every_truncation_is_corrupt_or_consistent(tmp_path: Path) -> None:
    """Cut a real shared object at every length: the reader either says CorruptElf or
    gives the full file's answer (when the cut leaves everything it reads) — never
    another exception and never a wrong SONAME."""
    elfbuild.compile_so(tmp_path / "a.so", "libnvidia-cut.so.1")
    data = (tmp_path / "a.so").read_bytes()
    full = mine(data)
    assert full is not None and full.soname == "libnvidia-cut.so.1"
    corrupt = whole = 0
    for length in range(len(data)):
        cut = data[:length]
        try:
            got = mine(cut)
        except CorruptElf:
            corrupt += 1
            continue
        if length < 4:
            assert got is None
        else:
            # Exactly the full answer: a SONAME lost to the cut (None) is a wrong answer,
            # it would file the library under its file name.
            assert got == full, length
            whole += 1
    assert corrupt and whole, (corrupt, whole)


X86_64_DYN = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HH", 3, 62)


@pytest.mark.parametrize("garbage", [b"\x7fELF", b"\x7fELF" + b"\x09" * 60,
                                     X86_64_DYN + b"\xff" * 100, X86_64_DYN])
def test_garbage_after_the_magic_is_corrupt(garbage: bytes) -> None:
    with pytest.raises(CorruptElf):
        mine(garbage)
    with pytest.raises(ELFError):
        reference(garbage)


@pytest.mark.parametrize("damage", [
    elfmutate.header("<Q", 32, (1 << 64) - 1),  # e_phoff: seek() cannot take it
    elfmutate.header("<Q", 32, 1 << 63),
    elfmutate.header("<H", 54, 0xFFFF),  # e_phentsize: a stride over garbage
    elfmutate.header("<H", 54, 64),
    elfmutate.dynamic_field(8, (1 << 64) - 1),  # PT_DYNAMIC p_offset
    elfmutate.dynamic_field(32, (1 << 64) - 1),  # PT_DYNAMIC p_filesz: read() of 2**64
    elfmutate.dynamic_field(32, 1 << 40),  # ... or a MemoryError
    lambda data: elfmutate.soname_value(data, 1 << 63),  # DT_SONAME string offset
    lambda data: elfmutate.soname_value(data, (1 << 64) - 1),
    elfmutate.two_sonames,
], ids=["phoff-2**64-1", "phoff-2**63", "phentsize-0xffff", "phentsize-64",
        "dynamic-offset-2**64-1", "dynamic-size-2**64-1", "dynamic-size-2**40",
        "soname-offset-2**63", "soname-offset-2**64-1", "two-sonames"])
def test_offsets_sizes_and_tags_a_real_library_cannot_have_are_corrupt(
        tmp_path: Path, damage: Callable[[bytes], bytes | None]) -> None:
    """Header fields the staging fuzz (issue 16) set on real driver files: each once ended
    in a traceback (ValueError from seek, OverflowError or MemoryError from read) or in a
    SONAME glibc's ldconfig did not see; each is CorruptElf, the run's "damaged ELF
    file". The library is gcc-built against libc, so it has DT_NEEDED entries as real
    driver libraries do (two_sonames turns one into a second DT_SONAME)."""
    (tmp_path / "a.c").write_text("int f(void) { return 0; }\n")
    out = tmp_path / "a.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out),
                    str(tmp_path / "a.c"), "-lm", "-Wl,--no-as-needed"], check=True)
    whole = out.read_bytes()
    assert mine(whole) == ElfInfo(64, "x86_64", "ET_DYN", "libcuda.so.1")
    data = damage(whole)
    assert data is not None
    out.write_bytes(data)
    # Read from a file as the tool does: BytesIO.read(2**40) allocates nothing.
    with open(out, "rb", buffering=4096) as f, pytest.raises(CorruptElf):
        read_elf(f)
