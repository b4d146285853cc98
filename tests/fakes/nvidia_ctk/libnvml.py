"""pkg/nvcdi/lib-nvml.go and what it uses: NVML mode's devices, full GPUs and MIG devices.

Followed call for call where a call can fail (go-nvlib's VisitDevices / VisitMigDevices,
nvcdi's full-gpu-nvml.go and mig-device-nvml.go, internal/platform-support/dgpu,
internal/nvcaps), with the real tool's error texts: a GPU whose handle NVML refuses (15,
GPU is lost, on a GPU fallen off the bus) fails the whole generate at the index that
refused. ``--device-id`` as 1.20 reads it (``all``, ``none``, indices, ``N:M``,
``GPU-``/``MIG-`` uuids). Not simulated: nvsandboxutils as the source of device nodes,
the DRM nodes of a GPU's PCI address (host sysfs) and their by-path symlink hook (the
links' absence is warned about as the real tool does), coherence annotations.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .discover import device_edits
from .edits import Edits
from .logger import CtkError, Logger
from .nvml import ERROR_INVALID_ARGUMENT, ERROR_NOT_FOUND, ERROR_NOT_SUPPORTED, NvmlLib
from .version import Version

T = TypeVar("T")
SKIPPED_DEVICES = ("DGX Display", "NVIDIA DGX Display")  # go-nvlib's default
DEVICE_MIG_ENABLE = 1
GPU_INSTANCE_PROFILE_COUNT = 18
COMPUTE_INSTANCE_PROFILE_COUNT = 9
COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT = 1
GFX_GI_PROFILES = (10, 11, 12)  # GPU_INSTANCE_PROFILE_{1,2,4}_SLICE_GFX
# go-nvlib NewMigProfile: the GPU and compute instance profiles it knows.
GI_PROFILE_SLICES = {0: 1, 7: 1, 9: 1, 10: 1, 13: 1, 15: 1, 1: 2, 8: 2, 11: 2, 14: 2, 16: 2,
                     2: 3, 3: 4, 12: 4, 6: 6, 4: 7, 5: 8}
CI_PROFILE_SLICES = {0: 1, 7: 1, 1: 2, 2: 3, 3: 4, 6: 6, 4: 7, 8: 7, 5: 8}
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"  # the host's, absolute (nvcaps.go)
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def go_quote(text: str) -> str:
    """Go's %q of a plain string."""
    return json.dumps(text, ensure_ascii=False)


# ---------------------------------------------------------------- identifiers


def is_go_uuid(text: str) -> bool:
    """github.com/google/uuid Parse: 36 chars with dashes, {..} around them, urn:uuid:
    before them, or 32 hex digits."""
    if len(text) == 38 and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    elif len(text) == 45 and text[:9].lower() == "urn:uuid:":
        text = text[9:]
    if len(text) == 32:
        return all(c in "0123456789abcdefABCDEF" for c in text)
    return len(text) == 36 and _UUID.fullmatch(text) is not None


def is_gpu_index(text: str) -> bool:
    """strconv.ParseUint(text, 10, 0) succeeds."""
    return text.isascii() and text.isdigit() and int(text) < 1 << 64


def is_mig_index(text: str) -> bool:
    parts = text.split(":")
    return len(parts) == 2 and all(is_gpu_index(p) for p in parts)


def is_gpu_uuid(text: str) -> bool:
    return text.startswith("GPU-") and is_go_uuid(text[4:])


def is_mig_uuid(text: str) -> bool:
    if not text.startswith("MIG-"):
        return False
    suffix = text[4:]
    if is_go_uuid(suffix):
        return True
    parts = suffix.split("/")
    return len(parts) == 3 and is_gpu_uuid(parts[0]) and all(is_gpu_index(p) for p in parts[1:])


# ---------------------------------------------------------------- MIG caps


