"""The machine's GPUs as its kernel module lists them, and which of them a spec serves.

A GPU that falls off the bus (Xid 79) answers NVML_ERROR_GPU_IS_LOST, and NVIDIA's
nvidia-ctk then fails the whole NVML-mode generate, naming the index of the first lost
GPU (FACTS.md). The run asks it again for the healthy GPUs only (`--device-id`, cdi.py),
and `check` tells the GPUs the spec does not serve from those it does. Both need the
GPUs without NVML: the module's /proc/driver/nvidia/gpus/<PCI bus id>/information, one
per GPU (its "GPU UUID:" and "Device Minor:" lines), in PCI bus order, which is NVML's
index order. /proc/driver is not namespaced: the machine reads the host kernel's.

MIG: NVML mode lists a MIG-enabled GPU as its MIG devices, never as a full GPU. The
module shows the instances that exist as /proc/driver/nvidia/capabilities/gpu<minor>/mig/
gi<G>/ci<C> directories, so the healthy GPUs are asked for by MIG index (`<i>:<j>`,
j = 0 … instances - 1) there, by UUID elsewhere.
"""

from __future__ import annotations

import os

from .config import GPUS_DIR, Machine

CAPABILITIES_DIR = "/proc/driver/nvidia/capabilities"
_FIELDS = ("GPU UUID", "Device Minor")
_MAX_INFO = 1 << 14


# A plain class and str methods, not a frozen dataclass and a regular expression: every
# run's end-state proof reads the GPUs (docs/performance.md, the import diet).
class KernelGpu:
    __slots__ = ("bus_id", "index", "minor", "uuid")

    def __init__(self, index: int, bus_id: str, uuid: str | None, minor: int | None) -> None:
        self.index = index  # NVML's: the position in PCI bus order
        self.bus_id = bus_id
        self.uuid = uuid
        self.minor = minor

    @property
    def device(self) -> str | None:
        return None if self.minor is None else f"/dev/nvidia{self.minor}"

    def describe(self) -> str:
        known = [x for x in (self.uuid, self.device, self.bus_id) if x]
        return f"GPU {self.index} ({', '.join(known)})"


def kernel_gpus(machine: Machine) -> list[KernelGpu]:
    """The GPUs the loaded module lists; empty when it lists none (or cannot be read)."""
    top = machine.at(GPUS_DIR)
    try:
        buses = sorted(os.listdir(top))
    except OSError:
        return []
    found = []
    for index, bus in enumerate(buses):
        try:
            with open(top / bus / "information", "rb") as f:
                text = f.read(_MAX_INFO).decode(errors="replace")
        except OSError:
            text = ""
        fields = _fields(text)
        uuid = fields.get("GPU UUID", "")
        minor = fields.get("Device Minor", "")
        found.append(KernelGpu(index, bus, uuid if uuid.startswith("GPU-") else None,
                               int(minor) if minor.isdigit() else None))
    return found


def _fields(text: str) -> dict[str, str]:
    """The information file's "GPU UUID" and "Device Minor" values ("Key: \t value")."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        words = value.split()
        if sep and key in _FIELDS and len(words) == 1:
            found[key] = words[0]
    return found


def mig_instances(machine: Machine, gpu: KernelGpu) -> int:
    """How many MIG devices (compute instances) the GPU has now: 0 when MIG is off."""
    if gpu.minor is None:
        return 0
    mig = machine.at(f"{CAPABILITIES_DIR}/gpu{gpu.minor}/mig")
    count = 0
    try:
        with os.scandir(mig) as entries:
            for gi in entries:
                if gi.name.startswith("gi") and gi.is_dir(follow_symlinks=False):
                    with os.scandir(gi.path) as inner:
                        count += sum(1 for ci in inner if ci.name.startswith("ci")
                                     and ci.is_dir(follow_symlinks=False))
    except OSError:
        return count
    return count


def device_ids(machine: Machine, healthy: list[KernelGpu]) -> list[str] | None:
    """nvidia-ctk's `--device-id` values for `healthy`, as its default `all` would list
    them; None when a GPU cannot be named (no UUID in its information file)."""
    ids: list[str] = []
    for gpu in healthy:
        migs = mig_instances(machine, gpu)
        if migs:
            ids += [f"{gpu.index}:{j}" for j in range(migs)]
        elif gpu.uuid is None:
            return None
        else:
            ids.append(gpu.uuid)
    return ids


def served_minors(doc: object) -> set[int]:
    """The /dev/nvidia<N> a spec gives containers, in any device or its common edits."""
    if not isinstance(doc, dict):
        return set()
    edits = [doc.get("containerEdits")]
    edits += [d.get("containerEdits") for d in doc.get("devices") or [] if isinstance(d, dict)]
    served = set()
    for edit in edits:
        if not isinstance(edit, dict):
            continue
        for node in edit.get("deviceNodes") or []:
            if not isinstance(node, dict):
                continue
            rest = str(node.get("path", "")).removeprefix("/dev/nvidia")
            if rest.isdigit() and str(node.get("path")) != rest:
                served.add(int(rest))
    return served
