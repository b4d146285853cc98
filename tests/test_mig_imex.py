"""MIG devices and IMEX channels through the product (issue 27, points 3 and 4).

MIG: nvidia-ctk reads the caps minors from the host's /proc/driver/nvidia-caps/mig-minors
only (tests/procdriver.py), so every run here that meets a MIG-enabled GPU runs in a
private mount namespace that shows the machine's proc/driver there, as a GPU host's own
/proc/driver would be. IMEX: /dev/nvidia-caps-imex-channels/channel<N>, which 1.20's
NVML mode lists nowhere and the product keeps out of every device, whatever nvidia-ctk
wrote (guest/.../imex.py): channels are handed out one by one by their consumers.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

import simgpu
import simnvml
from conftest import Cli, needs_root
from test_lost_gpu import nodes_by_device
from test_run import check_json, codes, load_spec

pytestmark = [needs_root, pytest.mark.usefixtures("nvml_reading")]
CAPS = simnvml.CAPS_MAJOR
IMEX = simnvml.IMEX_MAJOR


@pytest.fixture
def mig(tmp_path: Path) -> tuple[simgpu.SimMachine, list[str]]:
    """Two GPUs, the second MIG-enabled with two MIG devices (a 3g and a 1g slice)."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    return m, simnvml.enable_mig(m, 1, [(1, 0, 3, 3), (7, 0, 0, 0)])


def caps_nodes(gi: int, ci: int) -> list[str]:
    return sorted(["/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{simnvml.gi_cap_minor(1, gi)}",
                   f"/dev/nvidia-caps/nvidia-cap{simnvml.ci_cap_minor(1, gi, ci)}"])


def numbers(doc: dict[str, Any], path: str) -> set[tuple[int, int]]:
    return {(n["major"], n.get("minor", 0)) for d in doc["devices"]
            for n in d["containerEdits"].get("deviceNodes", []) if n["path"] == path}


def test_mig_devices_are_in_the_spec_with_their_caps_nodes(
        mig: tuple[simgpu.SimMachine, list[str]], cli: Cli) -> None:
    m, uuids = mig
    out = cli(m.root, "run", proc_driver=True)
    assert out.code == 0, out.stderr
    doc = load_spec(m)
    devices = nodes_by_device(doc)
    first, second = caps_nodes(1, 0), caps_nodes(7, 0)
    assert devices["1:0"] == devices[uuids[0]] == first, devices
    assert devices["1:1"] == devices[uuids[1]] == second, devices
    assert "1" not in devices and m.nvml_gpus[1] not in devices  # no full-GPU device
    assert set(first + second) <= set(devices["all"])
    cap = f"/dev/nvidia-caps/nvidia-cap{simnvml.gi_cap_minor(1, 1)}"
    assert numbers(doc, cap) == {(CAPS, simnvml.gi_cap_minor(1, 1))}
    report: dict[str, Any] = check_json(cli, m)
    assert report["verdict"] == "ready", report["problems"]
    assert report["gpus"] == {"listed": 2, "served": 2, "lost": [], "unusable": [],
                              "excluded": [], "node_error": None}


@pytest.mark.parametrize("damage", ["removed", "other-major", "renumbered"])
def test_check_validates_each_mig_caps_node(
        mig: tuple[simgpu.SimMachine, list[str]], cli: Cli, damage: str) -> None:
    """A caps node the spec names must exist, be the `nvidia-caps` major of
    /proc/devices, and be the device the spec's numbers say."""
    m, _ = mig
    assert cli(m.root, "run", proc_driver=True).code == 0
    minor = simnvml.ci_cap_minor(1, 7, 0)
    node = m.root / f"dev/nvidia-caps/nvidia-cap{minor}"
    node.unlink()
    want: set[str]
    if damage == "removed":
        want = {"spec-bad-device-node"}
    elif damage == "other-major":  # a node of a module that is not nvidia-caps now
        os.mknod(node, stat.S_IFCHR | 0o444, os.makedev(CAPS + 1, minor))
        want = {"device-stale", "spec-bad-device-node"}
    else:  # the right driver, another cap: MIG reconfigured under a spec not refreshed
        os.mknod(node, stat.S_IFCHR | 0o444, os.makedev(CAPS, minor + 1))
        want = {"spec-bad-device-node"}
    report: dict[str, Any] = check_json(cli, m)
    assert report["verdict"] == "broken" and codes(report) == want, report["problems"]
    paths = {p["path"] for p in report["problems"] if p["code"] == "spec-bad-device-node"}
    assert paths == {str(node)}, report["problems"]


