"""The node as it runs: Debian trixie's real containerd (1.7) and runc in the boot
suite's machine, gated by our drop-in, start GPU pods through CRI as kubelet does, on
the real NVIDIA userspace from Debian (535, and 550 for the upgrade). Issue 23.

tests/cri.py builds the machine and is the CRI client; the pods' images come from the
host's own files (tests/images.py). Every boot, wait and CRI call is bounded; a pod that
cannot start fails with containerd's own message (CriError). Timings are printed
(``pytest -s``) and kept in the boot timings summary.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import cri
import pod
import realdriver
import simgpu
import simnvml
import toolkit
from .harness import (
    CONTAINERD,
    GUEST_PROC_DRIVER,
    KUBELET,
    NODE_UNITS,
    SETUP,
    Node,
    check_json,
    destroy_node,
    host_command,
    is_active,
    new_node_on,
    record_timing,
    require,
    snapshot,
    sync_proc_driver,
    us,
)
from .nspawn import Bind, Machine, now_us
from .test_boot import CHECK as CHECK_UNIT
from .test_boot import METRICS, SPEC, metric_values
from realmachine import use_real_driver

MA = "x86_64-linux-gnu"
DRIVER_ROOT = "/run/nvidia/driver"
SOCKET = cri.SOCKET
GPU = "nvidia.com/gpu=all"
PLUGIN_KIND = "k8s.device-plugin.nvidia.com/gpu"
PLUGIN_SPEC = "/var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"
UP_TIMEOUT = 60.0
POD_TIMEOUT = 60.0
SLEEPER = ["python3", "-c", "import signal, sys\n"
           "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
           "while True: signal.pause()"]


def fetch(suite: str) -> realdriver.RealDriver:
    try:
        return realdriver.fetch_real_driver("amd64", suite=suite)
    except realdriver.RealDriverUnavailable as e:
        require(False, f"real NVIDIA files ({suite}) unavailable: {e}")
        raise


@dataclass
class CriNode:
    node: Node
    state: Path  # host dir bound at the guest's /var/lib/containerd
    images: Path
    clients: list[cri.Cri]

    def machine(self) -> Machine:
        binds = [*self.node.binds(), Bind(self.state, "/var/lib/containerd"),
                 Bind(self.images, cri.GUEST_IMAGES, read_only=True)]
        m = Machine(self.node.rootfs, binds=binds, log_dir=self.node.log_dir,
                    extra_args=cri.NSPAWN_ARGS)
        self.node.machines.append(m)
        return m

    def client(self, m: Machine) -> cri.Cri:
        assert m.leader is not None
        c = cri.Cri(m.leader)
        self.clients.append(c)
        return c


@pytest.fixture
def cri_node(tmp_path: Path, product_deb: Path) -> Iterator[Any]:
    """``cri_node(driver, nvml=False, gpus=2, lost=(), **config)`` -> :class:`CriNode`
    (``harness.new_node``: ``nvml``, nvidia-ctk's default mode with the simulated NVML
    in place of Debian's; ``gpus`` GPUs, those at the minors ``lost`` lost before the
    boot); pods removed, machines stopped and rootfs removed afterwards."""
    why = cri.client_missing()
    require(why is None, str(why))
    try:
        lower = cri.ensure_tree()
        archives = cri.image_archives()
    except (cri.CriUnavailable, OSError, RuntimeError) as e:
        require(False, f"no containerd machine: {e}")
        raise
    made: list[CriNode] = []

    def factory(driver: realdriver.RealDriver, *, nvml: bool = False, gpus: int = 2,
                lost: Sequence[int] = (), **config: object) -> CriNode:
        base = tmp_path / f"node{len(made)}"
        node = new_node_on(lower, base, product_deb, driver=driver, nvml=nvml, gpus=gpus,
                           lost=lost, config=config)
        state = base / "containerd-state"
        state.mkdir()
        cn = CriNode(node, state, archives, [])
        made.append(cn)
        return cn

    try:
        yield factory
    finally:
        errors = []
        for cn in made:
            for c in cn.clients:
                try:
                    c.remove_all()
                except Exception as e:  # the machine may be gone already
                    errors.append(f"removing pods: {e}")
                c.close()
            errors += destroy_node(cn.node)
        assert not [e for e in errors if "removing pods" not in e], errors


# -- what the scenarios share ----------------------------------------------------------------


def socket_present(m: Machine) -> bool:
    assert m.leader is not None
    return os.path.exists(f"/proc/{m.leader}/root{SOCKET}")


def watch_gate(m: Machine, timeout: float = UP_TIMEOUT) -> list[tuple[str, bool]]:
    """Sample (setup state, containerd socket present) until containerd is active; fails
    at once on a sample with the socket there before the setup is active."""
    samples: list[tuple[str, bool]] = []

    def up() -> bool:
        state, present = m.active_state(SETUP), socket_present(m)
        samples.append((state, present))
        assert not (present and state != "active"), f"containerd socket with setup {state}"
        return state == "active" and m.is_active(CONTAINERD) and present

    m.wait_until(up, timeout=timeout, what="containerd's socket after the setup",
                 interval=0.05, units=NODE_UNITS)
    return samples


def assert_socket_after_ready(m: Machine, status: str = "Ready") -> None:
    """The socket's inode was made after the setup became active (it did not exist
    before), and containerd's process started after that too; the setup's STATUS=
    says ``status`` ("Up without GPUs" on a node that serves none)."""
    assert m.leader is not None
    born_us = os.stat(f"/proc/{m.leader}/root{SOCKET}").st_mtime_ns // 1000
    snap = snapshot(m, SETUP, CONTAINERD)
    ready_mono = us(snap[SETUP], "ActiveEnterTimestampMonotonic")
    assert 0 < ready_mono <= us(snap[CONTAINERD], "ExecMainStartTimestampMonotonic"), snap
    ready_real = time.time_ns() // 1000 - (now_us() - ready_mono)  # the same instant
    assert born_us >= ready_real, f"socket made {(ready_real - born_us) / 1000:.0f} ms " \
        "before the setup was active"
    assert status in snap[SETUP]["StatusText"], snap[SETUP]


def import_images(m: Machine) -> None:
    for name in ("pause", "probe"):
        m.exec("ctr", "-n", cri.NAMESPACE, "images", "import", f"{cri.GUEST_IMAGES}/{name}.tar",
               timeout=60)


def probe(c: cri.Cri, name: str, device: str) -> dict[str, Any]:
    """The probe in a pod asking CRI for ``device``: its report (fails with the pod's
    output when it did not exit 0)."""
    ex = c.run(name, ["python3", "-c", pod.PROBE], cdi=[device], timeout=POD_TIMEOUT)
    return pod.Pod(ex.code, ex.stdout, ex.stderr).report()


def boot_ready(cn: CriNode, m: Machine, status: str = "Ready") -> cri.Cri:
    watch_gate(m)
    assert_socket_after_ready(m, status)
    import_images(m)
    return cn.client(m)


def container_pid(c: cri.Cri, ctr: cri.Container) -> int:
    res = c.call("ContainerStatus", c.pb.ContainerStatusRequest(container_id=ctr.id,
                                                                 verbose=True))
    return int(json.loads(res.info["info"])["pid"])


def timed(what: str, start: float) -> None:
    print(f"cri scenario {what}: {time.monotonic() - start:.1f} s", flush=True)


# -- a, b: a cold boot, our spec and the device plugin's --------------------------------------


def test_cold_boot_gpu_pods_through_cri(cri_node: Any) -> None:
    """a. containerd's socket appears only after the setup is Ready; a pod asking CRI for
    nvidia.com/gpu=all gets the driver (pod.missing). b. The device plugin's spec,
    generated in the machine from the driver root alone with the staging hidden, in
    /var/run/cdi: a pod asking for k8s.device-plugin.nvidia.com/gpu=all gets it too."""
    start = time.monotonic()
    drv = fetch("bookworm")
    cn = cri_node(drv)
    with cn.machine() as m:
        c = boot_ready(cn, m)
        assert "containerd" in c.version()
        report = probe(c, "gpu-a", GPU)
        assert pod.missing(report, drv.version) == [], report
        record_timing("cri cold boot (a)", m, snapshot(m))
        # b: the plugin's own generation, the staging hidden in its mount namespace
        gen = [str(Path("/usr/bin") / toolkit.NVIDIA_CTK.name), "cdi", "generate",
               f"--driver-root={DRIVER_ROOT}", "--dev-root=/", "--mode=management",
               "--vendor=k8s.device-plugin.nvidia.com", "--class=gpu",
               f"--output={PLUGIN_SPEC}"]
        m.exec("mkdir", "-p", "/var/run/cdi")
        m.exec("unshare", "--mount", "--propagation", "private", "sh", "-c",
               "mount -t tmpfs none /run/host-nvidia && exec \"$@\"", "sh", *gen)
        spec = m.read_text(PLUGIN_SPEC)
        assert json.loads(spec)["kind"] == PLUGIN_KIND
        assert "/run/host-nvidia" not in spec and f"libcuda.so.{drv.version}" in spec, spec
        report = probe(c, "gpu-b", f"{PLUGIN_KIND}=all")
        assert pod.missing(report, drv.version) == [], report
        c.remove_all()
    timed("a+b (cold boot, our spec, the plugin's spec)", start)


# -- c: late staging ---------------------------------------------------------------------------


def test_late_staging_containerd_socket_waits(cri_node: Any) -> None:
    """c. The library staging is empty at boot: the setup retries, containerd's socket is
    absent; once the staging is filled, the setup finishes and only then the socket
    appears; a GPU pod gets the driver."""
    start = time.monotonic()
    drv = fetch("bookworm")
    cn = cri_node(drv, staging_wait_seconds=2)
    late = cn.node.host / "late-staging-0"
    late.mkdir()
    full = cn.node.staging["0"]
    cn.node.staging["0"] = late
    with cn.machine() as m:
        m.wait_until(lambda: int(m.prop(SETUP, "NRestarts") or 0) >= 1, timeout=UP_TIMEOUT,
                     what="the setup retrying on the empty staging", units=NODE_UNITS)
        assert m.active_state(SETUP) == "activating"
        assert m.active_state(CONTAINERD) == "inactive"
        assert not socket_present(m)
        # What the operator and the host agent see meanwhile (this replaces the stand-in
        # containerd's late-staging boot test): STATUS= names the empty staging, the
        # start jobs of containerd and kubelet wait, the unit is "activating", and
        # check's verdict is "not ready yet" (no root, but the unit is still trying).
        # (STATUS= is empty between two attempts: wait for one that is waiting.)
        m.wait_until(lambda: "/run/host-nvidia/0" in m.prop(SETUP, "StatusText")
                     and "staging" in m.prop(SETUP, "StatusText"), timeout=UP_TIMEOUT,
                     what="STATUS= naming the empty staging", units=NODE_UNITS)
        m.wait_until(lambda: any("Status:" in ln and "staging" in ln for ln in
                                 m.systemctl("status", SETUP).stdout.splitlines()),
                     timeout=UP_TIMEOUT, what="`systemctl status` naming the staging",
                     units=NODE_UNITS)
        jobs = m.systemctl("list-jobs", "--plain", "--no-legend").stdout
        assert CONTAINERD in jobs and KUBELET in jobs, jobs
        assert is_active(m) == "activating"
        report = check_json(m)
        assert report["verdict"] == "not-ready-yet", report
        assert report["unit"]["active_state"] == "activating", report
        # The staging the node waits for first; the root it will build pending (issue 36).
        assert report["problems"][0]["code"] == "staging-missing", report
        assert "root-missing" in {p["code"] for p in report["pending"]}, report
        filled = now_us()
        for entry in sorted(full.iterdir()):
            os.rename(entry, late / entry.name)
        samples = watch_gate(m)
        assert_socket_after_ready(m)
        snap = snapshot(m)
        assert us(snap[CONTAINERD], "ExecMainStartTimestampMonotonic") >= filled
        assert us(snap[SETUP], "ActiveEnterTimestampMonotonic") >= filled
        assert int(snap[SETUP]["NRestarts"]) >= 1, snap[SETUP]
        assert snap[CONTAINERD]["NRestarts"] == "0", snap[CONTAINERD]
        assert "staging" in m.journal("--priority=warning", "--output=cat", unit=SETUP)
        import_images(m)
        c = cn.client(m)
        report = probe(c, "gpu-c", GPU)
        assert pod.missing(report, drv.version) == [], report
        wait = (us(snap[CONTAINERD], "ExecMainStartTimestampMonotonic") - filled) / 1000
        record_timing("cri late staging (c)", m, snap,
                      note=f"staging filled -> containerd {wait:.0f} ms, "
                           f"{len(samples)} gate samples")
        c.remove_all()
    timed("c (late staging)", start)


# -- d: restart with pods running, and a driver upgrade ---------------------------------------


def upgrade_staging(cn: CriNode, new: realdriver.RealDriver) -> None:
    """The host's staging goes from the booted driver to ``new``: each staging dir's
    entries replaced by a freshly staged machine's, and the module version with them."""
    other = simgpu.make_machine(cn.node.host.parent / "host-new", new.version)
    use_real_driver(other, new)
    for old_dir, new_dir in zip(cn.node.sim.staging, other.staging, strict=True):
        for entry in old_dir.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for entry in sorted(new_dir.iterdir()):
            os.rename(entry, old_dir / entry.name)
    version = cn.node.rootfs / GUEST_PROC_DRIVER.lstrip("/") / "nvidia/version"
    version.write_text((other.root / "proc/driver/nvidia/version").read_text())


