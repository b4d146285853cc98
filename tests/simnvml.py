"""The GPUs of a simulated machine as the kernel module lists them and as the simulated
NVML (tests/simnvml.c, which the nvidia-ctk stand-in and NVIDIA's nvidia-ctk both load)
answers for them: GPUs arriving, a GPU fallen off the bus or failing otherwise, GPUs the
host excludes, bus ids out of minor order, an NVML that answers for none, MIG devices
with their caps nodes, IMEX channels. tests/simgpu.py builds the machine; this module
changes what its GPUs say.

The simulated NVML reads, for each GPU, the module's own
``proc/driver/nvidia/gpus/<bus id>/information`` and, beside it, a ``simulated-nvml``
file of its own state (``error <code>``, ``lost``, ``hang``, ``hang <function>``,
``query-error <function> <code>``, ``mig``, ``mig-device ...``), and the machine-wide
``proc/driver/nvidia/simulated-nvml-reading`` (``target``, ``walk``, ``any``: how
strictly it reads NVML's header on which lookups a GPU's error fails; the table is in
tests/simnvml.c) and ``proc/driver/nvidia/simulated-nvml-devices`` (``skip``, ``deny``:
what it does with a GPU whose /dev/nvidia<minor> is missing, as in a container CDI gave
other GPUs), all read again at NVML's first init; and an ``xid-events`` file per GPU
(:func:`deliver_xid`), read again at every event wait. In a container the library reads
these from :data:`STATE_DIR` when it exists (a test bind-mounts the machine's
``proc/driver`` there; tests/simnvml.c says why).
``SimMachine.nvml_gpus`` stays the GPUs' uuids in NVML index order (bus id order,
excluded GPUs left out, and, under the ``skip`` devices reading, GPUs without a node in
the machine's own dev/) after every change made here; where a test moves a GPU's bus id
(:func:`move_gpu_bus`), index and minor differ and :func:`gpu_bus_id` no longer names
its bus: ask :func:`bus_of` and :func:`nvml_index`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from nodefiles import mknod_char, proc_devices_major

if TYPE_CHECKING:
    from simgpu import SimMachine

GPUS_DIR = Path("proc/driver/nvidia/gpus")
READING_FILE = Path("proc/driver/nvidia/simulated-nvml-reading")
READINGS = ("target", "walk", "any")
DEVICES_FILE = Path("proc/driver/nvidia/simulated-nvml-devices")
DEVICES_READINGS = ("skip", "deny")
# The per-device queries a GPU's state can fail (fail_query) or block (hang_gpu), by the
# names tests/simnvml.c reads (a versioned entry point answers as its base name).
QUERIES = (
    "nvmlDeviceGetUUID", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMigMode", "nvmlDeviceGetName", "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetAttributes",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetIndex", "nvmlDeviceIsMigDeviceHandle",
)
# What NVML's lookups may answer for one GPU (nvml.h): No Permission, Insufficient
# (external) Power, IRQ Issue, GPU is lost, Unknown.
ERROR_CODES = (4, 8, 11, 15, 999)
GPU_IS_LOST = 15
EXCLUDED_UUID = "GPU-????????-????-????-????-????????????"


def gpu_bus_id(minor: int) -> str:
    """The PCI bus id of the GPU at /dev/nvidia<minor> (its information file's directory;
    NVML says it with an 8-digit domain). None of them is a PCI device of this host, so
    nvidia-ctk finds no DRM nodes of the host's for them."""
    return f"0000:{0x17 + 0x10 * minor:02x}:00.0"


def gpu_uuid(minor: int) -> str:
    """A stable GPU uuid for the GPU at /dev/nvidia<minor>, in NVML's form."""
    import uuid

    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"unbounded-nvidia-setup/gpu/{minor}"))


def add_gpu_information(root: Path, minor: int, firmware: str) -> str:
    """The kernel module's ``proc/driver/nvidia/gpus/<PCI bus id>/information`` for the GPU
    at /dev/nvidia<minor> (the real file's lines and tabs): the simulated NVML lists the
    GPUs written so (tests/simnvml.c). Returns the GPU's uuid."""
    uuid = gpu_uuid(minor)
    bus = gpu_bus_id(minor)
    info = root / GPUS_DIR / bus / "information"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(
        "Model: \t\t NVIDIA H100 80GB HBM3\n"
        f"IRQ:   \t\t {120 + minor}\n"
        f"GPU UUID: \t {uuid}\n"
        "Video BIOS: \t 96.00.74.00.0d\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 52 bits\n"
        "DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {bus}\n"
        f"Device Minor: \t {minor}\n"
        f"GPU Firmware: \t {firmware}\n"
        "GPU Excluded:\t No\n"
    )
    return uuid