def read_mig_caps(log: Logger) -> dict[str, int] | None:
    """internal/nvcaps NewMigCaps: the host's /proc/driver/nvidia-caps/mig-minors (None
    when it does not exist); bad lines are skipped."""
    try:
        with open(MIG_MINORS, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CtkError(f"error opening MIG minors file: {exc}") from exc
    caps: dict[str, int] = {}
    for line in lines:
        parts = line.split(" ")
        if len(parts) != 2:
            continue
        cap, minor = parts
        valid = cap in ("config", "monitor") or re.fullmatch(
            r"gpu[+-]?\d+/gi[+-]?\d+/(ci[+-]?\d+/)?access", cap) is not None
        if valid and re.fullmatch(r"[+-]?\d+", minor):
            caps[cap] = int(minor)
    return caps


# ---------------------------------------------------------------- generators


@dataclass
class FullGpu:
    """full-gpu-nvml.go fullGPUDeviceSpecGenerator: a GPU by uuid, named by its index."""

    uuid: str
    index: int


@dataclass
class MigDevice:
    """mig-device-nvml.go migDeviceSpecGenerator: parent (uuid, index), slot, uuid."""

    parent: FullGpu
    mig_index: int
    mig_uuid: str


@dataclass
class NoneDevice:
    """emptyDeviceSpecGenerator("none")."""


Generator = FullGpu | MigDevice | NoneDevice


class NvmlDevices:
    """The device specs of NVML mode (nvmllib), for one ``cdi generate``."""

    def __init__(self, log: Logger, nvml: NvmlLib, dev_root: str, strategies: Sequence[str],
                 ctk: Version) -> None:
        self.log = log
        self.nvml = nvml
        self.dev_root = dev_root
        self.strategies = list(strategies)
        self.ctk = ctk

    # -------------------------------------------------------- helpers

    def _err(self, ret: int) -> str:
        return self.nvml.error_string(ret)

    def _answer(self, got: tuple[T, int], what: str) -> T:
        """An NVML call's value, or nvidia-ctk's error for it: `what: <NVML's string>`."""
        value, ret = got
        if ret != 0:
            raise CtkError(f"{what}: {self._err(ret)}")
        return value

    def _init(self) -> None:
        ret = self.nvml.init()
        if ret != 0:
            raise CtkError(f"failed to initialize NVML: {self._err(ret)}")

    def _shutdown(self) -> None:
        ret = self.nvml.shutdown()
        if ret != 0:
            self.log.warning(f"failed to shutdown NVML: {self._err(ret)}")

    def visit_devices(self, visit: Any) -> None:
        """go-nvlib devicelib.VisitDevices."""
        count = self._answer(self.nvml.count(), "error getting device count")
        for i in range(count):
            handle = self._answer(self.nvml.handle_by_index(i),
                                  f"error getting device handle for index '{i}'")
            name, ret = self.nvml.name(handle)
            if ret != 0:
                raise CtkError("error checking whether device is skipped: error getting "
                               f"device name: {self._err(ret)}")
            if name in SKIPPED_DEVICES:
                continue
            try:
                visit(i, handle)
            except CtkError as exc:
                raise CtkError(f"error visiting device: {exc}") from exc

    def _mig_mode(self, handle: Any) -> int | None:
        """IsMigCapable/IsMigEnabled's query: None when not MIG capable."""
        if not self.nvml.has("nvmlDeviceGetMigMode"):
            return None
        mode, ret = self.nvml.mig_mode(handle)
        if ret == ERROR_NOT_SUPPORTED:
            return None
        if ret != 0:
            raise CtkError(f"error getting MIG mode: {self._err(ret)}")
        return mode

    def _new_mig_device(self, handle: Any) -> None:
        """go-nvlib NewMigDevice: the handle must be a MIG device's."""
        is_mig = self._answer(self.nvml.is_mig_device(handle),
                              "error checking if device is a MIG device")
        if not is_mig:
            raise CtkError("not a MIG device")

    def _uuid(self, handle: Any, what: str = "device UUID") -> str:
        uuid = self._answer(self.nvml.uuid(handle), f"failed to get {what}")
        return uuid

    # -------------------------------------------------------- DeviceSpecGenerators

    def generators(self, ids: Sequence[str]) -> list[Generator]:
        """nvmllib.DeviceSpecGenerators(ids...) (its init and shutdown around it)."""
        self._init()
        try:
            return self._generators_for_ids(ids)
        finally:
            self._shutdown()

    def _generators_for_ids(self, ids: Sequence[str]) -> list[Generator]:
        identifiers: list[str] = []
        for id_ in ids:
            if id_ == "none":
                return [NoneDevice()]
            if id_ == "all":
                return self._all_generators()
            identifiers.append(id_)
        uuids = [self._normalize(i) for i in identifiers]
        generators: list[Generator] = []
        for uuid in uuids:
            handle = self._answer(self.nvml.handle_by_uuid(uuid),
                                  "failed to get device handle from UUID")
            is_mig, ret = self.nvml.is_mig_device(handle)
            if ret != 0:
                raise CtkError(self._err(ret))
            if not is_mig:
                index = self._answer(self.nvml.index(handle), "failed to get device index")
                generators.append(FullGpu(uuid, index))
                continue
            self._new_mig_device(handle)
            parent = self._answer(self.nvml.parent_of_mig(handle),
                                  "failed to get parent device handle")
            parent_index = self._answer(self.nvml.index(parent),
                                        "failed to get parent device index")
            mig_index = self._answer(self.nvml.index(handle), "failed to get MIG device index")
            generators.append(self._mig_generator(parent_index, parent, mig_index, handle))
        return generators

    def _normalize(self, identifier: str) -> str:
        """nvmllib.normalizeDeviceID: the uuid a device id names."""
        if is_gpu_uuid(identifier) or is_mig_uuid(identifier):
            return identifier
        if is_gpu_index(identifier):
            handle = self._answer(self.nvml.handle_by_index(int(identifier)),
                                  "failed to get device handle from index")
            return self._uuid(handle)
        if is_mig_index(identifier):
            gpu, mig = (int(p) for p in identifier.split(":"))
            parent = self._answer(self.nvml.handle_by_index(gpu),
                                  "failed to get parent device handle")
            handle = self._answer(self.nvml.mig_handle_by_index(parent, mig),
                                  "failed to get MIG handle by index")
            return self._uuid(handle, "MIG UUID")
        raise CtkError(f"identifier is not a valid UUID or index: {go_quote(identifier)}")

    def _mig_generator(self, i: int, parent: Any, j: int, mig: Any) -> MigDevice:
        full = FullGpu(self._uuid(parent), i)
        return MigDevice(full, j, self._uuid(mig, "MIG UUID"))

    def _all_generators(self) -> list[Generator]:
        """getDeviceSpecGeneratorsForAllDevices: every full GPU not in MIG mode, then
        every MIG device."""
        generators: list[Generator] = []

        def full_gpu(i: int, handle: Any) -> None:
            if self._mig_mode(handle) == DEVICE_MIG_ENABLE:
                return
            generators.append(FullGpu(self._uuid(handle), i))

        try:
            self.visit_devices(full_gpu)
        except CtkError as exc:
            raise CtkError(f"failed to get full GPU device editors: {exc}") from exc

        def mig_devices(i: int, handle: Any) -> None:
            try:
                capable = self._mig_mode(handle) is not None
            except CtkError as exc:
                raise CtkError(f"error checking if GPU is MIG capable: {exc}") from exc
            if not capable:
                return
            count = self._answer(self.nvml.max_mig_device_count(handle),
                                 "error getting max MIG device count")
            for j in range(count):
                mig, ret = self.nvml.mig_handle_by_index(handle, j)
                if ret in (ERROR_NOT_FOUND, ERROR_INVALID_ARGUMENT):
                    continue
                if ret != 0:
                    raise CtkError(f"error getting MIG device handle at index '{j}': "
                                   f"{self._err(ret)}")
                try:
                    self._new_mig_device(mig)
                except CtkError as exc:
                    raise CtkError(f"error creating new MIG device wrapper: {exc}") from exc
                try:
                    generators.append(self._mig_generator(i, handle, j, mig))
                except CtkError as exc:
                    raise CtkError(f"error visiting MIG device: error visiting MIG device: "
                                   f"{exc}") from exc

        try:
            try:
                self.visit_devices(lambda i, h: self._wrap_visit(mig_devices, i, h))
            except CtkError as exc:
                raise CtkError(f"error visiting devices: {exc}") from exc
        except CtkError as exc:
            raise CtkError(f"failed to get MIG device editors: {exc}") from exc
        return generators

    @staticmethod
    def _wrap_visit(visit: Any, i: int, handle: Any) -> None:
        try:
            visit(i, handle)
        except CtkError as exc:
            raise CtkError(f"error visiting device: {exc}") from exc

    # -------------------------------------------------------- GetDeviceSpecs

    def device_specs(self, generators: Sequence[Generator]) -> list[tuple[str, Edits]]:
        """The generators' GetDeviceSpecs, with NVML initialised around them (withInit)."""
        self._init()
        try:
            specs: list[tuple[str, Edits]] = []
            for generator in generators:
                if isinstance(generator, FullGpu):
                    edits = self._full_gpu_edits(generator)
                    names = self._names(generator.index, generator.uuid)
                elif isinstance(generator, MigDevice):
                    edits = self._mig_edits(generator)
                    names = self._mig_names(generator)
                else:
                    edits, names = Edits(env=["NVCT_EMPTY_DEVICE="]), ["none"]
                specs += [(name, edits) for name in names]
            return specs
        finally:
            self._shutdown()

    def _names(self, index: int, uuid: str) -> list[str]:
        names = {"index": str(index), "uuid": uuid, "type-index": f"gpu{index}"}
        return [names[s] for s in self.strategies]

    def _mig_names(self, mig: MigDevice) -> list[str]:
        i, j = mig.parent.index, mig.mig_index
        names = {"index": f"{i}:{j}", "uuid": mig.mig_uuid, "type-index": f"mig{i}:{j}"}
        return [names[s] for s in self.strategies]

    def _device(self, uuid: str) -> Any:
        """go-nvlib NewDeviceByUUID."""
        handle = self._answer(self.nvml.handle_by_uuid(uuid),
                              f"error getting device handle for uuid '{uuid}'")
        return handle

    def _dev_node(self, handle: Any) -> str:
        minor = self._answer(self.nvml.minor(handle), "error getting GPU device minor number")
        return f"/dev/nvidia{minor}"

    def _bus_id(self, handle: Any) -> str:
        """go-nvlib GetPCIBusID: NVML's busId, lowercased, an 8-digit domain cut to 4."""
        bus, ret = self.nvml.pci_bus_id(handle)
        if ret != 0:
            raise CtkError(f"error getting PCI info for device: error getting PCI info: "
                           f"{self._err(ret)}")
        bus = bus.lower()
        return bus[4:] if re.match(r"^0{4}[0-9a-f]{4}:", bus) else bus

    def _by_path_warnings(self, bus: str) -> None:
        """dgpu/by-path-hooks.go: /dev/dri/by-path links of the GPU's PCI address (none
        here: no DRM nodes are simulated)."""
        for kind in ("card", "render"):
            link = os.path.join(self.dev_root, "dev/dri/by-path", f"pci-{bus}-{kind}")
            if not os.path.islink(link):
                self.log.warning(f"Failed to evaluate symlink {link}; ignoring")

    def _full_gpu_edits(self, gpu: FullGpu) -> Edits:
        try:
            handle = self._device(gpu.uuid)
            try:
                read_mig_caps(self.log)  # dgpu.new() reads them for every device
                try:
                    path = self._dev_node(handle)
                except CtkError as exc:
                    raise CtkError(f"error getting device node path: {exc}") from exc
                bus = self._bus_id(handle)
            except CtkError as exc:
                raise CtkError("failed to create device discoverer: failed to create device "
                               f"discoverer: {exc}") from exc
        except CtkError as exc:
            raise CtkError(f"failed to get CDI device edits: {exc}") from exc
        edits = device_edits(self.log, self.dev_root, [path], self.ctk)
        self._by_path_warnings(bus)
        return edits

    def _profile(self, mig: Any) -> int:
        """go-nvlib migdevice.GetProfile (the GPU instance profile index, for gfx)."""
        parent = self._answer(self.nvml.parent_of_mig(mig), "error getting parent device handle")
        _ = self._answer(self.nvml.memory_total(parent), "error getting parent memory info")
        _ = self._answer(self.nvml.attributes_memory_mb(mig), "error getting MIG device attributes")
        gi_id = self._answer(self.nvml.gpu_instance_id(mig),
                             "error getting MIG device GPU Instance ID")
        ci_id = self._answer(self.nvml.compute_instance_id(mig),
                             "error getting MIG device Compute Instance ID")
        gi = self._answer(self.nvml.gpu_instance_by_id(parent, gi_id), "error getting GPU Instance")
        ci = self._answer(self.nvml.compute_instance_by_id(gi, ci_id),
                          "error getting Compute Instance")
        gi_profile_id = self._answer(self.nvml.gpu_instance_profile_id(gi),
                                     "error getting GPU Instance info")
        ci_profile_id = self._answer(self.nvml.compute_instance_profile_id(ci),
                                     "error getting Compute Instance info")
        for p in range(GPU_INSTANCE_PROFILE_COUNT):
            info_id, ret = self.nvml.gpu_instance_profile_info_id(parent, p)
            if ret in (ERROR_NOT_SUPPORTED, ERROR_INVALID_ARGUMENT):
                continue
            if ret != 0:
                raise CtkError(f"error getting GPU Instance profile info: {self._err(ret)}")
            if info_id != gi_profile_id:
                continue
            for q in range(COMPUTE_INSTANCE_PROFILE_COUNT):
                for k in range(COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT):
                    info_id, ret = self.nvml.compute_instance_profile_info_id(gi, q, k)
                    if ret in (ERROR_NOT_SUPPORTED, ERROR_INVALID_ARGUMENT):
                        continue
                    if ret != 0:
                        raise CtkError("error getting Compute Instance profile info: "
                                       f"{self._err(ret)}")
                    if info_id != ci_profile_id:
                        continue
                    if p not in GI_PROFILE_SLICES:
                        raise CtkError("error creating MIG profile: invalid GPU Instance "
                                       f"Profile ID: {p}")
                    if q not in CI_PROFILE_SLICES:
                        raise CtkError("error creating MIG profile: invalid Compute "
                                       f"Instance Profile ID: {q}")
                    return p
        raise CtkError("no matching profile IDs found")

    def _mig_edits(self, mig: MigDevice) -> Edits:
        try:
            parent = self._device(mig.parent.uuid)
            handle, ret = self.nvml.handle_by_uuid(mig.mig_uuid)
            if ret != 0:
                raise CtkError(f"error getting device handle for uuid '{mig.mig_uuid}': "
                               f"{self._err(ret)}")
            self._new_mig_device(handle)
            try:
                try:
                    caps = read_mig_caps(self.log)
                except CtkError as exc:
                    self.log.debug(f"ignoring error getting MIG capability device paths: {exc}")
                    caps = None
                try:
                    profile = self._profile(handle)
                except CtkError as exc:
                    raise CtkError(f"error getting MIG Profile attributes: {exc}") from exc
                if caps is None:
                    raise CtkError("error getting MIG capability device paths: <nil>")
                path = self._dev_node(parent)
                gpu = int(path.removeprefix("/dev/nvidia"))
                gi, ret = self.nvml.gpu_instance_id(handle)
                if ret != 0:
                    raise CtkError("error getting placement info: error getting GPU Instance "
                                   f"ID: {self._err(ret)}")
                ci, ret = self.nvml.compute_instance_id(handle)
                if ret != 0:
                    raise CtkError("error getting placement info: error getting Compute "
                                   f"Instance ID: {self._err(ret)}")
                paths = [path]
                for what, cap in (("GI", f"gpu{gpu}/gi{gi}/access"),
                                  ("CI", f"gpu{gpu}/gi{gi}/ci{ci}/access")):
                    if cap not in caps:
                        raise CtkError(f"failed to get {what} cap device path: invalid MIG "
                                       f"capability path {cap}")
                    paths.append(f"/dev/nvidia-caps/nvidia-cap{caps[cap]}")
                bus = self._bus_id(parent) if profile in GFX_GI_PROFILES else None
            except CtkError as exc:
                raise CtkError(f"failed to create device discoverer: {exc}") from exc
        except CtkError as exc:
            raise CtkError(f"failed to get CDI device edits: {exc}") from exc
        edits = device_edits(self.log, self.dev_root, paths, self.ctk)
        if bus is not None:
            self._by_path_warnings(bus)
        return edits

    # -------------------------------------------------------- auto mode

    def has_an_integrated_gpu(self) -> None:
        """go-nvlib info's HasAnIntegratedGPU in auto mode: every GPU's name (no
        integrated GPU is simulated); its errors are swallowed."""
        ret = self.nvml.init()
        if ret != 0:
            self._err(ret)  # its debug line formats the error: nvmlErrorString is called
            return
        try:
            def names(i: int, handle: Any) -> None:
                self.nvml.name(handle)

            self.visit_devices(names)
        except CtkError:
            pass
        finally:
            self.nvml.shutdown()