def listing(c: cri.Cri, ctr: cri.Container, path: str) -> str:
    code = ("import os, sys\np = sys.argv[1]\n"
            "print(sorted(os.listdir(p)) if os.path.isdir(p) else 'absent: ' + p)")
    ex = c.exec_sync(ctr, ["python3", "-c", code, path])
    assert ex.code == 0, ex.output
    return ex.stdout.strip()


def regenerated(m: Machine, pid: int, root: str, name: str) -> dict[str, Any]:
    """What nvidia-ctk generates from the driver root as pod ``pid`` sees it at ``root``:
    that view copied (``cp -a`` through /proc/<pid>/root) to a plain directory of the
    machine, since nvidia-ctk refuses library paths that resolve outside its driver root,
    which every path under /proc/<pid>/root does. The generated mounts' file names."""
    view, out = f"/run/regen-{name}", f"/run/regen-{name}.yaml"
    m.exec("cp", "-a", f"/proc/{pid}/root{root}", view)
    res = m.exec("nvidia-ctk", "cdi", "generate", f"--driver-root={view}", "--dev-root=/",
                 "--mode=management", f"--output={out}", check=False)
    m.exec("rm", "-rf", view)
    if res.returncode != 0:
        return {"exit": res.returncode, "error": (res.stdout + res.stderr).strip()[-400:]}
    doc = yaml.safe_load(m.read_text(out))
    mounts = [os.path.basename(x["hostPath"]) for x in
              doc.get("containerEdits", {}).get("mounts", []) or []]
    return {"exit": 0, "mounts": len(mounts),
            "libcuda": sorted(n for n in mounts if n.startswith("libcuda.so")),
            "nvml": sorted(n for n in mounts if n.startswith("libnvidia-ml.so"))}


