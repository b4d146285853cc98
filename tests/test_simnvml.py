"""The simulated NVML (tests/simnvml.c) speaks as NVML's header reads, at each strictness.

No GPU here can say whether a real NVML's lookup by UUID fails for the target alone or for
any GPU it meets (FACTS.md, "NVML's documented semantics for a lost GPU"), so a machine
picks a reading (simnvml.set_reading) and the product must hold under each. These tests
load the library with ctypes, as go-nvml calls it, and pin, per reading and per code,
which lookups fail with which code; then they run nvidia-ctk (the stand-in, and NVIDIA's
real one in real-tool mode) to show what each reading does to a generate that asks for a
healthy GPU by UUID. Also: host-excluded GPUs are not enumerated, and NVML's index order
is bus order, not minor order; a GPU's queries fail one by one (query-error), its lookups
or one query block (hang), and a GPU whose device node is missing is skipped or denied.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from test_fake_nvidia_ctk import TOOLS, clean_env, last_error, load

import elfbuild
import simgpu
import simnvml
from conftest import needs_root

pytestmark = needs_root

SUCCESS, NOT_FOUND, UNKNOWN = 0, 6, 999
MACHINE_WIDE = (8, 11)  # the header's "any attached devices" / "the attached GPUs"
TEXTS = {4: "Insufficient Permissions", 8: "Insufficient External Power",
         11: "Interrupt Request Issue", 15: "GPU is lost", 999: "Unknown Error"}
FAILING = 2  # of GPUs 0..3 (minor = index on these machines unless a test moves a bus)
MIG_PLACEMENT = [(1, 0, 3, 3)]  # one 4g MIG device (gi 1, ci 0, profiles 3/3)


class Nvml:
    """The machine's simulated libnvidia-ml, loaded from its staging, initialised."""

    def __init__(self, m: simgpu.SimMachine) -> None:
        self.lib: Any = ctypes.CDLL(str(m.lib_dir / "libnvidia-ml.so.1"))
        self.lib.nvmlErrorString.restype = ctypes.c_char_p
        self.init()

    def init(self) -> None:
        assert self.lib.nvmlInit_v2() == SUCCESS

    def restart(self) -> None:
        """Shut down and init again: the machine's state is read at a first init."""
        assert self.lib.nvmlShutdown() == SUCCESS
        self.init()

    def count(self) -> int:
        count = ctypes.c_uint()
        assert self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == SUCCESS
        return count.value

    def by_index(self, index: int) -> int:
        handle = ctypes.c_void_p()
        return int(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)))

    def by_uuid(self, uuid: str) -> int:
        handle = ctypes.c_void_p()
        return int(self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)))

    def by_bus(self, bus: str) -> int:
        handle = ctypes.c_void_p()
        return int(self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)))

    def gpu(self, index: int) -> tuple[str, int]:
        """(uuid, minor) of the GPU at an NVML index."""
        handle, minor = ctypes.c_void_p(), ctypes.c_uint()
        buf = ctypes.create_string_buffer(96)
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == SUCCESS
        assert self.lib.nvmlDeviceGetUUID(handle, buf, 96) == SUCCESS
        assert self.lib.nvmlDeviceGetMinorNumber(handle, ctypes.byref(minor)) == SUCCESS
        return buf.value.decode(), minor.value


def four_gpus(tmp_path: Path) -> simgpu.SimMachine:
    m = simgpu.make_machine(tmp_path / "root", unrelated=0, toolkit_libs=False,
                            helpers=False, firmware=False)
    for minor in (2, 3):
        simnvml.add_gpu(m, minor)
    assert len(m.nvml_gpus) == 4
    return m


@pytest.fixture
def machine(tmp_path: Path) -> simgpu.SimMachine:
    return four_gpus(tmp_path)


def nvml_bus(m: simgpu.SimMachine, minor: int) -> str:
    """The GPU's bus id as NVML writes it (8 domain digits)."""
    return "0000" + simnvml.bus_of(m, minor)


@pytest.mark.parametrize("code", simnvml.ERROR_CODES)
@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_which_lookups_a_failing_gpu_fails(machine: simgpu.SimMachine, reading: str,
                                           code: int) -> None:
    """GPU 2 of 0..3 fails with ``code``. By index and by PCI bus id only GPU 2 fails,
    except that in walk and any a code of 8 or 11 fails every lookup; by UUID, target
    fails GPU 2 alone, walk every GPU from 2 on (the search meets GPU 2 first), any every
    GPU; a UUID no GPU has walks past GPU 2 in walk and any (its code) and is 6 in
    target. A MIG device's UUID is looked up like its GPU's. The count keeps GPU 2."""
    m = machine
    migs = {minor: simnvml.enable_mig(m, minor, MIG_PLACEMENT)[0] for minor in (1, 3)}
    simnvml.set_reading(m, reading)
    simnvml.fail_gpu(m, FAILING, code)
    nvml = Nvml(m)
    everywhere = reading != "target" and code in MACHINE_WIDE
    fails_target = [code if everywhere or i == FAILING else SUCCESS for i in range(4)]
    fails_uuid = {
        "target": fails_target,
        "walk": [code if everywhere or i >= FAILING else SUCCESS for i in range(4)],
        "any": [code] * 4,
    }[reading]
    assert nvml.count() == 4
    assert [nvml.by_index(i) for i in range(4)] == fails_target
    assert [nvml.by_bus(nvml_bus(m, i)) for i in range(4)] == fails_target
    assert [nvml.by_uuid(u) for u in m.nvml_gpus] == fails_uuid
    assert [nvml.by_uuid(migs[i]) for i in (1, 3)] == [fails_uuid[1], fails_uuid[3]]
    unknown = "GPU-00000000-0000-0000-0000-000000000000"
    assert nvml.by_uuid(unknown) == (NOT_FOUND if reading == "target" else code)
    assert nvml.by_bus("0000:ee:00.0") == (code if everywhere else NOT_FOUND)
    assert nvml.lib.nvmlErrorString(code).decode() == TEXTS[code]


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_the_first_failing_gpu_in_index_order_speaks(machine: simgpu.SimMachine,
                                                     reading: str) -> None:
    """Two failing GPUs, 1 (4) and 3 (15): a walk by UUID stops at the first it meets, so
    GPU 3's UUID answers GPU 1's 4; any answers 4 for every UUID. A third GPU with 8 on
    the bus makes walk and any answer 8 for every lookup, before either."""
    m = machine
    simnvml.set_reading(m, reading)
    simnvml.fail_gpu(m, 1, 4)
    simnvml.fail_gpu(m, 3, 15)
    nvml = Nvml(m)
    by_uuid = {"target": [0, 4, 0, 15], "walk": [0, 4, 4, 4], "any": [4, 4, 4, 4]}[reading]
    assert [nvml.by_uuid(u) for u in m.nvml_gpus] == by_uuid
    assert [nvml.by_index(i) for i in range(4)] == [0, 4, 0, 15]
    simnvml.fail_gpu(m, 2, 8)
    nvml.restart()
    if reading == "target":
        assert [nvml.by_index(i) for i in range(4)] == [0, 4, 8, 15]
        assert [nvml.by_uuid(u) for u in m.nvml_gpus] == [0, 4, 8, 15]
    else:
        assert [nvml.by_index(i) for i in range(4)] == [8] * 4
        assert [nvml.by_uuid(u) for u in m.nvml_gpus] == [8] * 4


