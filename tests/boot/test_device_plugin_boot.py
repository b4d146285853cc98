"""NVIDIA's real device plugin (v0.20.0) on the booted node, as its DaemonSet runs it
(issue 32, points 2 and 4): Debian trixie's containerd, the machine's own kubelet.service
playing kubelet, the plugin in a container through CRI.

* **kubelet.** The machine's kubelet.service runs tests/boot/guestkubelet.py (installed
  as /usr/local/bin/kubelet, with Debian's python3-grpcio and python3-protobuf, which
  tests/cri.py's tree installs). The product's drop-ins make kubelet Require and follow
  the setup, so `systemctl restart unbounded-nvidia-setup` stops and starts it, and at
  each start it creates /var/lib/kubelet/device-plugins/kubelet.sock again, as a real
  kubelet does. The test reads what it saw (registrations, ListAndWatch) and asks it for
  Allocate through files under /run/test-kubelet (:class:`GuestKubelet`).
* **The plugin.** A container through CRI (:class:`PluginDaemon`), the image made from
  local files (tests/pluginimage.py), with the DaemonSet's settings for this root
  (:data:`PLUGIN_ARGS`, :data:`PLUGIN_ENV`, :func:`plugin_mounts`). It gets its device
  nodes as a CDI device from the product's own spec, ``nvidia.com/gpu=all`` (see
  :data:`PLUGIN_CDI`). When it exits, the test's loop creates its next attempt in the
  same sandbox, as kubelet's restart policy does (after 1 s, not kubelet's back-off).
* **A pod through the plugin.** Allocate (through the guest's kubelet) gives CDI device
  names; they go to containerd in ContainerConfig's CDI devices, as kubelet hands them.

Marked ``device_plugin``: deselected unless UNB_TEST_DEVICE_PLUGIN names the plugin.
Every wait is bounded; the pods are removed before the machine powers off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pluginimage

import cri
import elfbuild
import pod
import realdriver
import simnvml
import toolkit
from .harness import (
    GUEST_PROC_DRIVER,
    KUBELET,
    SETUP,
    check_json,
    host_command,
    record_timing,
    snapshot,
    sync_proc_driver,
    us,
)
from .nspawn import Machine, now_us, wait_until
from .test_boot import CHECK as CHECK_UNIT
from .test_cri import (  # noqa: F401  (cri_node: the fixture)
    DRIVER_ROOT,
    GPU,
    MA,
    PLUGIN_KIND,
    PLUGIN_SPEC,
    POD_TIMEOUT,
    SLEEPER,
    CriNode,
    boot_ready,
    cri_node,
    fetch,
    probe,
    upgrade_staging,
    watch_gate,
)
from nvplugin import edits, host_paths

pytestmark = [pytest.mark.device_plugin]

GUEST_KUBELET = Path(__file__).with_name("guestkubelet.py")
KUBELET_HOME = "/run/test-kubelet"
DESCRIPTORS = "/usr/local/lib/unb-test-kubelet/api.desc"
PLUGIN_REF = "localhost/unb-nvidia-device-plugin:v0.20.0"
GUEST_PLUGIN_IMAGE = "/var/lib/unb-test-plugin-image/plugin.tar"
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"
RESOURCE = "nvidia.com/gpu"
WAIT = 60.0
POLL = 0.1  # seconds between looks at what a wait waits for
RESTART_DELAY = 1.0
MOUNT_FAILURE = "failed to fulfil mount request"

# NVIDIA's chart for a driver root at /run/nvidia/driver with nvidiaDevRoot=/ and the
# cdi-cri strategy: its flags and environment.
PLUGIN_ARGS = ["--device-list-strategy=cdi-cri", f"--nvidia-driver-root={DRIVER_ROOT}",
               "--container-driver-root=/driver-root",
               "--nvidia-cdi-hook-path=/usr/bin/nvidia-cdi-hook"]
PLUGIN_ENV = {"NVIDIA_DRIVER_ROOT": DRIVER_ROOT, "CONTAINER_DRIVER_ROOT": "/driver-root",
              "NVIDIA_DEV_ROOT": "/", "DEVICE_LIST_STRATEGY": "cdi-cri"}
# The chart's container gets every NVIDIA node through NVIDIA's runtime
# (NVIDIA_VISIBLE_DEVICES=all). Here runc alone runs it, so it asks for our spec's `all`
# device, which gives exactly the NVIDIA nodes as that does (privileged would give it
# every node of the machine). How it differs: our spec must exist before the plugin's
# container is created (containerd refuses an unknown CDI device: the setup gates
# containerd, so it does on this node), and the spec's driver libraries are mounted
# into the container and its hooks run there. NVIDIA's runtime injects the libraries of
# its default capabilities (utility, compute) too; measured here (b): when /driver-root
# lacks NVML, the plugin loads this injected copy instead of failing on its flags.
PLUGIN_CDI = GPU


def plugin_mounts() -> list[tuple[str, str, bool]]:
    """(container path, host path, read-only): the DaemonSet's hostPath volumes, and
    one that a real node does not need: the machine's /proc/driver at
    /run/simulated-nvml. runc gives a container a fresh /proc, in which this host's
    kernel lists no NVIDIA module, so the simulated NVML (tests/simnvml.c) reads the
    machine's module files there; a real NVML talks to the kernel through the nodes."""
    return [("/driver-root", DRIVER_ROOT, True),
            (DEVICE_PLUGINS, DEVICE_PLUGINS, False),
            ("/var/run/cdi", "/var/run/cdi", False),
            ("/run/simulated-nvml", "/proc/driver", True)]


