"""Machines built like real ones (issue 20): Debian's own linker conf files for the
machine's architecture, the older agent's leftovers made as it made them (links into the
staging, then a plain ldconfig), /proc/devices as the kernel writes it, and the device
nodes CUDA needs with their majors.

The migrations use the real NVIDIA files (Debian non-free), the real ldconfig of the
machine's architecture (Debian's arm64 one under qemu for GB300-style machines) and the
nvidia-ctk stand-in (or NVIDIA's own in real-tool mode)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from invariants import secure_after  # noqa: F401  (fixture)

import realdriver
import simgpu
from conftest import Cli, needs_root
from realmachine import real_machine
from test_realdriver import fetch
from test_run import check_json, codes, load_spec, root_of, snapshot, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
ARM = "aarch64-linux-gnu"
X86 = "x86_64-linux-gnu"
DROPIN = "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"


def problems_of(report: dict[str, object]) -> list[dict[str, str]]:
    found = report["problems"]
    assert isinstance(found, list)
    return found


def cache_of(m: simgpu.SimMachine, ldconfig: str = "ldconfig") -> list[str]:
    """What the machine's loader reads: its cache, listed by its own ldconfig."""
    return subprocess.run([ldconfig, "-p", "-C", str(m.root / "etc/ld.so.cache")],
                          capture_output=True, text=True, check=True).stdout.splitlines()


def arm_machine(tmp_path: Path, ldconfig: str) -> tuple[simgpu.SimMachine, str]:
    """A GB300-style node: the real arm64 driver staged, Debian's arm64 conf files, the
    open kernel module's version line for aarch64 (what GB300 hosts run). Management
    mode: the nvidia-ctk stand-in, an x86_64 process here, cannot load the arm64 NVML
    that a real arm64 nvidia-ctk would."""
    drv = fetch("arm64")
    m = real_machine(tmp_path, drv)
    simgpu.debian_linker_files(m.root, ARM)
    (m.root / "proc/driver/nvidia/version").write_text(
        simgpu.module_version_text(drv.version, "open", "aarch64"))
    m.write_config(arch="aarch64", ldconfig=ldconfig, nvidia_ctk_args=["--mode=management"])
    return m, drv.version


# --------------------------------------------------------------------------------------
# The machines themselves


def test_simulated_machines_carry_debian_linker_files_and_proc_devices(
        m: simgpu.SimMachine) -> None:
    conf = m.root / "etc/ld.so.conf.d"
    assert sorted(p.name for p in conf.iterdir()) == ["libc.conf", f"{X86}.conf"]
    assert (conf / f"{X86}.conf").read_text().splitlines()[1:] == [
        f"/usr/local/lib/{X86}", f"/lib/{X86}", f"/usr/lib/{X86}"]
    assert os.readlink(m.root / "lib") == "usr/lib"
    text = (m.root / "proc/devices").read_text()
    assert text.startswith("Character devices:\n") and "\nBlock devices:\n" in text
    assert "195 nvidia\n" in text and "511 nvidia-uvm\n" in text


def test_debian_arm64_conf_sorts_before_the_dropin_and_x86_64_after() -> None:
    """The fact the migration bug rests on: glibc reads includes in byte order."""
    names = sorted([f"{ARM}.conf", f"{X86}.conf", "unbounded-nvidia-setup.conf",
                    "libc.conf"], key=os.fsencode)
    assert names == [f"{ARM}.conf", "libc.conf", "unbounded-nvidia-setup.conf", f"{X86}.conf"]


# --------------------------------------------------------------------------------------
# Migrated from the older agent


