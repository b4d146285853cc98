"""The machine's GPUs as its kernel module lists them, which of them NVML can use, and
which of them a spec serves.

A GPU that NVML cannot use (lost, Xid 79; unknown error; no permission) makes NVIDIA's
nvidia-ctk fail the whole NVML-mode generate (FACTS.md). The run then asks NVML by
index which GPUs it can use (nvml.py) and serves those (cdi.Generator). `check` tells
the GPUs the spec leaves out from those it serves. Both need the GPUs without NVML: the
module's /proc/driver/nvidia/gpus/<PCI bus id>/information, one per GPU (its "GPU
UUID:", "Device Minor:" and "GPU Excluded:" lines). /proc/driver is not namespaced: the
machine reads the host kernel's.

A GPU excluded on the host (NVreg_ExcludedGpus) is listed with "GPU Excluded: Yes" and
a placeholder UUID (GPU-????????-...), and NVML does not enumerate it: NVML's indices
are the positions of the other GPUs in PCI bus order, never the kernel list's.

MIG: NVML mode lists a MIG-enabled GPU as its MIG devices, never as a full GPU, and a
MIG-enabled GPU without MIG devices not at all.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .config import GPUS_DIR, Machine

if TYPE_CHECKING:
    from .nvml import Answer, NvmlGpu

CAPABILITIES_DIR = "/proc/driver/nvidia/capabilities"
_FIELDS = ("GPU UUID", "Device Minor", "GPU Excluded")
_MAX_INFO = 1 << 14
_HEX = frozenset("0123456789abcdefABCDEF-")


# A plain class and str methods, not a frozen dataclass and a regular expression: every
# run's end-state proof on a degraded node reads the GPUs (docs/performance.md).
class KernelGpu:
    __slots__ = ("bus_id", "excluded", "index", "minor", "uuid")

    def __init__(self, index: int | None, bus_id: str, uuid: str | None, minor: int | None,
                 excluded: bool = False) -> None:
        self.index = index  # NVML's, when NVML enumerates it (None: excluded)
        self.bus_id = bus_id
        self.uuid = uuid
        self.minor = minor
        self.excluded = excluded

    @property
    def device(self) -> str | None:
        return None if self.minor is None else f"/dev/nvidia{self.minor}"

    def describe(self) -> str:
        known = [x for x in (self.uuid, self.device, self.bus_id) if x]
        name = "excluded GPU" if self.index is None else f"GPU {self.index}"
        return f"{name} ({', '.join(known)})"


def is_uuid(text: str) -> bool:
    """GPU-<hex and dashes>: not the module's placeholder for a GPU it has not set up."""
    rest = text.removeprefix("GPU-")
    return rest != text and len(rest) >= 32 and set(rest) <= _HEX


def kernel_gpus(machine: Machine) -> list[KernelGpu]:
    """The GPUs the loaded module lists, in PCI bus order; empty when it lists none (or
    cannot be read). NVML's index is the position among those not excluded."""
    top = machine.at(GPUS_DIR)
    try:
        buses = sorted(os.listdir(top))
    except OSError:
        return []
    found = []
    index = 0
    for bus in buses:
        fields = _fields(_information(top / bus / "information"))
        uuid = fields.get("GPU UUID", "")
        minor = fields.get("Device Minor", "")
        excluded = fields.get("GPU Excluded", "").lower() == "yes"
        found.append(KernelGpu(None if excluded else index, bus,
                               uuid if is_uuid(uuid) else None,
                               int(minor) if minor.isdigit() else None, excluded))
        index += not excluded
    return found


def _information(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_INFO).decode(errors="replace")
    except OSError:
        return ""


def _fields(text: str) -> dict[str, str]:
    """The information file's values of _FIELDS ("Key: \t value")."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        words = value.split()
        if sep and key in _FIELDS and len(words) == 1:
            found[key] = words[0]
    return found


def fingerprint(machine: Machine) -> str:
    """What the kernel shows of the GPUs now (bus ids and information files), as a
    short digest: the drift check asks NVML again early only when it changed."""
    import zlib

    top = machine.at(GPUS_DIR)
    try:
        buses = sorted(os.listdir(top))
    except OSError:
        buses = []
    crc = 0
    for bus in buses:
        crc = zlib.crc32(f"{bus}\0{_information(top / bus / 'information')}\0".encode(), crc)
    return f"{len(buses)}-{crc:08x}"


def same_bus(a: str | None, b: str | None) -> bool:
    """PCI bus ids equal whatever the domain's width: NVML writes 00000000:17:00.0, the
    module's directory 0000:17:00.0."""
    if a is None or b is None:
        return False
    try:
        return _bus_tuple(a) == _bus_tuple(b)
    except ValueError:
        return False


def _bus_tuple(text: str) -> tuple[int, int, int, int]:
    domain, bus, rest = text.strip().lower().split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