# -- the machine's kubelet ------------------------------------------------------------------


@pytest.fixture(scope="session")
def descriptors(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """tests/deviceplugin/api.proto as a FileDescriptorSet (the host's protoc)."""
    from grpc_tools import protoc

    from kubelet import PROTO
    out = tmp_path_factory.mktemp("dp-desc") / "api.desc"
    code = protoc.main(["grpc_tools.protoc", f"-I{PROTO.parent}",
                        f"--descriptor_set_out={out}", str(PROTO)])
    assert code == 0, f"protoc failed ({code})"
    return out.read_bytes()


def install(cn: CriNode, desc: bytes) -> None:
    """Before the boot: the guest kubelet as the kubelet unit's program, its
    descriptors, and the plugin's image archive in the machine."""
    root = cn.node.rootfs
    binary = toolkit.plugin_binary()
    assert binary is not None
    kubelet = root / "usr/local/bin/kubelet"
    kubelet.unlink()
    shutil.copyfile(GUEST_KUBELET, kubelet)
    kubelet.chmod(0o755)
    (root / DESCRIPTORS.lstrip("/")).parent.mkdir(parents=True)
    (root / DESCRIPTORS.lstrip("/")).write_bytes(desc)
    image = root / GUEST_PLUGIN_IMAGE.lstrip("/")
    image.parent.mkdir(parents=True)
    shutil.copyfile(pluginimage.plugin_archive(binary, toolkit.NVIDIA_CDI_HOOK, PLUGIN_REF), image)


class GuestKubelet:
    """The host's side of tests/boot/guestkubelet.py in machine ``m``."""

    def __init__(self, m: Machine) -> None:
        self.m = m

    def path(self, rel: str) -> Path:
        return Path(f"/proc/{self.m.leader}/root{KUBELET_HOME}/{rel}")

    def state(self) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = json.loads(self.path("state.json").read_text())
            return doc
        except (FileNotFoundError, ValueError):
            return {}

    def wait_started(self, after_us: int = 0) -> dict[str, Any]:
        """Its state once a kubelet started after ``after_us`` serves kubelet.sock."""
        return wait_until(lambda: (s := self.state()).get("socket_mono_us") and
                          s["started_mono_us"] > after_us and s, timeout=WAIT, interval=POLL,
                          what="the guest kubelet serving",
                          describe=lambda: str(self.m.states(KUBELET)))

    def wait_registration(self, after_us: int = 0, timeout: float = WAIT) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            regs = [r for r in self.state().get("registrations", []) if r["mono_us"] > after_us]
            return regs[-1] if regs else None
        return wait_until(found, timeout=timeout, interval=POLL,
                          what="a registration with the guest kubelet",
                          describe=lambda: str(self.state()))

    def wait_devices(self, until: Callable[[dict[str, str]], bool], after_us: int = 0,
                     timeout: float = WAIT) -> dict[str, str]:
        """The latest ListAndWatch list of a stream opened after ``after_us``, once
        ``until`` holds for it."""
        def found() -> dict[str, str] | None:
            watches = [w for w in self.state().get("watches", []) if w["mono_us"] > after_us]
            if watches and watches[-1]["lists"]:
                devices: dict[str, str] = watches[-1]["lists"][-1]["devices"]
                return devices if until(devices) else None
            return None
        return wait_until(found, timeout=timeout, interval=POLL, what="ListAndWatch as awaited",
                          describe=lambda: str(self.state()))

    def ask(self, request: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        name = f"{uuid.uuid4().hex}.json"
        tmp = self.path(f"requests/.{name}")
        tmp.write_text(json.dumps(request))
        os.replace(tmp, self.path(f"requests/{name}"))
        answer = self.path(f"answers/{name}")
        wait_until(answer.exists, timeout=timeout, interval=POLL,
                   what=f"the guest kubelet's answer to {request}")
        doc: dict[str, Any] = json.loads(answer.read_text())
        return doc

    def allocate(self, ids: list[str]) -> dict[str, Any]:
        answer = self.ask({"op": "allocate", "ids": ids})
        assert "error" not in answer, answer
        return answer


# -- the plugin's DaemonSet -----------------------------------------------------------------


class PluginDaemon:
    """NVIDIA's plugin as its DaemonSet's pod on machine ``m``: one sandbox, the
    container created again (attempt + 1) whenever it exited (:data:`RESTART_DELAY`)."""

    NAME = "nvidia-device-plugin-ctr"

    def __init__(self, m: Machine) -> None:
        assert m.leader is not None
        self.m = m
        self.c = cri.Cri(m.leader)
        self.sandbox: tuple[str, Any] | None = None
        self.ctr: cri.Container | None = None
        self.attempt = -1
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="plugin daemon")

    def _note(self, event: str, **more: Any) -> None:
        self.events.append({"event": event, "mono_us": now_us(), "attempt": self.attempt,
                            **more})

    def start(self) -> None:
        self.sandbox = self.c.run_pod("nvidia-device-plugin")
        with self._lock:
            self._create()
        self._thread.start()

    def _create(self) -> None:
        assert self.sandbox is not None
        pb = self.c.pb
        self.attempt += 1
        self._note("creating")
        sid, sconfig = self.sandbox
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=self.NAME, attempt=self.attempt),
            image=pb.ImageSpec(image=PLUGIN_REF),
            command=["/usr/bin/nvidia-device-plugin"], args=PLUGIN_ARGS,
            envs=[pb.KeyValue(key=k, value=v) for k, v in PLUGIN_ENV.items()],
            mounts=[pb.Mount(container_path=c, host_path=h, readonly=ro)
                    for c, h, ro in plugin_mounts()],
            CDI_devices=[pb.CDIDevice(name=PLUGIN_CDI)],
            log_path=f"{self.NAME}_{self.attempt}.log")
        res = self.c.call("CreateContainer", pb.CreateContainerRequest(
            pod_sandbox_id=sid, config=config, sandbox_config=sconfig))
        log = Path(f"/proc/{self.m.leader}/root{sconfig.log_directory}/"
                   f"{self.NAME}_{self.attempt}.log")
        self.ctr = cri.Container(str(res.container_id), sid, log)
        self.c.start(self.ctr)
        self._note("started", id=self.ctr.id)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with self._lock:
                    if self._stop.is_set() or self.ctr is None:
                        continue
                    st = self.c.status(self.ctr)
                    if st.state != self.c.pb.CONTAINER_EXITED:
                        continue
                    self._note("exited", code=int(st.exit_code), reason=st.reason,
                               log_tail=self.log(self.attempt)[-600:])
                self._stop.wait(RESTART_DELAY)
                with self._lock:
                    if not self._stop.is_set():
                        self._create()
            except Exception as e:  # containerd restarting: kubelet retries too
                self._note("cri-error", error=str(e)[:300])
                self.c.close()
                self.c = cri.Cri(self.m.leader)  # type: ignore[arg-type]

    def restart(self) -> None:
        """kubelet's restart of the plugin's container (the host agent's one step:
        `crictl stop` of it, or deleting the pod): stopped, then its next attempt."""
        with self._lock:
            assert self.ctr is not None
            self.c.call("StopContainer", self.c.pb.StopContainerRequest(
                container_id=self.ctr.id, timeout=10), timeout=30)
            self._note("stopped by the test")
            self._create()

    def running(self) -> bool:
        with self._lock:
            return self.ctr is not None and self.c.running(self.ctr)

    def log(self, attempt: int | None = None) -> str:
        attempts = range(self.attempt + 1) if attempt is None else [attempt]
        assert self.sandbox is not None
        base = f"/proc/{self.m.leader}/root{self.sandbox[1].log_directory}"
        out = []
        for a in attempts:
            p = Path(f"{base}/{self.NAME}_{a}.log")
            text = p.read_text(errors="replace") if p.exists() else ""
            out.append(f"--- attempt {a}\n" + "".join(cri.parse_log(text)))
        return "\n".join(out)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15)
        if self.sandbox is not None:
            self.c.remove_pod(self.sandbox[0])
        self.c.close()