def test_lost_recover_and_reading_are_read_at_a_first_init(machine: simgpu.SimMachine) -> None:
    """``lost`` still means 15; a change shows at the next first init, not before; a
    recovered GPU answers again; a reading the library does not know fails init (999)
    rather than pass for target."""
    m = machine
    (simnvml._gpu_dir(m, 1) / simnvml.SIM_STATE).write_text("lost\n")
    nvml = Nvml(m)
    assert nvml.by_index(1) == 15 and nvml.by_uuid(m.nvml_gpus[3]) == SUCCESS
    simnvml.set_reading(m, "any")
    assert nvml.by_uuid(m.nvml_gpus[3]) == SUCCESS  # still initialised: old state
    nvml.restart()
    assert nvml.by_uuid(m.nvml_gpus[3]) == 15
    simnvml.recover_gpu(m, 1)
    nvml.restart()
    assert [nvml.by_uuid(u) for u in m.nvml_gpus] == [SUCCESS] * 4
    assert nvml.lib.nvmlShutdown() == SUCCESS
    (m.root / simnvml.READING_FILE).write_text("strict\n")
    assert nvml.lib.nvmlInit_v2() == UNKNOWN
    with pytest.raises(ValueError):
        simnvml.set_reading(m, "strict")
    with pytest.raises(ValueError):
        simnvml.fail_gpu(m, 1, 9)


def test_an_excluded_gpu_is_not_enumerated(machine: simgpu.SimMachine) -> None:
    """NVreg_ExcludedGpus: the module lists GPU 1 as excluded, with an uninitialised
    UUID; NVML counts three GPUs and index 1 is the GPU at minor 2. Its node stays."""
    m = machine
    excluded_uuid = m.nvml_gpus[1]
    simnvml.exclude_gpu(m, 1)
    info = (simnvml._gpu_dir(m, 1) / "information").read_text()
    assert "GPU Excluded:\t Yes\n" in info and simnvml.EXCLUDED_UUID in info
    assert excluded_uuid not in m.nvml_gpus and len(m.nvml_gpus) == 3
    assert (m.root / "dev" / "nvidia1").is_char_device()
    nvml = Nvml(m)
    assert nvml.count() == 3
    assert [nvml.gpu(i) for i in range(3)] == list(zip(m.nvml_gpus, (0, 2, 3), strict=True))
    assert nvml.by_index(3) == 2  # invalid argument: past the count
    assert nvml.by_uuid(excluded_uuid) == NOT_FOUND
    assert nvml.by_bus(nvml_bus(m, 1)) == NOT_FOUND
    assert [simnvml.nvml_index(m, minor) for minor in (0, 2, 3)] == [0, 1, 2]


def test_index_order_is_bus_order_not_minor_order(machine: simgpu.SimMachine) -> None:
    """Minor 0 on bus 9a, minor 3 on bus 07: NVML's indices follow the bus ids, so index 0
    is minor 3 and index 3 is minor 0; nvml_gpus follows, and a lookup by bus id finds
    each GPU on its new bus."""
    m = machine
    simnvml.move_gpu_bus(m, 0, "0000:9a:00.0")
    simnvml.move_gpu_bus(m, 3, "0000:07:00.0")
    nvml = Nvml(m)
    assert [minor for _, minor in (nvml.gpu(i) for i in range(4))] == [3, 1, 2, 0]
    assert [uuid for uuid, _ in (nvml.gpu(i) for i in range(4))] == m.nvml_gpus
    assert [simnvml.nvml_index(m, minor) for minor in range(4)] == [3, 1, 2, 0]
    assert simnvml.bus_of(m, 0) == "0000:9a:00.0"
    assert nvml.by_bus("00000000:9A:00.0") == SUCCESS
    assert nvml.by_bus(simnvml.gpu_bus_id(0)) == NOT_FOUND
    with pytest.raises(FileExistsError):
        simnvml.move_gpu_bus(m, 1, "0000:9a:00.0")


# ------------------------------------------------- nvidia-ctk against each reading

GENERATORS = ("failed to generate CDI spec: failed to create device CDI specs: failed to "
              "construct device spec generators: ")


@pytest.fixture(params=TOOLS)
def nvidia_ctk(request: pytest.FixtureRequest) -> Path:
    tool: Path = request.param
    return tool


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_nvidia_ctk_asks_for_a_healthy_gpu_after_a_lost_one(
        tmp_path: Path, nvidia_ctk: Path, reading: str) -> None:
    """nvidia-ctk 1.20 looks every --device-id up by UUID: asked for GPU 2 by its UUID
    while GPU 1 is lost, it succeeds in target and fails in walk and any, with NVML's
    text for 15; asked for GPU 0 (before the lost one), only any fails."""
    m = four_gpus(tmp_path)
    shutil.copytree(m.lib_dir, m.driver_lib_dir, symlinks=True)
    simnvml.set_reading(m, reading)
    simnvml.lose_gpu(m, 1)
    out = tmp_path / "out" / "nvidia.yaml"

    def generate(uuid: str) -> subprocess.CompletedProcess[str]:
        if out.exists():
            out.unlink()
        argv = [str(nvidia_ctk), "cdi", "generate", f"--driver-root={m.driver_root}",
                f"--dev-root={m.root}", f"--output={out}", f"--device-id={uuid}"]
        return subprocess.run(argv, env=clean_env(), capture_output=True, text=True,
                              timeout=60, check=False)

    for index, fails in ((2, reading != "target"), (0, reading == "any")):
        uuid = m.nvml_gpus[index]
        result = generate(uuid)
        if fails:
            assert result.returncode == 1, result.stderr
            assert last_error(result) == (GENERATORS + "failed to get device handle from "
                                          "UUID: GPU is lost")
            assert not out.exists()
        else:
            assert result.returncode == 0, result.stderr
            devices = {d["name"] for d in load(out)["devices"]}
            assert devices == {str(index), uuid, "all"}, devices


