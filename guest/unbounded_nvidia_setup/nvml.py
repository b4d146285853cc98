"""NVML asked by index, GPU by GPU, every call NVIDIA's generate makes: which GPUs it can
use, after nvidia-ctk failed or did not finish.

nvidia-ctk 1.20 cannot tell which GPU its failure belongs to. Its `all` stops at the
first GPU any of its per-device calls fails for, and it looks up every `--device-id`
by UUID, which NVML's header lets fail when *any* GPU is lost (FACTS.md). So this asks
NVML by index, one GPU at a time, every per-device call nvidia-ctk 1.20's NVML mode
makes (read in its source, pkg/nvcdi and go-nvlib; `QUERIES` and `MIG_QUERIES` list
them in its order), and never trusts a lookup by UUID. A GPU is unusable when one of
them fails for it (NOT_SUPPORTED is an answer where nvidia-ctk takes it as one), or
does not answer within `nvml_gpu_timeout_seconds`.

The asking runs in a child process, `python3 -I -m unbounded_nvidia_setup.nvml LIBRARY
[SKIP...]`: isolated from the caller's working directory and environment (-I), bounded
in time and killed like nvidia-ctk, and the run's own process never loads the driver.
NVML may print to stdout, so the child writes its lines to a descriptor of its own
(stdout's, duplicated before NVML is loaded; stdout then goes to stderr). It says which
GPU it asks before it asks: when a GPU's calls block, the parent kills the child after
the per-GPU bound, counts that GPU as not answering, and asks again for the GPUs after
it, skipping it. Only a failed generate pays for this (ctypes, a Python start).

The child's lines, which the parent parses:

    text <code> <nvmlErrorString's text>
    init <ret>
    count <ret> <n>
    asking <index> <call>         (said before the call is made: it may block)
    gpu <index> <ret> <call|-> <uuid|-> <minor|-> <bus id|-> <mig mode 0|1>
    mig <index> <slot>            (a MIG device present in that slot of GPU <index>)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from .gpus import NODE_WIDE, NOT_SUPPORTED, SUCCESS, TIMEOUT, Gpu, NodeGpus

if TYPE_CHECKING:
    from .config import Machine

_NOT_FOUND, _INVALID_ARGUMENT = 6, 2
# Per full GPU, in nvidia-ctk 1.20's order (VisitDevices, then the device's spec).
QUERIES = ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetName", "nvmlDeviceGetMigMode",
           "nvmlDeviceGetUUID", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo_v3",
           "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex")
# Per MIG device (VisitMigDevices, then mig.GetProfile and the device's spec).
MIG_QUERIES = ("nvmlDeviceIsMigDeviceHandle", "nvmlDeviceGetUUID",
               "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetMemoryInfo",
               "nvmlDeviceGetAttributes_v2", "nvmlDeviceGetGpuInstanceId",
               "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetGpuInstanceById",
               "nvmlGpuInstanceGetComputeInstanceById", "nvmlGpuInstanceGetInfo",
               "nvmlComputeInstanceGetInfo_v2")


def parse(text: str) -> tuple[int | None, int, list[Gpu], dict[int, str], Gpu | None]:
    """The child's lines: (init's code, count's code, the GPUs answered in index order,
    NVML's texts, the GPU and call being asked when the lines end); init None when the
    lines do not read as the child writes them."""
    init: int | None = None
    count = SUCCESS
    found: dict[int, Gpu] = {}
    texts: dict[int, str] = {}
    asking: int | None = None
    call: str | None = None
    try:
        for line in text.splitlines():
            word, _, rest = line.partition(" ")
            parts = rest.split(" ")
            if word == "init":
                init = int(parts[0])
            elif word == "count":
                count = int(parts[0])
            elif word == "asking":
                asking, call = int(parts[0]), parts[1] if len(parts) > 1 else None
            elif word == "gpu" and len(parts) == 7:
                index, ret = int(parts[0]), int(parts[1])
                query, uuid, minor, bus = (None if p == "-" else p for p in parts[2:6])
                found[index] = Gpu(index, bus, uuid, int(minor) if minor else None,
                                   mig=parts[6] == "1", code=None if ret == SUCCESS else ret,
                                   query=query)
                asking = None
            elif word == "mig" and len(parts) == 2:
                found[int(parts[0])].migs.append(int(parts[1]))
            elif word == "text":
                code, _, what = rest.partition(" ")
                texts[int(code)] = what
    except (ValueError, KeyError, IndexError):
        return None, count, [], texts, None
    pending = None if asking is None else Gpu(asking, query=call)
    return init, count, [found[i] for i in sorted(found)], texts, pending


def ask(machine: Machine) -> NodeGpus | None:
    """NVML's answers for the machine's GPUs, from the driver root's libnvidia-ml.so.1
    (the library nvidia-ctk loads), GPU by GPU; None, with a warning, when NVML cannot be
    asked at all (it cannot initialise, count, or says nothing)."""
    from . import log
    from .run import start

    library = machine.driver_root / machine.libdir / "libnvidia-ml.so.1"
    bound = machine.config.nvml_gpu_timeout_seconds or None
    own = machine.config.nvidia_ctk_timeout_seconds or None
    texts: dict[int, str] = {}
    answered: dict[int, Gpu] = {}
    while True:
        skip = sorted(answered)  # asked already: answered, or not answering
        argv = [sys.executable, "-I", "-m", "unbounded_nvidia_setup.nvml", str(library),
                *map(str, skip)]
        with start(argv, limit=machine.limit(own)) as child:
            lines, why = child.lines(bound)
        init, count, gpus, said, pending = parse(lines)
        texts.update(said)
        answered.update({g.index: g for g in gpus if g.index is not None})
        if (pending is not None and pending.index is not None and why is not None
                and bound is not None and why.startswith("no answer")):
            # It blocked in one GPU's call: that GPU does not answer; ask again for the
            # GPUs after it, skipping it.
            pending.code, pending.waited = TIMEOUT, bound
            answered[pending.index] = pending
            continue
        if init != SUCCESS or count != SUCCESS or why is not None:
            what = why or ("no answer" if init is None else
                           f"NVML answers {init if init != SUCCESS else count}")
            log.warn(f"cannot ask NVML which GPUs it can use ({what}): the GPUs nvidia-ctk "
                     "failed on cannot be told apart")
            return None
        break
    return NodeGpus([answered[i] for i in sorted(answered)], texts=texts)


def assess(machine: Machine, answer: NodeGpus) -> NodeGpus | None:
    """NVML's answers matched with the kernel's GPUs; None when every GPU answered
    (nothing here explains the failure)."""
    from .gpus import fingerprint, kernel_gpus

    failed = answer.unusable
    if not failed:
        return None
    kernel = [g for g in kernel_gpus(machine) if not g.excluded]
    # NVML's index i is the i-th enumerated GPU in bus order. The GPUs that told their
    # own bus ids must agree with the kernel's list at their index: else the failed
    # indices cannot be named, and a GPU is never named wrongly (a healthy one lost).
    trusted = len(kernel) == len(answer.gpus) and all(
        same_bus(g.bus_id, kernel[g.index].bus_id)
        for g in answer.gpus if g.bus_id is not None and g.index is not None)
    for gpu in failed:
        if trusted and gpu.index is not None:
            known = kernel[gpu.index]
            gpu.bus_id, gpu.uuid, gpu.minor = known.bus_id, known.uuid, known.minor
        else:
            gpu.bus_id = gpu.uuid = gpu.minor = None
    answer.node_error = next((g.code for g in failed if g.code in NODE_WIDE), None)
    answer.serves = answer.node_error is None and bool(answer.serve_minors())
    answer.kernel = fingerprint(machine)
    return answer


def same_bus(a: str | None, b: str | None) -> bool:
    """PCI bus ids equal whatever the domain's width: NVML writes 00000000:17:00.0, the
    module's directory 0000:17:00.0."""
    if a is None or b is None:
        return False
    try:
        return _bus_tuple(a) == _bus_tuple(b)
    except ValueError:
        return False