def add_gpu(m: SimMachine, minor: int) -> str:
    """A GPU arrives (what a reload is for): its /dev/nvidia<minor> (major 195) and, when
    the machine's GPUs answer NVML, its information file. Returns its uuid."""
    mknod_char(m.root / "dev" / f"nvidia{minor}", 195, minor)
    m.devices.append(f"nvidia{minor}")
    uuid = gpu_uuid(minor)
    if m.nvml_gpus:
        add_gpu_information(m.root, minor, m.version)
        _reorder(m)
    return uuid


SIM_STATE = "simulated-nvml"  # beside each information file (tests/simnvml.c)
MIG_MINORS = Path("proc/driver/nvidia-caps/mig-minors")
CAPABILITIES_DIR = Path("proc/driver/nvidia/capabilities")
CAPS_DIR = "nvidia-caps"  # under dev/
IMEX_DIR = "nvidia-caps-imex-channels"  # under dev/
# Dynamic majors as a 550 host's kernel gives them (the module registers both)
CAPS_MAJOR, IMEX_MAJOR = 510, 509
MAX_MIG_DEVICES = 7  # nvmlDeviceGetMaxMigDeviceCount
GI_PER_GPU, CI_PER_GI = 15, 8  # the driver's numbering of the caps minors


def silence_nvml(m: SimMachine) -> None:
    """The machine's GPUs no longer answer NVML (their information files go): nvidia-ctk's
    default mode then fails as it does without a GPU."""
    shutil.rmtree(m.root / "proc" / "driver" / "nvidia" / "gpus", ignore_errors=True)
    m.nvml_gpus.clear()


# --------------------------------------------------------------------------------------
# What NVML says of a GPU: lost, MIG (the simulated NVML's own state, tests/simnvml.c)