@pytest.mark.parametrize("code", (4, 8))
def test_nvidia_ctk_device_ids_in_a_walk(tmp_path: Path, nvidia_ctk: Path, code: int) -> None:
    """What each kind of --device-id meets in the walk reading, GPU 1 failing with
    ``code`` and GPU 3 in MIG mode: `all` stops at index 1 (VisitDevices by index); an
    index or a MIG ``i:j`` becomes a UUID first, then is looked up by UUID, so GPU 2 and
    MIG device 3:0 fail there while GPU 0 passes; with 8 (any attached device) even the
    index lookup that turns 0 into a UUID fails. The stand-in's texts are 1.20's."""
    m = four_gpus(tmp_path)
    shutil.copytree(m.lib_dir, m.driver_lib_dir, symlinks=True)
    simnvml.enable_mig(m, 3, MIG_PLACEMENT)
    simnvml.set_reading(m, "walk")
    simnvml.fail_gpu(m, 1, code)
    text = TEXTS[code]
    out = tmp_path / "out" / "nvidia.yaml"

    def generate(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [str(nvidia_ctk), "cdi", "generate", f"--driver-root={m.driver_root}",
                f"--dev-root={m.root}", f"--output={out}", *extra]
        return subprocess.run(argv, env=clean_env(), capture_output=True, text=True,
                              timeout=60, check=False)

    first = "0" if code in MACHINE_WIDE else "1"
    expected = {
        (): f"failed to get full GPU device editors: error getting device handle for index "
            f"'{first}': {text}",
        ("--device-id=2",): f"failed to get device handle from UUID: {text}",
        ("--device-id=3:0",): f"failed to get device handle from UUID: {text}",
    }
    if code in MACHINE_WIDE:
        expected = {
            **expected,
            ("--device-id=2",): f"failed to get device handle from index: {text}",
            ("--device-id=3:0",): f"failed to get parent device handle: {text}",
            ("--device-id=0",): f"failed to get device handle from index: {text}",
        }
    for extra, error in expected.items():
        result = generate(*extra)
        assert result.returncode == 1, (extra, result.stderr)
        assert last_error(result) == GENERATORS + error, extra
        assert not out.exists()
    if code not in MACHINE_WIDE:
        result = generate("--device-id=0")
        assert result.returncode == 0, result.stderr
        assert {d["name"] for d in load(out)["devices"]} == {"0", m.nvml_gpus[0], "all"}


# ------------------------------------------------- what NVIDIA's device plugin calls

TIMEOUT = 10  # NVML_ERROR_TIMEOUT
INVALID, NOT_SUPPORTED, UNINITIALIZED = 2, 3, 1
XID_EVENT, ECC_EVENTS = 0x8, 0x1 | 0x2  # nvmlEventTypeXidCriticalError, single/double ECC
SUPPORTED_EVENTS = 0x10F  # ECC single and double, PState, Xid, MIG config change
FULL_GPU = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of a full GPU's event


class EventData(ctypes.Structure):
    """nvmlEventData_t (nvml.h)."""

    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                ("eventData", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


class EventDataV1(ctypes.Structure):
    """nvmlEventSetWait's (v1) data: no instance ids."""

    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                ("eventData", ctypes.c_ulonglong)]


def handle(nvml: Nvml, index: int) -> ctypes.c_void_p:
    found = ctypes.c_void_p()
    assert nvml.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(found)) == SUCCESS
    return found


def event_set(nvml: Nvml) -> ctypes.c_void_p:
    made = ctypes.c_void_p()
    assert nvml.lib.nvmlEventSetCreate(ctypes.byref(made)) == SUCCESS
    return made


def register(nvml: Nvml, device: ctypes.c_void_p, types: int,
             events: ctypes.c_void_p | None) -> int:
    return int(nvml.lib.nvmlDeviceRegisterEvents(device, ctypes.c_ulonglong(types), events))


def wait(nvml: Nvml, events: ctypes.c_void_p, ms: int) -> tuple[int, EventData, float]:
    """nvmlEventSetWait_v2: (code, data, seconds it took)."""
    data = EventData()
    start = time.monotonic()
    code = nvml.lib.nvmlEventSetWait_v2(events, ctypes.byref(data), ms)
    return int(code), data, time.monotonic() - start


def test_the_device_plugins_other_calls_answer(machine: simgpu.SimMachine) -> None:
    """The compute capability (an H100's 9.0), the supported events, an event set's life
    and its arguments, as nvml.h documents each: NULL pointers 2, an unknown event type
    2, a supported-by-NVML one this GPU lacks (Clock) 3, before init 1."""
    nvml = Nvml(machine)
    lib = nvml.lib
    gpu = handle(nvml, 1)
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert lib.nvmlDeviceGetCudaComputeCapability(gpu, ctypes.byref(major),
                                                  ctypes.byref(minor)) == SUCCESS
    assert (major.value, minor.value) == (9, 0)
    assert lib.nvmlDeviceGetCudaComputeCapability(gpu, None, ctypes.byref(minor)) == INVALID
    assert lib.nvmlDeviceGetCudaComputeCapability(None, ctypes.byref(major),
                                                  ctypes.byref(minor)) == INVALID
    types = ctypes.c_ulonglong()
    assert lib.nvmlDeviceGetSupportedEventTypes(gpu, ctypes.byref(types)) == SUCCESS
    assert types.value == SUPPORTED_EVENTS
    assert lib.nvmlDeviceGetSupportedEventTypes(gpu, None) == INVALID
    assert lib.nvmlEventSetCreate(None) == INVALID
    events = event_set(nvml)
    assert register(nvml, gpu, XID_EVENT | ECC_EVENTS, events) == SUCCESS
    assert register(nvml, gpu, 0x10000, events) == INVALID  # outside nvmlEventTypeAll
    assert register(nvml, gpu, 0x10 | XID_EVENT, events) == NOT_SUPPORTED  # Clock: Kepler
    assert register(nvml, gpu, XID_EVENT, None) == INVALID
    assert lib.nvmlEventSetWait_v2(events, None, 0) == INVALID
    assert lib.nvmlEventSetFree(events) == SUCCESS
    assert lib.nvmlShutdown() == SUCCESS
    assert lib.nvmlShutdown() == UNINITIALIZED  # nvml.h, at its strictest
    assert lib.nvmlEventSetCreate(ctypes.byref(ctypes.c_void_p())) == UNINITIALIZED
    assert lib.nvmlDeviceGetCudaComputeCapability(gpu, ctypes.byref(major),
                                                  ctypes.byref(minor)) == UNINITIALIZED