def _bus_tuple(value: str) -> tuple[int, int, int, int]:
    domain, bus, rest = value.strip().lower().split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


# ----------------------------------------------------------------------------- child


class _Failed(Exception):
    """A call failed for the GPU being asked: its line is written."""


def _ask(library: str, skip: set[int], write: Callable[[str], None]) -> None:
    """The child's side: NVML's answers, each line written as soon as it is known."""
    import ctypes as c

    class PciInfo(c.Structure):  # nvmlPciInfo_t (v3)
        _fields_ = [("busIdLegacy", c.c_char * 16), ("domain", c.c_uint), ("bus", c.c_uint),
                    ("device", c.c_uint), ("pciDeviceId", c.c_uint),
                    ("pciSubSystemId", c.c_uint), ("busId", c.c_char * 32)]

    nvml = c.CDLL(library)
    nvml.nvmlErrorString.restype = c.c_char_p
    seen: set[int] = set()

    def said(ret: int) -> int:
        if ret != SUCCESS and ret not in seen:
            seen.add(ret)
            text = nvml.nvmlErrorString(ret)
            if text:
                write(f"text {ret} {text.decode(errors='replace').strip()}")
        return ret

    ret = said(nvml.nvmlInit_v2())
    write(f"init {ret}")
    if ret != SUCCESS:
        return
    try:
        count = c.c_uint(0)
        ret = said(nvml.nvmlDeviceGetCount_v2(c.byref(count)))
        write(f"count {ret} {count.value}")
        for index in range(count.value if ret == SUCCESS else 0):
            if index in skip:
                continue
            facts = ["-", "-", "-", "0"]  # uuid, minor, bus id, MIG mode

            def call(query: str, *args: object, accept: tuple[int, ...] = (),
                     index: int = index, facts: list[str] = facts) -> int:
                """NVML's `query`, said before it is made (it may block); a failure
                other than `accept` ends this GPU's asking."""
                write(f"asking {index} {query}")
                ret = int(getattr(nvml, query)(*args))
                if ret != SUCCESS and ret not in accept:
                    said(ret)
                    write(f"gpu {index} {ret} {query} {' '.join(facts)}")
                    raise _Failed
                return ret

            try:
                handle, mig, name = c.c_void_p(), c.c_void_p(), c.create_string_buffer(96)
                call(QUERIES[0], c.c_uint(index), c.byref(handle))
                call(QUERIES[1], handle, name, c.c_uint(96))
                current, pending = c.c_uint(), c.c_uint()
                capable = call(QUERIES[2], handle, c.byref(current), c.byref(pending),
                               accept=(NOT_SUPPORTED,)) == SUCCESS
                facts[3] = "1" if capable and current.value == 1 else "0"
                uuid = c.create_string_buffer(96)
                call(QUERIES[3], handle, uuid, c.c_uint(96))
                facts[0] = uuid.value.decode(errors="replace") or "-"
                minor = c.c_uint()
                call(QUERIES[4], handle, c.byref(minor))
                facts[1] = str(minor.value)
                pci = PciInfo()
                call(QUERIES[5], handle, c.byref(pci))
                facts[2] = pci.busId.decode(errors="replace") or "-"
                slots = []
                slot_count = c.c_uint()
                if capable:  # nvidia-ctk asks a MIG-capable GPU for its MIG devices
                    call(QUERIES[6], handle, c.byref(slot_count))
                for slot in range(slot_count.value):
                    if call(QUERIES[7], handle, c.c_uint(slot), c.byref(mig),
                            accept=(_NOT_FOUND, _INVALID_ARGUMENT)) != SUCCESS:
                        continue
                    flag, gi, ci = c.c_uint(), c.c_uint(), c.c_uint()
                    parent, gih, cih = c.c_void_p(), c.c_void_p(), c.c_void_p()
                    buf = c.create_string_buffer(512)  # fits each call's struct
                    for query, args in zip(MIG_QUERIES, (
                            (mig, c.byref(flag)), (mig, buf, c.c_uint(96)),
                            (mig, c.byref(parent)), (handle, buf), (mig, buf),
                            (mig, c.byref(gi)), (mig, c.byref(ci)),
                            (handle, gi, c.byref(gih)), (gih, ci, c.byref(cih)), (gih, buf),
                            (cih, buf)), strict=True):
                        call(query, *args)
                    slots.append(slot)
            except _Failed:
                continue
            write(f"gpu {index} {SUCCESS} - {' '.join(facts)}")
            for slot in slots:
                write(f"mig {index} {slot}")
    finally:
        nvml.nvmlShutdown()


def main(argv: list[str]) -> int:
    if not argv or not all(a.isdigit() for a in argv[1:]):
        print("usage: python3 -m unbounded_nvidia_setup.nvml LIBNVIDIA_ML [SKIP_INDEX...]",
              file=sys.stderr)
        return 2
    # Our lines go to the parent's pipe on a descriptor of their own; NVML's own prints
    # to stdout go to stderr, so a line of ours is never mixed with one of NVML's.
    out = os.dup(1)
    os.dup2(2, 1)

    def say(line: str) -> None:
        os.write(out, f"{line}\n".encode())  # one write: a whole line, or none

    try:
        _ask(argv[0], {int(a) for a in argv[1:]}, say)
    except (OSError, AttributeError) as e:  # no such library, or one without NVML's calls
        print(f"cannot ask NVML through {argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

