"""`run --spec-only` (what `systemctl reload unbounded-nvidia-setup` runs): the CDI spec
is regenerated for the live driver root, which is neither copied nor swapped; when the
root no longer matches the staging mounts, nothing changes and the one line says to
restart. Real CLI, real ELF files, real ldconfig, the tests' nvidia-ctk (tests/toolkit.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from invariants import secure_after  # noqa: F401  (fixture)
from unbounded_nvidia_setup.config import load_yaml
from unbounded_nvidia_setup.tree import manifest

import simgpu
import simnvml
from conftest import Cli, needs_root

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
RESTART = "systemctl restart unbounded-nvidia-setup"


def live_state(m: simgpu.SimMachine) -> tuple[object, ...]:
    """Everything a refresh must leave alone, inode of the root included."""
    dropin = m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"
    cache = m.root / "etc/ld.so.cache"
    return (os.stat(m.driver_root).st_ino, manifest(m.driver_root), dropin.read_bytes(),
            cache.read_bytes(), sorted(p.name for p in m.driver_root.parent.iterdir()))


def spec_devices(m: simgpu.SimMachine) -> set[str]:
    doc = load_yaml(m.cdi_spec.read_bytes())
    nodes = {str(n["path"]) for n in doc["containerEdits"].get("deviceNodes") or []}
    for device in doc["devices"]:
        nodes |= {str(n["path"]) for n in device["containerEdits"].get("deviceNodes") or []}
    return nodes


def spec_names(m: simgpu.SimMachine) -> list[str]:
    return [str(d["name"]) for d in load_yaml(m.cdi_spec.read_bytes())["devices"]]


def pretend_running(m: simgpu.SimMachine) -> None:
    """containerd and kubelet as the tool sees their units run without systemd to ask:
    processes in their units' cgroups."""
    for pid, comm in (("4242", "containerd"), ("4243", "kubelet")):
        (m.root / "proc" / pid).mkdir(parents=True)
        (m.root / "proc" / pid / "comm").write_text(f"{comm}\n")
        (m.root / "proc" / pid / "cgroup").write_text(f"0::/system.slice/{comm}.service\n")


@pytest.mark.parametrize("nvml", [True, False], ids=["nvml", "management"])
def test_new_device_node_reaches_the_spec_without_touching_the_root(
        tmp_path: Path, cli: Cli, nvml: bool) -> None:
    """A GPU arrives with pods running. Where NVML answers (nvidia-ctk's default mode,
    the stand-in's and the real one's alike on a simulated machine) it is a new device `2`
    and its uuid, beside 0, 1 and all (in name order, as 1.20 sorts them); in management
    mode (a machine whose GPUs no NVML answers) its node joins `all`."""
    m = simgpu.make_machine(tmp_path / "root", nvml=nvml)
    m.write_config()
    assert m.nvml_answers == nvml
    assert cli(m.root, "run").code == 0
    assert "/dev/nvidia2" not in spec_devices(m)
    old = m.nvml_gpus[:]
    if nvml:
        assert spec_names(m) == sorted(["0", old[0], "1", old[1], "all"])
    before = live_state(m)
    pretend_running(m)  # pods keep running: a refresh needs no --force
    uuid = simnvml.add_gpu(m, 2)

    out = cli(m.root, "run", "--spec-only")
    assert out.code == 0, out.stderr
    assert "/dev/nvidia2" in spec_devices(m)
    if nvml:
        assert spec_names(m) == sorted(["0", old[0], "1", old[1], "2", uuid, "all"])
    else:
        assert spec_names(m) == ["all"]
    assert live_state(m) == before
    assert cli(m.root, "check").code == 0

    spec_ino = os.stat(m.cdi_spec).st_ino
    assert cli(m.root, "run", "--spec-only").code == 0  # nothing new: spec not rewritten
    assert os.stat(m.cdi_spec).st_ino == spec_ino


def test_driver_change_in_staging_changes_nothing(m: simgpu.SimMachine, cli: Cli,
                                                  tmp_path: Path) -> None:
    assert cli(m.root, "run").code == 0
    before = live_state(m)
    spec = m.cdi_spec.read_bytes()
    new = simgpu.make_machine(tmp_path / "new", version="570.133.20",
                              stale_versions=(m.version,))
    shutil.rmtree(m.root / "run/host-nvidia")
    shutil.copytree(new.root / "run/host-nvidia", m.root / "run/host-nvidia", symlinks=True)
    shutil.copy(new.root / "proc/driver/nvidia/version", m.root / "proc/driver/nvidia/version")
    os.mknod(m.root / "dev/nvidia2", 0o666 | 0o020000, os.makedev(195, 2))

    out = cli(m.root, "run", "--spec-only")
    assert out.code == 1
    assert len(out.errors) == 1 and len(out.lines) == len(
        [line for line in out.lines if not line.startswith("warning")]), out.stderr
    line = out.errors[0]
    assert RESTART in line and "kubelet" in line and "containerd" in line
    assert "no longer matches" in line
    assert live_state(m) == before and m.cdi_spec.read_bytes() == spec
    assert not (m.root / "run/unbounded-nvidia-setup").exists()


@pytest.mark.parametrize("what", ["no-root", "no-staging", "no-gpu", "tampered-root"])
def test_refresh_refuses_what_only_a_restart_can_fix(m: simgpu.SimMachine, cli: Cli,
                                                     what: str) -> None:
    if what != "no-root":
        assert cli(m.root, "run").code == 0
    spec = m.cdi_spec.read_bytes() if m.cdi_spec.exists() else None
    if what == "no-staging":
        shutil.rmtree(m.root / "run/host-nvidia")
    elif what == "no-gpu":
        for name in m.devices:
            (m.root / "dev" / name).unlink()
    elif what == "tampered-root":
        (m.driver_lib_dir / f"libnvidia-ptxjitcompiler.so.{m.version}").unlink()
    root = manifest(m.driver_root)
    out = cli(m.root, "run", "--spec-only")
    assert out.code == 1 and len(out.errors) == 1 and RESTART in out.errors[0], out.stderr
    assert manifest(m.driver_root) == root
    assert (m.cdi_spec.read_bytes() if m.cdi_spec.exists() else None) == spec
    if what == "tampered-root":
        assert cli(m.root, "run").code == 0  # what the line says to do repairs it