def test_an_event_wait_with_nothing_to_deliver_times_out(machine: simgpu.SimMachine) -> None:
    """nvmlEventSetWait_v2 with nothing recorded waits its timeout, then answers 10; with
    0 ms it answers at once. NVML's text for 10 is "Timeout"."""
    nvml = Nvml(machine)
    events = event_set(nvml)
    for index in range(4):
        assert register(nvml, handle(nvml, index), XID_EVENT | ECC_EVENTS, events) == SUCCESS
    code, _, took = wait(nvml, events, 300)
    assert code == TIMEOUT and 0.29 <= took < 2, took
    code, _, took = wait(nvml, events, 0)
    assert code == TIMEOUT and took < 0.2, took
    assert nvml.lib.nvmlErrorString(TIMEOUT) == b"Timeout"


def test_an_xid_is_delivered_once_to_its_gpu(machine: simgpu.SimMachine) -> None:
    """Xids delivered before a GPU registers are not recorded; one delivered while NVML
    stays initialised comes once, as an Xid event with the Xid and that GPU's handle,
    full-GPU instance ids; two come in order; an Xid delivered during a wait ends it;
    the v1 wait delivers too; ``lose`` leaves the GPU lost at NVML's next first init."""
    m = machine
    simnvml.deliver_xid(m, 2, 31)  # before registration: not recorded
    nvml = Nvml(m)
    handles = [handle(nvml, index) for index in range(4)]
    events = event_set(nvml)
    for gpu in handles:
        assert register(nvml, gpu, XID_EVENT | ECC_EVENTS, events) == SUCCESS
    assert wait(nvml, events, 0)[0] == TIMEOUT
    simnvml.deliver_xid(m, 2, 79)
    code, data, _ = wait(nvml, events, 1000)
    assert code == SUCCESS
    assert (data.eventType, data.eventData) == (XID_EVENT, 79)
    assert data.device == handles[2].value
    assert (data.gpuInstanceId, data.computeInstanceId) == (FULL_GPU, FULL_GPU)
    buf = ctypes.create_string_buffer(96)
    assert nvml.lib.nvmlDeviceGetUUID(ctypes.c_void_p(data.device), buf, 96) == SUCCESS
    assert buf.value.decode() == m.nvml_gpus[2]
    assert wait(nvml, events, 50)[0] == TIMEOUT  # once
    simnvml.deliver_xid(m, 1, 48)
    simnvml.deliver_xid(m, 1, 13)
    got = [wait(nvml, events, 1000)[1] for _ in range(2)]
    assert [(d.device, d.eventData) for d in got] == [(handles[1].value, 48),
                                                      (handles[1].value, 13)]
    timer = threading.Timer(0.3, simnvml.deliver_xid, (m, 3, 94))
    timer.start()
    code, data, took = wait(nvml, events, 5000)
    timer.join()
    assert (code, data.device, data.eventData) == (SUCCESS, handles[3].value, 94)
    assert 0.25 < took < 2, took
    simnvml.deliver_xid(m, 0, 63)
    v1 = EventDataV1()
    assert nvml.lib.nvmlEventSetWait(events, ctypes.byref(v1), 1000) == SUCCESS
    assert (v1.device, v1.eventType, v1.eventData) == (handles[0].value, XID_EVENT, 63)
    simnvml.deliver_xid(m, 2, 79, lose=True)
    assert wait(nvml, events, 1000)[1].eventData == 79
    assert nvml.by_index(2) == SUCCESS  # still initialised: the state of its first init
    assert nvml.lib.nvmlEventSetFree(events) == SUCCESS
    nvml.restart()
    assert nvml.by_index(2) == simnvml.GPU_IS_LOST


@pytest.mark.parametrize("code", (15, 8))
@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_registering_a_failing_gpu_answers_as_the_reading_says(
        machine: simgpu.SimMachine, reading: str, code: int) -> None:
    """Handles taken while every GPU answered, then GPU 2 fails with ``code`` (seen at a
    first init): registering events, and asking which are supported, answer as a lookup
    of that GPU by index does in the reading: 15 for GPU 2 alone; 8 for GPU 2 alone in
    target, for every GPU in walk and any (the header's "any attached devices")."""
    m = machine
    simnvml.set_reading(m, reading)
    nvml = Nvml(m)
    handles = [handle(nvml, index) for index in range(4)]
    simnvml.fail_gpu(m, FAILING, code)
    nvml.restart()
    everywhere = reading != "target" and code in MACHINE_WIDE
    expected = [code if everywhere or i == FAILING else SUCCESS for i in range(4)]
    events = event_set(nvml)
    assert [register(nvml, gpu, XID_EVENT, events) for gpu in handles] == expected
    types = ctypes.c_ulonglong()
    assert [nvml.lib.nvmlDeviceGetSupportedEventTypes(gpu, ctypes.byref(types))
            for gpu in handles] == expected


# ------------------------------------------------- failing queries, blocking calls

NO_PERMISSION, INVALID = 4, 2


def _text_out(name: str) -> Any:
    def call(lib: Any, device: ctypes.c_void_p) -> int:
        buf = ctypes.create_string_buffer(96)
        return int(getattr(lib, name)(device, buf, 96))
    return call


def _uint_out(name: str) -> Any:
    def call(lib: Any, device: ctypes.c_void_p) -> int:
        return int(getattr(lib, name)(device, ctypes.byref(ctypes.c_uint())))
    return call


def _struct_out(name: str, size: int = 128) -> Any:
    def call(lib: Any, device: ctypes.c_void_p) -> int:
        return int(getattr(lib, name)(device, ctypes.create_string_buffer(size)))
    return call


def _mig_mode(lib: Any, device: ctypes.c_void_p) -> int:
    return int(lib.nvmlDeviceGetMigMode(device, ctypes.byref(ctypes.c_uint()),
                                        ctypes.byref(ctypes.c_uint())))


def _compute_capability(lib: Any, device: ctypes.c_void_p) -> int:
    return int(lib.nvmlDeviceGetCudaComputeCapability(device, ctypes.byref(ctypes.c_int()),
                                                      ctypes.byref(ctypes.c_int())))