def test_restart_with_pods_running_and_a_driver_upgrade(cri_node: Any) -> None:
    """d. Two long-running pods mount the driver root as device plugins do: `old` binds
    /run/nvidia/driver at /driver-root, `parent` binds /run/nvidia. The staging goes
    535 -> 550, then `systemctl restart unbounded-nvidia-setup`: containerd stops and
    starts (Debian's KillMode=process leaves the pods running), a new pod gets 550, `old`
    sees a deleted, empty root, `parent` the new one, and check names `old` only."""
    start = time.monotonic()
    old_drv, new_drv = fetch("bookworm"), fetch("trixie")
    cn = cri_node(old_drv)
    with cn.machine() as m:
        c = boot_ready(cn, m)
        pods = {}
        for name, mount in (("old", ("/driver-root", DRIVER_ROOT)),
                            ("parent", ("/run/nvidia", "/run/nvidia"))):
            sandbox = c.run_pod(f"plugin-{name}")
            ctr = c.create(sandbox, name, SLEEPER, mounts=[mount])
            c.start(ctr)
            pods[name] = ctr
        lib = f"lib/{MA}"
        before = {"old": listing(c, pods["old"], f"/driver-root/{lib}"),
                  "parent": listing(c, pods["parent"], f"{DRIVER_ROOT}/{lib}")}
        assert f"libcuda.so.{old_drv.version}" in before["old"], before
        assert f"libcuda.so.{old_drv.version}" in before["parent"], before
        pids = {name: container_pid(c, ctr) for name, ctr in pods.items()}
        ctd_before = snapshot(m, CONTAINERD)[CONTAINERD]

        # The GPU Operator's toolkit and NVIDIA's DRA driver write their specs from the
        # live root when their pods start (issue 38): nvidia-ctk as they run it.
        kinds = {"/var/run/cdi/management.nvidia.com-gpu.yaml": ("management.nvidia.com", "gpu"),
                 "/var/run/cdi/k8s.gpu.nvidia.com-claim_d.yaml": ("k8s.gpu.nvidia.com", "claim")}
        consumer_specs = list(kinds)
        for out, (vendor, klass) in kinds.items():
            m.exec("nvidia-ctk", "cdi", "generate", "--mode=management",
                   f"--driver-root={DRIVER_ROOT}", "--dev-root=/", f"--vendor={vendor}",
                   f"--class={klass}", f"--output={out}")
        assert not [p for p in check_json(m)["problems"] if p["code"] == "consumer-spec-stale"]

        upgrade_staging(cn, new_drv)
        restart_start = time.monotonic()
        res = host_command(m, "restart")  # docs/host-integration.md's own command
        assert res.returncode == 0, res.stderr
        watch_gate(m)
        restart_s = time.monotonic() - restart_start
        ctd_after = snapshot(m, CONTAINERD)[CONTAINERD]
        assert ctd_after["MainPID"] != ctd_before["MainPID"], (ctd_before, ctd_after)
        assert us(ctd_after, "ExecMainStartTimestampMonotonic") > \
            us(ctd_before, "ExecMainStartTimestampMonotonic")
        c.close()
        c = cn.client(m)
        for name, ctr in pods.items():
            assert c.running(ctr), f"pod {name} did not survive the restart"
            assert container_pid(c, ctr) == pids[name]
        report = probe(c, "gpu-d", GPU)
        assert pod.missing(report, new_drv.version) == [], report

        after = {"old": listing(c, pods["old"], f"/driver-root/{lib}"),
                 "old-top": listing(c, pods["old"], "/driver-root"),
                 "parent": listing(c, pods["parent"], f"{DRIVER_ROOT}/{lib}")}
        regen = {"old": regenerated(m, pids["old"], "/driver-root", "old"),
                 "parent": regenerated(m, pids["parent"], DRIVER_ROOT, "parent")}
        mountinfo = {name: [ln for ln in m.read_text(f"/proc/{pid}/mountinfo").splitlines()
                            if "nvidia" in ln]
                     for name, pid in pids.items()}
        report_check = check_json(m)
        held = [p for p in report_check["problems"] if p["code"] == "pod-on-old-root"]
        # The drift check's own unit, in its sandbox without capabilities, must name it
        # too: it is what reaches the metrics (issue 37, point 2).
        check_unit = "unbounded-nvidia-setup-check.service"
        since = m.exec("date", "+%Y-%m-%d %H:%M:%S").stdout.strip()
        m.systemctl("start", check_unit)
        unit_says = m.journal("--since", since, "-o", "cat", unit=check_unit)
        unit_result = m.show(check_unit, "Result", "ExecMainStatus")
        evidence = {"after": after, "regenerated": regen, "mountinfo": mountinfo,
                    "pod-on-old-root": held, "verdict": report_check["verdict"],
                    "pids": pids, "restart_s": round(restart_s, 1)}
        print("scenario d evidence: " + json.dumps(evidence, indent=1), flush=True)

        assert after["old"] == f"absent: /driver-root/{lib}", evidence
        assert f"libcuda.so.{new_drv.version}" in after["parent"], evidence
        assert f"libcuda.so.{old_drv.version}" not in after["parent"], evidence
        assert regen["parent"]["libcuda"] == [f"libcuda.so.{new_drv.version}"], evidence
        assert not regen["old"].get("libcuda") and not regen["old"].get("nvml"), evidence
        assert [f"pid {pids['old']} " in p["message"] for p in held] == [True], evidence
        assert not any(f"pid {pids['parent']} " in p["message"] for p in held), evidence
        stale = {p["path"]: p["message"] for p in report_check["problems"]
                 if p["code"] == "consumer-spec-stale"}
        assert set(stale) == set(consumer_specs), report_check["problems"]
        assert all(f"driver {old_drv.version}" in text for text in stale.values()), stale
        assert all(path in unit_says for path in consumer_specs), unit_says
        assert f"pid {pids['old']} " in unit_says, (unit_result, unit_says)
        assert f"pid {pids['parent']} " not in unit_says, unit_says
        assert unit_result["ExecMainStatus"] == "1", (unit_result, unit_says)
        record_timing("cri restart + upgrade (d)", m, snapshot(m),
                      note=f"restart {restart_s:.1f} s")
        # Seen here: after containerd's restart, StopPodSandbox and RemovePodSandbox of
        # these pods answer OK but leave their processes running (30 s and more). The
        # stale process is ended by hand (SIGKILL), and then check no
        # longer names anything.
        c.remove_all()
        gone = f"/proc/{pids['old']}"
        still = m.exists(gone)
        m.exec("python3", "-c", "import os, sys\nfor p in sys.argv[1:]:\n"
               "    try: os.kill(int(p), 9)\n    except ProcessLookupError: pass",
               str(pids["old"]), str(pids["parent"]))
        m.wait_until(lambda: not m.exists(gone), timeout=30, what="the stale pod's process gone")
        again = check_json(m)
        assert "pod-on-old-root" not in {p["code"] for p in again["problems"]}, again
        print(f"scenario d: process of the removed stale pod still running: {still}; "
              f"check afterwards: {again['verdict']}", flush=True)
    timed("d (restart with pods, 535 -> 550)", start)


