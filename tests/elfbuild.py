"""Real ELF objects for tests: gcc-built shared objects and programs (cached), simulated NVML.

Everything that looks like an ELF object in the tests is a REAL one built by gcc (except
where a function says it is hand-made), so the product's ELF reader, ``ldconfig -r`` and
the nvidia-ctk stand-in all see genuine shared objects with genuine DT_SONAMEs. The
simulated libnvidia-ml (tests/simnvml.c) exports NVML's entry points (NVML_ENTRY_POINTS)
and answers like the real library from the simulated machine it sits in: the GPUs its
kernel module lists, or, without them, as on a machine without a loaded NVIDIA kernel
module. NVIDIA's real nvidia-ctk and the stand-in both load it and call it.

Compiled objects are cached in ``$XDG_CACHE_HOME/unbounded-nvidia-setup-tests/elf``
(default ``~/.cache/...``), keyed by a hash of compiler, C source and flags; writes go
through a temporary file and ``os.replace`` so concurrent pytest processes are safe.
Files are padded to realistic sizes (:func:`write_file`) without becoming invalid.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

EM_386 = 3
EM_X86_64 = 62
EM_AARCH64 = 183


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/unbounded-nvidia-setup-tests`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "unbounded-nvidia-setup-tests"


def elf_cache_dir() -> Path:
    return cache_root() / "elf"


_MEMO: dict[str, bytes] = {}
_PROBES: dict[str, bool] = {}


class CompileError(RuntimeError):
    pass


def _c_string(text: str) -> str:
    """A C string literal for arbitrary text (octal escapes for anything unusual)."""
    out = []
    for byte in text.encode():
        ch = chr(byte)
        if 0x20 <= byte < 0x7F and ch not in '"\\?':
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _so_source(tag: str) -> str:
    return (
        "/* unbounded-nvidia-setup test fixture: simulated shared object */\n"
        '__attribute__((visibility("default"))) const char unb_sim_tag[] = '
        f"{_c_string(tag)};\n"
        '__attribute__((visibility("default"))) int unb_sim_answer(void) { return 42; }\n'
    )


NVML_SONAME = "libnvidia-ml.so.1"
# The simulated libnvidia-ml (tests/simnvml.c): NVML's entry points, answering from the
# simulated machine the library sits in (its GPUs, lost GPUs, MIG devices; see the C
# file). Without a GPU there (no /dev/nvidiactl, no GPU information file), as the real
# library on a machine without a loaded NVIDIA kernel module (Debian's 535.309.01, called
# with ctypes here): every init returns 9 (NVML_ERROR_DRIVER_NOT_LOADED), queries 1
# (NVML_ERROR_UNINITIALIZED), shutdown 0. nvidia-ctk loads the libnvidia-ml.so.1 of the
# driver root and calls nvmlInit_v2 (else nvmlInit) even in management mode; a library
# without them kills it (FACTS.md). Every name here is exported (tests check it).
NVML_ENTRY_POINTS = (
    "nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString",
    "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount", "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetUUID", "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2",
    "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetIndex", "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetAttributes", "nvmlDeviceGetAttributes_v2", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetGpuInstanceById", "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlGpuInstanceGetInfo", "nvmlGpuInstanceGetComputeInstanceById",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlComputeInstanceGetInfo",
    "nvmlComputeInstanceGetInfo_v2",
    # NVIDIA's device plugin v0.20.0 binds these too (its device map and health checks)
    "nvmlDeviceGetCudaComputeCapability", "nvmlEventSetCreate", "nvmlEventSetFree",
    "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents", "nvmlEventSetWait",
    "nvmlEventSetWait_v2", "nvmlDeviceGetTopologyCommonAncestor", "nvmlDeviceGetNvLinkState",
    # NVIDIA's nvidia-smi --version (550) calls these (tests/test_consumers.py)
    "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlInternalGetExportTable",
)
NVML_SOURCE_FILE = Path(__file__).resolve().parent / "simnvml.c"
_NVML_SOURCE = NVML_SOURCE_FILE.read_text()
# A string only the simulated library holds (SimMachine.nvml_answers looks for it).
NVML_MARKER = b"unbounded-nvidia-setup simulated NVML"


def nvml_source() -> str:
    """C source of the simulated libnvidia-ml's NVML (tests/simnvml.c)."""
    return _NVML_SOURCE


def _source_for(soname: str | None, tag: str, nvml: bool | None) -> str:
    """A simulated library's source; libnvidia-ml also gets NVML's entry points unless
    `nvml` is False (a stub such as the CUDA toolkit's, which nvidia-ctk cannot use)."""
    with_nvml = soname == NVML_SONAME if nvml is None else nvml
    return _so_source(tag) + (_NVML_SOURCE if with_nvml else "")


