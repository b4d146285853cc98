"""NVML asked by index, GPU by GPU: which GPUs it can use, after nvidia-ctk failed.

nvidia-ctk 1.20 cannot tell which GPU its failure belongs to. Its `all` stops at the
first GPU whose handle fails by index, and it looks up every `--device-id` by UUID.
NVML's header lets a lookup by UUID fail when *any* GPU is lost, since NVML "may
initialize additional GPUs as it searches for the target GPU" (FACTS.md). A lookup by
index speaks of its target alone, for GPU_IS_LOST, NO_PERMISSION and UNKNOWN. So this
asks NVML by index, one handle per GPU, and never trusts a lookup by UUID.
INSUFFICIENT_POWER and IRQ_ISSUE are tied by the header to "any attached devices",
even by index. Either of them means that NVML cannot use any GPU of the node.

The asking runs in a child process, `python3 -m unbounded_nvidia_setup.nvml LIBRARY`.
NVML may hang, or print to stdout; a child can be bounded in time like nvidia-ctk
(run.py) and killed. The run's own process never loads the driver. Only a failed
generate pays for this (ctypes, a Python start): a healthy boot never does.

The child prints one line per fact, which the parent parses:

    init <ret>
    count <ret> <n>
    gpu <index> <ret> <uuid|-> <minor|-> <bus id|-> <mig mode 0|1>
    mig <index> <slot>            (a MIG device present in that slot of GPU <index>)
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Machine

# NVML's return codes (nvml.h) this tool names.
SUCCESS = 0
NO_PERMISSION = 4
INSUFFICIENT_POWER = 8
DRIVER_NOT_LOADED = 9
IRQ_ISSUE = 11
GPU_IS_LOST = 15
UNKNOWN = 999
# Errors nvml.h ties to the attached devices as a whole, not to the GPU asked for.
NODE_WIDE = frozenset({INSUFFICIENT_POWER, IRQ_ISSUE})
# nvmlErrorString's texts (Debian's 550 library), for a code the child could not ask
# the library about.
TEXTS = {NO_PERMISSION: "Insufficient Permissions", INSUFFICIENT_POWER:
         "Insufficient External Power", DRIVER_NOT_LOADED: "Driver Not Loaded",
         IRQ_ISSUE: "Interrupt Request Issue", GPU_IS_LOST: "GPU is lost",
         UNKNOWN: "Unknown Error"}


class NvmlGpu:
    """A GPU as NVML answers for it by index. `ret` is the lookup's return code; the
    other facts are known only when it is SUCCESS."""

    __slots__ = ("bus_id", "index", "mig", "migs", "minor", "ret", "uuid")

    def __init__(self, index: int, ret: int, uuid: str | None = None,
                 minor: int | None = None, bus_id: str | None = None,
                 mig: bool = False) -> None:
        self.index = index
        self.ret = ret
        self.uuid = uuid
        self.minor = minor
        self.bus_id = bus_id
        self.mig = mig
        self.migs: list[int] = []  # slots with a MIG device (nvidia-ctk's `<index>:<slot>`)


class Answer:
    """What NVML said: `init` and `count` are return codes; `gpus` in index order."""

    def __init__(self, init: int, count: int = SUCCESS, gpus: list[NvmlGpu] | None = None,
                 texts: dict[int, str] | None = None) -> None:
        self.init = init
        self.count = count
        self.gpus = gpus or []
        self.texts = texts or {}


def parse(text: str) -> Answer | None:
    """The child's lines; None when they do not read as the child writes them."""
    init: int | None = None
    count = SUCCESS
    gpus: dict[int, NvmlGpu] = {}
    texts: dict[int, str] = {}
    try:
        for line in text.splitlines():
            word, _, rest = line.partition(" ")
            parts = rest.split(" ")
            if word == "init":
                init = int(parts[0])
            elif word == "count":
                count = int(parts[0])
            elif word == "gpu" and len(parts) == 6:
                index, ret = int(parts[0]), int(parts[1])
                uuid, minor, bus = (None if p == "-" else p for p in parts[2:5])
                gpus[index] = NvmlGpu(index, ret, uuid, int(minor) if minor else None, bus,
                                      parts[5] == "1")
            elif word == "mig" and len(parts) == 2:
                gpus[int(parts[0])].migs.append(int(parts[1]))
            elif word == "text":
                code, _, what = rest.partition(" ")
                texts[int(code)] = what
    except (ValueError, KeyError):
        return None
    if init is None:
        return None
    return Answer(init, count, [gpus[i] for i in sorted(gpus)], texts)