# -- e: the incident's controls through CRI ----------------------------------------------------


def test_incident_controls_through_cri(cri_node: Any) -> None:
    """e. A spec less its libcuda and NVML mounts: nvidia-smi in the pod says it
    "couldn't find libnvidia-ml.so". A root of absolute links into the staging, the
    staging hidden from containerd: StartContainer fails with "no such file or
    directory" naming the library."""
    start = time.monotonic()
    drv = fetch("bookworm")
    cn = cri_node(drv)
    with cn.machine() as m:
        c = boot_ready(cn, m)
        doc = yaml.safe_load(m.read_text("/etc/cdi/nvidia.yaml"))
        doc["kind"] = "incident.test/gpu"
        drop = (f"libcuda.so.{drv.version}", f"libnvidia-ml.so.{drv.version}")
        edits = doc["containerEdits"]
        edits["mounts"] = [x for x in edits["mounts"]
                           if not os.path.basename(x["hostPath"]).startswith(drop)]
        m.exec("mkdir", "-p", "/var/run/cdi")
        m.exec("sh", "-c", "cat > /var/run/cdi/incident.yaml", input=yaml.safe_dump(doc))
        report = probe(c, "incident-spec", "incident.test/gpu=all")
        assert pod.SMI_NO_NVML in report["nvidia_smi"][1], report
        assert pod.missing(report, drv.version) == [
            "libcuda.so.1 in the linker cache", "libnvidia-ml.so.1 in the linker cache",
            "nvmlInit_v2 answering 9", "cuInit answering a CUDA error code",
            "nvidia-smi loading NVML"], report
        m.exec("rm", "/var/run/cdi/incident.yaml")

        # The old agent's root: libcuda and NVML as absolute links into the staging.
        libdir = f"{DRIVER_ROOT}/lib/{MA}"
        for stem in ("libcuda.so", "libnvidia-ml.so"):
            name = f"{stem}.{drv.version}"
            m.exec("ln", "-sf", f"/run/host-nvidia/0/{name}", f"{libdir}/{name}")
        m.exec("mount", "-t", "tmpfs", "-o", "size=1m", "none", "/run/host-nvidia")
        with pytest.raises(cri.CriError) as failed:
            probe(c, "incident-root", GPU)
        message = str(failed.value)
        print(f"incident root: {message}", flush=True)
        assert failed.value.call == "StartContainer", message
        assert "no such file or directory" in message, message
        assert f"libcuda.so.{drv.version}" in message or \
            f"libnvidia-ml.so.{drv.version}" in message, message
        m.exec("umount", "/run/host-nvidia")
        c.remove_all()
    timed("e (the incident's controls)", start)