def _gpu_dir(m: SimMachine, minor: int) -> Path:
    """The directory of the information file of the GPU at /dev/nvidia<minor>."""
    top = m.root / GPUS_DIR
    for info in sorted(top.glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key == "Device Minor" and value.strip() == str(minor):
                return info.parent
    raise FileNotFoundError(f"no GPU information file under {top} says Device Minor {minor}")


def _state_lines(m: SimMachine, minor: int) -> list[str]:
    try:
        return (_gpu_dir(m, minor) / SIM_STATE).read_text().splitlines()
    except FileNotFoundError:
        return []


def _write_state(m: SimMachine, minor: int, lines: list[str]) -> None:
    path = _gpu_dir(m, minor) / SIM_STATE
    if lines:
        path.write_text("".join(f"{line}\n" for line in lines))
    elif path.exists():
        path.unlink()


def _information(path: Path) -> dict[str, str]:
    """An information file's fields, trimmed."""
    fields = {}
    for line in path.read_text(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _reorder(m: SimMachine) -> None:
    """``m.nvml_gpus`` from the information files, as tests/simnvml.c enumerates them
    from the machine itself: bus id order, excluded GPUs left out, and under the ``skip``
    devices reading GPUs whose dev/nvidia<minor> under the machine's root is not a
    character device."""
    top = m.root / GPUS_DIR
    skip = _devices_reading(m) == "skip"
    uuids = []
    for info in sorted(top.glob("*/information")):
        fields = _information(info)
        if fields.get("GPU Excluded", "").lower() == "yes":
            continue
        if skip and not (m.root / "dev" / f"nvidia{fields.get('Device Minor')}").is_char_device():
            continue
        uuids.append(fields.get("GPU UUID", ""))
    m.nvml_gpus[:] = uuids


def _devices_reading(m: SimMachine) -> str | None:
    try:
        return (m.root / DEVICES_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def bus_of(m: SimMachine, minor: int) -> str:
    """The PCI bus id of the GPU at /dev/nvidia<minor> as the machine lists it now (its
    information file's directory, ``0000:17:00.0``; NVML says it with 8 domain digits)."""
    return _gpu_dir(m, minor).name


def nvml_index(m: SimMachine, minor: int) -> int:
    """The NVML index of the GPU at /dev/nvidia<minor> (its place in bus id order among
    the GPUs NVML enumerates). ValueError for an excluded GPU."""
    uuid = _information(_gpu_dir(m, minor) / "information").get("GPU UUID", "")
    return m.nvml_gpus.index(uuid)


def set_reading(m: SimMachine, reading: str) -> None:
    """How strictly the machine's NVML reads its header (one of READINGS; the table of
    which lookups fail with which code is in tests/simnvml.c): ``target``, a GPU's error
    fails only lookups of that GPU; ``walk``, a lookup by UUID also fails at an erring GPU
    met before its target in index order; ``any``, a lookup by UUID fails while any GPU
    errs. In ``walk`` and ``any`` a GPU answering 8 or 11 fails every lookup. Read at the
    next first init, as a real machine's state is."""
    if reading not in READINGS:
        raise ValueError(f"reading {reading!r}: the simulated NVML knows {READINGS}")
    path = m.root / READING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{reading}\n")


def fail_gpu(m: SimMachine, minor: int, code: int) -> None:
    """Getting the handle of the GPU at /dev/nvidia<minor> answers ``code`` (one of
    ERROR_CODES) for the lookups the machine's reading says (:func:`set_reading`); NVML
    still counts it, its node and information file stay. Replaces an earlier error."""
    if code not in ERROR_CODES:
        raise ValueError(f"NVML code {code}: a GPU's lookups fail with one of {ERROR_CODES}")
    lines = [line for line in _state_lines(m, minor) if not _is_error(line)]
    _write_state(m, minor, [f"error {code}", *lines])


def _is_error(line: str) -> bool:
    return line == "lost" or line.startswith("error ")


def _is_fault(line: str) -> bool:
    """A line of a GPU's state that fails or blocks its lookups or queries."""
    return _is_error(line) or line == "hang" or line.startswith(("hang ", "query-error "))


def fail_query(m: SimMachine, minor: int, function: str, code: int) -> None:
    """``function`` (one of QUERIES: nvmlDeviceGetPciInfo stands for its _v2 and _v3 too),
    called with the handle of the GPU at /dev/nvidia<minor> or of one of its MIG devices,
    answers ``code`` (> 0, e.g. 999 Unknown Error) after its argument checks; its handle
    lookups and every other query answer as before. Replaces an earlier code for the same
    function; seen at NVML's next first init."""
    if function not in QUERIES:
        raise ValueError(f"{function!r}: the simulated NVML fails one of {QUERIES}")
    if code <= 0:
        raise ValueError(f"NVML code {code}: a failing query answers a code > 0")
    lines = [line for line in _state_lines(m, minor)
             if line.split()[:2] != ["query-error", function]]
    _write_state(m, minor, [*lines, f"query-error {function} {code}"])


def hang_gpu(m: SimMachine, minor: int, function: str | None = None) -> None:
    """The GPU at /dev/nvidia<minor> stops answering (its GSP, say): without
    ``function``, getting its handle blocks, never returning, for the lookups an error
    of its would fail in the machine's reading (:func:`set_reading`; under ``any`` every
    lookup by UUID); with ``function`` (one of QUERIES), only that query blocks, called
    with its handle or one of its MIG devices'. The caller must be killed. Seen at NVML's
    next first init; :func:`recover_gpu` ends it."""
    if function is not None and function not in QUERIES:
        raise ValueError(f"{function!r}: the simulated NVML blocks one of {QUERIES}")
    line = "hang" if function is None else f"hang {function}"
    lines = _state_lines(m, minor)
    if line not in lines:
        _write_state(m, minor, [*lines, line])


def lose_gpu(m: SimMachine, minor: int) -> None:
    """The GPU at /dev/nvidia<minor> falls off the bus (Xid 79): NVML answers 15, GPU is
    lost, for its handle (and, in the ``walk`` and ``any`` readings, for other lookups
    by UUID) while still counting it, so nvidia-ctk's NVML mode fails at its index. Its
    node and information file stay."""
    fail_gpu(m, minor, GPU_IS_LOST)


def recover_gpu(m: SimMachine, minor: int) -> None:
    """The GPU at /dev/nvidia<minor> is back (reset): whatever error it had, failing
    queries, a hang, NVML answers for it again."""
    _write_state(m, minor, [line for line in _state_lines(m, minor) if not _is_fault(line)])


def set_devices_reading(m: SimMachine, word: str | None) -> None:
    """What the machine's NVML does with a GPU whose dev/nvidia<minor> is not a character
    device (one of DEVICES_READINGS; None: device nodes are not looked at, the default):
    ``skip``, it is not enumerated (count and indices skip it, as for an excluded GPU);
    ``deny``, it is counted and its lookups answer 4, No Permission, as ``error 4`` would
    in the machine's reading. The library looks in its caller's /dev when P is "" (a
    container's own, CDI-injected nodes), so under ``skip`` a container's NVML may list
    fewer GPUs than ``m.nvml_gpus``, which follows the machine's own dev/. Read at the
    next first init."""
    path = m.root / DEVICES_FILE
    if word is None:
        path.unlink(missing_ok=True)
    elif word not in DEVICES_READINGS:
        raise ValueError(f"devices reading {word!r}: the simulated NVML knows {DEVICES_READINGS}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{word}\n")
    _reorder(m)


def remove_gpu_node(m: SimMachine, minor: int) -> None:
    """The machine's dev/nvidia<minor> goes (its GPU's information file stays): what NVML
    then does with the GPU is the devices reading's (:func:`set_devices_reading`)."""
    _remove_device(m, f"nvidia{minor}")
    _reorder(m)


XID_EVENTS = "xid-events"  # beside each information file (tests/simnvml.c)
STATE_DIR = Path("/run/simulated-nvml")  # where a container's NVML reads proc/driver


def deliver_xid(m: SimMachine, minor: int, xid: int, *, lose: bool = False) -> None:
    """The GPU at /dev/nvidia<minor> reports Xid ``xid``: every NVML event set registered
    for its Xid events delivers it once, at its next nvmlEventSetWait_v2, as an
    nvmlEventTypeXidCriticalError with eventData ``xid`` and that GPU's handle, while
    NVML stays initialised (the library reads the GPU's ``xid-events`` file again at
    every wait). ``lose``: the GPU then falls off the bus as after an Xid 79
    (:func:`lose_gpu`, seen at NVML's next first init)."""
    if not 0 <= xid < 2**64:
        raise ValueError(f"Xid {xid}: an nvmlEventData_t eventData is an unsigned 64-bit value")
    with open(_gpu_dir(m, minor) / XID_EVENTS, "a") as events:
        events.write(f"{xid}\n")  # one write: a waiting NVML never sees half a line
    if lose:
        lose_gpu(m, minor)


class XidRegistrations:
    """When a consumer has registered for a GPU's Xid events: NVML's event registration
    (tests/simnvml.c, nvmlDeviceRegisterEvents) reads the GPU's ``xid-events`` file to
    know which Xids came before it, so the first open of that file is the moment from
    which an Xid delivered reaches the consumer. A real NVML does not deliver an event
    that happened before the registration either; this is how a test knows that moment
    instead of guessing it (inotify's IN_OPEN; the file is made empty first)."""

    _IN_OPEN, _IN_NONBLOCK, _IN_CLOEXEC = 0x20, 0o4000, 0o2000000

    def __init__(self, files: list[Path]) -> None:
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        for path in files:
            path.touch()
        self._fd = self._libc.inotify_init1(self._IN_NONBLOCK | self._IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._pending: dict[int, Path] = {}
        for path in files:
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), self._IN_OPEN)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
            self._pending[wd] = path

    def wait(self, timeout: float) -> None:
        """Until every file was opened (every GPU registered); AssertionError naming the
        others after ``timeout`` seconds."""
        import select
        import struct
        import time

        deadline = time.monotonic() + timeout
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                waiting = sorted(map(str, self._pending.values()))
                raise AssertionError(f"no Xid event registration within {timeout:g} s for "
                                     f"{waiting}")
            data = os.read(self._fd, 65536)
            while data:
                wd, _mask, _cookie, size = struct.unpack_from("iIII", data)
                self._pending.pop(wd, None)
                data = data[16 + size:]

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> XidRegistrations:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def xid_files(m: SimMachine) -> list[Path]:
    """Every GPU's ``xid-events`` file (for :class:`XidRegistrations`)."""
    return [info.parent / XID_EVENTS for info in sorted((m.root / GPUS_DIR).glob("*/information"))]


def exclude_gpu(m: SimMachine, minor: int) -> None:
    """The host excludes the GPU at /dev/nvidia<minor> (``NVreg_ExcludedGpus``): the
    module still lists it, with ``GPU Excluded: Yes`` and an uninitialised UUID, and NVML
    no longer enumerates it (the indices after it shift down). Its /dev node stays: the
    host binds every /dev/nvidia* into the machine."""
    info = _gpu_dir(m, minor) / "information"
    lines = []
    for line in info.read_text().splitlines():
        key = line.partition(":")[0]
        if key == "GPU UUID":
            line = f"GPU UUID: \t {EXCLUDED_UUID}"
        elif key == "GPU Excluded":
            line = "GPU Excluded:\t Yes"
        lines.append(line)
    info.write_text("".join(f"{line}\n" for line in lines))
    _reorder(m)


def move_gpu_bus(m: SimMachine, minor: int, bus_id: str) -> None:
    """The GPU at /dev/nvidia<minor> sits at PCI ``bus_id`` (``0000:9a:00.0``, lower case
    as the module writes it): NVML orders GPUs by bus id, so its index no longer follows
    its minor. Its information file and simulated state move with it."""
    old = _gpu_dir(m, minor)
    new = old.parent / bus_id
    if new.exists():
        raise FileExistsError(f"{new}: another GPU is at {bus_id}")
    old.rename(new)
    info = new / "information"
    info.write_text("".join(
        f"Bus Location: \t {bus_id}\n" if line.partition(":")[0] == "Bus Location"
        else f"{line}\n" for line in info.read_text().splitlines()))
    _reorder(m)


def _remove_device(m: SimMachine, name: str) -> None:
    path = m.root / "dev" / name
    if os.path.lexists(path):
        path.unlink()
    if name in m.devices:
        m.devices.remove(name)


def _add_device(m: SimMachine, name: str, major: int, minor: int, mode: int) -> None:
    path = m.root / "dev" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        path.unlink()
    mknod_char(path, major, minor, mode)
    if name not in m.devices:
        m.devices.append(name)


def _read_mig_minors(m: SimMachine) -> dict[str, int]:
    path = m.root / MIG_MINORS
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        cap, _, minor = line.partition(" ")
        if minor.isdigit():
            found[cap] = int(minor)
    return found


def gi_cap_minor(minor: int, gi: int) -> int:
    """The minor of the access cap of GPU instance ``gi`` of the GPU at /dev/nvidia<minor>
    as the driver numbers them in mig-minors: config 1, monitor 2, then per GPU 15 GPU
    instances of 9 minors each (the GI's own, then its 8 compute instances')."""
    if not 0 <= gi < GI_PER_GPU:
        raise ValueError(f"GPU instance id {gi}: the driver numbers 0..{GI_PER_GPU - 1}")
    return 3 + minor * GI_PER_GPU * (1 + CI_PER_GI) + gi * (1 + CI_PER_GI)


def ci_cap_minor(minor: int, gi: int, ci: int) -> int:
    if not 0 <= ci < CI_PER_GI:
        raise ValueError(f"compute instance id {ci}: the driver numbers 0..{CI_PER_GI - 1}")
    return gi_cap_minor(minor, gi) + 1 + ci


def _capability_text(minor: int, mode: int) -> str:
    """/proc/driver/nvidia/capabilities/.../access as the module writes it."""
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def _clear_mig(m: SimMachine, minor: int) -> None:
    """Remove what the module shows of the GPU's MIG instances: its mig-minors lines,
    their caps nodes and its capabilities/gpu<minor>/mig/gi* dirs."""
    caps = _read_mig_minors(m)
    mine = {cap: n for cap, n in caps.items() if cap.startswith(f"gpu{minor}/")}
    for n in mine.values():
        _remove_device(m, f"{CAPS_DIR}/nvidia-cap{n}")
    if mine:
        rest = [(n, cap) for cap, n in caps.items() if cap not in mine]
        (m.root / MIG_MINORS).write_text("".join(f"{cap} {n}\n" for n, cap in sorted(rest)))
    mig = m.root / CAPABILITIES_DIR / f"gpu{minor}" / "mig"
    for gi in mig.glob("gi*") if mig.is_dir() else []:
        shutil.rmtree(gi)


def enable_mig(m: SimMachine, minor: int, devices: list[tuple[int, int, int, int]]) -> list[str]:
    """MIG mode on the GPU at /dev/nvidia<minor>, with ``devices`` (gpu instance id,
    compute instance id, GPU instance profile 0..16, compute instance profile 0..8), in
    MIG slots 0..n-1: NVML lists them, the GPU itself no longer gets a full-GPU device.
    Writes the module's files for them too: mig-minors (``config 1``, ``monitor 2``,
    ``gpu<minor>/gi<G>/access <M>``, ``gpu<minor>/gi<G>/ci<C>/access <M>``, minors
    numbered as the driver numbers them), the capabilities/gpu<minor>/mig/gi<G>/ci<C>
    dirs and the caps nodes /dev/nvidia-caps/nvidia-cap<M> (config's and monitor's
    too). Called again, it reconfigures: the GPU's previous MIG devices, their lines and
    nodes go first. Returns the MIG devices' uuids (``MIG-<uuid5>``, stable for the same
    GPU, ids and profiles), in slot order."""
    if len(devices) > MAX_MIG_DEVICES:
        raise ValueError(f"{len(devices)} MIG devices: a GPU has {MAX_MIG_DEVICES} slots")
    if len({(gi, ci) for gi, ci, _, _ in devices}) != len(devices):
        raise ValueError(f"MIG devices {devices}: a (gi, ci) pair twice")
    import uuid as uuidlib

    state = [line for line in _state_lines(m, minor)
             if line != "mig" and not line.startswith("mig-device ")]
    _clear_mig(m, minor)
    uuids = []
    lines = [*state, "mig"]
    for slot, (gi, ci, gi_profile, ci_profile) in enumerate(devices):
        name = f"unbounded-nvidia-setup/mig/{minor}/{gi}/{ci}/{gi_profile}/{ci_profile}"
        uuid = "MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, name))
        uuids.append(uuid)
        lines.append(f"mig-device {slot} {gi} {ci} {gi_profile} {ci_profile} {uuid}")
    _write_state(m, minor, lines)

    major = proc_devices_major(m.root, "nvidia-caps", CAPS_MAJOR)
    caps = _read_mig_minors(m)
    caps.update({"config": 1, "monitor": 2})
    modes = {"config": 0o400, "monitor": 0o444}
    for gi, ci, _, _ in devices:
        caps[f"gpu{minor}/gi{gi}/access"] = gi_cap_minor(minor, gi)
        caps[f"gpu{minor}/gi{gi}/ci{ci}/access"] = ci_cap_minor(minor, gi, ci)
    path = m.root / MIG_MINORS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{cap} {n}\n" for n, cap in sorted((n, c) for c, n in caps.items())))
    capabilities = m.root / CAPABILITIES_DIR
    for cap, n in caps.items():
        mode = modes.get(cap, 0o444)
        if cap in modes or cap.startswith(f"gpu{minor}/"):
            _add_device(m, f"{CAPS_DIR}/nvidia-cap{n}", major, n, mode)
        if cap in modes:
            where = capabilities / "mig" / cap
        elif cap.startswith(f"gpu{minor}/"):
            where = capabilities / f"gpu{minor}" / "mig" / cap.partition("/")[2]
        else:
            continue
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(_capability_text(n, mode))
    return uuids


def disable_mig(m: SimMachine, minor: int) -> None:
    """MIG mode off on the GPU at /dev/nvidia<minor>: its MIG devices, their mig-minors
    lines, caps nodes and capabilities dirs go; it is a full GPU again."""
    _write_state(m, minor, [line for line in _state_lines(m, minor)
                            if line != "mig" and not line.startswith("mig-device ")])
    _clear_mig(m, minor)


def add_imex_channels(m: SimMachine, count: int) -> list[str]:
    """IMEX channels 0..count-1 (GB200/GB300 NVL racks): character nodes
    /dev/nvidia-caps-imex-channels/channel<N>, minor N, the major of
    ``nvidia-caps-imex-channels`` in proc/devices (added when missing). Returns their
    /dev paths."""
    major = proc_devices_major(m.root, IMEX_DIR, IMEX_MAJOR)
    paths = []
    for n in range(count):
        _add_device(m, f"{IMEX_DIR}/channel{n}", major, n, 0o666)
        paths.append(f"/dev/{IMEX_DIR}/channel{n}")
    return paths