def _mig_by_index(lib: Any, device: ctypes.c_void_p) -> int:
    return int(lib.nvmlDeviceGetMigDeviceHandleByIndex(device, 0, ctypes.byref(ctypes.c_void_p())))


def _parent(lib: Any, device: ctypes.c_void_p) -> int:
    return int(lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
        device, ctypes.byref(ctypes.c_void_p())))


# Every entry point of each query a GPU's state can fail, and how to call it with a handle.
ENTRY_POINTS: dict[str, dict[str, Any]] = {
    "nvmlDeviceGetUUID": {"nvmlDeviceGetUUID": _text_out("nvmlDeviceGetUUID")},
    "nvmlDeviceGetName": {"nvmlDeviceGetName": _text_out("nvmlDeviceGetName")},
    "nvmlDeviceGetMinorNumber": {"nvmlDeviceGetMinorNumber":
                                 _uint_out("nvmlDeviceGetMinorNumber")},
    "nvmlDeviceGetIndex": {"nvmlDeviceGetIndex": _uint_out("nvmlDeviceGetIndex")},
    "nvmlDeviceGetPciInfo": {name: _struct_out(name) for name in (
        "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3")},
    "nvmlDeviceGetMemoryInfo": {"nvmlDeviceGetMemoryInfo":
                                _struct_out("nvmlDeviceGetMemoryInfo")},
    "nvmlDeviceGetAttributes": {name: _struct_out(name) for name in (
        "nvmlDeviceGetAttributes", "nvmlDeviceGetAttributes_v2")},
    "nvmlDeviceGetCudaComputeCapability": {"nvmlDeviceGetCudaComputeCapability":
                                           _compute_capability},
    "nvmlDeviceGetMigMode": {"nvmlDeviceGetMigMode": _mig_mode},
    "nvmlDeviceGetMaxMigDeviceCount": {"nvmlDeviceGetMaxMigDeviceCount":
                                       _uint_out("nvmlDeviceGetMaxMigDeviceCount")},
    "nvmlDeviceGetMigDeviceHandleByIndex": {"nvmlDeviceGetMigDeviceHandleByIndex":
                                            _mig_by_index},
    "nvmlDeviceIsMigDeviceHandle": {"nvmlDeviceIsMigDeviceHandle":
                                    _uint_out("nvmlDeviceIsMigDeviceHandle")},
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": {
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": _parent},
    "nvmlDeviceGetGpuInstanceId": {"nvmlDeviceGetGpuInstanceId":
                                   _uint_out("nvmlDeviceGetGpuInstanceId")},
    "nvmlDeviceGetComputeInstanceId": {"nvmlDeviceGetComputeInstanceId":
                                       _uint_out("nvmlDeviceGetComputeInstanceId")},
}


def test_the_queries_named_are_the_librarys() -> None:
    """simnvml.QUERIES, the calls above and tests/simnvml.c's query_names are one list."""
    source = elfbuild.nvml_source()
    table = source.split("query_names[QUERIES] = {", 1)[1].split("};", 1)[0]
    assert re.findall(r'"(\w+)"', table) == list(simnvml.QUERIES)
    assert sorted(ENTRY_POINTS) == sorted(simnvml.QUERIES)


def _all_answers(nvml: Nvml, migs: dict[int, str]) -> dict[tuple[int, str, str], int]:
    """(GPU index, "gpu" or "mig", entry point) -> what it answers, for every GPU's handle
    and the handle of its MIG device in ``migs`` (index -> MIG UUID; got by UUID)."""
    answers = {}
    for index in range(nvml.count()):
        devices = {"gpu": handle(nvml, index)}
        if index in migs:
            mig = ctypes.c_void_p()
            assert nvml.lib.nvmlDeviceGetHandleByUUID(migs[index].encode(),
                                                      ctypes.byref(mig)) == SUCCESS
            devices["mig"] = mig
        for kind, device in devices.items():
            for entries in ENTRY_POINTS.values():
                for name, call in entries.items():
                    answers[index, kind, name] = call(nvml.lib, device)
    return answers


def test_a_query_error_fails_that_query_of_that_gpu_alone(machine: simgpu.SimMachine) -> None:
    """``query-error <function> <code>`` on GPU 2 (MIG on, as GPU 1): each entry point
    of that function (PciInfo's v1, v2 and v3, Attributes' two) answers the code for GPU
    2's handle and its MIG device's, where the healthy answer was not an argument error
    (2, e.g. a GPU instance id of a full GPU); every other function, every other GPU,
    answers as before, and GPU 2's handles are still got by index, UUID and bus id. Two
    lines fail two functions; a function name, or a line, the library does not know
    fails init with 999."""
    m = machine
    migs = {minor: simnvml.enable_mig(m, minor, MIG_PLACEMENT)[0] for minor in (1, FAILING)}
    nvml = Nvml(m)
    healthy = _all_answers(nvml, migs)
    assert {key[1] for key in healthy if key[0] in (1, FAILING)} == {"gpu", "mig"}
    assert healthy[FAILING, "gpu", "nvmlDeviceGetMigMode"] == SUCCESS
    assert healthy[FAILING, "mig", "nvmlDeviceGetGpuInstanceId"] == SUCCESS
    for function, code in zip(simnvml.QUERIES, [999, 15, 4] * 5, strict=True):
        simnvml.fail_query(m, FAILING, function, code)
        nvml.restart()
        expected = {key: code if key[0] == FAILING and key[2] in ENTRY_POINTS[function]
                    and answer != INVALID else answer for key, answer in healthy.items()}
        assert _all_answers(nvml, migs) == expected, function
        assert expected != healthy, function
        assert nvml.by_index(FAILING) == SUCCESS
        assert nvml.by_uuid(m.nvml_gpus[FAILING]) == SUCCESS
        assert nvml.by_bus(nvml_bus(m, FAILING)) == SUCCESS
        simnvml.recover_gpu(m, FAILING)
    simnvml.fail_query(m, FAILING, "nvmlDeviceGetUUID", 999)
    simnvml.fail_query(m, FAILING, "nvmlDeviceGetName", 15)
    simnvml.fail_query(m, FAILING, "nvmlDeviceGetUUID", 4)  # replaces the 999
    nvml.restart()
    answers = _all_answers(nvml, migs)
    assert (answers[FAILING, "gpu", "nvmlDeviceGetUUID"],
            answers[FAILING, "gpu", "nvmlDeviceGetName"]) == (4, 15)
    simnvml.recover_gpu(m, FAILING)
    nvml.restart()
    assert _all_answers(nvml, migs) == healthy
    assert nvml.lib.nvmlShutdown() == SUCCESS
    state = simnvml._gpu_dir(m, FAILING) / simnvml.SIM_STATE
    before = state.read_text()
    for line in ("query-error nvmlDeviceGetUUId 999", "query-error nvmlDeviceGetUUID",
                 "query-error nvmlDeviceGetUUID 0", "query-error nvmlDeviceGetUUID 9 9",
                 "hang nvmlDeviceGetPciInfo_v3", "hang nvmlDeviceGetUUID now"):
        state.write_text(f"{before}{line}\n")
        assert nvml.lib.nvmlInit_v2() == UNKNOWN, line
    state.write_text(before)
    assert nvml.lib.nvmlInit_v2() == SUCCESS
    for bad in (("nvmlDeviceGetPciInfo_v3", 999), ("nvmlDeviceGetUUID", 0)):
        with pytest.raises(ValueError):
            simnvml.fail_query(m, FAILING, *bad)
    with pytest.raises(ValueError):
        simnvml.hang_gpu(m, FAILING, "nvmlDeviceGetHandleByIndex")