class Assessment:
    """The node's GPUs after a failed generate: the kernel's list matched with NVML's
    answers by index. `unusable` pairs a GPU with the code its own lookup answered;
    `node_error` is an error NVML ties to every attached GPU (nvml.NODE_WIDE): then no
    GPU is usable."""

    def __init__(self, count: int, usable: list[NvmlGpu],
                 unusable: list[tuple[KernelGpu, int]], node_error: int | None,
                 texts: dict[int, str]) -> None:
        self.count = count  # the GPUs NVML enumerates (excluded ones left out)
        self.usable = usable
        self.unusable = unusable
        self.node_error = node_error
        self.texts = texts

    @property
    def serves_none(self) -> bool:
        return self.node_error is not None or not self.serve_minors()

    def serve_minors(self) -> set[int]:
        """The /dev/nvidia<N> a spec for the usable GPUs gives containers: a MIG-enabled
        GPU only through its MIG devices (none without them), as NVML mode's `all`."""
        if self.node_error is not None:
            return set()
        return {g.minor for g in self.usable if g.minor is not None and (g.migs or not g.mig)}

    def device_ids(self) -> list[str]:
        """nvidia-ctk's `--device-id` values for the usable GPUs, as its own `all` would
        list them: a GPU by UUID, a MIG-enabled one by its MIG devices (`<index>:<slot>`),
        never as a full GPU."""
        ids: list[str] = []
        for gpu in self.usable:
            if gpu.mig:
                ids += [f"{gpu.index}:{slot}" for slot in gpu.migs]
            elif gpu.uuid is not None:
                ids.append(gpu.uuid)
        return ids


def assess(machine: Machine, answer: Answer) -> Assessment | None:
    """Match NVML's answers by index with the kernel's GPUs; None when NVML answered
    for every GPU (nothing here explains the failure) or could not be asked."""
    from . import nvml

    if answer.init != nvml.SUCCESS or answer.count != nvml.SUCCESS:
        return None
    failed = [g for g in answer.gpus if g.ret != nvml.SUCCESS]
    if not failed:
        return None
    kernel = [g for g in kernel_gpus(machine) if not g.excluded]
    usable = [g for g in answer.gpus if g.ret == nvml.SUCCESS]
    # NVML's index i is the i-th enumerated GPU in bus order. The usable GPUs tell their
    # own bus ids: when one disagrees with the kernel's list at its index, the failed
    # indices cannot be named, and a GPU is never named wrongly (a healthy one lost).
    trusted = len(kernel) == len(answer.gpus) and all(
        same_bus(g.bus_id, kernel[g.index].bus_id) for g in usable)
    unusable = [(kernel[g.index] if trusted else KernelGpu(g.index, "", None, None), g.ret)
                for g in failed]
    node = next((g.ret for g in failed if g.ret in nvml.NODE_WIDE), None)
    return Assessment(len(answer.gpus), usable, unusable, node, answer.texts)


def mig_cap_minors(machine: Machine, minor: int) -> set[int]:
    """The minors of the GPU's MIG access caps (/dev/nvidia-caps/nvidia-cap<M>) that
    exist now: each GPU and compute instance's `access` file says its DeviceFileMinor."""
    mig = machine.at(f"{CAPABILITIES_DIR}/gpu{minor}/mig")
    found: set[int] = set()
    try:
        with os.scandir(mig) as entries:
            gis = [e.path for e in entries
                   if e.name.startswith("gi") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return found
    for gi in gis:
        files = [f"{gi}/access"]
        try:
            with os.scandir(gi) as inner:
                files += [f"{e.path}/access" for e in inner
                          if e.name.startswith("ci") and e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for path in files:
            for line in _information(path).splitlines():
                key, _, value = line.partition(":")
                if key == "DeviceFileMinor" and value.strip().isdigit():
                    found.add(int(value))
    return found


def node_path_minor(path: str) -> int | None:
    """N of /dev/nvidia<N>; None for any other node."""
    rest = path.removeprefix("/dev/nvidia")
    return int(rest) if rest != path and rest.isdigit() else None


def served_minors(doc: object) -> set[int]:
    """The /dev/nvidia<N> a spec gives containers, in any device or its common edits."""
    served = set()
    for node in device_nodes(doc):
        minor = node_path_minor(str(node.get("path", "")))
        if minor is not None:
            served.add(minor)
    return served


def device_nodes(doc: object) -> list[dict[str, object]]:
    """Every deviceNodes entry of a spec: the common edits' and each device's."""
    if not isinstance(doc, dict):
        return []
    edits = [doc.get("containerEdits")]
    edits += [d.get("containerEdits") for d in doc.get("devices") or [] if isinstance(d, dict)]
    return [node for edit in edits if isinstance(edit, dict)
            for node in edit.get("deviceNodes") or [] if isinstance(node, dict)]