def _exe_source(tag: str) -> str:
    return (
        "/* unbounded-nvidia-setup test fixture: simulated executable */\n"
        "#include <stdio.h>\n"
        f"static const char unb_sim_tag[] = {_c_string(tag)};\n"
        "int main(void) { puts(unb_sim_tag); return 0; }\n"
    )


def _so_flags(soname: str | None) -> list[str]:
    flags = ["-shared", "-fPIC", "-O1", "-s"]
    if soname is not None:
        flags.append(f"-Wl,-soname,{soname}")
    return flags


def _compiler(cc: str) -> str:
    path = shutil.which(cc)
    if path is None:
        raise CompileError(f"{cc} not found on PATH (apt-get install gcc)")
    return path


def _build(cc: str, source: str, flags: list[str]) -> bytes:
    """Compile ``source`` with ``flags``; cached on disk and in memory."""
    cc_path = _compiler(cc)
    key = hashlib.sha256(json.dumps([cc_path, source, flags]).encode()).hexdigest()[:32]
    cached = _MEMO.get(key)
    if cached is not None:
        return cached
    cache = elf_cache_dir()
    target = cache / f"{key}.elf"
    data = target.read_bytes() if target.exists() else None
    if data is None:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=cache) as tmp:
            src = Path(tmp) / "src.c"
            src.write_text(source)
            out = Path(tmp) / "out.elf"
            proc = subprocess.run(
                [cc_path, *flags, "-o", str(out), str(src)],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise CompileError(f"{cc} {' '.join(flags)} failed: {proc.stderr.strip()}")
            data = out.read_bytes()
            # Another process may be doing the same: os.replace makes the last one win
            # with identical content, and readers only ever see a complete file.
            os.replace(out, target)
    _MEMO[key] = data
    return data


def so_bytes(soname: str | None, *, tag: str | None = None, nvml: bool | None = None) -> bytes:
    """The bytes of a real x86_64 shared object with DT_SONAME ``soname`` (None: none);
    ``nvml``: export NVML's entry points (default: when ``soname`` is libnvidia-ml's)."""
    source = _source_for(soname, tag if tag is not None else f"so:{soname}", nvml)
    return _build("gcc", source, _so_flags(soname))


def exe_bytes(tag: str = "simulated program") -> bytes:
    return _build("gcc", _exe_source(tag), ["-O1", "-s"])


def prewarm(sonames: Iterable[str | None], exe_tags: Iterable[str] = ()) -> None:
    """Compile missing cache entries in parallel (a cold cache holds ~100 objects)."""
    jobs: list[tuple[str, str, list[str]]] = []
    seen: set[str] = set()
    for soname in sonames:
        key = f"so:{soname}"
        if key not in seen:
            seen.add(key)
            jobs.append(("gcc", _source_for(soname, key, None), _so_flags(soname)))
    for tag in exe_tags:
        if f"exe:{tag}" not in seen:
            seen.add(f"exe:{tag}")
            jobs.append(("gcc", _exe_source(tag), ["-O1", "-s"]))
    workers = max(1, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for fut in [pool.submit(_build, *job) for job in jobs]:
            fut.result()


_PAD_BLOCK_SIZE = 1 << 20
_pad_block: bytes | None = None


def _padding_block() -> bytes:
    """1 MiB of pseudo-random bytes without a single zero (nothing sparse or trivial)."""
    global _pad_block
    if _pad_block is None:
        raw = random.Random(0x5EED_6B0D).randbytes(_PAD_BLOCK_SIZE)
        _pad_block = raw.replace(b"\0", b"\xa5")
    return _pad_block


def write_file(out: Path, data: bytes, size: int = 0, mode: int = 0o644) -> None:
    """Write ``data`` to ``out`` (replacing what is there, never following a link), then
    pad it to at least ``size`` bytes with non-zero pseudo-random bytes. ELF parsers and
    ldconfig ignore bytes after the last section, so a padded ELF stays valid."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(out):
        out.unlink()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        remaining = size - len(data)
        if remaining > 0:
            block = _padding_block()
            start = int.from_bytes(hashlib.sha256(out.name.encode()).digest()[:4]) % len(block)
            first = block[start : start + remaining]
            f.write(first)
            remaining -= len(first)
            while remaining > 0:
                chunk = block[:remaining]
                f.write(chunk)
                remaining -= len(chunk)
    os.chmod(out, mode)


def compile_so(
    out: Path, soname: str | None, size: int = 0, *, mode: int = 0o644, tag: str | None = None,
    nvml: bool | None = None,
) -> None:
    """A real x86_64 shared object (``gcc -shared -fPIC -Wl,-soname,<soname>``; no
    DT_SONAME when ``soname`` is None), at least ``size`` bytes long. libnvidia-ml
    (``soname`` libnvidia-ml.so.1) exports NVML's entry points unless ``nvml`` is False."""
    write_file(out, so_bytes(soname, tag=tag, nvml=nvml), size, mode)


def compile_exe(out: Path, size: int = 0, *, tag: str = "simulated program") -> None:
    """A real x86_64 executable (a tiny C main printing ``tag``), mode 0755."""
    write_file(out, exe_bytes(tag), size, 0o755)


def _probe(name: str, cc: str, flags: list[str]) -> bool:
    if name not in _PROBES:
        try:
            _build(cc, _so_source(f"probe:{name}"), flags)
            _PROBES[name] = True
        except CompileError:
            _PROBES[name] = False
    return _PROBES[name]


def aarch64_so(out: Path, soname: str) -> None:
    """An aarch64 (EM_AARCH64) 64-bit shared object with DT_SONAME ``soname``.

    Real when ``aarch64-linux-gnu-gcc`` (Debian gcc-aarch64-linux-gnu) is installed.
    Otherwise HAND-MADE: an x86_64 .so whose ELF header e_machine is patched to
    EM_AARCH64 (183). Its header, program headers and dynamic section parse like any
    aarch64 object (which is all a loader-independent tool reads); its code is x86."""
    flags = [*_so_flags(soname), "-nostdlib"]
    data = None
    if shutil.which("aarch64-linux-gnu-gcc") and _probe("aarch64", "aarch64-linux-gnu-gcc", flags):
        try:  # the simulated NVML includes libc headers, which a bare cross gcc may lack
            data = _build("aarch64-linux-gnu-gcc",
                          _source_for(soname, f"aarch64:{soname}", None), flags)
        except CompileError:
            data = None
    if data is None:
        patched = bytearray(so_bytes(soname, tag=f"aarch64:{soname}"))
        struct.pack_into("<H", patched, 18, EM_AARCH64)
        data = bytes(patched)
    write_file(out, data)


def _handmade_elf32_so(soname: str) -> bytes:
    """A minimal valid ELF32 ET_DYN object for EM_386: PT_LOAD + PT_DYNAMIC program
    headers, a dynamic section (DT_STRTAB, DT_STRSZ, DT_SONAME, DT_NULL), its string
    table and section headers (null, .dynstr, .dynamic, .shstrtab). No code."""
    ehsize, phsize, shsize = 52, 32, 40
    dynstr = b"\0" + soname.encode() + b"\0"
    shstrtab = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    dyn_off = ehsize + 2 * phsize
    dyn_size = 8 * 4
    str_off = dyn_off + dyn_size
    shstr_off = str_off + len(dynstr)
    sh_off = (shstr_off + len(shstrtab) + 3) & ~3
    load_size = shstr_off  # vaddr == file offset: PT_LOAD maps offset 0 at address 0
    ident = b"\x7fELF" + bytes([1, 1, 1, 0]) + bytes(8)  # ELFCLASS32, LSB, version 1
    header = ident + struct.pack(
        "<HHIIIIIHHHHHH", 3, EM_386, 1, 0, ehsize, sh_off, 0, ehsize, phsize, 2, shsize, 4, 3
    )
    pt_load = struct.pack("<IIIIIIII", 1, 0, 0, 0, load_size, load_size, 4 | 2, 0x1000)
    pt_dyn = struct.pack("<IIIIIIII", 2, dyn_off, dyn_off, dyn_off, dyn_size, dyn_size, 6, 4)
    dyn = struct.pack("<iIiIiIiI", 5, str_off, 10, len(dynstr), 14, 1, 0, 0)
    body = header + pt_load + pt_dyn + dyn + dynstr + shstrtab
    body += bytes(sh_off - len(body))

    def shdr(name: int, typ: int, flags: int, off: int, size: int, link: int, ent: int) -> bytes:
        addr = off if flags else 0
        return struct.pack("<IIIIIIIIII", name, typ, flags, addr, off, size, link, 0, 1, ent)

    sections = (
        bytes(shsize)
        + shdr(1, 3, 2, str_off, len(dynstr), 0, 0)  # .dynstr: SHT_STRTAB, SHF_ALLOC
        + shdr(9, 6, 3, dyn_off, dyn_size, 1, 8)  # .dynamic: SHT_DYNAMIC, WA, link .dynstr
        + shdr(18, 3, 0, shstr_off, len(shstrtab), 0, 0)  # .shstrtab
    )
    return body + sections


def elf32_so(out: Path, soname: str) -> None:
    """A 32-bit (ELFCLASS32, EM_386) shared object with DT_SONAME ``soname``: real
    (``gcc -m32 -nostdlib``, which needs no multilib) when the toolchain can, else a
    hand-made minimal ELF32 ET_DYN object."""
    flags = [*_so_flags(soname), "-m32", "-nostdlib"]
    if _probe("m32", "gcc", flags):
        data = _build("gcc", _so_source(f"elf32:{soname}"), flags)
    else:
        data = _handmade_elf32_so(soname)
    write_file(out, data)


def truncated_elf(out: Path) -> None:
    """The first 100 bytes of a real .so: valid ELF magic and header, unparsable rest."""
    write_file(out, so_bytes("libnvidia-truncated.so.1")[:100])