# -- what the scenarios share ----------------------------------------------------------------


def spec_file(m: Machine) -> Path:
    """The plugin's spec as the host reaches it: the machine's /var/run is a link to
    /run, and an absolute link under /proc/<pid>/root resolves in the host's root."""
    assert m.leader is not None
    return Path(f"/proc/{m.leader}/root{PLUGIN_SPEC.replace('/var/run/', '/run/')}")


def spec_doc(m: Machine) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(spec_file(m).read_text())
        return doc
    except (FileNotFoundError, ValueError):
        return None


def spec_mtime_us(m: Machine) -> int:
    """The spec's mtime on CLOCK_MONOTONIC (the machine shares the host's clocks)."""
    real = spec_file(m).stat().st_mtime_ns // 1000
    return real - (time.time_ns() // 1000 - now_us())


def mounted(doc: dict[str, Any]) -> list[str]:
    return sorted({x["hostPath"] for e in edits(doc) for x in e.get("mounts", [])})


def absent(m: Machine, paths: list[str]) -> list[str]:
    """The paths that do not exist in the machine."""
    res = m.exec("python3", "-c", "import json, os, sys\n"
                 "print(json.dumps([p for p in sys.argv[1:] if not os.path.lexists(p)]))",
                 *paths)
    found: list[str] = json.loads(res.stdout)
    return found


def summary(m: Machine, version: str) -> dict[str, Any]:
    """What the plugin's spec says now: its libcuda and NVML, whether it names
    ``version``'s libcuda, and the hostPaths absent from the machine."""
    doc = spec_doc(m)
    if doc is None:
        return {"spec": None}
    libs = [os.path.basename(p) for p in mounted(doc)]
    return {"libcuda": sorted(n for n in libs if n.startswith("libcuda.so")),
            "nvml": sorted(n for n in libs if n.startswith("libnvidia-ml.so")),
            "mounts": len(libs), "names_version": f"libcuda.so.{version}" in libs,
            "absent": absent(m, host_paths(doc)), "mtime_us": spec_mtime_us(m)}


def plugin_node(cri_node: Any, desc: bytes, drv: realdriver.RealDriver,  # noqa: F811
                reading: str = "target") -> CriNode:
    cn: CriNode = cri_node(drv, nvml=True, gpus=2)
    simnvml.set_reading(cn.node.sim, reading)
    sync_proc_driver(cn.node)
    install(cn, desc)
    return cn


def up(cn: CriNode, m: Machine) -> tuple[cri.Cri, GuestKubelet]:
    c = boot_ready(cn, m)
    m.exec("ctr", "-n", cri.NAMESPACE, "images", "import", GUEST_PLUGIN_IMAGE, timeout=120)
    k = GuestKubelet(m)
    k.wait_started()
    return c, k


@contextlib.contextmanager
def plugin_up(cn: CriNode, m: Machine) -> Iterator[tuple[cri.Cri, GuestKubelet, PluginDaemon]]:
    """The booted machine's containerd and kubelet up, and the plugin's daemon (not
    started yet); on leaving, the daemon stopped and every container removed."""
    c, k = up(cn, m)
    daemon = PluginDaemon(m)
    try:
        yield c, k, daemon
    finally:
        daemon.close()
        c.remove_all()


def pod_through_plugin(c: cri.Cri, k: GuestKubelet, name: str, gpu: str) -> dict[str, Any]:
    """Allocate ``gpu`` through the machine's kubelet, then a pod given the CDI devices
    Allocate answered: the probe's report."""
    allocation = k.allocate([gpu])
    assert allocation["cdi_devices"] == [f"{PLUGIN_KIND}={gpu}"], allocation
    ex = c.run(name, ["python3", "-c", pod.PROBE], cdi=allocation["cdi_devices"],
               timeout=POD_TIMEOUT)
    return pod.Pod(ex.code, ex.stdout, ex.stderr).report()


def assert_pod_gets(report: dict[str, Any], minor: int, version: str) -> None:
    gpus = {d for d in report["devices"] if d.removeprefix("nvidia").isdigit()}
    assert gpus == {f"nvidia{minor}"} and "nvidiactl" in report["devices"], report
    gaps = [g for g in pod.missing(report, version) if g != "/dev/nvidia0 and /dev/nvidiactl"]
    assert gaps == [], report


# -- a: boot ---------------------------------------------------------------------------------


def test_a_boot_the_plugin_registers_writes_its_spec_and_a_pod_gets_its_gpu(
        cri_node: Any, descriptors: bytes) -> None:  # noqa: F811
    """a. A booted node (NVML mode, Debian's 535): the plugin's container registers with
    the machine's kubelet and lists both GPUs Healthy; its spec mounts libcuda, NVML and
    nvidia-smi from /run/nvidia/driver, every hostPath exists in the machine, `check`
    finds no plugin-spec problem; a pod allocated GPU 1 through it gets /dev/nvidia1,
    libcuda, NVML and nvidia-smi. The time from the setup's start to the spec written is
    printed."""
    drv = fetch("bookworm")
    cn = plugin_node(cri_node, descriptors, drv)
    uuids = list(cn.node.sim.nvml_gpus)
    with cn.machine() as m, plugin_up(cn, m) as (c, k, daemon):
        daemon.start()
        reg = k.wait_registration()
        assert (reg["version"], reg["endpoint"], reg["resource_name"]) == (
            "v1beta1", "nvidia-gpu.sock", RESOURCE), reg
        listed = k.wait_devices(lambda d: len(d) == len(uuids))
        assert listed == dict.fromkeys(uuids, "Healthy"), listed
        doc = wait_until(lambda: spec_doc(m), timeout=WAIT, interval=POLL,
                         what="the plugin's spec", describe=daemon.log)
        assert doc["kind"] == PLUGIN_KIND
        assert sorted(d["name"] for d in doc["devices"]) == sorted(uuids), doc
        lib = f"{DRIVER_ROOT}/lib/{MA}"
        libs = mounted(doc)
        for path in (f"{lib}/libcuda.so.{drv.version}", f"{lib}/libnvidia-ml.so.{drv.version}"):
            assert path in libs, libs
        smi = [p for p in libs if os.path.basename(p) == "nvidia-smi"]
        assert smi and all(p.startswith(DRIVER_ROOT + "/") for p in smi), libs
        assert [p for p in libs if not p.startswith((DRIVER_ROOT + "/", "/dev/"))] == [], libs
        assert absent(m, host_paths(doc)) == [], doc
        report = check_json(m)
        assert report["device_plugin_spec"]["present"] is True, report
        assert [p for p in report["problems"] if p["code"].startswith("plugin-spec-")] == \
            [], report["problems"]
        result = pod_through_plugin(c, k, "gpu-through-plugin", uuids[1])
        assert_pod_gets(result, 1, drv.version)

        snap = snapshot(m)
        setup_start = us(snap[SETUP], "ExecMainStartTimestampMonotonic")
        marks = {"setup active": us(snap[SETUP], "ActiveEnterTimestampMonotonic"),
                 "kubelet started": us(snap[KUBELET], "ExecMainStartTimestampMonotonic"),
                 "plugin container created": daemon.events[0]["mono_us"],
                 "plugin container started": daemon.events[1]["mono_us"],
                 "registered": reg["mono_us"], "spec written": spec_mtime_us(m)}
        line = ", ".join(f"{k_} +{(v - setup_start) / 1e3:.0f} ms" for k_, v in marks.items())
        gap = (marks["spec written"] - marks["plugin container created"]) / 1e3
        print(f"device plugin boot (a): from the setup's start: {line}; plugin container "
              f"created -> spec {gap:.0f} ms", flush=True)
        record_timing("device plugin boot (a)", m, snap, note=(
            f"setup start -> plugin spec {(marks['spec written'] - setup_start) / 1e3:.0f}"
            f" ms, plugin container created -> spec {gap:.0f} ms"))
        assert daemon.attempt == 0, daemon.events


# -- c: a driver upgrade ---------------------------------------------------------------------


def upgrade_to(cn: CriNode, new: realdriver.RealDriver) -> None:
    """test_cri's staging change, then the simulated NVML again in place of Debian's
    (NVML mode: the GPUs answer it; its version is its file name's)."""
    upgrade_staging(cn, new)
    for old in cn.node.sim.lib_dir.glob("libnvidia-ml.so.*"):
        if not old.is_symlink():
            old.unlink()
    elfbuild.compile_so(cn.node.sim.lib_dir / f"libnvidia-ml.so.{new.version}",
                        elfbuild.NVML_SONAME)


STALE_SPEC_EXIT = ("error starting plugins: error getting plugins: unable to create cdi spec "
                   "file: failed to get CDI spec:")


def test_c_driver_upgrade_under_the_running_plugin(
        cri_node: Any, descriptors: bytes) -> None:  # noqa: F811
    """c. The plugin runs (535); the staging goes 535 -> 550 and `systemctl restart
    unbounded-nvidia-setup` runs: the machine's kubelet restarts with it (kubelet.sock
    created again). Measured, by itself: the running plugin restarts its plugins, reads
    its stale /driver-root (the deleted generation: empty), fails to find 535's libcuda
    and NVML (NVML, loaded before, still says 535), and exits 1; kubelet's restart policy
    starts a new container with a fresh mount, which writes a spec naming 550 with every
    hostPath present, and a new pod through it starts with 550. Until then the plugin's
    spec on disk names 535's files, which are gone: a pod given its CDI device in that
    window is recorded. The host agent's step (the plugin's container restarted) is then
    taken too, and is harmless: the node still ends right, never on the incident's mount
    failure."""
    old_drv, new_drv = fetch("bookworm"), fetch("trixie")
    cn = plugin_node(cri_node, descriptors, old_drv)
    uuids = list(cn.node.sim.nvml_gpus)
    with cn.machine() as m, plugin_up(cn, m) as (c, k, daemon):
        daemon.start()
        k.wait_registration()
        k.wait_devices(lambda d: len(d) == len(uuids))
        wait_until(lambda: (s := summary(m, old_drv.version)).get("names_version") and s,
                   timeout=WAIT, interval=POLL, what="the plugin's spec naming 535",
                   describe=daemon.log)
        assert_pod_gets(pod_through_plugin(c, k, "before", uuids[1]), 1, old_drv.version)

        upgrade_to(cn, new_drv)
        t0 = now_us()
        res = host_command(m, "restart")
        assert res.returncode == 0, res.stderr
        watch_gate(m)
        kubelet_again = k.wait_started(after_us=t0)
        by_itself: dict[str, Any] = {
            "setup restarted, containerd up at_ms": (now_us() - t0) // 1000,
            "kubelet restarted at_ms": (kubelet_again["started_mono_us"] - t0) // 1000}
        # A pod given the plugin's CDI device now, before the plugin wrote again (as
        # containerd resolves it from the spec on disk): recorded, not asserted.
        window = summary(m, old_drv.version)
        if window.get("names_version"):
            try:
                ex = c.run("in-window", ["python3", "-c", pod.PROBE],
                           cdi=[f"{PLUGIN_KIND}={uuids[1]}"], timeout=POD_TIMEOUT)
                by_itself["pod in the window"] = f"started, exit {ex.code}"
            except cri.CriError as e:
                by_itself["pod in the window"] = str(e)[-500:]
        # By itself: what the plugin does in a bounded window after the restart.
        timeline: list[dict[str, Any]] = []
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            s = summary(m, new_drv.version)
            regs = [r["mono_us"] for r in k.state().get("registrations", [])
                    if r["mono_us"] > t0]
            entry = {"t_ms": (now_us() - t0) // 1000, "registrations": len(regs),
                     "plugin_attempt": daemon.attempt, "libcuda": s.get("libcuda"),
                     "absent": len(s.get("absent") or [])}
            if not timeline or {x: y for x, y in entry.items() if x != "t_ms"} != \
                    {x: y for x, y in timeline[-1].items() if x != "t_ms"}:
                timeline.append(entry)
            if regs and s.get("names_version") and not s.get("absent"):
                by_itself["healed: spec naming 550, all present, at_ms"] = \
                    (s["mtime_us"] - t0) // 1000
                break
            time.sleep(0.2)
        exits = [e for e in daemon.events if e["event"] == "exited" and e["mono_us"] > t0]
        by_itself["timeline"] = timeline
        by_itself["plugin exits"] = [
            {"attempt": e["attempt"], "code": e["code"], "at_ms": (e["mono_us"] - t0) // 1000,
             "error": e["log_tail"].rpartition("main.go:")[2][:300]} for e in exits]
        new_pod: dict[str, Any]
        try:
            report = pod_through_plugin(c, k, "after-by-itself", uuids[1])
            new_pod = {"started": True, "report": report}
        except (cri.CriError, AssertionError) as e:
            new_pod = {"started": False, "error": str(e)[:600]}
        by_itself["new pod through the plugin started"] = new_pod["started"]
        print("device plugin upgrade (c), by itself: " + json.dumps(by_itself, indent=1),
              flush=True)

        # What it did by itself, as measured (a change in the plugin shows here).
        assert [(e["attempt"], e["code"]) for e in exits] == [(0, 1)], by_itself
        assert STALE_SPEC_EXIT in exits[0]["log_tail"], exits[0]["log_tail"]
        assert f"libcuda.so.{old_drv.version}: not found" in exits[0]["log_tail"]
        assert "healed: spec naming 550, all present, at_ms" in by_itself, by_itself
        assert new_pod["started"], new_pod
        assert_pod_gets(new_pod["report"], 1, new_drv.version)

        # The host agent's step, taken anyway: harmless, the node still ends right.
        t1 = now_us()
        daemon.restart()
        k.wait_registration(after_us=t1)
        k.wait_devices(lambda d: d == dict.fromkeys(uuids, "Healthy"), after_us=t1)
        end = wait_until(lambda: (s := summary(m, new_drv.version)).get("names_version")
                         and s["mtime_us"] > t1 and s, timeout=WAIT, interval=POLL,
                         what="the spec naming 550", describe=daemon.log)
        assert end["libcuda"] == [f"libcuda.so.{new_drv.version}"], end
        assert end["nvml"] == [f"libnvidia-ml.so.{new_drv.version}"], end
        assert end["absent"] == [], end
        try:
            report = pod_through_plugin(c, k, "after-restart", uuids[1])
        except cri.CriError as e:
            assert MOUNT_FAILURE not in str(e), e
            raise
        assert_pod_gets(report, 1, new_drv.version)
        print(f"device plugin upgrade (c): after the plugin's restart: spec "
              f"{(end['mtime_us'] - t1) / 1e3:.0f} ms after the step", flush=True)


# -- d: Xids while the plugin runs -------------------------------------------------------------


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_d_xids_while_the_plugin_runs(cri_node: Any, descriptors: bytes,  # noqa: F811
                                      reading: str) -> None:
    """d. The plugin runs on two GPUs. GPU 0 reports Xid 13, which it ignores, and GPU 1
    Xid 48 (NVML still answers for it); then GPU 0 Xid 48, and GPU 1 Xid 79, falling
    off the bus (NVML answers 15 for it from its next init). The plugin marks both Unhealthy in
    ListAndWatch (it ignores only 13, 31, 43, 45, 68, 109). The product sees GPU 1 only:
    `check` still says ready (it does not ask NVML), so does the drift check's unit (as
    its timer starts it; recorded), and after the product's reload `check` names GPU 1
    lost, and never GPU 0."""
    drv = fetch("bookworm")
    cn = plugin_node(cri_node, descriptors, drv, reading)
    uuids = list(cn.node.sim.nvml_gpus)
    with cn.machine() as m, plugin_up(cn, m) as (_, k, daemon):
        # Its health checks hear an Xid only once they registered (as with a real NVML):
        # the moment each GPU's xid-events file is first opened (simnvml.XidRegistrations).
        host_files = simnvml.xid_files(cn.node.sim)
        for f in host_files:
            f.touch()
        sync_proc_driver(cn.node)
        proc_driver = cn.node.host / "proc/driver"
        guest = [cn.node.rootfs / GUEST_PROC_DRIVER.lstrip("/") / f.relative_to(proc_driver)
                 for f in host_files]
        with simnvml.XidRegistrations(guest) as registered:
            daemon.start()
            k.wait_registration()
            k.wait_devices(lambda d: d == dict.fromkeys(uuids, "Healthy"))
            registered.wait(60)
            # An Xid the plugin ignores (13, a graphics engine exception) on GPU 0, then
            # Xid 48 on GPU 1 (NVML still answers for it): the library delivers GPU 0's
            # first, so once GPU 1 is Unhealthy, GPU 0 still Healthy shows 13 ignored.
            simnvml.deliver_xid(cn.node.sim, 0, 13)
            simnvml.deliver_xid(cn.node.sim, 1, 48)
            sync_proc_driver(cn.node)
            half = {uuids[0]: "Healthy", uuids[1]: "Unhealthy"}
            assert k.wait_devices(lambda d: d == half) == half
            t0 = now_us()
            simnvml.deliver_xid(cn.node.sim, 0, 48)
            simnvml.deliver_xid(cn.node.sim, 1, 79, lose=True)
            sync_proc_driver(cn.node)
            listed = k.wait_devices(lambda d: d == dict.fromkeys(uuids, "Unhealthy"))
            state = k.state()
            marked = [x["mono_us"] for x in state["watches"][-1]["lists"]
                      if all(h == "Unhealthy" for h in x["devices"].values())]
            print(f"device plugin Xid (d): both GPUs Unhealthy in ListAndWatch "
                  f"{(marked[0] - t0) / 1e3:.0f} ms after the Xids; {listed}", flush=True)
            assert daemon.attempt == 0 and daemon.running(), daemon.log()
            before = check_json(m)
            drift = m.systemctl("start", CHECK_UNIT)
            after_drift = check_json(m)
            res = m.systemctl("reload", SETUP)
            assert res.returncode == 0, res.stdout + res.stderr
            after = check_json(m)
            seen = {"check before": (before["verdict"], [p["code"] for p in before["problems"]]),
                    "drift check unit exit": drift.returncode,
                    "check after drift check": (after_drift["verdict"],
                                                [p["code"] for p in after_drift["problems"]]),
                    "check after reload": (after["verdict"],
                                           [(p["code"], p["path"]) for p in after["problems"]])}
            print("device plugin Xid (d), the product: " + json.dumps(seen), flush=True)
            assert before["verdict"] == "ready", before
            assert after["verdict"] == "degraded", after
            # The plugin started while GPU 1 was healthy and its spec still lists it: check
            # names that too, with the step (issue 35), and the node stays degraded.
            assert [(p["code"], p["path"]) for p in after["problems"]] == [
                ("gpu-lost", "/dev/nvidia1"),
                ("plugin-spec-unusable-gpu", PLUGIN_SPEC)], \
                after["problems"]
            plugin = after["problems"][1]["message"]
            assert "/dev/nvidia1" in plugin and "restart the device plugin" in plugin, plugin
            # The plugin, still running, still lists both Unhealthy (until its plugins restart).
            assert k.wait_devices(lambda d: True) == dict.fromkeys(uuids, "Unhealthy")


# -- e: a lost GPU at the plugin's start --------------------------------------------------------


LOST_GPU_ERROR = ("error starting plugins: error getting plugins: unable to create plugins: "
                  "failed to construct resource managers: error building device map: error "
                  "building device map from config.resources: error building GPU device map: "
                  "error getting device handle for index '1': GPU is lost")


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_e_a_lost_gpu_at_the_plugins_start(cri_node: Any, descriptors: bytes,  # noqa: F811
                                           reading: str) -> None:
    """e. Three GPUs, GPU 1 lost before the boot: the product comes up degraded and its
    spec serves GPUs 0 and 2, but NVIDIA's plugin exits 1 at every start (kubelet
    restarting it), never registers and writes no spec: on this node pods get no GPU
    through it. What `check`, STATUS= and the restarts show is printed."""
    drv = fetch("bookworm")
    cn: CriNode = cri_node(drv, nvml=True, gpus=3, lost=[1])
    simnvml.set_reading(cn.node.sim, reading)
    sync_proc_driver(cn.node)
    install(cn, descriptors)
    with cn.machine() as m, plugin_up(cn, m) as (_, k, daemon):
        t0 = now_us()
        daemon.start()
        wait_until(lambda: len([e for e in daemon.events if e["event"] == "exited"]) >= 3,
                   timeout=WAIT, interval=POLL, what="three exits of the plugin",
                   describe=daemon.log)
        exits = [e for e in daemon.events if e["event"] == "exited"]
        firsts = [(e["mono_us"] - t0) // 1000 for e in exits]
        print(f"device plugin lost GPU (e): exits at {firsts} ms after the first start "
              f"(restart delay {RESTART_DELAY} s here; kubelet backs off 10 s, 20 s, ... "
              "to 5 min: CrashLoopBackOff)", flush=True)
        for e in exits:
            assert e["code"] == 1, e
            assert e["log_tail"].rstrip().endswith(LOST_GPU_ERROR), e["log_tail"]
        assert k.state().get("registrations") == [], k.state()
        assert spec_doc(m) is None
        report = check_json(m)
        status = m.prop(SETUP, "StatusText")
        shown = m.exec("/usr/bin/unbounded-nvidia-setup", "status", check=False).stdout
        print("device plugin lost GPU (e), the product: " + json.dumps({
            "status": [ln for ln in shown.splitlines() if ln.startswith(("Device", "GPUs"))],
            "verdict": report["verdict"],
            "problems": [p["message"] for p in report["problems"]],
            "device_plugin_spec": report.get("device_plugin_spec"), "STATUS": status}),
            flush=True)
        assert report["verdict"] == "degraded", report
        # What the operator reads (issues 32, 4e and 35): our spec serves 2 of 3, and
        # the plugin wrote no spec; what the plugin does is never predicted.
        assert "Device plugin:  no spec\n" in shown, shown
        assert status.startswith("Ready (degraded): the spec serves 2 of 3 GPUs"), status
        assert "device plugin" not in status, status
        lost, = report["problems"]
        assert "device plugin" not in lost["message"], lost


# -- b: the incident, with its own component ---------------------------------------------------


@pytest.mark.parametrize("links", [("libcuda.so", "libnvidia-ml.so"), ("libcuda.so",),
                                   ("libnvidia-ml.so",)], ids=["both", "libcuda", "nvml"])
def test_b_the_older_agents_root_under_the_plugin(
        cri_node: Any, descriptors: bytes, links: tuple[str, ...]) -> None:  # noqa: F811
    """b. The older agent's root: ``links`` in /run/nvidia/driver as absolute
    links into /run/host-nvidia/0, which the machine sees (its containerd mounts them for
    our spec) but the plugin's container, given /run/nvidia/driver alone, does not. What
    the plugin writes or fails to write, what `check` says, and what a pod through the
    plugin meets are printed and asserted as measured: with both links the plugin exits 1
    at every start (no spec); with one, it registers and writes the incident's spec
    without that library, `check` says plugin-spec-missing-library of it, and a pod
    through the plugin lacks it; without NVML, nvidia-smi in the pod says the incident's
    "couldn't find libnvidia-ml.so"."""
    drv = fetch("bookworm")
    cn = plugin_node(cri_node, descriptors, drv)
    uuids = list(cn.node.sim.nvml_gpus)
    with cn.machine() as m, plugin_up(cn, m) as (c, k, daemon):
        libdir = f"{DRIVER_ROOT}/lib/{MA}"
        for stem in links:
            name = f"{stem}.{drv.version}"
            m.exec("ln", "-sf", f"/run/host-nvidia/0/{name}", f"{libdir}/{name}")
        daemon.start()
        outcome = wait_until(
            lambda: ("registered" if k.state().get("registrations") and spec_doc(m)
                     else "exited" if any(e["event"] == "exited" for e in daemon.events)
                     else None), timeout=WAIT, interval=POLL,
            what="the plugin registering or exiting", describe=daemon.log)
        seen: dict[str, Any] = {"plugin": outcome}
        if outcome == "exited":
            seen["exit"] = next(e["log_tail"][-400:] for e in daemon.events
                                if e["event"] == "exited")
        else:
            doc = spec_doc(m)
            assert doc is not None
            names = [os.path.basename(p) for p in mounted(doc)]
            seen["spec libcuda"] = [n for n in names if n.startswith("libcuda.so")]
            seen["spec nvml"] = [n for n in names if n.startswith("libnvidia-ml.so")]
            seen["spec mounts"] = len(names)
        report = check_json(m)
        seen["check"] = (report["verdict"], sorted({p["code"] for p in report["problems"]}))
        seen["check plugin-spec"] = [p["message"] for p in report["problems"]
                                     if p["code"].startswith("plugin-spec-")]
        if outcome == "registered":
            try:
                result = pod_through_plugin(c, k, "incident-pod", uuids[1])
                seen["pod nvidia-smi"] = result["nvidia_smi"]
                seen["pod gaps"] = pod.missing(result, drv.version)
            except cri.CriError as e:
                seen["pod"] = str(e)[-400:]
        print(f"device plugin incident (b, {'+'.join(links)}): " + json.dumps(seen, indent=1),
              flush=True)
        # As measured: NVML loads (the plugin's container has it from our spec's
        # `all` device) and names the driver's version; the spec generation looks for
        # that version's libcuda, then NVML, under /driver-root.
        assert {"root-absolute-link", "root-escaping-link"} <= set(seen["check"][1]), seen
        if links == ("libcuda.so", "libnvidia-ml.so"):
            assert outcome == "exited", seen
            assert f'failed to locate "libcuda.so.": libcuda.so.{drv.version}: not found' \
                in seen["exit"], seen
            assert seen["check plugin-spec"] == [], seen
            return
        assert outcome == "registered", seen
        lost = links[0]
        kept = "libnvidia-ml.so" if lost == "libcuda.so" else "libcuda.so"
        key = {"libcuda.so": "spec libcuda", "libnvidia-ml.so": "spec nvml"}
        assert seen[key[lost]] == [] and seen[key[kept]] == [f"{kept}.{drv.version}"], seen
        assert len(seen["check plugin-spec"]) == 1, seen
        assert f"does not mount {lost}.{drv.version}" in seen["check plugin-spec"][0], seen
        if lost == "libcuda.so":
            assert seen["pod gaps"] == ["/dev/nvidia0 and /dev/nvidiactl",
                                        "libcuda.so.1 in the linker cache",
                                        "cuInit answering a CUDA error code"], seen
        else:  # the incident's pod: nvidia-smi cannot find NVML
            assert pod.SMI_NO_NVML in seen["pod nvidia-smi"][1], seen
            assert seen["pod gaps"] == ["/dev/nvidia0 and /dev/nvidiactl",
                                        "libnvidia-ml.so.1 in the linker cache",
                                        "nvmlInit_v2 answering 9",
                                        "nvidia-smi loading NVML"], seen