_CALLS = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.nvmlInit_v2() == 0
def call(op):
    kind, _, arg = op.partition(":")
    h = ctypes.c_void_p()
    if kind == "index":
        return lib.nvmlDeviceGetHandleByIndex_v2(int(arg), ctypes.byref(h))
    if kind == "uuid":
        return lib.nvmlDeviceGetHandleByUUID(arg.encode(), ctypes.byref(h))
    if kind == "bus":
        return lib.nvmlDeviceGetHandleByPciBusId_v2(arg.encode(), ctypes.byref(h))
    assert lib.nvmlDeviceGetHandleByIndex_v2(int(arg), ctypes.byref(h)) == 0
    if kind == "migmode":
        u = ctypes.c_uint()
        return lib.nvmlDeviceGetMigMode(h, ctypes.byref(u), ctypes.byref(u))
    assert kind == "uuidof", op
    return lib.nvmlDeviceGetUUID(h, ctypes.create_string_buffer(96), 96)
for op in sys.argv[2:]:
    print("calling", op, flush=True)
    print(json.dumps(call(op)), flush=True)
"""
BLOCKED_FOR = 1.0  # seconds a call that blocks must not have returned in


def calls(m: simgpu.SimMachine, ops: list[str], blocks: str | None = None,
          end: signal.Signals = signal.SIGKILL) -> list[int]:
    """The answers of NVML calls made in order in a fresh process (``index:<i>``,
    ``uuid:<u>``, ``bus:<b>`` lookups; ``uuidof``, ``migmode`` of the GPU at index
    ``:<i>``). ``blocks``: a last call that must not return within
    BLOCKED_FOR seconds; the process is then ended with ``end`` and must die of it."""
    argv = [sys.executable, "-c", _CALLS, str(m.lib_dir / "libnvidia-ml.so.1"), *ops]
    with subprocess.Popen([*argv, *([blocks] if blocks else [])], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        watchdog = threading.Timer(30, proc.kill)  # a call that blocks where it must not
        watchdog.start()
        try:
            answers = []
            for op in ops:
                assert proc.stdout.readline() == f"calling {op}\n", (op, proc.stderr.read())
                answers.append(int(proc.stdout.readline()))
            if blocks is None:
                assert proc.wait() == 0, proc.stderr.read()
                return answers
            assert proc.stdout.readline() == f"calling {blocks}\n", proc.stderr.read()
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=BLOCKED_FOR)
            proc.send_signal(end)
            assert proc.wait(timeout=10) == -end
            return answers
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()


def test_a_hanging_gpus_lookups_block_where_its_error_would_fail_them(
        machine: simgpu.SimMachine) -> None:
    """``hang`` on GPU 2 blocks a call that nothing but a signal ends (SIGTERM here, as
    SIGKILL elsewhere): in target a lookup of GPU 2 by index, by bus id and by UUID; the
    other GPUs answer. In walk a lookup by UUID of GPU 3 (the search meets GPU 2) blocks,
    GPU 1's does not; in any a lookup by UUID of GPU 0 blocks too. The count keeps it;
    recovered, it answers."""
    m = machine
    simnvml.hang_gpu(m, FAILING)
    uuids = m.nvml_gpus
    others = [f"index:{i}" for i in (0, 1, 3)] + [f"uuid:{uuids[i]}" for i in (0, 1, 3)]
    assert calls(m, others, blocks=f"index:{FAILING}", end=signal.SIGTERM) == [SUCCESS] * 6
    assert calls(m, [], blocks=f"bus:{nvml_bus(m, FAILING)}") == []
    assert calls(m, [], blocks=f"uuid:{uuids[FAILING]}") == []
    assert Nvml(m).count() == 4
    simnvml.set_reading(m, "walk")
    assert calls(m, [f"uuid:{uuids[1]}", "index:3"], blocks=f"uuid:{uuids[3]}") == [0, 0]
    simnvml.set_reading(m, "any")
    assert calls(m, ["index:0", f"bus:{nvml_bus(m, 0)}"], blocks=f"uuid:{uuids[0]}") == [0, 0]
    simnvml.recover_gpu(m, FAILING)
    assert calls(m, [f"uuid:{u}" for u in uuids] + [f"index:{FAILING}"]) == [SUCCESS] * 5


def test_a_hanging_query_blocks_that_query_alone(machine: simgpu.SimMachine) -> None:
    """``hang nvmlDeviceGetMigMode`` on GPU 2: its handle is got by index and UUID, its
    UUID read, but its MIG mode blocks; GPU 1's MIG mode answers."""
    m = machine
    simnvml.hang_gpu(m, FAILING, "nvmlDeviceGetMigMode")
    ops = [f"index:{FAILING}", f"uuid:{m.nvml_gpus[FAILING]}", f"uuidof:{FAILING}", "migmode:1"]
    assert calls(m, ops, blocks=f"migmode:{FAILING}") == [SUCCESS] * 4
    simnvml.recover_gpu(m, FAILING)
    assert simnvml._state_lines(m, FAILING) == []
    assert calls(m, [f"migmode:{FAILING}"]) == [SUCCESS]


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_a_gpu_without_its_device_node_is_skipped_or_denied(machine: simgpu.SimMachine,
                                                            reading: str) -> None:
    """dev/nvidia2 removed. No devices reading: NVML does not look, all four answer.
    ``skip``: three GPUs (minors 0, 1, 3), GPU 2's UUID and bus id not found, nvml_gpus
    follows. ``deny``: four, GPU 2's lookups answer 4 as an ``error 4`` would in the
    reading (any: every lookup by UUID; walk: from GPU 2 on), even for a GPU that would
    hang. A word the library does not know fails init (999)."""
    m = machine
    simnvml.set_reading(m, reading)
    all_uuids = m.nvml_gpus[:]
    simnvml.remove_gpu_node(m, FAILING)
    assert m.nvml_gpus == all_uuids
    nvml = Nvml(m)
    assert nvml.count() == 4
    assert [nvml.by_uuid(u) for u in all_uuids] == [SUCCESS] * 4

    simnvml.set_devices_reading(m, "skip")
    assert m.nvml_gpus == [u for i, u in enumerate(all_uuids) if i != FAILING]
    nvml.restart()
    assert nvml.count() == 3
    assert [nvml.gpu(i) for i in range(3)] == list(zip(m.nvml_gpus, (0, 1, 3), strict=True))
    assert nvml.by_uuid(all_uuids[FAILING]) == NOT_FOUND
    assert nvml.by_bus(nvml_bus(m, FAILING)) == NOT_FOUND
    assert [simnvml.nvml_index(m, minor) for minor in (0, 1, 3)] == [0, 1, 2]

    simnvml.set_devices_reading(m, "deny")
    assert m.nvml_gpus == all_uuids
    nvml.restart()
    assert nvml.count() == 4
    by_uuid = {"target": [0, 0, 4, 0], "walk": [0, 0, 4, 4], "any": [4] * 4}[reading]
    assert [nvml.by_index(i) for i in range(4)] == [0, 0, NO_PERMISSION, 0]
    assert [nvml.by_uuid(u) for u in all_uuids] == by_uuid
    assert nvml.by_bus(nvml_bus(m, FAILING)) == NO_PERMISSION
    simnvml.hang_gpu(m, FAILING)  # a process of its own: were it to block, it is killed
    assert calls(m, [f"index:{FAILING}", f"uuid:{all_uuids[FAILING]}"]) == [NO_PERMISSION] * 2

    simnvml.set_devices_reading(m, None)
    simnvml.recover_gpu(m, FAILING)
    assert nvml.lib.nvmlShutdown() == SUCCESS
    (m.root / simnvml.DEVICES_FILE).write_text("hide\n")
    assert nvml.lib.nvmlInit_v2() == UNKNOWN
    with pytest.raises(ValueError):
        simnvml.set_devices_reading(m, "hide")


