"""go-nvml and nvsandboxutils: the driver root's libraries, loaded and called through ctypes."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

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


# go-nvml's own names for the return codes (defaultErrorStringFunc): its text for a
# return while no library is loaded.
def default_error_string(ret: int) -> str:
    return NVML_RETURNS.get(ret, f"unknown return value: {ret}")


SUCCESS, ERROR_INVALID_ARGUMENT, ERROR_NOT_SUPPORTED, ERROR_NOT_FOUND = 0, 2, 3, 6
ERROR_LIBRARY_NOT_FOUND = 12
UUID_BUFFER, NAME_BUFFER, VERSION_BUFFER = 96, 96, 80


class NvmlReturn(CtkError):
    """A non-SUCCESS nvml.Return, with the text go-nvml gives it (Return.Error())."""

    def __init__(self, ret: int, text: str) -> None:
        super().__init__(text)
        self.ret = ret


class NvmlLib:
    """go-nvml (pkg/nvml) over the libnvidia-ml.so.1 found in the driver root.

    Loaded as go-nvml loads it (dlopen RTLD_LAZY|RTLD_GLOBAL); None or unloadable: every
    init is ERROR_LIBRARY_NOT_FOUND. Each function is resolved as updateVersionedSymbols
    does (``nvmlInit_v2`` else ``nvmlInit``, ...) and called in the loaded library: one it
    lacks kills the process as it kills the real tool, a lazily bound cgo binary
    (symbol_lookup_error), at the first call. A return's text is the library's own
    nvmlErrorString (go-nvml's errorStringFunc once the library is loaded), which must
    exist too. The first init runs isolated (call_isolated: the real libnvidia-ml, as
    root, mknods in the caller's /dev); only when it answers SUCCESS (a simulated GPU
    machine's library, tests/simnvml.c) is the library used in this process."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.lib: Any = load_library(path) if path is not None else None
        self._isolated: int | None = None
        self._functions: dict[str, Any] = {}
        if self.lib is not None:
            self._fn("nvmlInit_v2", "nvmlInit")  # the real tool's first call: dies here

    @property
    def loaded(self) -> bool:
        return self.lib is not None

    def has(self, name: str) -> bool:
        """go-nvlib's hasSymbol (a dlsym probe)."""
        return self.lib is not None and hasattr(self.lib, name)

    def _fn(self, *names: str) -> Any:
        """The first of ``names`` the library has (versioned name first); none: the
        process dies naming the last (the v1 name go-nvml then calls)."""
        key = names[0]
        if key not in self._functions:
            found = next((n for n in names if self.has(n)), None)
            if found is None:
                symbol_lookup_error(names[-1])
            function = getattr(self.lib, found)
            function.restype = ctypes().c_int
            self._functions[key] = function
        return self._functions[key]

    def error_string(self, ret: int) -> str:
        if self.lib is None:
            return default_error_string(ret)
        if "nvmlErrorString" not in self._functions:
            if not self.has("nvmlErrorString"):
                symbol_lookup_error("nvmlErrorString")
            function = self.lib.nvmlErrorString
            function.restype = ctypes().c_char_p
            function.argtypes = [ctypes().c_int]
            self._functions["nvmlErrorString"] = function
        text = self._functions["nvmlErrorString"](ret)
        return text.decode(errors="replace") if text else ""

    def error(self, ret: int) -> NvmlReturn:
        return NvmlReturn(ret, self.error_string(ret))

    def check(self, ret: int) -> None:
        if ret != SUCCESS:
            raise self.error(ret)

    # ------------------------------------------------------------ init and shutdown

    def init(self) -> int:
        """nvml.Init(): the library's nvmlInit_v2 (else nvmlInit)."""
        if self.lib is None:
            return ERROR_LIBRARY_NOT_FOUND
        init = self._fn("nvmlInit_v2", "nvmlInit")
        if self._isolated is None:
            self._isolated = call_isolated(init)
        if self._isolated != SUCCESS:
            return self._isolated
        return int(init())

    def shutdown(self) -> int:
        if self.lib is None:
            return SUCCESS
        return int(self._fn("nvmlShutdown")())

    def driver_version(self) -> tuple[str, int]:
        buf = ctypes().create_string_buffer(VERSION_BUFFER)
        ret = self._fn("nvmlSystemGetDriverVersion")(buf, VERSION_BUFFER)
        return buf.value.decode(errors="replace"), ret

    # ------------------------------------------------------------ devices

    def _out(self, name: tuple[str, ...], kind: str, *args: Any) -> tuple[Any, int]:
        c = ctypes()
        value = getattr(c, kind)()
        ret = self._fn(*name)(*args, c.byref(value))
        return value.value, int(ret)

    def count(self) -> tuple[int, int]:
        return self._out(("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"), "c_uint")

    def handle_by_index(self, index: int) -> tuple[Any, int]:
        c = ctypes()
        return self._out(("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"),
                         "c_void_p", c.c_uint(index))

    def handle_by_uuid(self, uuid: str) -> tuple[Any, int]:
        c = ctypes()
        return self._out(("nvmlDeviceGetHandleByUUID",), "c_void_p", c.c_char_p(uuid.encode()))

    def _text(self, name: str, handle: Any, size: int) -> tuple[str, int]:
        c = ctypes()
        buf = c.create_string_buffer(size)
        ret = self._fn(name)(c.c_void_p(handle), buf, c.c_uint(size))
        return buf.value.decode(errors="replace"), int(ret)

    def name(self, handle: Any) -> tuple[str, int]:
        return self._text("nvmlDeviceGetName", handle, NAME_BUFFER)

    def uuid(self, handle: Any) -> tuple[str, int]:
        return self._text("nvmlDeviceGetUUID", handle, UUID_BUFFER)

    def _uint(self, name: str, handle: Any) -> tuple[int, int]:
        return self._out((name,), "c_uint", ctypes().c_void_p(handle))

    def minor(self, handle: Any) -> tuple[int, int]:
        return self._uint("nvmlDeviceGetMinorNumber", handle)

    def index(self, handle: Any) -> tuple[int, int]:
        return self._uint("nvmlDeviceGetIndex", handle)

    def is_mig_device(self, handle: Any) -> tuple[bool, int]:
        value, ret = self._uint("nvmlDeviceIsMigDeviceHandle", handle)
        return bool(value), ret

    def mig_mode(self, handle: Any) -> tuple[int, int]:
        """(current mode, return) of nvmlDeviceGetMigMode."""
        c = ctypes()
        current, pending = c.c_uint(), c.c_uint()
        ret = self._fn("nvmlDeviceGetMigMode")(c.c_void_p(handle), c.byref(current),
                                              c.byref(pending))
        return current.value, int(ret)

    def max_mig_device_count(self, handle: Any) -> tuple[int, int]:
        return self._uint("nvmlDeviceGetMaxMigDeviceCount", handle)

    def mig_handle_by_index(self, handle: Any, index: int) -> tuple[Any, int]:
        c = ctypes()
        return self._out(("nvmlDeviceGetMigDeviceHandleByIndex",), "c_void_p",
                         c.c_void_p(handle), c.c_uint(index))

    def parent_of_mig(self, handle: Any) -> tuple[Any, int]:
        return self._out(("nvmlDeviceGetDeviceHandleFromMigDeviceHandle",), "c_void_p",
                         ctypes().c_void_p(handle))

    def gpu_instance_id(self, handle: Any) -> tuple[int, int]:
        return self._uint("nvmlDeviceGetGpuInstanceId", handle)

    def compute_instance_id(self, handle: Any) -> tuple[int, int]:
        return self._uint("nvmlDeviceGetComputeInstanceId", handle)

    def _struct(self, name: tuple[str, ...], words: int, *args: Any) -> tuple[list[int], int]:
        """A struct out-parameter as ``words`` unsigned ints (enough room for any
        version of it)."""
        c = ctypes()
        buf = (c.c_uint * words)()
        ret = self._fn(*name)(*args, c.byref(buf))
        return list(buf), int(ret)

    def memory_total(self, handle: Any) -> tuple[int, int]:
        words, ret = self._struct(("nvmlDeviceGetMemoryInfo",), 6, ctypes().c_void_p(handle))
        return words[0] | words[1] << 32, ret

    def attributes_memory_mb(self, handle: Any) -> tuple[int, int]:
        words, ret = self._struct(("nvmlDeviceGetAttributes_v2", "nvmlDeviceGetAttributes"),
                                  10, ctypes().c_void_p(handle))
        return words[8] | words[9] << 32, ret

    def gpu_instance_by_id(self, handle: Any, gi: int) -> tuple[Any, int]:
        c = ctypes()
        return self._out(("nvmlDeviceGetGpuInstanceById",), "c_void_p", c.c_void_p(handle),
                         c.c_uint(gi))

    def compute_instance_by_id(self, gpu_instance: Any, ci: int) -> tuple[Any, int]:
        c = ctypes()
        return self._out(("nvmlGpuInstanceGetComputeInstanceById",), "c_void_p",
                         c.c_void_p(gpu_instance), c.c_uint(ci))

    def gpu_instance_profile_id(self, gpu_instance: Any) -> tuple[int, int]:
        """nvmlGpuInstanceGetInfo's profileId (after the device pointer and the id)."""
        words, ret = self._struct(("nvmlGpuInstanceGetInfo",), 6, ctypes().c_void_p(gpu_instance))
        return words[3], ret

    def compute_instance_profile_id(self, compute_instance: Any) -> tuple[int, int]:
        """nvmlComputeInstanceGetInfo's profileId (after two pointers and the id)."""
        words, ret = self._struct(("nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceGetInfo"),
                                  8, ctypes().c_void_p(compute_instance))
        return words[5], ret

    def gpu_instance_profile_info_id(self, handle: Any, profile: int) -> tuple[int, int]:
        c = ctypes()
        words, ret = self._struct(("nvmlDeviceGetGpuInstanceProfileInfo",), 12,
                                  c.c_void_p(handle), c.c_uint(profile))
        return words[0], ret

    def compute_instance_profile_info_id(self, gpu_instance: Any, profile: int,
                                         engine: int) -> tuple[int, int]:
        c = ctypes()
        words, ret = self._struct(("nvmlGpuInstanceGetComputeInstanceProfileInfo",), 9,
                                  c.c_void_p(gpu_instance), c.c_uint(profile), c.c_uint(engine))
        return words[0], ret

    def pci_bus_id(self, handle: Any) -> tuple[str, int]:
        """nvmlDeviceGetPciInfo (v3, else v2: busId at byte 36; v1: busId first)."""
        c = ctypes()
        buf = c.create_string_buffer(128)
        if self.has("nvmlDeviceGetPciInfo_v3") or self.has("nvmlDeviceGetPciInfo_v2"):
            ret = self._fn("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2")(
                c.c_void_p(handle), buf)
            raw = buf.raw[36:68]
        else:
            ret = self._fn("nvmlDeviceGetPciInfo")(c.c_void_p(handle), buf)
            raw = buf.raw[:16]
        return raw.split(b"\0", 1)[0].decode(errors="replace"), int(ret)


def ctypes() -> Any:
    """The ctypes module (imported on first use: management mode never needs it)."""
    import ctypes as module

    return module


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