def test_migrated_gb300_node_becomes_ready_with_no_leftovers(tmp_path: Path, cli: Cli,
                                                           aarch64_ldconfig: str) -> None:
    """Debian's arm64 conf puts /usr/lib/aarch64-linux-gnu before the drop-in, and the old
    agent's links and its ldconfig's SONAME links sit there: the run removes them all
    before it judges the search order, and the node is Ready."""
    m, version = arm_machine(tmp_path, aarch64_ldconfig)
    left = simgpu.leave_old_agent_links(m, aarch64_ldconfig, ARM)
    usr = m.root / "usr/lib" / ARM
    assert f"libcuda.so.{version}" in left and "libcuda.so.1" in left, left
    assert os.readlink(usr / "libcuda.so.1") == f"libcuda.so.{version}"  # ldconfig's
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert [n for n in left if os.path.lexists(usr / n)] == []
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]
    lines = cache_of(m, aarch64_ldconfig)
    found = [line for line in lines if line.startswith("\tlibcuda.so.1 ")]
    assert found == [f"\tlibcuda.so.1 (libc6,AArch64) => /run/nvidia/driver/lib/{ARM}/"
                     "libcuda.so.1"], found


@pytest.mark.parametrize("suite", list(realdriver.SUITES), ids=realdriver.SUITES.values())
def test_migrated_x86_64_node_keeps_no_dangling_soname_links(tmp_path: Path, cli: Cli,
                                                            suite: str) -> None:
    drv = fetch("amd64", suite)
    m = real_machine(tmp_path, drv)
    left = simgpu.leave_old_agent_links(m)
    assert "libcuda.so.1" in left and "libnvidia-ml.so.1" in left, left
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    usr = m.root / "usr/lib" / X86
    assert [n for n in left if os.path.lexists(usr / n)] == []
    assert check_json(cli, m)["ok"] is True


def test_check_names_leftovers_as_legacy_links_not_as_shadows(tmp_path: Path, cli: Cli,
                                                             aarch64_ldconfig: str) -> None:
    m, _ = arm_machine(tmp_path, aarch64_ldconfig)
    assert cli(m.root, "run").code == 0
    left = simgpu.leave_old_agent_links(m, aarch64_ldconfig, ARM)
    report = check_json(cli, m)
    found = codes(report)
    assert "legacy-link" in found and "ldcache-shadowed" not in found, report["problems"]
    paths = {p["path"] for p in problems_of(report) if p["code"] == "legacy-link"}
    assert paths == {str(m.root / "usr/lib" / ARM / n) for n in left}


def test_a_package_copy_ahead_of_the_root_is_still_refused(tmp_path: Path, cli: Cli,
                                                          aarch64_ldconfig: str) -> None:
    """A regular libcuda.so.1 that a package put in /usr/lib/aarch64-linux-gnu is a real
    shadow: refused, naming the file and how to find its package, never advising to
    remove Debian's multiarch conf."""
    m, version = arm_machine(tmp_path, aarch64_ldconfig)
    usr = m.root / "usr/lib" / ARM
    shutil.copy(m.lib_dir / f"libcuda.so.{version}", usr / "libcuda.so.1")
    before = snapshot(m)
    out = cli(m.root, "run")
    assert out.code == 1, out.stderr
    assert len(out.errors) == 1, out.stderr
    line = out.errors[0]
    assert f"{usr}/libcuda.so.1 is another copy of libcuda.so.1" in line, line
    assert f"`dpkg -S /usr/lib/{ARM}/libcuda.so.1`" in line, line
    assert f"{ARM}.conf line 3" in line, line
    assert "remove that file or its line" not in line and "remove that conf" not in line
    assert snapshot(m) == before
    report = check_json(cli, m)
    shadowed = [p for p in problems_of(report) if p["code"] == "ldcache-shadowed"]
    conf = m.root / "etc/ld.so.conf.d" / f"{ARM}.conf"
    assert [p["path"] for p in shadowed] == [str(conf)], shadowed  # as within schema 1
    assert f"{usr}/libcuda.so.1 is another copy" in shadowed[0]["message"], shadowed