# -- f: a lost GPU in NVML mode (issue 27, point 5) ---------------------------------------------

LOST = 1  # the minor (and NVML index: the simulated GPUs' bus ids follow their minors)


def gpu_nodes(doc: dict[str, Any]) -> dict[str, list[str]]:
    """Each device of the spec: the GPU nodes (/dev/nvidia<N>) it gives a container."""
    return {d["name"]: sorted(n["path"] for n in d["containerEdits"].get("deviceNodes", [])
                              if n["path"].removeprefix("/dev/nvidia").isdigit())
            for d in doc["devices"]}


def expected_devices(uuids: list[str], served: list[int]) -> dict[str, list[str]]:
    """NVML mode's devices for the GPUs at the minors ``served``: one by index and one by
    uuid per GPU, and ``all``."""
    want = {"all": [f"/dev/nvidia{n}" for n in served]}
    for n in served:
        want[str(n)] = want[uuids[n]] = [f"/dev/nvidia{n}"]
    return want


def pod_gpus(report: dict[str, Any]) -> set[str]:
    return {d for d in report["devices"] if d.removeprefix("nvidia").isdigit()}


def lost_gpu_node(cri_node: Any, drv: realdriver.RealDriver, reading: str) -> CriNode:
    """nvidia-ctk's default mode (NVML) on a host with three GPUs, GPU :data:`LOST`
    fallen off the bus (Xid 79, NVML: GPU_IS_LOST) before the boot, NVML's lookups by
    UUID read as ``reading`` (simnvml.READINGS); node_exporter's textfile directory in
    the machine."""
    cn: CriNode = cri_node(drv, nvml=True, gpus=3, lost=[LOST])
    simnvml.set_reading(cn.node.sim, reading)
    sync_proc_driver(cn.node)
    assert len(cn.node.sim.nvml_gpus) == 3, cn.node.sim.nvml_gpus
    (cn.node.rootfs / METRICS.lstrip("/")).parent.mkdir(parents=True)
    return cn


