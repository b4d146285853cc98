"""go-nvml and nvsandboxutils: the root's libraries loaded and their init functions called."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .filepath import trim_prefix
from .logger import CtkError, Logger
from .lookup import LIBRARY_SEARCH_DIRS, Locator

# go-nvml's names for the NVML return codes the stand-in can meet.
NVML_RETURNS = {0: "SUCCESS", 1: "ERROR_UNINITIALIZED", 2: "ERROR_INVALID_ARGUMENT",
                3: "ERROR_NOT_SUPPORTED", 9: "ERROR_DRIVER_NOT_LOADED",
                12: "ERROR_LIBRARY_NOT_FOUND", 13: "ERROR_FUNCTION_NOT_FOUND",
                999: "ERROR_UNKNOWN"}
SANDBOXUTILS_LIBRARY = "libnvidia-sandboxutils.so.1"


def symbol_lookup_error(symbol: str) -> NoReturn:
    """How the real tool dies when a library it loaded lacks a function it calls: it is
    a cgo binary, lazily bound, so glibc's ld.so fails the call itself, prints this line
    and exits 127 (FACTS.md). No Go log line, no cleanup."""
    prog = sys.argv[0] if sys.argv and sys.argv[0] else "nvidia-ctk"
    sys.stdout.flush()
    sys.stderr.write(f"{prog}: symbol lookup error: {prog}: undefined symbol: {symbol}\n")
    sys.stderr.flush()
    os._exit(127)


def load_library(path: str) -> Any:
    """dlopen(path, RTLD_LAZY|RTLD_GLOBAL) as go-nvml's dl package does; None when it
    cannot be loaded (another architecture, not ELF, missing dependencies)."""
    import ctypes

    try:
        return ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_GLOBAL)
    except OSError:
        return None


_SCRATCH_PREFIX = ".nvidia-ctk-nvml."


def _remove_stale_scratch(tmp: str) -> None:
    """Empty roots of stand-ins that were SIGKILLed in the instant between making theirs
    and removing it (the product kills an nvidia-ctk whose answer it no longer needs)."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(_SCRATCH_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_SCRATCH_PREFIX):].split(".", 1)[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(tmp, name))
        except (ValueError, PermissionError):
            continue