def test_keeping_the_dropin_after_debian_multiarch_changes_no_machine_library(
        tmp_path: Path, cli: Cli, aarch64_ldconfig: str) -> None:
    """The drop-in keeps its name, and so its place after aarch64-linux-gnu.conf
    (docs/architecture.md says why). Once the leftovers are gone that place costs
    nothing: the machine's own libraries resolve where they did before the run, and every
    driver SONAME to the driver root, each listed once."""
    m, _ = arm_machine(tmp_path, aarch64_ldconfig)
    usr = m.root / "usr/lib" / ARM
    # A library of the machine's own, in its multiarch dir.
    shutil.copy(m.lib_dir / "libz.so.1.2.13", usr / "libz.so.1.2.13")
    subprocess.run([aarch64_ldconfig, "-r", str(m.root)], check=True)
    own_before = [ln for ln in cache_of(m, aarch64_ldconfig) if "driver" not in ln]
    assert cli(m.root, "run").code == 0
    lines = cache_of(m, aarch64_ldconfig)
    assert [ln for ln in lines if "/run/nvidia/driver/" not in ln][1:] == own_before[1:]
    driver = [ln for ln in lines if "/run/nvidia/driver/" in ln]
    assert driver and all(ln.split(" => ")[1].startswith(f"/run/nvidia/driver/lib/{ARM}/")
                          for ln in driver)
    names = [ln.split()[0] for ln in lines]
    assert names.count("libcuda.so.1") == 1 and names.count("libnvidia-ml.so.1") == 1
    conf = sorted(os.listdir(m.root / "etc/ld.so.conf.d"), key=os.fsencode)
    assert conf == [f"{ARM}.conf", "libc.conf", "unbounded-nvidia-setup.conf"]


# --------------------------------------------------------------------------------------
# The device nodes CUDA needs


def set_majors(m: simgpu.SimMachine, **drivers: int) -> None:
    majors = dict(simgpu.NVIDIA_MAJORS, **{"nvidia-uvm": 511})
    majors.update({k.replace("_", "-"): v for k, v in drivers.items() if v})
    for k, v in drivers.items():
        if not v:
            majors.pop(k.replace("_", "-"), None)
    simgpu.write_proc_devices(m.root, majors)


def refused(cli: Cli, m: simgpu.SimMachine, code: str, *needles: str) -> None:
    """`run` exits 75 with one line holding `needles`, changes nothing, and `check` says
    `code` for the node."""
    before = snapshot(m)
    out = cli(m.root, "run")
    assert out.code == 75, out.stderr
    assert len(out.errors) == 1, out.stderr
    for needle in needles:
        assert needle in out.errors[0], out.errors[0]
    assert snapshot(m) == before
    report = check_json(cli, m)
    assert code in codes(report), report["problems"]


