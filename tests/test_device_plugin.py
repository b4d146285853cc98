"""NVIDIA's real device plugin (k8s-device-plugin v0.20.0) against the node this tool
sets up, with the test playing kubelet (issue 32, the part without a booted machine).

The plugin runs as a plain process in a private mount namespace (tests/nvplugin.py), its
kubelet is tests/kubelet.py, and the machine is a simulated one set up by the product's
`run`. What each test asserts of the plugin (exit status, error line, registration, spec)
is what it was measured to do, so that a change in it shows. These tests run only when
UNB_TEST_DEVICE_PLUGIN names the plugin (.ci/run's real-tool step); without it they are
deselected (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import kubelet
import nvplugin
import pod
import simgpu
import simnvml
import toolkit
from conftest import Cli, needs_root, unmet
from nvplugin import edits, host_paths
from test_pod import fetch, simulated_nvml, staging
from test_run import check_json as _check_json
from test_run import codes, load_spec, root_of

# Every test runs under each reading of NVML's lookups (issue 31; conftest.nvml_reading).
pytestmark = [pytest.mark.device_plugin, needs_root, pytest.mark.usefixtures("nvml_reading")]

REGISTER_TIMEOUT = 20.0
EXIT_TIMEOUT = 20.0
# What the plugin says at its start on a degraded node (measured, every reading of NVML's
# lookups): GPU 2 of 4 lost, or its MIG mode answering 999, with its node in the plugin's
# container; or, under the `deny` devices reading, without it.
GPU_MAP_ERROR = ("error starting plugins: error getting plugins: unable to create plugins: "
                 "failed to construct resource managers: error building device map: error "
                 "building device map from config.resources: error building GPU device map: ")
LOST_GPU_ERROR = GPU_MAP_ERROR + "error getting device handle for index '2': GPU is lost"
MIG_MODE_ERROR = (GPU_MAP_ERROR + "error visiting device: error checking if MIG is enabled on "
                  "GPU: error getting MIG mode: Unknown Error")
DENIED_GPU_ERROR = (GPU_MAP_ERROR
                    + "error getting device handle for index '2': Insufficient Permissions")
NO_NVML_ERROR = ("error starting plugins: unable to validate flags: CDI --device-list-strategy "
                 "options are only supported on NVML-based systems")


@pytest.fixture(scope="session")
def api(tmp_path_factory: pytest.TempPathFactory) -> kubelet.Api:
    return kubelet.api(tmp_path_factory.mktemp("deviceplugin-api"))


@pytest.fixture
def binary() -> Path:
    found = toolkit.plugin_binary()
    assert found is not None  # deselected otherwise (conftest.py)
    return found


@dataclass
class Node:
    m: simgpu.SimMachine
    kubelet: kubelet.Kubelet
    plugin: nvplugin.Running


@contextmanager
def plugin_on(binary: Path, api: kubelet.Api, m: simgpu.SimMachine, tmp_path: Path,
              **kwargs: Any) -> Iterator[Node]:
    """The test's kubelet serving, then NVIDIA's plugin started against ``m``; both
    ended on leaving (the plugin's process group killed, its mounts gone with it)."""
    with kubelet.Kubelet(tmp_path / "kubelet", api) as k, nvplugin.running(
            binary, m.root, k.dir, log=tmp_path / "plugin.log", **kwargs) as p:
        yield Node(m, k, p)


def four_gpus(m: simgpu.SimMachine) -> simgpu.SimMachine:
    for minor in (2, 3):
        simnvml.add_gpu(m, minor)
    m.write_config()
    assert len(m.nvml_gpus) == 4
    return m


def serves_every_gpu(node: Node) -> kubelet.Plugin:
    """The plugin registered with the test's kubelet, lists every GPU of the machine
    Healthy in ListAndWatch, and is still running: its client, watching."""
    plugin = node.kubelet.connect(node.kubelet.wait_registration(REGISTER_TIMEOUT))
    plugin.watch()
    assert plugin.devices() == dict.fromkeys(node.m.nvml_gpus, kubelet.HEALTHY)
    assert node.plugin.wait(0) is None, node.plugin.output()
    return plugin


def plugin_spec(m: simgpu.SimMachine) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(nvplugin.spec_path(m.root).read_text())
    return doc


def device_nodes(doc: dict[str, Any], uuid: str) -> list[str]:
    device = next(d for d in doc["devices"] if d["name"] == uuid)
    return [x.get("hostPath") or x["path"] for x in device["containerEdits"]["deviceNodes"]]


def check_json(cli: Cli, m: simgpu.SimMachine) -> dict[str, Any]:
    report: dict[str, Any] = _check_json(cli, m)
    return report


def plugin_codes(report: dict[str, Any]) -> set[str]:
    return {c for c in codes(report) if c.startswith("plugin-spec-")}


def error_lines(plugin: nvplugin.Running) -> list[str]:
    """The plugin's klog error lines, less their header (``E1205 21:27:42.6 2671 main.go:198]``)."""
    return [line.partition("] ")[2] for line in plugin.output().splitlines()
            if line.startswith("E") and "] " in line]


def stops_at_its_start(node: Node, error: str) -> None:
    """The plugin exits 1 at its start with `error` its one error line: it never
    registers and writes no spec."""
    code = node.plugin.wait(EXIT_TIMEOUT)
    assert code == 1, node.plugin.output()
    assert error_lines(node.plugin) == [error], node.plugin.output()
    assert node.kubelet.registrations == []
    assert not nvplugin.spec_path(node.m.root).exists()


def debian_machine(tmp_path: Path) -> simgpu.SimMachine:
    """Debian's 550 driver with the simulated NVML, for a pod through podman + runc (the
    test is unmet without a container runtime)."""
    why = pod.unavailable()
    if why is not None:
        unmet(f"no container runtime: {why}")
    from realmachine import real_machine

    m = real_machine(tmp_path, fetch("550"))
    simulated_nvml(m)
    return m


def test_the_plugin_serves_the_nodes_gpus_and_a_pod_gets_the_gpu_it_was_allocated(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli, nvml_reading: str) -> None:
    """Debian's 550 driver with the simulated NVML, 4 GPUs, set up by `run`: the plugin
    registers nvidia.com/gpu, lists the 4 GPUs by UUID, all Healthy, and Allocate hands
    out the CDI device of the one asked for; its spec mounts libcuda and NVML from the
    driver root, every hostPath exists, and `check` finds no problem with it. A pod given
    that CDI device by podman + runc (the CDI library containerd uses) gets that GPU's
    node and no other, libcuda and NVML."""
    m = debian_machine(tmp_path)
    four_gpus(m)
    simnvml.set_reading(m, nvml_reading)
    assert cli(m.root, "run").code == 0
    with plugin_on(binary, api, m, tmp_path) as node:
        reg = node.kubelet.wait_registration(REGISTER_TIMEOUT)
        assert (reg.version, reg.endpoint, reg.resource_name) == (
            kubelet.VERSION, nvplugin.ENDPOINT, nvplugin.RESOURCE), reg
        plugin = node.kubelet.connect(reg)
        assert plugin.options() == {"pre_start_required": False,
                                    "get_preferred_allocation_available": True}
        plugin.watch()
        listed = plugin.devices()
        assert listed == dict.fromkeys(m.nvml_gpus, kubelet.HEALTHY), listed
        chosen = m.nvml_gpus[1]
        assert plugin.preferred([chosen], 1) == [chosen]
        allocation = plugin.allocate([chosen])
        assert allocation.cdi_devices == [f"{nvplugin.KIND}={chosen}"], allocation
        assert node.plugin.wait(0) is None, node.plugin.output()

        doc = plugin_spec(m)
        assert doc["kind"] == nvplugin.KIND
        assert sorted(d["name"] for d in doc["devices"]) == sorted(m.nvml_gpus)
        mounted = {x["hostPath"] for e in edits(doc) for x in e.get("mounts", [])}
        lib = root_of(m) / "lib" / m.multiarch
        for name in (f"libcuda.so.{m.version}", f"libnvidia-ml.so.{m.version}"):
            assert str(lib / name) in mounted, sorted(mounted)
        assert [p for p in host_paths(doc) if not os.path.exists(p)] == []
        assert device_nodes(doc, chosen) == [str(m.root / "dev/nvidia1")]
        report = check_json(cli, m)
        assert report["device_plugin_spec"]["present"] is True, report
        assert plugin_codes(report) == set(), report["problems"]

        result = pod.probe(allocation.cdi_devices[0], run_cdi=nvplugin.spec_path(m.root).parent,
                           hide=[staging(m)]).report()
    gpus = {d for d in result["devices"] if d.removeprefix("nvidia").isdigit()}
    assert gpus == {"nvidia1"} and "nvidiactl" in result["devices"], result
    gaps = [g for g in pod.missing(result, m.version)
            if g != "/dev/nvidia0 and /dev/nvidiactl"]
    assert gaps == [], result


def test_the_charts_default_dev_root_names_nodes_the_root_does_not_have(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli) -> None:
    """NVIDIA's chart with nvidiaDriverRoot=/run/nvidia/driver and no nvidiaDevRoot: the
    plugin takes the driver root for its dev root. It still registers and serves every
    GPU, but its spec names <driver root>/dev/nvidia<N>, nvidiactl and the rest, which
    the product's root does not have (so every pod through it fails), and `check` says
    plugin-spec-bad-device-node for each of them and nothing else."""
    m = four_gpus(simgpu.make_machine(tmp_path / "root"))
    assert cli(m.root, "run").code == 0
    with plugin_on(binary, api, m, tmp_path, default_dev_root=True) as node:
        serves_every_gpu(node)
    doc = plugin_spec(m)
    dev = root_of(m) / "dev"
    nodes = {x["hostPath"] for e in edits(doc) for x in e.get("deviceNodes", [])}
    assert nodes == {str(dev / n) for n in (
        "nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-modeset",
        "nvidia-uvm", "nvidia-uvm-tools")}, sorted(nodes)
    assert not dev.exists()
    report = check_json(cli, m)
    assert plugin_codes(report) == {"plugin-spec-bad-device-node"}, report["problems"]
    bad = sorted(p["path"] for p in report["problems"]
                 if p["code"] == "plugin-spec-bad-device-node")
    assert bad == sorted(nodes), report["problems"]
    # check names the setting that fixes it (issue 32, point 5)
    for p in report["problems"]:
        if p["code"] == "plugin-spec-bad-device-node":
            assert "NVIDIA_DEV_ROOT=/" in p["message"], p
            assert "nvidiaDevRoot" in p["message"], p


@dataclass(frozen=True)
class Fault:
    """How GPU 2 of 4 is unusable: what the product's check calls it, and the plugin's
    error line at its start when its container has that GPU's node."""
    code: str
    error: str

    def make(self, m: simgpu.SimMachine) -> None:
        if self.code == "gpu-lost":
            simnvml.lose_gpu(m, 2)
        else:  # its handle opens, its later query fails: a GSP timeout (Xid 119/120)
            simnvml.fail_query(m, 2, "nvmlDeviceGetMigMode", 999)


FAULTS = {"lost": Fault("gpu-lost", LOST_GPU_ERROR),
          "mig-mode-999": Fault("gpu-unusable", MIG_MODE_ERROR)}


def degraded_node(cli: Cli, m: simgpu.SimMachine, fault: Fault, devices: str | None) -> None:
    """``m`` with 4 GPUs, GPU 2 unusable by ``fault`` and NVML's ``devices`` reading, set up
    by `run`: degraded, our spec serving GPUs 0, 1 and 3 and not GPU 2's node."""
    four_gpus(m)
    fault.make(m)
    simnvml.set_devices_reading(m, devices)
    assert cli(m.root, "run").code == 0
    report = check_json(cli, m)
    assert (report["verdict"], codes(report)) == ("degraded", {fault.code}), report["problems"]
    gpu_nodes = [n.name for n in spec_nodes(m) if n.name.removeprefix("nvidia").isdigit()]
    assert gpu_nodes == ["nvidia0", "nvidia1", "nvidia3"], gpu_nodes


def uuid_of(m: simgpu.SimMachine, minor: int) -> str:
    return m.nvml_gpus[simnvml.nvml_index(m, minor)]


def spec_nodes(m: simgpu.SimMachine) -> list[Path]:
    """The machine's NVIDIA device nodes that a pod given our spec's `nvidia.com/gpu=all`
    gets: those named by its common edits or by any of its devices."""
    doc = load_spec(m)
    named = {x.get("hostPath") or x["path"] for e in edits(doc) for x in e.get("deviceNodes", [])}
    return [n for n in nvplugin.device_nodes(m.root) if str(n) in named]


@pytest.mark.parametrize("devices", [None, *simnvml.DEVICES_READINGS])
@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_an_unusable_gpu_whose_node_its_container_has_stops_the_plugin(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli, nvml_reading: str,
        fault: Fault, devices: str | None) -> None:
    """GPU 2 of 4 lost (NVML 15), or its MIG mode answering 999, before the node's run,
    under each reading of NVML's lookups: the product degrades the node and serves the
    other 3. The plugin's container has every GPU's node (all of the machine's, as a pod
    given the host's /dev has), so what NVML does with a node it lacks does not come into
    it: under either devices reading, and without one, the plugin exits 1 at once on
    building its device map with NVML's own answer for GPU 2, never registers, and writes
    no spec: on such a node it serves no GPU at all."""
    m = simgpu.make_machine(tmp_path / "root")
    assert (m.root / simnvml.READING_FILE).read_text().strip() == nvml_reading
    degraded_node(cli, m, fault, devices)
    with plugin_on(binary, api, m, tmp_path) as node:
        stops_at_its_start(node, fault.error)
    report = check_json(cli, m)
    assert (report["verdict"], codes(report)) == ("degraded", {fault.code}), report["problems"]
    assert "device_plugin_spec" not in report


@pytest.mark.parametrize("devices", simnvml.DEVICES_READINGS)
@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_a_degraded_node_with_the_plugins_container_given_what_our_spec_serves(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli, nvml_reading: str,
        fault: Fault, devices: str) -> None:
    """As above, but the plugin's container gets only the device nodes our degraded spec
    serves (as a pod given its `nvidia.com/gpu=all` would): no /dev/nvidia2. Under each
    devices reading of NVML (which one the real library follows is not known here), and
    each reading of its lookups, the same:
    - ``skip`` (GPU 2 not enumerated, GPU 3 renumbered 2): the plugin starts, registers,
      lists GPUs 0, 1 and 3 Healthy by their UUIDs and keeps running; its spec lists those
      three, each with its own /dev/nvidia<N> (GPU 3's is nvidia3, not nvidia2), Allocate
      of GPU 3 hands out its CDI device, and `check` reads that spec without a plugin
      problem: degraded, by the fault alone.
    - ``deny`` (GPU 2 counted, its lookups answering 4): the plugin exits 1 at its start
      on GPU 2's lookup with Insufficient Permissions, whatever the fault, never
      registers and writes no spec: `check` has no device_plugin_spec section."""
    m = simgpu.make_machine(tmp_path / "root")
    degraded_node(cli, m, fault, devices)
    served = [uuid_of(m, minor) for minor in (0, 1, 3)]
    with plugin_on(binary, api, m, tmp_path, nodes=spec_nodes(m)) as node:
        if devices == "deny":
            stops_at_its_start(node, DENIED_GPU_ERROR)
        else:
            plugin = node.kubelet.connect(node.kubelet.wait_registration(REGISTER_TIMEOUT))
            plugin.watch()
            listed = plugin.devices()
            assert listed == dict.fromkeys(served, kubelet.HEALTHY), listed
            third = uuid_of(m, 3)
            allocation = plugin.allocate([third])
            assert allocation.cdi_devices == [f"{nvplugin.KIND}={third}"], allocation
            assert node.plugin.wait(0) is None, node.plugin.output()
            assert error_lines(node.plugin) == [], node.plugin.output()
    report = check_json(cli, m)
    assert (report["verdict"], codes(report)) == ("degraded", {fault.code}), report["problems"]
    if devices == "deny":
        assert "device_plugin_spec" not in report
        return
    doc = plugin_spec(m)
    assert sorted(d["name"] for d in doc["devices"]) == sorted(served)
    for minor in (0, 1, 3):
        assert device_nodes(doc, uuid_of(m, minor)) == [str(m.root / f"dev/nvidia{minor}")]
    assert report["device_plugin_spec"]["gpus"] == ["/dev/nvidia0", "/dev/nvidia1",
                                                    "/dev/nvidia3"], report
    assert sorted(report["device_plugin_spec"]["devices"]) == sorted(served), report


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_a_pod_allocated_the_renumbered_gpu_under_skip_gets_that_gpus_node(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli, nvml_reading: str,
        fault: Fault) -> None:
    """The ``skip`` case above with Debian's 550 driver (simulated NVML), through podman +
    runc: the plugin's container lacks /dev/nvidia2, its NVML numbers GPU 3 as 2, and a
    pod given the CDI device Allocate hands out for GPU 3 gets /dev/nvidia3 and no other
    GPU's node, with libcuda and NVML."""
    m = debian_machine(tmp_path)
    simnvml.set_reading(m, nvml_reading)
    degraded_node(cli, m, fault, "skip")
    with plugin_on(binary, api, m, tmp_path, nodes=spec_nodes(m)) as node:
        plugin = node.kubelet.connect(node.kubelet.wait_registration(REGISTER_TIMEOUT))
        third = uuid_of(m, 3)
        allocation = plugin.allocate([third])
        assert allocation.cdi_devices == [f"{nvplugin.KIND}={third}"], allocation
        result = pod.probe(allocation.cdi_devices[0], run_cdi=nvplugin.spec_path(m.root).parent,
                           hide=[staging(m)]).report()
        assert node.plugin.wait(0) is None, node.plugin.output()
    gpus = {d for d in result["devices"] if d.removeprefix("nvidia").isdigit()}
    assert gpus == {"nvidia3"} and "nvidiactl" in result["devices"], result
    gaps = [g for g in pod.missing(result, m.version)
            if g != "/dev/nvidia0 and /dev/nvidiactl"]
    assert gaps == [], result


def links_into_staging(m: simgpu.SimMachine, stems: tuple[str, ...]) -> None:
    """The older agent's root: these driver libraries as absolute links into the staging
    (the incident; test_pod.links_into_staging)."""
    lib = root_of(m) / "lib" / m.multiarch
    for stem in stems:
        name = f"{stem}.{m.version}"
        (lib / name).unlink()
        (lib / name).symlink_to(m.lib_dir / name)


def test_incident_libcuda_into_hidden_staging_gives_a_spec_without_libcuda(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli) -> None:
    """The older agent's root, libcuda an absolute link into the staging, which the
    plugin cannot see: the plugin registers and serves every GPU, and writes the
    incident's spec, with NVML but without libcuda; `check` says plugin-spec-missing-
    library of it, beside the root's own escaping links."""
    m = four_gpus(simgpu.make_machine(tmp_path / "root"))
    assert cli(m.root, "run").code == 0
    links_into_staging(m, ("libcuda.so",))
    with plugin_on(binary, api, m, tmp_path, hide=(staging(m),)) as node:
        serves_every_gpu(node)
    doc = plugin_spec(m)
    names = {os.path.basename(x["hostPath"]) for e in edits(doc) for x in e.get("mounts", [])}
    assert f"libnvidia-ml.so.{m.version}" in names
    assert not [n for n in names if n.startswith("libcuda.so")], sorted(names)
    report = check_json(cli, m)
    assert plugin_codes(report) == {"plugin-spec-missing-library"}, report["problems"]
    missing = [p for p in report["problems"] if p["code"] == "plugin-spec-missing-library"]
    assert len(missing) == 1 and f"libcuda.so.{m.version}" in missing[0]["message"], missing
    assert "nvidiaDriverRoot=/run/nvidia/driver" in missing[0]["message"], missing
    assert {"root-absolute-link", "root-escaping-link"} <= codes(report), report["problems"]


def test_incident_nvml_into_hidden_staging_stops_the_plugin(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli) -> None:
    """The older agent's root with libcuda and NVML both absolute links into the hidden
    staging: the plugin cannot load NVML from the driver root, exits 1 on its flags
    (cdi-cri needs NVML), never registers and writes no spec; `check` names the root's
    links, and no plugin spec."""
    m = four_gpus(simgpu.make_machine(tmp_path / "root"))
    assert cli(m.root, "run").code == 0
    links_into_staging(m, ("libcuda.so", "libnvidia-ml.so"))
    with plugin_on(binary, api, m, tmp_path, hide=(staging(m),)) as node:
        stops_at_its_start(node, NO_NVML_ERROR)
    report = check_json(cli, m)
    assert plugin_codes(report) == set(), report["problems"]
    assert {"root-absolute-link", "root-escaping-link"} <= codes(report), report["problems"]


def test_an_xid_79_marks_the_gpu_unhealthy_and_the_next_reload_agrees(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli) -> None:
    """Issue 32, 4d, without a booted machine, under each reading of NVML: an Xid 79 for
    GPU 2 while the plugin runs (health checks on), after which NVML answers 15 for it.
    The plugin marks GPU 2 Unhealthy in ListAndWatch and no other (measured: its NVML
    stays initialised, so the loss itself reaches it only at its next start), and keeps
    running with the spec it wrote at its start, which still lists GPU 2. The product
    cannot see an Xid (only NVML, asked again, can): its next reload finds GPU 2 lost and
    agrees (degraded, gpu-lost naming it), and check reads the plugin's spec still
    listing /dev/nvidia2 (plugin-spec-unusable-gpu, the plugin's pod to restart)."""
    m = four_gpus(simgpu.make_machine(tmp_path / "root"))
    assert cli(m.root, "run").code == 0
    with simnvml.XidRegistrations(simnvml.xid_files(m)) as registered, \
            plugin_on(binary, api, m, tmp_path) as node:
        plugin = node.kubelet.connect(node.kubelet.wait_registration(REGISTER_TIMEOUT))
        plugin.watch()
        assert plugin.devices() == dict.fromkeys(m.nvml_gpus, kubelet.HEALTHY)
        registered.wait(REGISTER_TIMEOUT)  # its health checks listen from here on
        simnvml.deliver_xid(m, 2, 79, lose=True)
        want = {**dict.fromkeys(m.nvml_gpus, kubelet.HEALTHY),
                m.nvml_gpus[2]: kubelet.UNHEALTHY}
        assert plugin.devices(until=lambda d: d == want) == want
        assert node.plugin.wait(0) is None, node.plugin.output()
        # check reads files: until something asks NVML again, it cannot know.
        assert check_json(cli, m)["verdict"] == "ready"
        assert cli(m.root, "run", "--spec-only").code == 0
        report = check_json(cli, m)
        assert report["verdict"] == "degraded", report
        assert [(p["code"], p["path"]) for p in report["problems"]] == [
            ("gpu-lost", str(m.root / "dev/nvidia2")),
            ("plugin-spec-unusable-gpu", str(nvplugin.spec_path(m.root)))], report["problems"]
        stale = report["problems"][1]["message"]
        assert "/dev/nvidia2" in stale and "restart the device plugin" in stale, stale
        assert report["device_plugin_spec"]["gpus"] == [f"/dev/nvidia{n}" for n in range(4)]
        assert node.plugin.wait(0) is None, node.plugin.output()


def test_an_xid_48_is_the_plugins_to_see_not_the_products(
        binary: Path, api: kubelet.Api, tmp_path: Path, cli: Cli) -> None:
    """An Xid after which NVML still answers (48, a double-bit ECC error): the plugin
    marks the GPU Unhealthy until its plugins restart; NVML answers for it, so the
    product's run, reload and check see a healthy node (docs/problems.md says so). The
    simulated NVML's event API holds: the plugin loads it without a symbol lookup error,
    skips its default Xids, and is still running past its first 5 s event wait (a timeout
    read as an error would mark every GPU unhealthy)."""
    m = four_gpus(simgpu.make_machine(tmp_path / "root"))
    assert cli(m.root, "run").code == 0
    with simnvml.XidRegistrations(simnvml.xid_files(m)) as registered, \
            plugin_on(binary, api, m, tmp_path) as node:
        started = time.monotonic()
        plugin = node.kubelet.connect(node.kubelet.wait_registration(REGISTER_TIMEOUT))
        plugin.watch()
        registered.wait(REGISTER_TIMEOUT)  # its health checks listen from here on
        simnvml.deliver_xid(m, 1, 48)
        want = {**dict.fromkeys(m.nvml_gpus, kubelet.HEALTHY),
                m.nvml_gpus[1]: kubelet.UNHEALTHY}
        assert plugin.devices(until=lambda d: d == want) == want
        assert cli(m.root, "run", "--spec-only").code == 0
        assert check_json(cli, m)["verdict"] == "ready"
        time.sleep(max(0.0, started + 6.5 - time.monotonic()))
        assert node.plugin.wait(0) is None, node.plugin.output()
    text = node.plugin.output()
    assert "symbol lookup error" not in text, text
    assert "Ignoring the following XIDs for health checks" in text, text
    assert f"XidCriticalError: Xid=48 on Device={m.nvml_gpus[1]}" in text, text
    assert not any(f"Device={u}" in text for i, u in enumerate(m.nvml_gpus) if i != 1), text
    assert "Error waiting for event" not in text, text