# ------------------------------------------------- the state directory, in a namespace

_NVML_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
out = {"init": lib.nvmlInit_v2()}
if out["init"] == 0:
    count, h, buf = ctypes.c_uint(), ctypes.c_void_p(), ctypes.create_string_buffer(96)
    lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
    out["uuids"], out["by_index"], handles = [], [], []
    for i in range(count.value):
        out["by_index"].append(lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)))
        handles.append(ctypes.c_void_p(h.value))
    for i, gpu in enumerate(handles):
        if out["by_index"][i] == 0:
            lib.nvmlDeviceGetUUID(gpu, buf, 96)
            out["uuids"].append(buf.value.decode())
    events = ctypes.c_void_p()
    lib.nvmlEventSetCreate(ctypes.byref(events))
    for i, gpu in enumerate(handles):
        if out["by_index"][i] == 0:
            lib.nvmlDeviceRegisterEvents(gpu, ctypes.c_ulonglong(8), events)
    print("registered", flush=True)
    data = (ctypes.c_ulonglong * 4)()  # device, type, Xid, the two instance ids
    out["wait"] = lib.nvmlEventSetWait_v2(events, data, 5000)
    if out["wait"] == 0:
        lib.nvmlDeviceGetUUID(ctypes.c_void_p(data[0]), buf, 96)
        out["event"] = [buf.value.decode(), data[1], data[2]]
print(json.dumps(out), flush=True)
"""

# A private /run and /dev: the host's stay untouched. $1 the machine's root, $2 "state"
# to bind its proc/driver at /run/simulated-nvml (read-only), $3 the machine's nodes to
# copy into that /dev ("-": none; "nvidiactl nvidia0": those two)
_CONTAINER_SETUP = """set -e
mount -t tmpfs tmpfs /run
mount -t tmpfs -o mode=755 tmpfs /dev
mknod -m 666 /dev/null c 1 3
if [ "$2" = state ]; then
    mkdir /run/simulated-nvml
    mount --bind "$1/proc/driver" /run/simulated-nvml
    mount -o remount,bind,ro /run/simulated-nvml