def test_a_mig_reconfiguration_then_a_reload_serves_the_new_devices(
        mig: tuple[simgpu.SimMachine, list[str]], cli: Cli) -> None:
    """nvidia-mig-manager's order: the new layout, the new caps nodes bound, then
    `systemctl restart nvidia-cdi-refresh`, which is our reload (`run --spec-only`)."""
    m, before = mig
    assert cli(m.root, "run", proc_driver=True).code == 0
    old = set(caps_nodes(1, 0) + caps_nodes(7, 0)) - {"/dev/nvidia1"}
    after = simnvml.enable_mig(m, 1, [(2, 0, 1, 1)])
    # The old spec still names the removed caps nodes: check says so until the reload.
    assert "spec-bad-device-node" in codes(check_json(cli, m))
    out = cli(m.root, "run", "--spec-only", proc_driver=True)
    assert out.code == 0, out.stderr
    devices = nodes_by_device(load_spec(m))
    assert devices["1:0"] == devices[after[0]] == caps_nodes(2, 0), devices
    assert not set(before) & set(devices) and "1:1" not in devices
    assert not old & {p for nodes in devices.values() for p in nodes}, devices
    assert check_json(cli, m)["verdict"] == "ready"


def test_a_lost_gpu_beside_a_mig_gpu_keeps_the_mig_devices(
        mig: tuple[simgpu.SimMachine, list[str]], cli: Cli, nvml_reading: str) -> None:
    """The MIG devices of the usable GPU stay, with their access caps; where NVML's
    lookups by UUID fail for the lost GPU's sake (GPU 0 comes first), through
    management mode's `all`, which must then give neither GPU 0's node, nor MIG's
    config and monitor caps, nor any other caps node."""
    m, uuids = mig
    simnvml.lose_gpu(m, 0)
    out = cli(m.root, "run", proc_driver=True)
    assert out.code == 0, out.stderr
    doc: dict[str, Any] = load_spec(m)
    devices = nodes_by_device(doc)
    if nvml_reading == "target":
        assert devices["1:0"] == devices[uuids[0]] == caps_nodes(1, 0), devices
        assert devices["1:1"] == caps_nodes(7, 0)
    else:
        assert set(devices) == {"all"}, devices
    every = {n["path"] for d in doc["devices"] for n in d["containerEdits"].get(
        "deviceNodes", [])} | {n["path"] for n in doc.get("containerEdits", {}).get(
            "deviceNodes", [])}
    assert {p for p in every if "nvidia-cap" in p or p.removeprefix("/dev/nvidia").isdigit()
            } == set(caps_nodes(1, 0) + caps_nodes(7, 0)), sorted(every)
    assert "0" not in devices and "/dev/nvidia0" not in devices["all"]
    report: dict[str, Any] = check_json(cli, m)
    assert report["verdict"] == "degraded" and codes(report) == {"gpu-lost"}, report
    assert [g["device"] for g in report["gpus"]["lost"]] == ["/dev/nvidia0"]


def test_a_mig_gpu_without_instances_is_not_a_lost_gpu(tmp_path: Path, cli: Cli) -> None:
    """MIG mode on, no instance made yet (nvidia-mig-manager has not applied a layout):
    NVIDIA's tool gives that GPU no device, and that is no fault of the GPU. The node
    is ready, not degraded; the other GPU is served as before."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert simnvml.enable_mig(m, 1, []) == []
    out = cli(m.root, "run", proc_driver=True)
    assert out.code == 0, out.stderr
    devices = nodes_by_device(load_spec(m))
    assert devices["0"] == devices[m.nvml_gpus[0]] == ["/dev/nvidia0"], devices
    assert "1" not in devices and m.nvml_gpus[1] not in devices, devices
    report: dict[str, Any] = check_json(cli, m)
    assert report["verdict"] == "ready" and report["problems"] == [], report["problems"]
    assert report["gpus"]["lost"] == [], report["gpus"]


def channel_places(doc: dict[str, Any]) -> list[str]:
    """Where the spec gives containers an IMEX channel: device names, "common" for the
    spec's own containerEdits."""
    places = [("common", doc.get("containerEdits") or {})]
    places += [(d["name"], d.get("containerEdits") or {}) for d in doc["devices"]]
    return [name for name, edits in places for n in edits.get("deviceNodes") or []
            if simnvml.IMEX_DIR in n["path"] or simnvml.IMEX_DIR in n.get("hostPath", "")]


@pytest.mark.parametrize("args", [None, ["--mode=management"]], ids=["nvml", "management"])
def test_imex_channels_are_in_no_device_of_the_spec(tmp_path: Path, cli: Cli,
                                                    args: list[str] | None) -> None:
    """A channel is an isolation boundary between jobs: NVIDIA hands them out one by one
    (nvidia-ctk --mode=imex, the device plugin, the DRA driver), never to every pod that
    asks for nvidia.com/gpu=all. NVML mode lists none; what management mode puts in
    `all` is taken out, and the rest of `all` stays."""
    m = simgpu.make_machine(tmp_path / "root")
    if args:
        m.write_config(nvidia_ctk_args=args)
    else:
        m.write_config()
    simnvml.add_imex_channels(m, 3)
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    doc = load_spec(m)
    assert channel_places(doc) == [], channel_places(doc)
    assert {"/dev/nvidia0", "/dev/nvidia1"} <= set(nodes_by_device(doc)["all"])
    assert check_json(cli, m)["verdict"] == "ready"
    # A second run changes nothing: the channels are left out the same way every time.
    spec = m.cdi_spec.read_bytes()
    assert cli(m.root, "run").code == 0 and m.cdi_spec.read_bytes() == spec


