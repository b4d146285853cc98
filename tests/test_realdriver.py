"""The real NVIDIA userspace driver (Debian non-free), among unrelated libraries, a stale
older driver and hostile entries: the root and spec nvidia-ctk accepts, also from the
device plugin's view where the staging mounts are not there."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from invariants import (
    assert_secure_root,
    secure_after,  # noqa: F401  (fixture)
)
from unbounded_nvidia_setup.elf import read_elf

import realdriver
import simgpu
from conftest import Cli, needs_root
from realmachine import real_machine
from test_run import check_json, load_spec, mounts, plugin_view, root_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]


def fetch(arch: str, suite: str = realdriver.DEFAULT_SUITE) -> realdriver.RealDriver:
    try:
        return realdriver.fetch_real_driver(arch, suite=suite)
    except realdriver.RealDriverUnavailable as e:
        if os.environ.get("CI"):
            raise  # CI must prove this for real
        pytest.skip(f"real NVIDIA files unavailable: {e}")


@pytest.mark.parametrize("suite", list(realdriver.SUITES), ids=realdriver.SUITES.values())
@pytest.mark.parametrize("arch", ["amd64"])
def test_real_driver_root_and_spec(tmp_path: Path, cli: Cli, arch: str, suite: str) -> None:
    """Bookworm's 535 and trixie's 550, each with its own file set (550 adds
    libnvidia-gpucomp, 535 has libnvidia-vulkan-producer without a SONAME)."""
    drv = fetch(arch, suite)
    assert drv.version.startswith(realdriver.SUITES[suite] + ".")
    m = real_machine(tmp_path, drv)
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    root = root_of(m)
    lib = root / "lib" / drv.multiarch
    assert_secure_root(root)
    files = {p.name for p in lib.rglob("*") if p.is_file() and not p.is_symlink()}
    real_libs = {p.name for p in drv.libraries}
    assert real_libs <= files | {n for n in real_libs if "vdpau" in n}
    assert not [f for f in files if "525.147.05" in f]
    assert (f"libnvidia-gpucomp.so.{drv.version}" in files) == (suite == "trixie")
    assert not [f for f in files if f in m.hostile]
    for name in ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"):
        assert (lib / name).is_symlink() and (lib / name).resolve().is_file()
    with open(lib / f"libcuda.so.{drv.version}", "rb") as f:
        elf = read_elf(f)
    assert elf is not None and elf.soname == "libcuda.so.1"
    assert (root / "usr/bin/nvidia-smi").stat().st_mode & 0o777 == 0o755
    assert (root / "lib/firmware/nvidia" / drv.version / "gsp_ga10x.bin").is_file()

    host_paths = mounts(load_spec(m))
    assert str(lib / f"libcuda.so.{drv.version}") in host_paths
    assert str(lib / f"libnvidia-ml.so.{drv.version}") in host_paths
    assert str(root / "usr/bin/nvidia-smi") in host_paths
    assert check_json(cli, m)["ok"] is True

    names = plugin_view(m, tmp_path)
    assert {f"libcuda.so.{drv.version}", f"libnvidia-ml.so.{drv.version}", "nvidia-smi",
            "gsp_ga10x.bin"} <= names

    # Second run: nothing to do, nothing swapped.
    shutil.move(tmp_path / "hidden", m.root / "run/host-nvidia")
    ino = os.stat(root).st_ino
    out = cli(m.root, "run")
    assert out.code == 0 and "not rebuilt" in out.stderr
    assert os.stat(root).st_ino == ino


def test_real_aarch64_driver_on_an_aarch64_machine(tmp_path: Path, cli: Cli,
                                                   aarch64_ldconfig: str) -> None:
    """GB300 hosts are arm64: with arch forced, the real arm64 files make the root, and
    the real arm64 ldconfig (under qemu) resolves every SONAME of it: `check` is clean."""
    drv = fetch("arm64")
    m = real_machine(tmp_path, drv)
    simgpu.debian_linker_files(m.root, "aarch64-linux-gnu")  # Debian's arm64 conf files
    # Management mode: the x86_64 stand-in cannot load the arm64 NVML (a real arm64
    # nvidia-ctk would, on a GPU).
    m.write_config(arch="aarch64", ldconfig=aarch64_ldconfig,
                   nvidia_ctk_args=["--mode=management"])
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    lib = root_of(m) / "lib/aarch64-linux-gnu"
    assert (lib / f"libcuda.so.{drv.version}").is_file()
    assert (root_of(m) / "usr/bin/nvidia-smi").is_file()
    assert not (root_of(m) / "lib/x86_64-linux-gnu").exists()
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]
    # The same arm64 staging on an x86_64 machine: every arm64 file is foreign.
    m.write_config()
    out = cli(m.root, "run")
    assert out.code == 1 and "incomplete driver state" in out.errors[0]