fi
for node in $3; do [ "$node" = - ] || cp -a "$1/dev/$node" "/dev/$node"; done
shift 3
exec "$@"
"""


def _namespace_unavailable() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare not installed (util-linux)"
    return None


def test_a_container_reads_the_state_directory(machine: simgpu.SimMachine,
                                               tmp_path: Path) -> None:
    """The library loaded from a container's path (/driver-root/lib/..., neither
    /run/nvidia/ nor /run/host-nvidia/ in it: P is "") in a private mount namespace with
    its own /run and /dev. Without /run/simulated-nvml it reads that namespace's
    /proc/driver (this host's: no NVIDIA module) and answers 9; with the machine's
    proc/driver bound there read-only it answers for the machine's GPUs, GPU 1 lost, and
    delivers an Xid to GPU 3 from the GPU's xid-events there; without /dev/nvidiactl in
    the caller's /dev it answers 9 even so. The devices reading is read there too and
    looks at the caller's own /dev: under ``skip`` a container given GPU 0's node alone
    sees GPU 0 alone (and none without GPU nodes: 9), under ``deny`` four GPUs of which
    only GPU 0 answers."""
    why = _namespace_unavailable()
    if why is not None:
        pytest.skip(why)
    m = machine
    simnvml.lose_gpu(m, 1)
    name = f"libnvidia-ml.so.{m.version}"
    lib = tmp_path / "driver-root" / "lib" / "x86_64-linux-gnu" / name
    lib.parent.mkdir(parents=True)
    shutil.copy2(m.lib_dir / name, lib)
    probe = tmp_path / "probe.py"
    probe.write_text(_NVML_PROBE)

    def run(state: bool, ctl: bool, xid_to: int | None = None,
            gpus: tuple[int, ...] = ()) -> dict[str, Any]:
        nodes = " ".join([*(["nvidiactl"] if ctl else []), *(f"nvidia{n}" for n in gpus)])
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                _CONTAINER_SETUP, "setup", str(m.root), "state" if state else "-",
                nodes or "-", sys.executable, str(probe), str(lib)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            if first == "registered\n" and xid_to is not None:
                simnvml.deliver_xid(m, xid_to, 45)
            rest, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        result: dict[str, Any] = json.loads((first + rest).splitlines()[-1])
        return result

    assert run(state=False, ctl=True) == {"init": 9}
    seen = run(state=True, ctl=True, xid_to=3)
    healthy = [u for i, u in enumerate(m.nvml_gpus) if i != 1]
    assert seen == {"init": 0, "uuids": healthy, "by_index": [0, 15, 0, 0], "wait": 0,
                    "event": [m.nvml_gpus[3], XID_EVENT, 45]}
    assert run(state=True, ctl=False) == {"init": 9}
    simnvml.set_devices_reading(m, "skip")
    assert len(m.nvml_gpus) == 4  # the machine's own dev/ has every node
    assert run(state=True, ctl=True, xid_to=0, gpus=(0,)) == {
        "init": 0, "uuids": m.nvml_gpus[:1], "by_index": [0], "wait": 0,
        "event": [m.nvml_gpus[0], XID_EVENT, 45]}
    assert run(state=True, ctl=True) == {"init": 9}
    simnvml.set_devices_reading(m, "deny")
    assert run(state=True, ctl=True, xid_to=0, gpus=(0,)) == {
        "init": 0, "uuids": m.nvml_gpus[:1], "by_index": [0, 4, 4, 4], "wait": 0,
        "event": [m.nvml_gpus[0], XID_EVENT, 45]}


# ------------------------------------------------- what NVIDIA's nvidia-smi --version calls

# nvidia-smi's private table (tests/simnvml.c): the UUID it asks nvmlInternalGetExportTable for.
SMI_TABLE_UUID = bytes.fromhex("c4fe3e6cc98f6c4ea327ee696e12f7c4")
LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND, INSUFFICIENT_SIZE = 12, 13, 7
_CUDA_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.nvmlInit_v2() == 0
version = ctypes.c_int(-1)
print(lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)), version.value)
"""


def cuda_driver_version(m: simgpu.SimMachine, library_path: Path | None) -> tuple[int, int]:
    """(code, version) of nvmlSystemGetCudaDriverVersion_v2 in a process whose dynamic
    linker looks in ``library_path`` first (LD_LIBRARY_PATH; read at its start)."""
    env = {"PATH": "/usr/bin:/bin"}
    if library_path is not None:
        env["LD_LIBRARY_PATH"] = str(library_path)
    proc = subprocess.run([sys.executable, "-c", _CUDA_PROBE, str(m.lib_dir / "libnvidia-ml.so.1")],
                          capture_output=True, text=True, env=env, timeout=30, check=True)
    code, version = proc.stdout.split()
    return int(code), int(version)


def libcuda(directory: Path, body: str) -> Path:
    """A libcuda.so.1 in ``directory`` with ``body`` as its C source."""
    directory.mkdir()
    source = directory / "cuda.c"
    source.write_text(body)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(directory / "libcuda.so.1"), str(source)], check=True)
    return directory


def test_the_calls_of_nvidia_smi_version_answer_as_nvml_h_says(
        machine: simgpu.SimMachine, tmp_path: Path) -> None:
    """nvmlSystemGetNVMLVersion, nvmlSystemGetDriverVersion,
    nvmlSystemGetCudaDriverVersion_v2 and NVIDIA's private nvmlInternalGetExportTable,
    as Debian's 535.309.01 and 550.163.01 answer them (ctypes, no GPU) and nvml.h lists:
    the NVML version "12.<driver>" before init too, a buffer one byte short 7, NULL 2;
    the driver version only after init; the CUDA version 1 before init, then what the
    libcuda.so.1 the dynamic linker finds says (none 12, no cuDriverGetVersion 13, a
    failing one 999); nvidia-smi's table (its size field alone), before init too, and 2
    for another UUID or a NULL argument."""
    lib: Any = ctypes.CDLL(str(machine.lib_dir / "libnvidia-ml.so.1"))
    text = f"12.{machine.version}"
    buf = ctypes.create_string_buffer(80)
    assert lib.nvmlSystemGetNVMLVersion(buf, 80) == SUCCESS and buf.value == text.encode()
    assert lib.nvmlSystemGetNVMLVersion(buf, len(text)) == INSUFFICIENT_SIZE
    assert lib.nvmlSystemGetNVMLVersion(ctypes.create_string_buffer(80), len(text) + 1) == SUCCESS
    assert lib.nvmlSystemGetNVMLVersion(None, 80) == INVALID
    assert lib.nvmlSystemGetDriverVersion(buf, 80) == UNINITIALIZED
    version = ctypes.c_int(-1)
    assert lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)) == UNINITIALIZED
    assert lib.nvmlSystemGetCudaDriverVersion_v2(None) == UNINITIALIZED
    table = ctypes.c_void_p()
    assert lib.nvmlInternalGetExportTable(ctypes.byref(table), SMI_TABLE_UUID) == SUCCESS
    assert table.value and ctypes.c_uint64.from_address(table.value).value == 8
    assert lib.nvmlInternalGetExportTable(ctypes.byref(table), bytes(16)) == INVALID
    assert lib.nvmlInternalGetExportTable(None, SMI_TABLE_UUID) == INVALID
    assert lib.nvmlInit_v2() == SUCCESS
    assert lib.nvmlSystemGetDriverVersion(buf, 80) == SUCCESS
    assert buf.value == machine.version.encode()
    assert lib.nvmlSystemGetDriverVersion(buf, len(machine.version)) == INSUFFICIENT_SIZE
    assert lib.nvmlSystemGetCudaDriverVersion_v2(None) == INVALID
    assert lib.nvmlShutdown() == SUCCESS

    stub = libcuda(tmp_path / "stub", "int cuInit(unsigned flags) { return 0; }\n")
    assert cuda_driver_version(machine, stub) == (FUNCTION_NOT_FOUND, -1)
    cuda = libcuda(tmp_path / "cuda",
                   "int cuDriverGetVersion(int *v) { *v = 12040; return 0; }\n")
    assert cuda_driver_version(machine, cuda) == (SUCCESS, 12040)
    failing = libcuda(tmp_path / "failing", "int cuDriverGetVersion(int *v) { return 3; }\n")
    assert cuda_driver_version(machine, failing) == (UNKNOWN, -1)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # this host has no libcuda.so.1 of its own (a host with a GPU may)
        assert cuda_driver_version(machine, None) == (LIBRARY_NOT_FOUND, -1)