def served_by_uuid(reading: str) -> bool:
    """Whether NVIDIA's nvidia-ctk can write GPUs 0 and 2's own devices beside lost GPU
    1: it looks each up by UUID, which fails for GPU 1's sake under `any`, and for GPU
    2's under `walk` (its search meets GPU 1 first)."""
    return reading == "target"


def gpu_metrics(m: Machine) -> dict[str, float | None]:
    metrics = metric_values(m)
    return {k: metrics.get(k) for k in (
        "unbounded_nvidia_setup_gpus", "unbounded_nvidia_setup_gpus_served",
        'unbounded_nvidia_setup_check_problems{code="gpu-lost"}',
        "unbounded_nvidia_setup_check_ok", "unbounded_nvidia_setup_run_success")}


def assert_degraded(m: Machine, uuids: list[str]) -> None:
    """check --json (schema-validated): degraded, GPU :data:`LOST` its only problem."""
    lost_node = f"/dev/nvidia{LOST}"
    check = check_json(m)
    assert check["verdict"] == "degraded" and check["ok"] is False, check
    assert [(p["code"], p["path"]) for p in check["problems"]] == [
        ("gpu-lost", lost_node)], check["problems"]
    lost = {"index": LOST, "uuid": uuids[LOST], "device": lost_node,
            "bus_id": simnvml.gpu_bus_id(LOST)}
    assert check["gpus"] == {
        "listed": 3, "served": 2, "lost": [lost],
        "unusable": [{**lost, "nvml_error": 15, "nvml_error_text": "GPU is lost",
                      "query": "nvmlDeviceGetHandleByIndex_v2", "timeout_seconds": None}],
        "excluded": [], "node_error": None}, check["gpus"]


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_a_lost_gpu_degrades_the_node_and_pods_get_the_others(cri_node: Any,
                                                              reading: str) -> None:
    """f. Issue 27, point 5, under each reading of NVML (issue 31): three GPUs in NVML
    mode, GPU 1 lost before the boot. The setup succeeds at once (no restart), the spec
    serves GPUs 0 and 2 (and `all` of them; their own devices where nvidia-ctk can look
    them up by UUID) and names nothing of GPU 1, containerd and kubelet start, a pod
    asking CRI for nvidia.com/gpu=all gets those two and the driver, and check, the
    metrics and STATUS= say degraded, naming GPU 1."""
    start = time.monotonic()
    drv = fetch("bookworm")
    cn = lost_gpu_node(cri_node, drv, reading)
    uuids = list(cn.node.sim.nvml_gpus)
    healthy = [n for n in range(3) if n != LOST]
    lost_node = f"/dev/nvidia{LOST}"
    with cn.machine() as m:
        assert "nvidia_ctk_args: []" in m.read_text("/etc/unbounded/nvidia-setup.yaml")
        c = boot_ready(cn, m)
        m.wait_until(lambda: m.is_active(KUBELET), timeout=UP_TIMEOUT, what="kubelet active",
                     units=NODE_UNITS)
        snap = snapshot(m)
        s = snap[SETUP]
        assert (s["ActiveState"], s["SubState"], s["Result"]) == ("active", "exited",
                                                                  "success"), s
        assert s["NRestarts"] == "0", s
        assert snap[CONTAINERD]["ActiveState"] == snap[KUBELET]["ActiveState"] == "active"
        assert is_active(m) == "active"
        status = m.prop(SETUP, "StatusText")
        assert status.startswith("Ready (degraded): the spec serves 2 of 3 GPUs, "
                                 f"GPU {LOST} ({uuids[LOST]}, {lost_node}"), status

        text = m.read_text(SPEC)
        want = expected_devices(uuids, healthy)
        if not served_by_uuid(reading):
            want = {"all": want["all"]}
        assert gpu_nodes(yaml.safe_load(text)) == want, text
        assert lost_node not in text and uuids[LOST] not in text, text

        report = probe(c, "gpu-f", GPU)
        assert pod.missing(report, drv.version) == [], report
        assert pod_gpus(report) == {f"nvidia{n}" for n in healthy}, report

        assert_degraded(m, uuids)
        assert gpu_metrics(m) == {
            "unbounded_nvidia_setup_gpus": 3, "unbounded_nvidia_setup_gpus_served": 2,
            'unbounded_nvidia_setup_check_problems{code="gpu-lost"}': 1,
            "unbounded_nvidia_setup_check_ok": 0,
            "unbounded_nvidia_setup_run_success": 1}, metric_values(m)
        # nvidia-ctk failed at GPU 1's index; NVML, asked by index, named GPU 1 alone;
        # nvidia-ctk was asked again for the other two by UUID, and, where that failed
        # for GPU 1's sake, through management mode. The setup logged a warning naming
        # the GPU, and no error.
        journal = m.journal("--output=cat", unit=SETUP)
        assert f"error getting device handle for index '{LOST}': GPU is lost" in journal
        assert "--device-id=" + ",".join(uuids[n] for n in healthy) in journal, journal
        assert ("--mode=management" in journal) != served_by_uuid(reading), journal
        warnings = m.journal("--priority=warning", "--output=cat", unit=SETUP)
        assert f"GPU {LOST} ({uuids[LOST]}, {lost_node}, {simnvml.gpu_bus_id(LOST)}) is " \
            "lost" in warnings, warnings
        for n in healthy:
            assert f"GPU {n} (" not in warnings, warnings
        assert m.journal("--priority=err", "--output=cat", unit=SETUP).strip() == ""
        record_timing(f"cri lost gpu (f, {reading})", m, snap)
        c.remove_all()
    timed(f"f (a lost GPU in NVML mode, {reading})", start)