@pytest.mark.parametrize("where", ["all", "0", "common"])
def test_check_flags_a_spec_that_carries_a_channel(tmp_path: Path, cli: Cli,
                                                   where: str) -> None:
    """A spec edited by hand (or written by something else) that gives a channel to a
    device or to every container is a problem of its own, even with the right numbers."""
    import yaml

    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    path, = simnvml.add_imex_channels(m, 1)
    assert cli(m.root, "run").code == 0
    m.cdi_spec.write_text(yaml.safe_dump(with_channel(m, path, where)))
    report: dict[str, Any] = check_json(cli, m)
    assert codes(report) == {"spec-imex-channel"}, report["problems"]
    assert [p["path"] for p in report["problems"]] == [str(m.root / path.lstrip("/"))]
    # The next run puts the spec right.
    assert cli(m.root, "run").code == 0 and channel_places(load_spec(m)) == []


def with_channel(m: simgpu.SimMachine, path: str, where: str) -> dict[str, Any]:
    """The installed spec with the channel node at `path` added to device `where` (or to
    the common edits), with its right numbers."""
    doc: dict[str, Any] = load_spec(m)
    node = {"path": path, "hostPath": str(m.root / path.lstrip("/")), "major": IMEX,
            "permissions": "rwm"}
    holder = doc if where == "common" else next(d for d in doc["devices"]
                                                if d["name"] == where)
    holder.setdefault("containerEdits", {}).setdefault("deviceNodes", []).append(node)
    return doc


def test_the_run_refuses_to_install_a_spec_that_carries_a_channel(tmp_path: Path,
                                                                  cli: Cli) -> None:
    """Stripping leaves none, but the run's own validation of the spec it is about to
    install refuses one, in one line."""
    import yaml

    from unbounded_nvidia_setup import cdi
    from unbounded_nvidia_setup.config import Machine, load_config
    from unbounded_nvidia_setup.log import Failure

    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    path, = simnvml.add_imex_channels(m, 1)
    assert cli(m.root, "run").code == 0
    machine = Machine.create(m.root, load_config(m.root, None)[0])
    data = yaml.safe_dump(with_channel(m, path, "all")).encode()
    with pytest.raises(Failure, match=f"names IMEX channel {path!r}.*it was not installed"):
        cdi.validate(machine, data, m.version, (), cdi.kept(True, True))


def test_an_imex_channel_of_another_major_is_found(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    path, = simnvml.add_imex_channels(m, 1)
    assert cli(m.root, "run").code == 0
    node = m.root / path.lstrip("/")
    node.unlink()
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(IMEX + 2, 0))
    report: dict[str, Any] = check_json(cli, m)
    assert codes(report) == {"device-stale"}, report["problems"]  # the spec names none
    stale, = [p for p in report["problems"] if p["code"] == "device-stale"]
    assert stale["path"] == str(node)
    # A run refuses while the node is stale, and changes nothing.
    spec = m.cdi_spec.read_bytes()
    assert cli(m.root, "run").code != 0 and m.cdi_spec.read_bytes() == spec


def test_without_channels_leaves_a_spec_without_one_as_it_is(tmp_path: Path,
                                                              cli: Cli) -> None:
    """The same bytes when there is no channel; otherwise every channel goes, from every
    device and the common edits, and every other node stays. A device that gave only a
    channel goes too: CDI refuses a device with no edits."""
    import yaml

    from unbounded_nvidia_setup import imex
    from unbounded_nvidia_setup.config import Machine, load_config

    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    path, = simnvml.add_imex_channels(m, 1)
    assert cli(m.root, "run").code == 0
    machine = Machine.create(m.root, load_config(m.root, None)[0])
    data = m.cdi_spec.read_bytes()
    assert imex.without_channels(machine, data) is data
    doc = with_channel(m, path, "common")
    with_all: dict[str, Any] = yaml.safe_load(yaml.safe_dump(doc))
    next(d for d in with_all["devices"] if d["name"] == "all")["containerEdits"][
        "deviceNodes"].append(doc["containerEdits"]["deviceNodes"][-1])
    with_all["devices"].append({"name": "channel0", "containerEdits": {
        "deviceNodes": [doc["containerEdits"]["deviceNodes"][-1]]}})
    stripped = yaml.safe_load(imex.without_channels(machine, yaml.safe_dump(with_all).encode()))
    assert channel_places(stripped) == [] and "channel0" not in [
        d["name"] for d in stripped["devices"]]
    installed: dict[str, Any] = load_spec(m)
    assert nodes_by_device(stripped) == nodes_by_device(installed)
    assert stripped["containerEdits"] == installed["containerEdits"]