def call_isolated(function: Callable[[], int]) -> int:
    """Call an NVML init function and return its result, in a child process that, when it
    may, chroots into an empty directory first. The real libnvidia-ml, run as root,
    mknods /dev/nvidiactl, unlinks /dev/char/<major>:<minor> and looks for modprobe in
    the caller's root (seen with Debian's 535.309.01): on a test machine that must not
    happen. In an empty root it finds no /proc, /sys or /dev and answers what it answers
    without a loaded kernel module. The directory is removed as soon as the child is in
    it (nothing can be made in a removed directory). Where chroot is not permitted (the
    unit's capability bounding set in a booted test machine) the call happens in place,
    as the real tool's would."""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    _remove_stale_scratch(tmp)
    empty = os.path.join(tmp, f"{_SCRATCH_PREFIX}{os.getpid()}.{time.monotonic_ns()}")
    os.mkdir(empty, 0o700)
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (child)
            try:
                os.close(read_end)
                try:
                    os.chroot(empty)
                    os.chdir("/")
                except PermissionError:
                    pass
                os.write(write_end, b"\n")  # in its root: the parent may remove it
                os.write(write_end, str(function()).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as answer:
            ready = answer.read(1)
            os.rmdir(empty)
            text = answer.read().decode() if ready else ""
        os.waitpid(pid, 0)
    finally:
        if os.path.isdir(empty):
            os.rmdir(empty)
    return int(text) if text.strip().lstrip("-").isdigit() else 999


KERNEL_GPUS_DIR = "proc/driver/nvidia/gpus"
_INFO_LINE = re.compile(r"^(GPU UUID|Device Minor):\s*(\S+)\s*$", re.M)


def kernel_gpus(dev_root: str) -> list[tuple[str, int]]:
    """The GPUs NVML would find through a loaded kernel module, as this stand-in plays
    one: each ``<dev root>/proc/driver/nvidia/gpus/<PCI bus id>/information`` (the file
    the real module writes there, with its ``GPU UUID:`` and ``Device Minor:`` lines),
    in PCI bus order as NVML enumerates them, while ``<dev root>/dev/nvidiactl`` (the
    node NVML talks to the module through) is a character device. None: the module is
    not loaded, NVML's init is really called and answers what the library answers.
    (The dev root stands for the host the devices are on; the real NVML asks the
    caller's own kernel.)"""
    try:
        if not stat.S_ISCHR(os.stat(os.path.join(dev_root, "dev/nvidiactl")).st_mode):
            return []
        buses = sorted(os.listdir(os.path.join(dev_root, KERNEL_GPUS_DIR)))
    except OSError:
        return []
    gpus: list[tuple[str, int]] = []
    for bus in buses:
        try:
            with open(os.path.join(dev_root, KERNEL_GPUS_DIR, bus, "information"),
                      encoding="utf-8", errors="replace") as f:
                fields = dict(_INFO_LINE.findall(f.read()))
        except OSError:
            continue
        minor = fields.get("Device Minor", "")
        if fields.get("GPU UUID", "").startswith("GPU-") and minor.isdigit():
            gpus.append((fields["GPU UUID"], int(minor)))
    return gpus


@dataclass
class Nvml:
    """go-nvml against the libnvidia-ml.so.1 found in the driver root.

    The library is loaded as go-nvml loads it and its init function is resolved as
    go-nvml's updateVersionedSymbols does (nvmlInit_v2, else nvmlInit). A library
    without either kills the process like the real tool (symbol_lookup_error); one that
    cannot be loaded is ERROR_LIBRARY_NOT_FOUND. The init is then really called
    (call_isolated): 9, ERROR_DRIVER_NOT_LOADED, from the real and the simulated library
    on a machine without a GPU. FAKE_NVIDIA_CTK_GPUS stands for a GPU machine: NVML
    initialises and lists those GPUs, without calling the library's init; so do the GPUs
    of a simulated kernel module (kernel_gpus). ``gpus``: (uuid, device minor) each."""

    library: str | None
    gpus: list[tuple[str, int]]
    result: int = 12

    @classmethod
    def load(cls, library: str | None, gpus: list[tuple[str, int]]) -> Nvml:
        nvml = cls(library, gpus)
        loaded = load_library(library) if library is not None else None
        if loaded is None:
            return nvml
        name = next((n for n in ("nvmlInit_v2", "nvmlInit") if hasattr(loaded, n)), None)
        if name is None:
            symbol_lookup_error("nvmlInit")
        init: Callable[[], int] = getattr(loaded, name)
        nvml.result = 0 if gpus else call_isolated(init)
        return nvml

    def init_error(self) -> str | None:
        if self.result == 0:
            return None
        return NVML_RETURNS.get(self.result, f"unknown return value: {self.result}")

    def driver_version(self) -> str:
        error = self.init_error()
        if error is not None:
            raise CtkError(f"failed to initialize nvml: {error}")
        assert self.library is not None
        version = trim_prefix(os.path.basename(self.library), "libnvidia-ml.so.")
        if not re.fullmatch(r"\d+(\.\d+)+", version):
            raise CtkError("failed to get driver version: ERROR_UNKNOWN")
        return version


def init_sandboxutils(log: Logger, root: str) -> None:
    """nvsandboxutils, when the driver root has it: loaded and its nvSandboxUtilsInit
    resolved like NVML's init (missing: the same death). Its init takes a versioned
    struct this stand-in does not build; it is reported as failing, which the real tool
    ignores with this warning (it then finds the driver files without it)."""
    locator = Locator(log, root, LIBRARY_SEARCH_DIRS, resolve=True, required=False)
    found = locator.locate(SANDBOXUTILS_LIBRARY)
    loaded = load_library(found[0]) if found else None
    if loaded is None:
        return
    if not hasattr(loaded, "nvSandboxUtilsInit"):
        symbol_lookup_error("nvSandboxUtilsInit")
    log.warning("Failed to init nvsandboxutils: ERROR_NOT_SUPPORTED (not simulated by this "
                "test stand-in); ignoring")