@pytest.mark.parametrize("reading", simnvml.READINGS)
def test_a_lost_gpu_that_comes_back_is_served_by_the_drift_check(cri_node: Any,
                                                                 reading: str) -> None:
    """g. The node of f; GPU 1 comes back (a reset on the host). The drift check's own
    unit runs (as its timer starts it) and asks for the reload itself: containerd and
    kubelet keep running, and the spec, a new pod, check, the metrics and STATUS= have
    all three GPUs. Nobody calls `systemctl reload` (issue 31: the unit's
    --reload-if-degraded had never run in a test)."""
    start = time.monotonic()
    drv = fetch("bookworm")
    cn = lost_gpu_node(cri_node, drv, reading)
    uuids = list(cn.node.sim.nvml_gpus)
    with cn.machine() as m:
        c = boot_ready(cn, m)
        m.wait_until(lambda: m.is_active(KUBELET), timeout=UP_TIMEOUT, what="kubelet active",
                     units=NODE_UNITS)
        assert_degraded(m, uuids)
        pids = {u: m.prop(u, "MainPID") for u in (CONTAINERD, KUBELET)}

        simnvml.recover_gpu(cn.node.sim, LOST)
        sync_proc_driver(cn.node)
        res = m.systemctl("start", CHECK_UNIT)
        # A degraded node is not drift: the check's unit succeeds on check's exit 3.
        assert res.returncode == 0, res.stdout + res.stderr
        assert m.prop(CHECK_UNIT, "Result") == "success"
        m.wait_until(lambda: check_json(m)["verdict"] == "ready" or None,
                     timeout=UP_TIMEOUT, what="the reload the check asked for",
                     units=[SETUP, CHECK_UNIT])
        journal = m.journal("--output=cat", unit=CHECK_UNIT)
        assert f"asked for `systemctl reload {SETUP}`" in journal, journal
        text = m.read_text(SPEC)
        assert gpu_nodes(yaml.safe_load(text)) == expected_devices(uuids, [0, 1, 2]), text
        check = check_json(m)
        assert check["gpus"] == {"listed": 3, "served": 3, "lost": [], "unusable": [],
                                 "excluded": [], "node_error": None}, check["gpus"]
        m.systemctl("start", CHECK_UNIT)  # the metrics: written by the check's unit
        assert gpu_metrics(m) == {
            "unbounded_nvidia_setup_gpus": 3, "unbounded_nvidia_setup_gpus_served": 3,
            'unbounded_nvidia_setup_check_problems{code="gpu-lost"}': 0,
            "unbounded_nvidia_setup_check_ok": 1,
            "unbounded_nvidia_setup_run_success": 1}, metric_values(m)
        assert metric_values(m).get("unbounded_nvidia_setup_reload_success") == 1
        assert {u: m.prop(u, "MainPID") for u in (CONTAINERD, KUBELET)} == pids
        assert m.is_active(SETUP)
        report = probe(c, "gpu-g", GPU)
        assert pod.missing(report, drv.version) == [], report
        assert pod_gpus(report) == {"nvidia0", "nvidia1", "nvidia2"}, report
        c.remove_all()
        # What `systemctl status` shows the operator: the reload's STATUS= (NotifyAccess=exec).
        status = m.prop(SETUP, "StatusText")
        assert status.startswith(f"Ready: spec refreshed for driver {drv.version}, "), status
    timed(f"g (a lost GPU back, the drift check's reload, {reading})", start)


