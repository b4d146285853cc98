"""A GPU pod, end to end: a real container runtime (podman + runc, the CDI library that
containerd uses) starts containers from the spec `run` installed, on a machine staged
with the real NVIDIA userspace from Debian non-free (535 from bookworm, 550 from trixie).

What a pod must get (the incident's acceptance criterion): the device nodes, `libcuda.so.1`
and `libnvidia-ml.so.1` in the container's linker cache resolving to the driver's own
files (the update-ldcache hook ran), NVML loading and answering 9
(NVML_ERROR_DRIVER_NOT_LOADED, right without a GPU), `cuInit` answering a CUDA error code
rather than failing to load, and nvidia-smi saying it "couldn't communicate with the
NVIDIA driver". The controls reproduce the incident's own failures, so each assertion is
seen to fail on the inputs that caused it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from invariants import secure_after  # noqa: F401  (fixture)

import elfbuild
import pod
import realdriver
import simgpu
import toolkit
from conftest import Cli, needs_root, unmet
from realmachine import real_machine
from test_run import root_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]

SUITES = {major: suite for suite, major in realdriver.SUITES.items()}
PLUGIN_SPEC = "k8s.device-plugin.nvidia.com-gpu.json"


@pytest.fixture(autouse=True)
def pods() -> None:
    why = pod.unavailable()
    if why is not None:
        unmet(f"no container runtime: {why}")


def fetch(major: str) -> realdriver.RealDriver:
    try:
        return realdriver.fetch_real_driver("amd64", suite=SUITES[major])
    except realdriver.RealDriverUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real NVIDIA {major} files unavailable: {e}")


def ready_machine(tmp_path: Path, cli: Cli, drv: realdriver.RealDriver) -> simgpu.SimMachine:
    m = real_machine(tmp_path, drv)
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    return m


def staging(m: simgpu.SimMachine) -> Path:
    return m.root / "run/host-nvidia"


def assert_gets_the_driver(report: dict[str, Any], version: str) -> None:
    assert pod.missing(report, version) == [], report


def plugin_generate(m: simgpu.SimMachine, out_dir: Path) -> list[str]:
    """The device plugin's own generation (cdi-cri strategy): the driver root alone.
    Management mode: with every hook on, NVML mode adds disable-device-node-modification,
    which the nvidia-cdi-hook stand-in does not play."""
    return [str(toolkit.NVIDIA_CTK), "cdi", "generate", f"--driver-root={root_of(m)}",
            f"--dev-root={m.root}", "--mode=management", "--vendor=k8s.device-plugin.nvidia.com",
            "--class=gpu", f"--output={out_dir / PLUGIN_SPEC}"]


def links_into_staging(m: simgpu.SimMachine, version: str) -> None:
    """Make the live root what the old agent made: libcuda and NVML as absolute links
    into the staging mount (the incident)."""
    lib = m.driver_lib_dir
    for stem in ("libcuda.so", "libnvidia-ml.so"):
        name = f"{stem}.{version}"
        (lib / name).unlink()
        (lib / name).symlink_to(m.lib_dir / name)


@pytest.mark.parametrize("major", sorted(SUITES))
def test_a_pod_gets_the_driver(tmp_path: Path, cli: Cli, major: str) -> None:
    """From the spec `run` installed, with the staging mounts there and hidden (as the
    pod's runtime sees a node)."""
    drv = fetch(major)
    m = ready_machine(tmp_path, cli, drv)
    assert_gets_the_driver(pod.probe(etc_cdi=m.cdi_spec.parent).report(), drv.version)
    hidden = pod.probe(etc_cdi=m.cdi_spec.parent, hide=[staging(m)]).report()
    assert_gets_the_driver(hidden, drv.version)


def simulated_nvml(m: simgpu.SimMachine) -> None:
    """The machine's libnvidia-ml becomes the simulated one (tests/simnvml.c), so that
    NVML answers for its GPUs (nvidia-ctk's NVML mode, the stand-in's and the real one's
    alike) where Debian's real library answers 9 here; the rest of the driver stays
    Debian's. In a pod it answers 9 too: there it finds no GPU the kernel lists."""
    elfbuild.compile_so(m.lib_dir / f"libnvidia-ml.so.{m.version}", elfbuild.NVML_SONAME)
    m.write_config()


def test_a_pod_gets_the_gpu_it_asks_for(tmp_path: Path, cli: Cli) -> None:
    """nvidia-ctk's default mode on a GPU node (NVML: a device per GPU by index and uuid,
    plus `all`), through the spec `run` installed: `nvidia.com/gpu=0` gets GPU 0's node
    and not GPU 1's, GPU 1 by its uuid the other way round, `all` both; each with the
    driver. The machine carries Debian's 550 driver with the simulated NVML, which its
    GPUs answer."""
    drv = fetch("550")
    m = real_machine(tmp_path, drv)
    assert not m.nvml_answers  # Debian's libnvidia-ml: no GPU answers it here
    simulated_nvml(m)
    assert m.nvml_answers
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    names = [d["name"] for d in yaml.safe_load(m.cdi_spec.read_text())["devices"]]
    assert names == sorted(["0", "1", *m.nvml_gpus, "all"]), names
    nodes = {"nvidia0", "nvidia1"}
    want = {"0": {"nvidia0"}, m.nvml_gpus[1]: {"nvidia1"}, "all": nodes}
    seen = {}
    for device in want:
        report = pod.probe(f"nvidia.com/gpu={device}", etc_cdi=m.cdi_spec.parent,
                           hide=[staging(m)]).report()
        # pod.missing asks for GPU 0's node; GPU 1 alone has the rest.
        gaps = [g for g in pod.missing(report, drv.version)
                if g != "/dev/nvidia0 and /dev/nvidiactl"]
        assert gaps == [] and "nvidiactl" in report["devices"], (device, report)
        seen[device] = nodes & set(report["devices"])
    assert seen == want


def test_the_device_plugins_spec_from_the_driver_root_alone(tmp_path: Path, cli: Cli) -> None:
    """The device plugin generates its own spec (vendor k8s.device-plugin.nvidia.com) in
    /var/run/cdi from the driver root with the staging hidden; a pod asking for
    `k8s.device-plugin.nvidia.com/gpu=all` gets the driver through it alone."""
    drv = fetch("535")
    m = ready_machine(tmp_path, cli, drv)
    run_cdi = tmp_path / "var-run-cdi"
    run_cdi.mkdir()
    report = pod.probe("k8s.device-plugin.nvidia.com/gpu=all", run_cdi=run_cdi,
                       hide=[staging(m)], before=[plugin_generate(m, run_cdi)]).report()
    assert_gets_the_driver(report, drv.version)


def test_a_host_driver_upgrade_reaches_new_pods(tmp_path: Path, cli: Cli) -> None:
    """The host moves from 535 to 550 between two runs: afterwards pods get 550 through
    the node's spec and through the device plugin's."""
    old, new = fetch("535"), fetch("550")
    m = ready_machine(tmp_path, cli, old)
    assert_gets_the_driver(pod.probe(etc_cdi=m.cdi_spec.parent).report(), old.version)
    upgraded = real_machine(tmp_path / "upgrade", new)
    shutil.rmtree(staging(m))
    shutil.move(staging(upgraded), staging(m))
    shutil.copy(upgraded.root / "proc/driver/nvidia/version",
                m.root / "proc/driver/nvidia/version")
    shutil.rmtree(upgraded.root)
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    run_cdi = tmp_path / "var-run-cdi"
    run_cdi.mkdir()
    report = pod.probe(etc_cdi=m.cdi_spec.parent, hide=[staging(m)]).report()
    assert_gets_the_driver(report, new.version)
    report = pod.probe("k8s.device-plugin.nvidia.com/gpu=all", run_cdi=run_cdi,
                       hide=[staging(m)], before=[plugin_generate(m, run_cdi)]).report()
    assert_gets_the_driver(report, new.version)


def test_without_the_update_ldcache_hook_the_pods_cache_lacks_the_driver(
        tmp_path: Path, cli: Cli) -> None:
    """The linker-cache assertion is the hook's doing: the same spec with only
    create-symlinks leaves libcuda.so.1 and libnvidia-ml.so.1 out of the pod's cache."""
    drv = fetch("535")
    m = ready_machine(tmp_path, cli, drv)
    specs = pod.spec_without(m.cdi_spec, tmp_path / "no-ldcache", hook="update-ldcache")
    report = pod.probe(etc_cdi=specs, hide=[staging(m)]).report()
    assert pod.missing(report, drv.version) == [
        "libcuda.so.1 in the linker cache", "libnvidia-ml.so.1 in the linker cache"], report


def test_incident_a_spec_without_libcuda_and_nvml(tmp_path: Path, cli: Cli) -> None:
    """The incident's spec: the node's spec less its libcuda and NVML mounts (what the
    device plugin wrote when they were absolute links into staging it could not see).
    nvidia-smi in the pod says the incident's words."""
    drv = fetch("535")
    m = ready_machine(tmp_path, cli, drv)
    specs = pod.spec_without(m.cdi_spec, tmp_path / "incident",
                             mounts=(f"libcuda.so.{drv.version}", f"libnvidia-ml.so.{drv.version}"))
    report = pod.probe(etc_cdi=specs, hide=[staging(m)]).report()
    assert pod.SMI_NO_NVML in report["nvidia_smi"][1], report
    assert pod.missing(report, drv.version) == [
        "libcuda.so.1 in the linker cache", "libnvidia-ml.so.1 in the linker cache",
        "nvmlInit_v2 answering 9", "cuInit answering a CUDA error code",
        "nvidia-smi loading NVML"], report


def test_incident_a_root_of_links_into_hidden_staging(tmp_path: Path, cli: Cli) -> None:
    """The incident's root under a spec that names its libraries: with the staging hidden
    the runtime cannot mount them and the pod does not start, with the runtime's own "no
    such file or directory"; `run` repairs the root and the pod starts again."""
    drv = fetch("535")
    m = ready_machine(tmp_path, cli, drv)
    links_into_staging(m, drv.version)
    failed = pod.probe(etc_cdi=m.cdi_spec.parent, hide=[staging(m)])
    assert failed.code != 0, failed.output
    assert "no such file or directory" in failed.output, failed.output
    assert f"libcuda.so.{drv.version}" in failed.output or \
        f"libnvidia-ml.so.{drv.version}" in failed.output, failed.output
    assert cli(m.root, "run").code == 0
    assert_gets_the_driver(pod.probe(etc_cdi=m.cdi_spec.parent, hide=[staging(m)]).report(),
                           drv.version)