def ask(machine: Machine) -> Answer | None:
    """NVML's answers for the machine's GPUs, from the driver root's libnvidia-ml.so.1
    (the library nvidia-ctk loads); None, with a warning, when they cannot be had."""
    from . import log
    from .run import run

    library = machine.driver_root / machine.libdir / "libnvidia-ml.so.1"
    own = machine.config.nvidia_ctk_timeout_seconds or None
    result = run([sys.executable, "-m", "unbounded_nvidia_setup.nvml", str(library)],
                 limit=machine.limit(own))
    answer = parse(result.stdout) if result.ok else None
    if answer is None:
        why = result.why() if not result.ok else "no answer"
        log.warn(f"cannot ask NVML which GPUs it can use ({why}): the GPUs nvidia-ctk "
                 "failed on cannot be told apart")
    return answer


# ----------------------------------------------------------------------------- child


def _ask(library: str) -> list[str]:
    """The child's side: NVML's answers, as lines."""
    import ctypes as c

    class PciInfo(c.Structure):  # nvmlPciInfo_t (v3)
        _fields_ = [("busIdLegacy", c.c_char * 16), ("domain", c.c_uint), ("bus", c.c_uint),
                    ("device", c.c_uint), ("pciDeviceId", c.c_uint),
                    ("pciSubSystemId", c.c_uint), ("busId", c.c_char * 32)]

    nvml = c.CDLL(library)
    nvml.nvmlErrorString.restype = c.c_char_p
    seen: set[int] = set()
    lines: list[str] = []

    def said(ret: int) -> int:
        if ret != SUCCESS and ret not in seen:
            seen.add(ret)
            text = nvml.nvmlErrorString(ret)
            if text:
                lines.append(f"text {ret} {text.decode(errors='replace').strip()}")
        return ret

    ret = said(nvml.nvmlInit_v2())
    lines.append(f"init {ret}")
    if ret != SUCCESS:
        return lines
    try:
        count = c.c_uint(0)
        ret = said(nvml.nvmlDeviceGetCount_v2(c.byref(count)))
        lines.append(f"count {ret} {count.value}")
        for index in range(count.value if ret == SUCCESS else 0):
            handle = c.c_void_p()
            ret = said(nvml.nvmlDeviceGetHandleByIndex_v2(c.c_uint(index), c.byref(handle)))
            if ret != SUCCESS:
                lines.append(f"gpu {index} {ret} - - - 0")
                continue
            uuid = c.create_string_buffer(96)
            minor, current, pending, slots = c.c_uint(), c.c_uint(), c.c_uint(), c.c_uint()
            pci = PciInfo()
            got_uuid = nvml.nvmlDeviceGetUUID(handle, uuid, c.c_uint(96)) == SUCCESS
            got_minor = nvml.nvmlDeviceGetMinorNumber(handle, c.byref(minor)) == SUCCESS
            got_pci = nvml.nvmlDeviceGetPciInfo_v3(handle, c.byref(pci)) == SUCCESS
            mig = nvml.nvmlDeviceGetMigMode(handle, c.byref(current), c.byref(pending))
            enabled = mig == SUCCESS and current.value == 1
            lines.append(" ".join([
                "gpu", str(index), str(SUCCESS),
                uuid.value.decode(errors="replace") if got_uuid and uuid.value else "-",
                str(minor.value) if got_minor else "-",
                pci.busId.decode(errors="replace") if got_pci and pci.busId else "-",
                "1" if enabled else "0"]))
            if enabled and nvml.nvmlDeviceGetMaxMigDeviceCount(handle, c.byref(slots)) == 0:
                for slot in range(slots.value):
                    device = c.c_void_p()
                    if nvml.nvmlDeviceGetMigDeviceHandleByIndex(
                            handle, c.c_uint(slot), c.byref(device)) == SUCCESS:
                        lines.append(f"mig {index} {slot}")
    finally:
        nvml.nvmlShutdown()
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m unbounded_nvidia_setup.nvml LIBNVIDIA_ML", file=sys.stderr)
        return 2
    try:
        lines = _ask(argv[0])
    except (OSError, AttributeError) as e:  # no such library, or one without NVML's calls
        print(f"cannot ask NVML through {argv[0]}: {e}", file=sys.stderr)
        return 1
    # One write, after NVML is shut down: NVML may itself print to stdout, so a line of
    # ours must never be half-written when it does.
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