def test_a_node_without_a_usable_gpu_comes_up_and_serves_none(cri_node: Any) -> None:
    """h. Issue 31, point 3: every GPU lost before the boot (any single-GPU node whose
    GPU is lost is this node), NVML read at its strictest. Issue 27's product failed
    every retry: the unit stayed activating, containerd and kubelet never started and
    check said not-ready-yet, which tells the host agent to wait for ever. Now the setup
    succeeds at once, containerd and kubelet start, no spec is installed, a pod asking
    CRI for a GPU fails to start naming the device, and check says no-usable-gpu."""
    start = time.monotonic()
    drv = fetch("bookworm")
    cn: CriNode = cri_node(drv, nvml=True, gpus=2, lost=[0, 1])
    simnvml.set_reading(cn.node.sim, "any")
    sync_proc_driver(cn.node)
    with cn.machine() as m:
        c = boot_ready(cn, m, "Up without GPUs")
        m.wait_until(lambda: m.is_active(KUBELET), timeout=UP_TIMEOUT, what="kubelet active",
                     units=NODE_UNITS)
        snap = snapshot(m)
        s = snap[SETUP]
        assert (s["ActiveState"], s["Result"], s["NRestarts"]) == ("active", "success", "0"), s
        assert snap[CONTAINERD]["ActiveState"] == "active"
        assert s["StatusText"].startswith("Up without GPUs: this node serves none of its 2 "
                                           "GPUs"), s
        assert m.exec("test", "-e", SPEC, check=False).returncode == 1
        report = check_json(m)
        assert report["verdict"] == "no-usable-gpu", report
        assert {p["code"] for p in report["problems"]} == {"no-usable-gpu", "gpu-lost"}, report
        with pytest.raises(cri.CriError) as failed:
            c.run("gpu-h", ["true"], cdi=[GPU], timeout=POD_TIMEOUT)
        assert "unresolvable CDI devices" in str(failed.value), failed.value
        # check exits 4, its own status (issue 35): not 1, which a host agent answers
        # with a restart that stops every CPU pod and mends nothing. The drift check's
        # unit takes it for success (SuccessExitStatus=3 4): no-usable-gpu has its own
        # critical alert, and a failed unit must mean drift.
        assert m.exec("/usr/bin/unbounded-nvidia-setup", "check", check=False).returncode == 4
        assert m.systemctl("start", CHECK_UNIT).returncode == 0
        c.remove_all()
    timed("h (no usable GPU)", start)