@pytest.fixture
def ready(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    return m


def test_no_nvidia_uvm_is_not_ready(ready: simgpu.SimMachine, cli: Cli) -> None:
    for name in ("nvidia-uvm", "nvidia-uvm-tools"):
        (ready.root / "dev" / name).unlink()
    refused(cli, ready, "device-missing", "/dev/nvidia-uvm is missing: CUDA needs it",
            "nvidia-modprobe -u -c0")
    report = check_json(cli, ready)
    found = [(p["code"], p["path"]) for p in problems_of(report)
             if p["code"] != "spec-bad-device-node"]  # the spec names the node too
    assert found == [("device-missing", str(ready.root / "dev/nvidia-uvm")),
                     ("setup-failed", str(ready.root / "run/unbounded-nvidia-setup.last-run"))
                     ], found


def test_no_nvidia_uvm_on_a_first_boot_builds_nothing(m: simgpu.SimMachine, cli: Cli) -> None:
    (m.root / "dev/nvidia-uvm").unlink()
    refused(cli, m, "device-missing", "/dev/nvidia-uvm")
    assert not os.path.lexists(root_of(m)) and not spec_of(m).exists()


@pytest.mark.parametrize("node", ["nvidiactl", "gpus"])
def test_no_control_or_gpu_node_is_not_ready(ready: simgpu.SimMachine, cli: Cli,
                                             node: str) -> None:
    if node == "gpus":
        for gpu in ("nvidia0", "nvidia1"):
            (ready.root / "dev" / gpu).unlink()
        refused(cli, ready, "device-missing", "no /dev/nvidia<N>")
    else:
        (ready.root / "dev/nvidiactl").unlink()
        refused(cli, ready, "device-missing", "/dev/nvidiactl is missing")


def test_uvm_node_of_a_reloaded_module_is_stale(ready: simgpu.SimMachine, cli: Cli) -> None:
    """nvidia-uvm was reloaded on the host and got major 508: the node bound before
    keeps 511 (CUDA error 999 in pods)."""
    set_majors(ready, nvidia_uvm=508)
    refused(cli, ready, "device-stale", "/dev/nvidia-uvm is character device 511:0",
            "gives nvidia-uvm major 508", "restart the machine")


def test_uvm_node_without_its_module_is_stale(ready: simgpu.SimMachine, cli: Cli) -> None:
    set_majors(ready, nvidia_uvm=0)
    refused(cli, ready, "device-stale", "lists no nvidia-uvm: its module is not loaded",
            "nvidia-modprobe -u -c0")


def test_gpu_node_without_the_nvidia_module_is_stale(ready: simgpu.SimMachine,
                                                     cli: Cli) -> None:
    simgpu.write_proc_devices(ready.root, {"nvidia-uvm": 511})
    refused(cli, ready, "device-stale", "lists no major 195")


def test_gpu_node_with_another_major_is_stale(ready: simgpu.SimMachine, cli: Cli) -> None:
    node = ready.root / "dev/nvidia0"
    node.unlink()
    os.mknod(node, 0o20666, os.makedev(196, 0))
    refused(cli, ready, "device-stale", "/dev/nvidia0 is character device 196:0")


@pytest.mark.parametrize("text", ["", "garbage\n", "Character devices:\n195 nvidia\n",
                                  "Character devices:\nxx nvidia\n\nBlock devices:\n"],
                         ids=["empty", "garbage", "cut-short", "bad-line"])
def test_a_proc_devices_that_does_not_parse_makes_the_nodes_stale(
        ready: simgpu.SimMachine, cli: Cli, text: str) -> None:
    (ready.root / "proc/devices").write_text(text)
    refused(cli, ready, "device-stale", "does not read as the kernel writes it")


def test_no_proc_devices_makes_the_nodes_stale(ready: simgpu.SimMachine, cli: Cli) -> None:
    (ready.root / "proc/devices").unlink()
    refused(cli, ready, "device-stale", "cannot read")


def test_the_older_driver_name_of_major_195_is_as_good(m: simgpu.SimMachine,
                                                       cli: Cli) -> None:
    """Up to 535 the nvidia module registered 195 once, as nvidia-frontend."""
    simgpu.write_proc_devices(m.root, {"nvidia-frontend": 195, "nvidia-uvm": 511})
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True


def test_mig_and_imex_nodes_carry_their_drivers_majors(m: simgpu.SimMachine,
                                                       cli: Cli) -> None:
    caps, imex = m.root / "dev/nvidia-caps", m.root / "dev/nvidia-caps-imex-channels"
    caps.mkdir()
    imex.mkdir()
    os.mknod(caps / "nvidia-cap1", 0o20444, os.makedev(237, 1))
    os.mknod(imex / "channel0", 0o20666, os.makedev(236, 0))
    set_majors(m, nvidia_caps=237, nvidia_caps_imex_channels=236)
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True
    set_majors(m, nvidia_caps=237, nvidia_caps_imex_channels=0)  # IMEX not loaded now
    report = check_json(cli, m)
    assert [(p["code"], p["path"]) for p in problems_of(report)] == [
        ("device-stale", str(imex / "channel0"))], report["problems"]


def test_the_drift_check_catches_a_module_reload_after_boot(ready: simgpu.SimMachine,
                                                            cli: Cli) -> None:
    metrics = ready.root / "var/lib/prometheus/node-exporter"  # the default, under --root
    metrics.mkdir(parents=True)
    assert cli(ready.root, "check", "--metrics").code == 0
    set_majors(ready, nvidia_uvm=508)
    assert cli(ready.root, "check", "--metrics").code == 1
    text = "".join(p.read_text() for p in metrics.glob("*.prom"))
    assert 'check_problems{code="device-stale"} 2' in text, text  # uvm and uvm-tools


# --------------------------------------------------------------------------------------
# Other modules' /dev/nvidia* nodes (GPUDirect Storage and the like)


def spec_nodes(m: simgpu.SimMachine) -> set[str]:
    """Every deviceNodes path of the installed spec: each device's and the common edits'."""
    doc: dict[str, Any] = load_spec(m)
    edits = [doc.get("containerEdits") or {}, *(d["containerEdits"] for d in doc["devices"])]
    return {n["path"] for e in edits for n in e.get("deviceNodes") or []}


@pytest.fixture
def gds(tmp_path: Path) -> simgpu.SimMachine:
    """An H100 GPUDirect Storage node: /dev/nvidia-fs<N> and another module's node beside
    the GPU's, as the host's bind of /dev/nvidia* brings them."""
    m = simgpu.make_machine(tmp_path / "root", gds=True)
    m.write_config()
    return m


@pytest.mark.parametrize("args", [None, ["--mode=management"]], ids=["nvml", "management"])
def test_a_gds_node_comes_up_ready_and_serves_no_nvidia_fs_node(
        gds: simgpu.SimMachine, cli: Cli, args: list[str] | None) -> None:
    """The nodes of a module the tool does not check never darken a node; nvidia-ctk
    serves no nvidia-fs node in either mode (NVML mode lists none, management mode skips
    the prefix): GDS is handed out by `--mode=gds`, not by nvidia.com/gpu."""
    assert "nvidia-fs3" in gds.devices and simgpu.OTHER_MODULE in gds.devices
    if args:
        gds.write_config(nvidia_ctk_args=args)
    out = cli(gds.root, "run")
    assert out.code == 0, out.stderr
    report = check_json(cli, gds)
    assert report["verdict"] == "ready" and report["problems"] == [], report["problems"]
    served = spec_nodes(gds)
    assert "/dev/nvidia0" in served and not [p for p in served if "nvidia-fs" in p], served
    if not args:  # NVML mode lists only the GPUs' and the control nodes
        assert f"/dev/{simgpu.OTHER_MODULE}" not in served, served


def test_other_modules_reloaded_or_gone_still_never_darken_a_node(
        gds: simgpu.SimMachine, cli: Cli) -> None:
    """nvidia-fs reloaded under another major, the other module unloaded: their nodes
    are stale, but not this tool's to judge."""
    assert cli(gds.root, "run").code == 0
    set_majors(gds, nvidia_fs=simgpu.GDS_MAJOR - 10)
    out = cli(gds.root, "run")
    assert out.code == 0, out.stderr
    assert check_json(cli, gds)["verdict"] == "ready"


@pytest.mark.parametrize("name,driver", [
    ("nvidia-uvm-tools", "nvidia-uvm"), ("nvidia-nvswitchctl", "nvidia-nvswitch"),
    ("nvidia-nvswitch0", "nvidia-nvswitch"), ("nvidia-nvlink", "nvidia-nvlink"),
    ("nvidia-modeset", None), ("nvidia1", None)])
def test_a_known_modules_stale_node_is_still_stale_beside_gds(
        gds: simgpu.SimMachine, cli: Cli, name: str, driver: str | None) -> None:
    """Names that share a prefix with another module's are still their module's: a
    stale major of a module the tool knows is `device-stale` on a GDS node too."""
    assert cli(gds.root, "run").code == 0
    stale = 504 if driver else simgpu.NVIDIA_MAJORS["nvidia"] + 1
    if driver and driver != "nvidia-uvm":
        simgpu.proc_devices_major(gds.root, driver, 505)
    node = gds.root / "dev" / name
    if node.exists():
        node.unlink()
    simgpu.mknod_char(node, stale, 1)
    refused(cli, gds, "device-stale", f"/dev/{name} is character device {stale}:1")


# --------------------------------------------------------------------------------------
# Staging without devices


def test_staging_without_devices_is_not_a_cpu_node(ready: simgpu.SimMachine, cli: Cli) -> None:
    for node in (ready.root / "dev").glob("nvidia*"):
        node.unlink()
    refused(cli, ready, "devices-not-bound", "driver staging is mounted",
            "no NVIDIA device node is", "nothing was changed")
    assert root_of(ready).is_dir() and spec_of(ready).is_file()
    assert (ready.root / DROPIN).is_file()
    assert check_json(cli, ready)["verdict"] == "not-ready-yet"


def test_staging_without_devices_on_a_first_boot(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    for node in (m.root / "dev").glob("nvidia*"):
        node.unlink()
    refused(cli, m, "devices-not-bound", "no NVIDIA device node is")
