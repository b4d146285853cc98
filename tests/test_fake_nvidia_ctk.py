"""Tests for the nvidia-ctk test stand-in (tests/fakes/nvidia-ctk).

Each test builds a tiny driver root in tmp_path: real ELF shared objects compiled with gcc
(with a DT_SONAME, as the real tool reads it) and mknod'ed character devices (needs root).
The stand-in is run as a program, the way the product runs nvidia-ctk.

The NVML tests at the end run on tests/simgpu.py machines, whose simulated libnvidia-ml
(tests/simnvml.c) both the stand-in and NVIDIA's nvidia-ctk load: with
UNB_TEST_NVIDIA_CTK set (real-tool mode) they run against the real tool too ([real]),
and every assertion holds for both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from invariants import TRACE_SET, accesses, parse_calls

import elfbuild
import realdriver
import toolkit
from conftest import needs, unmet

FAKE = Path(__file__).parent / "fakes" / "nvidia-ctk"
VER = "535.309.01"
LIBDIR = "lib/x86_64-linux-gnu"
CONTAINER_LIBDIR = "/" + LIBDIR
HOOK_FLAGS = (
    "--disable-hook",
    "all",
    "--enable-hook",
    "create-symlinks",
    "--enable-hook",
    "update-ldcache",
)

needs_root = needs(os.geteuid() == 0, "needs root: mknod of fake /dev/nvidia* character devices")
pytestmark = pytest.mark.root


# --------------------------------------------------------------------------- helpers


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FAKE_NVIDIA_CTK_", "NVIDIA_CTK_")) and k != "PYTHONFAULTHANDLER"
    }
    # The fake runs via its '#!/usr/bin/env python3' line: use this interpreter's python3.
    # No nvidia-cdi-hook on PATH (conftest puts the tests' one first): the specs name the
    # default /usr/bin/nvidia-cdi-hook, which the hook-path test changes on purpose.
    hooks = {str(toolkit.NVIDIA_CDI_HOOK.parent), str(toolkit.STAND_IN_NVIDIA_CDI_HOOK.parent)}
    path = [d for d in env.get("PATH", "").split(os.pathsep) if d not in hooks]
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), *path])
    env.update(extra)
    return env


def ctk(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FAKE), *args],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def mounts(spec: dict[str, Any]) -> dict[str, str]:
    """containerPath -> hostPath of the common mounts."""
    return {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"].get("mounts", [])}


def hooks(spec: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for hook in spec["containerEdits"].get("hooks", []):
        assert hook["hookName"] == "createContainer"
        assert hook["path"] == "/usr/bin/nvidia-cdi-hook"
        assert hook["args"][0] == "nvidia-cdi-hook"
        out[hook["args"][1]] = hook["args"][2:]
    return out


def links(spec: dict[str, Any]) -> list[str]:
    args = hooks(spec).get("create-symlinks", [])
    assert args[0::2] == ["--link"] * (len(args) // 2)
    return args[1::2]


@dataclass
class Tree:
    """A directory tree builder (driver roots, dev roots, staging dirs)."""

    path: Path
    so: Callable[[str], Path]

    def lib(self, name: str, soname: str | None = None, subdir: str = LIBDIR) -> Path:
        target = self.path / subdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if soname is None:
            soname = name.split(".so")[0] + ".so.1"
        shutil.copyfile(self.so(soname), target)
        return target

    def link(self, rel: str, target: str) -> Path:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
        return path

    def file(self, rel: str, mode: int = 0o644, text: str = "x") -> Path:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        return path

    def chardev(self, rel: str, major: int = 195, minor: int = 0) -> Path:
        path = self.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        return path


@pytest.fixture
def tree(tmp_path: Path, so_cache: Callable[[str], Path]) -> Callable[[str], Tree]:
    def make(name: str) -> Tree:
        path = tmp_path / name
        path.mkdir()
        return Tree(path, so_cache)

    return make


def standard_libs(root: Tree, version: str = VER) -> None:
    """libcuda + libnvidia-ml with relative SONAME links, as the product lays them out."""
    root.lib(f"libcuda.so.{version}")
    root.link(f"{LIBDIR}/libcuda.so.1", f"libcuda.so.{version}")
    root.link(f"{LIBDIR}/libcuda.so", "libcuda.so.1")
    root.lib(f"libnvidia-ml.so.{version}")
    root.link(f"{LIBDIR}/libnvidia-ml.so.1", f"libnvidia-ml.so.{version}")


@pytest.fixture
def driver_root(tree: Callable[[str], Tree]) -> Tree:
    root = tree("driver")
    standard_libs(root)
    return root


@pytest.fixture
def dev_root(tree: Callable[[str], Tree]) -> Iterator[Tree]:
    if os.geteuid() != 0:
        unmet("needs root: mknod of fake /dev/nvidia* character devices")
    dev = tree("devroot")
    dev.chardev("dev/nvidia0", 195, 0)
    dev.chardev("dev/nvidiactl", 195, 255)
    dev.chardev("dev/nvidia-uvm", 511, 0)
    yield dev


@pytest.fixture
def gpu_host(tree: Callable[[str], Tree]) -> Tree:
    """A GPU host's files, as the simulated NVML (tests/simnvml.c) reads them: its device
    nodes, the kernel module's information files of GPUs 0 and 1 (tests/simgpu.py), and a
    driver root at run/nvidia/driver holding libcuda and the simulated libnvidia-ml.
    The library finds the host by its own path (the part before /run/nvidia/); use the
    host as the dev root and :func:`host_driver` as the driver root."""
    import simgpu
    import simnvml

    if os.geteuid() != 0:
        unmet("needs root: mknod of fake /dev/nvidia* character devices")
    host = tree("host")
    for name, major, minor in (("nvidia0", 195, 0), ("nvidia1", 195, 1),
                               ("nvidiactl", 195, 255), ("nvidia-uvm", 511, 0)):
        host.chardev(f"dev/{name}", major, minor)
    for minor in (0, 1):
        simnvml.add_gpu_information(host.path, minor, simgpu.DEFAULT_VERSION)
    standard_libs(Tree(host.path / "run/nvidia/driver", host.so))
    return host


def host_driver(host: Tree) -> Path:
    return host.path / "run/nvidia/driver"


def generate(
    root: Path | str,
    out: Path | None,
    *extra: str,
    dev: Path | str | None = None,
    mode: str | None = "management",
    timeout: float = 30,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    args = ["cdi", "generate", f"--driver-root={root}"]
    if dev is not None:
        args.append(f"--dev-root={dev}")
    args.append("--format=yaml")
    if out is not None:
        args.append(f"--output={out}")
    if mode is not None:
        args.append(f"--mode={mode}")
    return ctk(*args, *extra, timeout=timeout, **env)


def assert_failed(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "level=error" in line]
    assert error_lines, result.stderr
    for needle in needles:
        assert needle in error_lines[-1], result.stderr


# --------------------------------------------------------------------------- --version


def test_is_an_executable_python_script() -> None:
    assert os.access(FAKE, os.X_OK)
    assert FAKE.read_text().startswith("#!/usr/bin/python3\n")


def test_version_default() -> None:
    result = ctk("--version")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "NVIDIA Container Toolkit CLI version 1.20.0"
    assert lines[1].startswith("commit: ")
    assert all(c in "0123456789abcdef" for c in lines[1].removeprefix("commit: "))


def test_version_override() -> None:
    result = ctk("--version", FAKE_NVIDIA_CTK_VERSION="1.17.8")
    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == "NVIDIA Container Toolkit CLI version 1.17.8"
    assert ctk("--version", FAKE_NVIDIA_CTK_VERSION="not-a-version").returncode == 2


# --------------------------------------------------------------------------- device nodes


@needs_root
def test_dev_root_defaults_to_driver_root(
    driver_root: Tree, dev_root: Tree, tmp_path: Path
) -> None:
    out = tmp_path / "out" / "nvidia.yaml"
    # The driver root has no dev/: without --dev-root nothing is found there.
    result = generate(driver_root.path, out)
    assert_failed(result, "failed to generate CDI spec", "no NVIDIA device nodes found")
    assert not out.exists()
    # With an explicit dev root it works; container paths are relative to the dev root.
    assert generate(driver_root.path, out, dev=dev_root.path).returncode == 0
    (device,) = load(out)["devices"]
    assert device["name"] == "all"
    nodes = {n["path"]: n for n in device["containerEdits"]["deviceNodes"]}
    assert set(nodes) == {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert nodes["/dev/nvidia0"]["hostPath"] == str(dev_root.path / "dev/nvidia0")
    assert nodes["/dev/nvidiactl"]["major"] == 195 and nodes["/dev/nvidiactl"]["minor"] == 255


@needs_root
def test_dev_nodes_inside_driver_root_are_found_by_default(
    driver_root: Tree, tmp_path: Path
) -> None:
    driver_root.chardev("dev/nvidiactl", 195, 255)
    out = tmp_path / "nvidia.yaml"
    assert generate(driver_root.path, out).returncode == 0
    nodes = load(out)["devices"][0]["containerEdits"]["deviceNodes"]
    assert [(n["path"], n["hostPath"]) for n in nodes] == [
        ("/dev/nvidiactl", str(driver_root.path / "dev/nvidiactl"))
    ]


def test_device_nodes_must_be_character_devices(
    driver_root: Tree, tree: Callable[[str], Tree], tmp_path: Path
) -> None:
    dev = tree("regular-dev")
    dev.file("dev/nvidia0")
    dev.file("dev/nvidiactl")
    dev.path.joinpath("dev/nvidia-uvm").mkdir()
    out = tmp_path / "nvidia.yaml"
    result = generate(driver_root.path, out, dev=dev.path)
    assert_failed(result, "no NVIDIA device nodes found")
    assert not out.exists()


@needs_root
def test_blocked_and_mixed_nodes(
    driver_root: Tree, tree: Callable[[str], Tree], tmp_path: Path
) -> None:
    dev = tree("mixed-dev")
    dev.chardev("dev/nvidia1", 195, 1)
    dev.file("dev/nvidia0")  # regular file: ignored
    dev.chardev("dev/nvidia-nvswitch0", 234, 0)  # blocked in management mode
    dev.chardev("dev/nvidia-caps/nvidia-cap1", 236, 1)
    out = tmp_path / "nvidia.yaml"
    assert generate(driver_root.path, out, dev=dev.path).returncode == 0
    nodes = load(out)["devices"][0]["containerEdits"]["deviceNodes"]
    assert sorted(n["path"] for n in nodes) == ["/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia1"]


# --------------------------------------------------------------------------- libraries


@needs_root
def test_spec_shape_and_library_mounts(driver_root: Tree, dev_root: Tree, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.yaml"
    result = generate(driver_root.path, out, *HOOK_FLAGS, dev=dev_root.path)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("---\n")
    spec = load(out)
    assert spec["cdiVersion"] == "0.5.0"  # hostPath on device nodes needs 0.5.0
    assert spec["kind"] == "nvidia.com/gpu"
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    real_libdir = os.path.realpath(driver_root.path / LIBDIR)
    assert mounts(spec) == {
        f"{CONTAINER_LIBDIR}/libcuda.so.{VER}": f"{real_libdir}/libcuda.so.{VER}",
        f"{CONTAINER_LIBDIR}/libnvidia-ml.so.{VER}": f"{real_libdir}/libnvidia-ml.so.{VER}",
    }
    for mount in spec["containerEdits"]["mounts"]:
        assert mount["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


@needs_root
def test_relative_soname_links_become_create_symlinks_args(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    root = tree("driver")
    standard_libs(root)
    root.lib(f"libnvidia-ptxjitcompiler.so.{VER}")  # no SONAME link next to it
    out = tmp_path / "nvidia.yaml"
    assert generate(root.path, out, *HOOK_FLAGS, dev=dev_root.path).returncode == 0
    spec = load(out)
    assert links(spec) == [
        f"libcuda.so.1::{CONTAINER_LIBDIR}/libcuda.so",
        f"libcuda.so.{VER}::{CONTAINER_LIBDIR}/libcuda.so.1",
        f"libnvidia-ml.so.{VER}::{CONTAINER_LIBDIR}/libnvidia-ml.so.1",
    ]
    assert hooks(spec)["update-ldcache"] == ["--folder", CONTAINER_LIBDIR]
    assert f"{CONTAINER_LIBDIR}/libnvidia-ptxjitcompiler.so.{VER}" in mounts(spec)


@needs_root
def test_absolute_link_out_of_root_drops_library(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    staging = tree("staging")  # stands for /run/host-nvidia/0, visible to this process
    staging.lib(f"libcuda.so.{VER}", subdir=".")
    root = tree("driver")
    root.link(f"{LIBDIR}/libcuda.so.{VER}", str(staging.path / f"libcuda.so.{VER}"))
    root.link(f"{LIBDIR}/libcuda.so.1", f"libcuda.so.{VER}")
    root.lib(f"libnvidia-ml.so.{VER}")
    root.link(f"{LIBDIR}/libnvidia-ml.so.1", f"libnvidia-ml.so.{VER}")
    out = tmp_path / "nvidia.yaml"
    result = generate(root.path, out, *HOOK_FLAGS, dev=dev_root.path)
    assert result.returncode == 0, result.stderr  # silently: the real tool does not fail
    spec = load(out)
    assert list(mounts(spec)) == [f"{CONTAINER_LIBDIR}/libnvidia-ml.so.{VER}"]
    assert not any(str(staging.path) in h for h in mounts(spec).values())
    assert not any("libcuda" in link for link in links(spec)[1:])


@needs_root
def test_all_libraries_out_of_root_leave_no_library_mounts(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    staging = tree("staging")
    standard_libs(staging)
    root = tree("driver")
    for name in (f"libcuda.so.{VER}", f"libnvidia-ml.so.{VER}"):
        root.link(f"{LIBDIR}/{name}", str(staging.path / LIBDIR / name))
    out = tmp_path / "nvidia.yaml"
    assert generate(root.path, out, dev=dev_root.path).returncode == 0
    # The version is still inferred (the links resolve), but nothing is mounted.
    assert not any(".so." in path for path in mounts(load(out)))


@needs_root
def test_dangling_absolute_links_fail_naming_the_libraries(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    root = tree("driver")
    for name in (f"libcuda.so.{VER}", f"libnvidia-ml.so.{VER}"):
        root.link(f"{LIBDIR}/{name}", f"/run/host-nvidia/0/not-mounted-here/{name}")
    out = tmp_path / "nvidia.yaml"
    result = generate(root.path, out, dev=dev_root.path)
    assert_failed(result, "failed to determine driver version", "libcuda.so.", "libnvidia-ml.so.")
    assert not out.exists()


@needs_root
def test_empty_root_fails(tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path) -> None:
    result = generate(tree("empty").path, tmp_path / "x.yaml", dev=dev_root.path)
    assert_failed(result, 'failed to locate \\"libcuda.so.\\"')
    assert not (tmp_path / "x.yaml").exists()


@needs_root
def test_version_comes_from_file_name(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    root = tree("driver")
    root.lib("libcuda.so.550.54.14", subdir="usr/lib/x86_64-linux-gnu/nvidia/current")
    root.lib(f"libnvidia-ml.so.{VER}", subdir="usr/lib64")  # not the libcuda version
    out = tmp_path / "nvidia.yaml"
    assert generate(root.path, out, dev=dev_root.path).returncode == 0
    spec = load(out)
    assert list(mounts(spec)) == ["/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.550.54.14"]
    assert hooks(spec)["enable-cuda-compat"] == ["--host-driver-version=550.54.14"]


@needs_root
def test_version_falls_back_to_libnvidia_ml(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    root = tree("driver")
    root.lib("libnvidia-ml.so.570.1.2")
    out = tmp_path / "nvidia.yaml"
    assert generate(root.path, out, dev=dev_root.path).returncode == 0
    assert list(mounts(load(out))) == [f"{CONTAINER_LIBDIR}/libnvidia-ml.so.570.1.2"]


@needs_root
def test_every_versioned_library_vdpau_and_nvvm70(
    driver_root: Tree, dev_root: Tree, tmp_path: Path
) -> None:
    driver_root.lib(f"libfoo.so.{VER}", soname="libfoo.so.1")  # any *.so.<ver> is taken
    driver_root.lib("libstale.so.470.1.1")  # other version: not taken
    driver_root.lib(f"libvdpau_nvidia.so.{VER}", subdir=f"{LIBDIR}/vdpau")
    driver_root.lib("libnvidia-nvvm70.so.4")
    out = tmp_path / "nvidia.yaml"
    assert generate(driver_root.path, out, dev=dev_root.path).returncode == 0
    spec = load(out)
    paths = set(mounts(spec))
    assert f"{CONTAINER_LIBDIR}/libfoo.so.{VER}" in paths
    assert f"{CONTAINER_LIBDIR}/vdpau/libvdpau_nvidia.so.{VER}" in paths
    assert f"{CONTAINER_LIBDIR}/libnvidia-nvvm70.so.4" in paths
    assert not any("libstale" in p for p in paths)
    folders = hooks(spec)["update-ldcache"][1::2]
    assert folders == [CONTAINER_LIBDIR, f"{CONTAINER_LIBDIR}/vdpau"]


@needs_root
def test_helpers_must_be_executable_files(
    driver_root: Tree, dev_root: Tree, tmp_path: Path
) -> None:
    driver_root.file("usr/bin/nvidia-smi", 0o755, "#!/bin/sh\n")
    driver_root.file("usr/bin/nvidia-debugdump", 0o644)  # not executable
    driver_root.path.joinpath("usr/bin/nvidia-persistenced").mkdir()  # a directory
    driver_root.link("usr/bin/nvidia-imex", "/nonexistent/nvidia-imex")  # dangling
    driver_root.file("nvidia-cuda-mps-control", 0o755)  # the root itself is not searched
    driver_root.file(f"lib/firmware/nvidia/{VER}/gsp_ga10x.bin")
    driver_root.file("lib/firmware/nvidia/470.1.1/gsp_old.bin")
    out = tmp_path / "nvidia.yaml"
    assert generate(driver_root.path, out, dev=dev_root.path).returncode == 0
    found = mounts(load(out))
    assert found["/usr/bin/nvidia-smi"] == str(driver_root.path / "usr/bin/nvidia-smi")
    assert f"/lib/firmware/nvidia/{VER}/gsp_ga10x.bin" in found
    unexpected = ("debugdump", "persistenced", "imex", "mps", "gsp_old")
    assert not [p for p in found if any(word in p for word in unexpected)]


# --------------------------------------------------------------------------- output


@needs_root
@pytest.mark.parametrize(
    ("name", "fmt", "written", "is_json"),
    [
        ("nvidia.yaml", "yaml", "nvidia.yaml", False),
        ("x.tmp", "yaml", "x.tmp.yaml", False),
        ("spec.yml", "yaml", "spec.yml.yaml", False),
        ("y.json", "yaml", "y.json", True),
        ("z", "json", "z.json", True),
    ],
)
def test_output_naming(
    driver_root: Tree,
    dev_root: Tree,
    tmp_path: Path,
    name: str,
    fmt: str,
    written: str,
    is_json: bool,
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = ctk(
        "cdi",
        "generate",
        f"--driver-root={driver_root.path}",
        f"--dev-root={dev_root.path}",
        f"--format={fmt}",
        f"--output={out_dir / name}",
        "--mode=management",
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == [written]  # no temp file left
    text = (out_dir / written).read_text()
    if is_json:
        assert json.loads(text)["kind"] == "nvidia.com/gpu"
    else:
        assert text.startswith("---\n")
        assert yaml.safe_load(text)["kind"] == "nvidia.com/gpu"


@needs_root
def test_output_replaced_by_rename_and_stdout(
    driver_root: Tree, dev_root: Tree, tmp_path: Path
) -> None:
    out = tmp_path / "nvidia.yaml"
    out.write_text("old")
    inode = out.stat().st_ino
    assert generate(driver_root.path, out, dev=dev_root.path).returncode == 0
    assert out.stat().st_ino != inode
    result = generate(driver_root.path, None, dev=dev_root.path)
    assert result.returncode == 0
    assert result.stdout.startswith("---\n")
    assert yaml.safe_load(result.stdout) == load(out)


# --------------------------------------------------------------------------- hooks


@needs_root
def test_hook_selection_flags(driver_root: Tree, dev_root: Tree, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.yaml"
    assert generate(driver_root.path, out, *HOOK_FLAGS, dev=dev_root.path).returncode == 0
    assert list(hooks(load(out))) == ["create-symlinks", "update-ldcache"]
    assert generate(driver_root.path, out, "--disable-hook=all", dev=dev_root.path).returncode == 0
    assert "hooks" not in load(out)["containerEdits"]


@needs_root
def test_default_hooks_per_version(gpu_host: Tree, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.yaml"
    expected = {
        "1.20.0": [
            "create-symlinks",
            "enable-cuda-compat",
            "update-ldcache",
            "disable-device-node-modification",
            "update-application-profile",
        ],
        "1.18.0": [
            "create-symlinks",
            "enable-cuda-compat",
            "update-ldcache",
            "disable-device-node-modification",
        ],
        "1.17.8": ["create-symlinks", "enable-cuda-compat", "update-ldcache"],
    }
    for version, names in expected.items():
        result = generate(
            host_driver(gpu_host),
            out,
            dev=gpu_host.path,
            mode=None,
            FAKE_NVIDIA_CTK_VERSION=version,
        )
        assert result.returncode == 0, result.stderr
        assert list(hooks(load(out))) == names, version


def test_hook_flags_unknown_before_1_18(driver_root: Tree, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.yaml"
    result = generate(driver_root.path, out, *HOOK_FLAGS, FAKE_NVIDIA_CTK_VERSION="1.17.8")
    assert_failed(result, "flag provided but not defined: -disable-hook")
    assert "Incorrect Usage: flag provided but not defined: -disable-hook" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("version", "args", "needle"),
    [
        ("1.20.0", ("--enable-hook", "all"), "enabling all hooks is not supported"),
        ("1.20.0", ("--enable-hook", "create-symlink"), 'unknown hook name \\"create-symlink\\"'),
        ("1.19.0", ("--enable-hook", "update-application-profile"), "unknown hook name"),
        ("1.20.0", ("--bogus",), "flag provided but not defined: -bogus"),
        ("1.20.0", ("--mode=bogus",), "invalid discovery mode: bogus"),
        ("1.17.8", ("--mode=imex",), "invalid discovery mode: imex"),
        ("1.20.0", ("--mode=csv",), 'unsupported mode \\"csv\\"'),
        ("1.20.0", ("--format=toml",), "invalid output format: toml"),
        ("1.20.0", ("--device-name-strategy=serial",), "invalid device name strategy: serial"),
        ("1.18.0", ("--no-all-device",), "flag provided but not defined: -no-all-device"),
        ("1.20.0", ("--output",), "flag needs an argument: -output"),
    ],
)
def test_bad_arguments_fail(
    driver_root: Tree, tmp_path: Path, version: str, args: tuple[str, ...], needle: str
) -> None:
    result = ctk(
        "cdi",
        "generate",
        f"--driver-root={driver_root.path}",
        f"--output={tmp_path / 'x.yaml'}",
        *args,
        FAKE_NVIDIA_CTK_VERSION=version,
    )
    assert_failed(result, needle)
    assert not (tmp_path / "x.yaml").exists()


# --------------------------------------------------------------------------- modes


def test_auto_mode_needs_nvml(driver_root: Tree, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.yaml"
    # libnvidia-ml.so.1 is in the root but no kernel driver is loaded: the library's own
    # text for 9 (nvmlErrorString, as the real tool prints it)
    result = generate(driver_root.path, out, mode=None)
    assert_failed(result, "failed to initialize NVML: Driver Not Loaded")
    os.unlink(driver_root.path / LIBDIR / "libnvidia-ml.so.1")
    # no library loaded: go-nvml's own name for the return
    result = generate(driver_root.path, out, mode="nvml")
    assert_failed(result, "failed to initialize NVML: ERROR_LIBRARY_NOT_FOUND")
    assert not out.exists()


# --------------------------------------------------------------------------- NVML


def custom_lib(root: Tree, name: str, soname: str, source: str) -> Path:
    """A real shared object `name` in the root's library dir built from `source`, with its
    SONAME link (as the product lays them out)."""
    src = root.path.parent / f"{name}.c"
    src.write_text(source)
    target = root.path / LIBDIR / name
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(target),
                    str(src)], check=True)
    link = root.path / LIBDIR / soname
    if not os.path.lexists(link):
        link.symlink_to(name)
    return target


def nvml_root(tree: Callable[[str], Tree], source: str) -> Tree:
    """libcuda as usual; libnvidia-ml.so.<ver> built from `source`."""
    root = tree("driver")
    root.lib(f"libcuda.so.{VER}")
    root.link(f"{LIBDIR}/libcuda.so.1", f"libcuda.so.{VER}")
    custom_lib(root, f"libnvidia-ml.so.{VER}", "libnvidia-ml.so.1", source)
    return root


def died_of_missing_symbol(result: subprocess.CompletedProcess[str], symbol: str) -> None:
    """The real tool's death (FACTS.md): ld.so's one line, exit 127, no Go error log."""
    assert result.returncode == 127, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last == f"{FAKE}: symbol lookup error: {FAKE}: undefined symbol: {symbol}", last
    assert "level=error" not in result.stderr


@needs_root
@pytest.mark.parametrize("mode", ["management", None])
def test_libnvidia_ml_without_nvml_init_kills_it_like_the_real_tool(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path, mode: str | None
) -> None:
    """A stub (the CUDA toolkit's, or another library behind a wrong libnvidia-ml.so.1
    link): the real nvidia-ctk 1.20 calls nvmlInit even in management mode, and dies."""
    root = nvml_root(tree, "int fake_symbol;\n")
    out = tmp_path / "nvidia.yaml"
    died_of_missing_symbol(generate(root.path, out, dev=dev_root.path, mode=mode),
                           "nvmlInit")
    assert not out.exists()


@needs_root
def test_nvml_init_is_called_and_its_answer_used(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    """The init function is resolved like go-nvml (nvmlInit_v2, else nvmlInit) and really
    called: its return code, in the library's own words (nvmlErrorString), is what nvml
    mode reports. Without nvmlErrorString the first failing init kills the process in any
    mode, when its error is formatted (seen with the real 1.20: exit 127)."""
    out = tmp_path / "nvidia.yaml"
    texts = ('const char *nvmlErrorString(int r) { return r == 2 ? "Invalid Argument" : '
             'r == 3 ? "Not Supported" : r == 9 ? "Driver Not Loaded" : "Unknown Error"; }\n')
    only_v2 = nvml_root(tree, "int nvmlInit_v2(void) { return 3; }\n" + texts)
    result = generate(only_v2.path, out, dev=dev_root.path, mode=None)
    assert_failed(result, "failed to initialize NVML: Not Supported")
    # Management mode goes on whatever NVML answers.
    assert generate(only_v2.path, out, dev=dev_root.path).returncode == 0
    shutil.rmtree(only_v2.path)
    only_v1 = nvml_root(tree, "int nvmlInit(void) { return 2; }\n" + texts)
    result = generate(only_v1.path, out, dev=dev_root.path, mode="nvml")
    assert_failed(result, "failed to initialize NVML: Invalid Argument")
    shutil.rmtree(only_v1.path)
    both = nvml_root(tree, "int nvmlInit(void) { return 2; }\n"
                           "int nvmlInit_v2(void) { return 9; }\n" + texts)
    result = generate(both.path, out, dev=dev_root.path, mode="nvml")
    assert_failed(result, "failed to initialize NVML: Driver Not Loaded")
    shutil.rmtree(both.path)
    mute = nvml_root(tree, "int nvmlInit_v2(void) { return 3; }\n")
    for mode in (None, "nvml", "management"):
        died_of_missing_symbol(generate(mute.path, out, dev=dev_root.path, mode=mode),
                               "nvmlErrorString")


def test_simulated_nvml_answers_like_a_machine_without_a_driver(tmp_path: Path) -> None:
    """tests/simgpu.py's libnvidia-ml (tests/simnvml.c) exports NVML's entry points and,
    away from a simulated GPU machine (its path has no /run/nvidia/ here: this host, no
    GPU), answers as the real library without a loaded kernel module (checked against
    Debian's 535.309.01)."""
    import ctypes

    path = tmp_path / "libnvidia-ml.so.1"
    elfbuild.compile_so(path, elfbuild.NVML_SONAME)
    lib = ctypes.CDLL(str(path))
    lib.nvmlErrorString.restype = ctypes.c_char_p
    for name in elfbuild.NVML_ENTRY_POINTS:
        assert hasattr(lib, name), name
    assert lib.nvmlInit() == lib.nvmlInit_v2() == lib.nvmlInitWithFlags(0) == 9
    assert lib.nvmlErrorString(9) == b"Driver Not Loaded"
    count = ctypes.c_uint()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # uninitialized
    assert lib.nvmlSystemGetDriverVersion(ctypes.create_string_buffer(80), 80) == 1
    # Debian's 535 answers 0 here; nvml.h says Uninitialized, the stricter reading the
    # simulated library takes (the product and nvidia-ctk ignore Shutdown's answer).
    assert lib.nvmlShutdown() == 1
    stub = tmp_path / "stub" / "libnvidia-ml.so.1"
    elfbuild.compile_so(stub, elfbuild.NVML_SONAME, nvml=False)
    assert not hasattr(ctypes.CDLL(str(stub)), "nvmlInit")


@needs_root
def test_unloadable_libnvidia_ml_is_library_not_found(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    """A libnvidia-ml.so.1 dlopen refuses (another architecture) is no library at all."""
    root = tree("driver")
    standard_libs(root)
    elfbuild.aarch64_so(root.path / LIBDIR / f"libnvidia-ml.so.{VER}", elfbuild.NVML_SONAME)
    out = tmp_path / "nvidia.yaml"
    result = generate(root.path, out, dev=dev_root.path, mode=None)
    assert_failed(result, "failed to initialize NVML: ERROR_LIBRARY_NOT_FOUND")
    assert generate(root.path, out, dev=dev_root.path).returncode == 0


@needs_root
def test_sandboxutils_without_its_init_kills_it_too(
    driver_root: Tree, dev_root: Tree, tmp_path: Path
) -> None:
    out = tmp_path / "nvidia.yaml"
    name = f"libnvidia-sandboxutils.so.{VER}"
    custom_lib(driver_root, name, "libnvidia-sandboxutils.so.1", "int fake_symbol;\n")
    died_of_missing_symbol(generate(driver_root.path, out, dev=dev_root.path),
                           "nvSandboxUtilsInit")
    assert not out.exists()
    os.unlink(driver_root.path / LIBDIR / name)
    custom_lib(driver_root, name, "libnvidia-sandboxutils.so.1",
               "int nvSandboxUtilsInit(void *input) { (void)input; return 0; }\n")
    result = generate(driver_root.path, out, dev=dev_root.path)
    assert result.returncode == 0, result.stderr
    assert "Failed to init nvsandboxutils" in result.stderr
    assert f"{CONTAINER_LIBDIR}/{name}" in mounts(load(out))


@needs_root
def test_nvml_scratch_root_is_never_left_behind(
    driver_root: Tree, dev_root: Tree, tmp_path: Path
) -> None:
    """The empty root the init runs in is gone when the stand-in is; one a SIGKILLed
    stand-in left (the product kills an nvidia-ctk it no longer needs) is removed by the
    next one, whatever else is there."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    stale = scratch / f".nvidia-ctk-nvml.{int(dead.stdout)}.1"
    alive = scratch / f".nvidia-ctk-nvml.{os.getpid()}.1"
    stale.mkdir()
    alive.mkdir()
    out = tmp_path / "nvidia.yaml"
    result = generate(driver_root.path, out, dev=dev_root.path, TMPDIR=str(scratch))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in scratch.iterdir()) == [alive.name]


@needs_root
def test_real_libnvidia_ml_answers_driver_not_loaded_and_touches_no_dev(
    tree: Callable[[str], Tree], dev_root: Tree, tmp_path: Path
) -> None:
    """Debian's real libnvidia-ml loads, its nvmlInit_v2 answers 9 without a GPU and
    generation goes on in management mode. Run as root in place, that library mknods
    /dev/nvidiactl and unlinks /dev/char/195:255 in the caller's /dev; the stand-in
    calls it chrooted into an empty directory, so every write it attempts is there."""
    try:
        drv = realdriver.fetch_real_driver("amd64")
    except realdriver.RealDriverUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real NVIDIA files unavailable: {e}")
    root = tree("driver")
    for lib in (f"libcuda.so.{drv.version}", f"libnvidia-ml.so.{drv.version}"):
        target = root.path / LIBDIR / lib
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(drv.library(lib), target)
        root.link(f"{LIBDIR}/{lib.split('.so.')[0]}.so.1", lib)
    out = tmp_path / "out" / "nvidia.yaml"
    result = generate(root.path, out, dev=dev_root.path, mode=None)
    assert_failed(result, "failed to initialize NVML: Driver Not Loaded")
    trace = tmp_path / "trace"
    argv = ["strace", "-f", "-qq", "-y", "-o", str(trace), "-e", f"trace={TRACE_SET}",
            str(FAKE), "cdi", "generate", f"--driver-root={root.path}",
            f"--dev-root={dev_root.path}", f"--output={out}", "--mode=management"]
    proc = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"{CONTAINER_LIBDIR}/libnvidia-ml.so.{drv.version}" in mounts(load(out))
    writes = [a for a in accesses(parse_calls(trace.read_text())) if a.kind == "write"]
    nvml_dev = [a for a in writes if a.path.endswith("/dev/nvidiactl")]
    assert nvml_dev, "the real nvmlInit_v2 was not called"
    scratch = ("/tmp/.nvidia-ctk-nvml.", str(out.parent))
    outside = [a for a in writes if not a.path.startswith(scratch)]
    assert not outside, outside


# --------------------------------------------------------------------------- knobs


def test_log_knob_records_exact_arguments(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    ctk("--version", FAKE_NVIDIA_CTK_LOG=str(log))
    ctk(
        "cdi",
        "generate",
        "--driver-root=/nonexistent",
        "--mode=management",
        FAKE_NVIDIA_CTK_LOG=str(log),
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [
        ["--version"],
        ["cdi", "generate", "--driver-root=/nonexistent", "--mode=management"],
    ]


def test_hang_knob(driver_root: Tree, tmp_path: Path) -> None:
    out = tmp_path / "nvidia.yaml"
    with pytest.raises(subprocess.TimeoutExpired):
        generate(driver_root.path, out, FAKE_NVIDIA_CTK_HANG="1", timeout=0.7)
    assert not out.exists()


@pytest.mark.parametrize(("name", "signum"), [("KILL", signal.SIGKILL), ("SEGV", signal.SIGSEGV)])
def test_signal_knob(driver_root: Tree, tmp_path: Path, name: str, signum: int) -> None:
    out = tmp_path / "nvidia.yaml"
    result = generate(driver_root.path, out, FAKE_NVIDIA_CTK_SIGNAL=name)
    assert result.returncode == -signum
    assert not out.exists()


@needs_root
def test_corrupt_knob(driver_root: Tree, dev_root: Tree, tmp_path: Path) -> None:
    def corrupt(how: str) -> str:
        out = tmp_path / f"{how}.yaml"
        result = generate(driver_root.path, out, dev=dev_root.path, FAKE_NVIDIA_CTK_CORRUPT=how)
        assert result.returncode == 0, result.stderr
        return out.read_text()

    with pytest.raises(yaml.YAMLError):
        yaml.safe_load(corrupt("garbage"))
    assert "kind" not in yaml.safe_load(corrupt("nokind"))
    assert yaml.safe_load(corrupt("wrongkind"))["kind"] != "nvidia.com/gpu"
    assert yaml.safe_load(corrupt("nodevices"))["devices"] == []
    staged = yaml.safe_load(corrupt("staging"))
    libcuda = mounts(staged)[f"{CONTAINER_LIBDIR}/libcuda.so.{VER}"]
    assert libcuda == f"/run/host-nvidia/0/libcuda.so.{VER}"
    # A generation that fails still fails, corrupt knob or not.
    result = generate(driver_root.path, tmp_path / "x.yaml", FAKE_NVIDIA_CTK_CORRUPT="garbage")
    assert_failed(result, "no NVIDIA device nodes found")
    assert ctk("cdi", "generate", FAKE_NVIDIA_CTK_CORRUPT="bogus").returncode == 2


@needs_root
def test_nvml_finds_the_gpus_a_simulated_kernel_module_lists(gpu_host: Tree,
                                                              tmp_path: Path) -> None:
    """The simulated libnvidia-ml lists the GPUs of the host it sits in (the part of its
    path before /run/nvidia/), as its kernel module lists them
    (proc/driver/nvidia/gpus/<bus>/information, as tests/simgpu.py writes them): in bus
    order, each with its uuid and /dev/nvidia<minor>; nvidia-ctk's default mode (auto)
    is then NVML mode. Without /dev/nvidiactl to reach the module through, or without the
    files, NVML's init fails as without a GPU."""
    import simgpu
    import simnvml

    shutil.rmtree(gpu_host.path / "proc")
    gpu_host.chardev("dev/nvidia3", 195, 3)
    late, first = (simnvml.add_gpu_information(gpu_host.path, minor, simgpu.DEFAULT_VERSION)
                   for minor in (3, 0))
    out = tmp_path / "nvidia.yaml"
    driver = host_driver(gpu_host)
    result = generate(driver, out, dev=gpu_host.path, mode=None)
    assert result.returncode == 0, result.stderr
    spec = load(out)
    assert [d["name"] for d in spec["devices"]] == sorted(["0", first, "1", late, "all"])
    by_name = {d["name"]: d["containerEdits"].get("deviceNodes", []) for d in spec["devices"]}
    assert [n["path"] for n in by_name["1"]] == ["/dev/nvidia3"]
    assert [n["path"] for n in by_name[first]] == ["/dev/nvidia0"]
    os.unlink(gpu_host.path / "dev/nvidiactl")
    result = generate(driver, out, dev=gpu_host.path, mode=None)
    assert_failed(result, "failed to initialize NVML: Driver Not Loaded")
    gpu_host.chardev("dev/nvidiactl", 195, 255)
    shutil.rmtree(gpu_host.path / "proc")
    result = generate(driver, out, dev=gpu_host.path, mode="nvml")
    assert_failed(result, "failed to initialize NVML: Driver Not Loaded")


# ------------------------------------------------- NVML on a simulated GPU machine, both tools
#
# These run the stand-in, and in real-tool mode (UNB_TEST_NVIDIA_CTK) NVIDIA's nvidia-ctk
# too ([real]), on a tests/simgpu.py machine: both load its simulated libnvidia-ml
# (tests/simnvml.c) from the driver root, which reads the machine's GPUs. Every
# assertion holds for both.

TOOLS = [pytest.param(FAKE, id="stand-in")]
if toolkit.REAL:
    TOOLS.append(pytest.param(toolkit.NVIDIA_CTK, id="real"))
LOST = ("failed to generate CDI spec: failed to create device CDI specs: failed to construct "
        "device spec generators: failed to get full GPU device editors: error getting device "
        "handle for index '2': GPU is lost")


@pytest.fixture(params=TOOLS)
def nvidia_ctk(request: pytest.FixtureRequest) -> Path:
    tool: Path = request.param
    return tool


@dataclass
class Machine:
    """A simulated machine with a driver root laid out as `run` lays it out (its staging
    copied to <root>/run/nvidia/driver/lib/x86_64-linux-gnu)."""

    m: Any  # simgpu.SimMachine
    tool: Path
    out: Path

    def generate(self, *extra: str, mode: str | None = None, proc_driver: bool = False,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``cdi generate`` of the machine (default mode: auto), ``proc_driver``: with the
        machine's proc/driver as /proc/driver (its MIG caps, tests/procdriver.py);
        subprocess.TimeoutExpired after ``timeout`` seconds, the tool killed."""
        import procdriver

        if os.path.lexists(self.out):
            self.out.unlink()
        argv = [str(self.tool), "cdi", "generate", f"--driver-root={self.m.driver_root}",
                f"--dev-root={self.m.root}", f"--output={self.out}", *extra]
        if mode is not None:
            argv.append(f"--mode={mode}")
        if proc_driver:
            why = procdriver.available()
            if why is not None:
                unmet(f"a private /proc/driver: {why}")
            argv = procdriver.in_private_proc_driver(self.m.root, argv)
        return subprocess.run(argv, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout, check=False)

    def devices(self, *extra: str, mode: str | None = None,
                proc_driver: bool = False) -> dict[str, list[tuple[str, int, int]]]:
        """name -> (path, major, minor) of its device nodes, in the spec's order."""
        result = self.generate(*extra, mode=mode, proc_driver=proc_driver)
        assert result.returncode == 0, result.stderr
        return {d["name"]: [(n["path"], n.get("major", 0), n.get("minor", 0))
                            for n in d["containerEdits"].get("deviceNodes", [])]
                for d in load(self.out)["devices"]}


@pytest.fixture
def machine(tmp_path: Path, nvidia_ctk: Path) -> Machine:
    import simgpu

    if os.geteuid() != 0:
        unmet("needs root: mknod of the machine's character devices")
    m = simgpu.make_machine(tmp_path / "root", unrelated=0, toolkit_libs=False,
                            helpers=False, firmware=False)
    shutil.copytree(m.lib_dir, m.driver_lib_dir, symlinks=True)
    return Machine(m, nvidia_ctk, tmp_path / "out" / "nvidia.yaml")


def node(path: str, major: int = 195, minor: int | None = None) -> tuple[str, int, int]:
    if minor is None:
        minor = int(path.removeprefix("/dev/nvidia"))
    return (path, major, minor)


def last_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if "level=error" in line]
    assert lines, result.stderr
    message: str = json.loads(lines[-1].split(" msg=", 1)[1])
    return message


def test_nvml_mode_lists_the_machines_gpus(machine: Machine) -> None:
    """The default mode (auto) is NVML mode on a simulated GPU machine: a device per GPU by
    index and by uuid, each with its /dev/nvidia<minor>, and `all` with both; the devices
    in name order (1.20's spec simplifier sorts them)."""
    uuid0, uuid1 = machine.m.nvml_gpus
    result = machine.generate()
    assert result.returncode == 0, result.stderr
    assert "Auto-detected mode as 'nvml'" in result.stderr
    assert "level=error" not in result.stderr
    devices = machine.devices()
    gpu0, gpu1 = [node("/dev/nvidia0")], [node("/dev/nvidia1")]
    assert devices == {"0": gpu0, "1": gpu1, uuid0: gpu0, uuid1: gpu1, "all": gpu0 + gpu1}
    assert list(devices) == sorted(devices)
    common = load(machine.out)["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in common] == ["/dev/nvidia-modeset", "/dev/nvidia-uvm",
                                           "/dev/nvidia-uvm-tools", "/dev/nvidiactl"]
    assert list(machine.devices("--device-name-strategy=uuid", mode="nvml")) == [
        *sorted([uuid0, uuid1]), "all"]


def test_a_lost_gpu_fails_nvml_mode_and_not_management_mode(machine: Machine) -> None:
    """A GPU fallen off the bus (NVML answers 15 for its handle) fails NVML mode's whole
    generate at its index, exit 1, no spec written; management mode, which never asks
    NVML for devices, lists its node in `all`. The healthy GPUs, asked for by uuid or by
    index (`--device-id`), get their devices and an `all` of them alone. Reset, it is
    back."""
    import simnvml

    uuid2 = simnvml.add_gpu(machine.m, 2)
    uuid0, uuid1 = machine.m.nvml_gpus[:2]
    simnvml.lose_gpu(machine.m, 2)
    for mode in (None, "nvml"):
        result = machine.generate(mode=mode)
        assert result.returncode == 1, result.stderr
        assert last_error(result) == LOST
        assert not machine.out.exists()
    nodes = [path for path, _, _ in machine.devices(mode="management")["all"]]
    assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2"} <= set(nodes)
    gpu0, gpu1 = [node("/dev/nvidia0")], [node("/dev/nvidia1")]
    healthy = {"0": gpu0, "1": gpu1, uuid0: gpu0, uuid1: gpu1, "all": gpu0 + gpu1}
    for ids in (f"{uuid0},{uuid1}", "0,1"):
        assert machine.devices(f"--device-id={ids}") == healthy, ids
    result = machine.generate("--device-id=2")
    assert result.returncode == 1
    assert last_error(result).endswith("failed to get device handle from index: GPU is lost")
    simnvml.recover_gpu(machine.m, 2)
    assert list(machine.devices()) == sorted(["0", "1", "2", uuid0, uuid1, uuid2, "all"])


def test_nvml_init_fails_without_the_kernel_modules_gpus(machine: Machine) -> None:
    """Without the GPU information files (simnvml.silence_nvml) or /dev/nvidiactl, NVML's
    init answers 9 and NVML mode fails with the library's words for it."""
    import simnvml

    want = ("failed to generate CDI spec: failed to create device CDI specs: failed to "
            "construct device spec generators: failed to initialize NVML: Driver Not Loaded")
    os.unlink(machine.m.root / "dev/nvidiactl")
    result = machine.generate()
    assert (result.returncode, last_error(result)) == (1, want), result.stderr
    os.mknod(machine.m.root / "dev/nvidiactl", stat.S_IFCHR | 0o666, os.makedev(195, 255))
    assert machine.generate().returncode == 0
    simnvml.silence_nvml(machine.m)
    result = machine.generate()
    assert (result.returncode, last_error(result)) == (1, want), result.stderr
    assert not machine.out.exists()
    assert machine.generate(mode="management").returncode == 0


def test_mig_devices_in_nvml_mode(machine: Machine) -> None:
    """A MIG-enabled GPU is its MIG devices in NVML mode, named `<i>:<j>` and by their
    MIG uuid, each with the parent's node and its GPU and compute instances' caps nodes
    (minors from the host's /proc/driver/nvidia-caps/mig-minors, the machine's here in a
    private mount namespace); the GPU itself gets no full-GPU device. Asked for by index
    it is a full GPU (1.20 checks no MIG mode there). Reconfigured, the spec lists the new
    MIG devices and none of the old; MIG off, the GPU is a full GPU again."""
    import simnvml

    m = machine.m
    uuid0, uuid1 = m.nvml_gpus
    migs = simnvml.enable_mig(m, 1, [(1, 0, 3, 3), (7, 0, 0, 0)])
    caps = 510  # simnvml.CAPS_MAJOR, written into the machine's proc/devices
    assert f"{caps} nvidia-caps" in (m.root / "proc/devices").read_text()

    def mig_nodes(gi: int, ci: int) -> list[tuple[str, int, int]]:
        g, c = simnvml.gi_cap_minor(1, gi), simnvml.ci_cap_minor(1, gi, ci)
        return [node("/dev/nvidia1"), (f"/dev/nvidia-caps/nvidia-cap{g}", caps, g),
                (f"/dev/nvidia-caps/nvidia-cap{c}", caps, c)]

    gpu0 = [node("/dev/nvidia0")]
    first, second = mig_nodes(1, 0), mig_nodes(7, 0)
    devices = machine.devices(proc_driver=True)
    assert devices == {"0": gpu0, uuid0: gpu0, "1:0": first, migs[0]: first,
                       "1:1": second, migs[1]: second,
                       "all": [*gpu0, *first, *second[1:]]}, devices
    assert list(devices) == sorted(devices)
    # Without the machine's mig-minors where nvidia-ctk reads them, every MIG device fails.
    result = machine.generate()
    assert result.returncode == 1
    assert last_error(result).endswith("error getting MIG capability device paths: <nil>")
    # By id: a MIG device by index or uuid; the MIG-enabled GPU by index, as a full GPU.
    assert machine.devices(f"--device-id=1:1,{migs[0]}", proc_driver=True) == {
        "1:0": first, migs[0]: first, "1:1": second, migs[1]: second,
        "all": first + second[1:]}
    assert machine.devices("--device-id=1", proc_driver=True) == {
        "1": [node("/dev/nvidia1")], uuid1: [node("/dev/nvidia1")],
        "all": [node("/dev/nvidia1")]}

    again = simnvml.enable_mig(m, 1, [(2, 0, 1, 1)])
    assert not set(again) & set(migs)
    third = mig_nodes(2, 0)
    devices = machine.devices(proc_driver=True)
    assert devices == {"0": gpu0, uuid0: gpu0, "1:0": third, again[0]: third,
                       "all": gpu0 + third}, devices
    old = {path for path, _, _ in first[1:] + second[1:]}
    assert not any(path in old for nodes in devices.values() for path, _, _ in nodes)
    assert not any(os.path.lexists(m.root / path.lstrip("/")) for path in old)

    simnvml.disable_mig(m, 1)
    gpu1 = [node("/dev/nvidia1")]
    assert machine.devices(proc_driver=True) == {"0": gpu0, "1": gpu1, uuid0: gpu0,
                                                 uuid1: gpu1, "all": gpu0 + gpu1}


def test_imex_channels_are_in_management_modes_all_only(machine: Machine) -> None:
    """IMEX channel nodes (/dev/nvidia-caps-imex-channels/channel<N>) are in management
    mode's `all`, with their major and minor; 1.20's NVML mode lists them nowhere."""
    import simnvml

    paths = simnvml.add_imex_channels(machine.m, 2)
    imex = 509  # simnvml.IMEX_MAJOR, written into the machine's proc/devices
    assert f"{imex} nvidia-caps-imex-channels" in (machine.m.root / "proc/devices").read_text()
    all_nodes = machine.devices(mode="management")["all"]
    assert [(p, imex, n) for n, p in enumerate(paths)] == [
        n for n in all_nodes if "nvidia-caps-imex-channels" in n[0]]
    machine.devices()
    assert "nvidia-caps-imex-channels" not in machine.out.read_text()


def test_gds_nodes_are_in_no_mode_and_another_modules_only_in_management(
        machine: Machine) -> None:
    """GPUDirect Storage's /dev/nvidia-fs<N> (nvidia-fs, its own major): NVML mode lists
    them nowhere and management mode skips the prefix, so the product's spec never
    serves them. Another module's /dev/nvidia* node (tests/nodefiles.py) is in
    management mode's `all`, which globs /dev/nvidia*, and nowhere in NVML mode."""
    import nodefiles

    other = f"/dev/{nodefiles.OTHER_MODULE}"
    assert nodefiles.add_other_module_nodes(machine.m.root, 4)[-1] == other[5:]
    served = {name: [n[0] for n in nodes] for name, nodes in
              machine.devices(mode="management").items()}
    assert other in served["all"] and not any("nvidia-fs" in p for p in served["all"])
    assert list(served) == ["all"]
    assert "nvidia-fs" not in machine.out.read_text()  # nor in the common edits
    machine.devices()
    assert "nvidia-fs" not in machine.out.read_text()
    assert other not in machine.out.read_text()


def test_simulated_nvml_reads_its_machine(tmp_path: Path) -> None:
    """tests/simnvml.c itself, through ctypes as go-nvml calls it: the machine it sits in
    (the part of its real path before /run/host-nvidia/), its GPUs in bus order, a lost
    GPU's 15 while it still counts, MIG mode and MIG devices, the driver version from its
    file name, and init again after shutdown sees what changed."""
    import ctypes

    import simgpu
    import simnvml

    if os.geteuid() != 0:
        unmet("needs root: mknod of the machine's character devices")
    m = simgpu.make_machine(tmp_path / "root", unrelated=0, toolkit_libs=False,
                            helpers=False, firmware=False)
    lib = ctypes.CDLL(str(m.lib_dir / "libnvidia-ml.so.1"))
    lib.nvmlErrorString.restype = ctypes.c_char_p
    count, handle, mig = ctypes.c_uint(), ctypes.c_void_p(), ctypes.c_void_p()
    buf = ctypes.create_string_buffer(96)
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # not initialised
    assert lib.nvmlInit_v2() == 0
    assert lib.nvmlSystemGetDriverVersion(buf, 96) == 0 and buf.value == m.version.encode()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 and count.value == 2
    for index, uuid in enumerate(m.nvml_gpus):
        assert lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0
        assert lib.nvmlDeviceGetUUID(handle, buf, 96) == 0 and buf.value == uuid.encode()
        minor = ctypes.c_uint()
        assert lib.nvmlDeviceGetMinorNumber(handle, ctypes.byref(minor)) == 0
        assert minor.value == index
        pci = ctypes.create_string_buffer(68)
        assert lib.nvmlDeviceGetPciInfo_v3(handle, pci) == 0
        assert pci.raw[36:52] == f"0000{simnvml.gpu_bus_id(index)}".encode()
    assert lib.nvmlDeviceGetUUID(handle, buf, 10) == 7  # insufficient size
    assert lib.nvmlShutdown() == 0
    simnvml.lose_gpu(m, 1)
    migs = simnvml.enable_mig(m, 0, [(1, 0, 3, 3)])
    assert lib.nvmlInit_v2() == 0
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 and count.value == 2
    assert lib.nvmlDeviceGetHandleByIndex_v2(1, ctypes.byref(handle)) == 15
    assert lib.nvmlErrorString(15) == b"GPU is lost"
    assert lib.nvmlDeviceGetHandleByUUID(m.nvml_gpus[1].encode(), ctypes.byref(handle)) == 15
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    current, pending, slots = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    assert lib.nvmlDeviceGetMigMode(handle, ctypes.byref(current), ctypes.byref(pending)) == 0
    assert (current.value, pending.value) == (1, 1)
    assert lib.nvmlDeviceGetMaxMigDeviceCount(handle, ctypes.byref(slots)) == 0
    assert slots.value == 7
    assert lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0, ctypes.byref(mig)) == 0
    assert lib.nvmlDeviceGetUUID(mig, buf, 96) == 0 and buf.value == migs[0].encode()
    assert lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, 1, ctypes.byref(mig)) == 6
    assert lib.nvmlShutdown() == 0
    simnvml.silence_nvml(m)
    assert lib.nvmlInit_v2() == 9


SPECS = "failed to generate CDI spec: failed to create device CDI specs: "
GENERATORS = SPECS + "failed to construct device spec generators: "
FULL_GPUS = GENERATORS + "failed to get full GPU device editors: "
MIGS = (GENERATORS + "failed to get MIG device editors: error visiting devices: error visiting "
        "device: error visiting device: ")
DISCOVERER = SPECS + "failed to get CDI device edits: failed to create device discoverer: "
# What 1.20 says when GPU 1's query answers 999 (simnvml.fail_query) in a plain `cdi
# generate` (auto: NVML mode), as NVIDIA's nvidia-ctk said it here; None: it is not
# fatal (1.20 does not ask it of a full GPU, or ignores it).
FAILING_QUERY = {
    "nvmlDeviceGetUUID": FULL_GPUS + "error visiting device: failed to get device UUID",
    "nvmlDeviceGetName": FULL_GPUS + "error checking whether device is skipped: error "
                                     "getting device name",
    "nvmlDeviceGetMigMode": FULL_GPUS + "error visiting device: error getting MIG mode",
    "nvmlDeviceGetMinorNumber": DISCOVERER + "failed to create device discoverer: error "
                                             "getting device node path: error getting GPU "
                                             "device minor number",
    "nvmlDeviceGetPciInfo": DISCOVERER + "failed to create device discoverer: error getting "
                                         "PCI info for device: error getting PCI info",
    "nvmlDeviceGetMaxMigDeviceCount": MIGS + "error getting max MIG device count",
    "nvmlDeviceGetMigDeviceHandleByIndex": MIGS + "error getting MIG device handle at index "
                                                  "'0'",
    "nvmlDeviceGetAttributes": None,
    "nvmlDeviceGetMemoryInfo": None,
    "nvmlDeviceGetCudaComputeCapability": None,
    "nvmlDeviceGetIndex": None,
    "nvmlDeviceIsMigDeviceHandle": None,
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": None,
    "nvmlDeviceGetGpuInstanceId": None,
    "nvmlDeviceGetComputeInstanceId": None,
}
MIG_PROFILE = DISCOVERER + "error getting MIG Profile attributes: "
# The same with GPU 1 in MIG mode (one 4g device), the machine's mig-minors in place.
FAILING_MIG_QUERY = {
    **FAILING_QUERY,
    "nvmlDeviceGetUUID": MIGS + "error visiting MIG device: error visiting MIG device: failed "
                                "to get device UUID",
    "nvmlDeviceGetMinorNumber": DISCOVERER + "error getting GPU device minor number",
    "nvmlDeviceGetPciInfo": None,  # asked of a graphics MIG profile's parent alone
    "nvmlDeviceIsMigDeviceHandle": MIGS + "error creating new MIG device wrapper: error "
                                          "checking if device is a MIG device",
    "nvmlDeviceGetAttributes": MIG_PROFILE + "error getting MIG device attributes",
    "nvmlDeviceGetMemoryInfo": MIG_PROFILE + "error getting parent memory info",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": MIG_PROFILE + "error getting parent "
                                                                  "device handle",
    "nvmlDeviceGetGpuInstanceId": MIG_PROFILE + "error getting MIG device GPU Instance ID",
    "nvmlDeviceGetComputeInstanceId": MIG_PROFILE + "error getting MIG device Compute "
                                                    "Instance ID",
}


def test_the_failing_queries_are_the_simulated_nvmls() -> None:
    import simnvml

    assert sorted(FAILING_QUERY) == sorted(FAILING_MIG_QUERY) == sorted(simnvml.QUERIES)


@pytest.mark.parametrize("mig", [False, True], ids=["full", "mig"])
@pytest.mark.parametrize("function", sorted(FAILING_QUERY))
def test_a_failing_query_fails_nvml_mode_where_1_20_does(machine: Machine, function: str,
                                                         mig: bool) -> None:
    """A GPU whose handle NVML gives but one of whose queries answers 999, Unknown Error
    (GPU 1 of 0..1; ``mig``: in MIG mode): where 1.20 asks that query in NVML mode its
    generate fails, exit 1, no spec, with its own words and NVML's for 999; a query it
    does not ask, or whose error it ignores, changes nothing. Management mode never asks."""
    import simnvml

    m = machine.m
    if mig:
        simnvml.enable_mig(m, 1, [(1, 0, 3, 3)])
    simnvml.fail_query(m, 1, function, 999)
    error = (FAILING_MIG_QUERY if mig else FAILING_QUERY)[function]
    result = machine.generate(proc_driver=mig)
    if error is None:
        assert result.returncode == 0, result.stderr
        # both GPUs: 0, 1 (or 1:0), their uuids and all
        assert len(load(machine.out)["devices"]) == 5
    else:
        assert result.returncode == 1, result.stderr
        assert last_error(result) == f"{error}: Unknown Error"
        assert not machine.out.exists()
    assert machine.generate(mode="management").returncode == 0


def test_a_hanging_gpu_blocks_nvml_mode_until_it_is_killed(machine: Machine) -> None:
    """A GPU whose GSP stopped answering (simnvml.hang_gpu): NVML mode's generate, which
    gets every GPU's handle, does not end (run killed it after 3 s); SIGTERM ends it,
    with no spec. One query that blocks (its MIG mode) blocks it too; management mode,
    which asks NVML for no GPU, ends; the GPU recovered, NVML mode ends."""
    import simnvml

    m = machine.m
    for function in (None, "nvmlDeviceGetMigMode"):
        simnvml.hang_gpu(m, 1, function)
        with pytest.raises(subprocess.TimeoutExpired):
            machine.generate(timeout=3)
        assert not machine.out.exists()
        assert machine.generate(mode="management").returncode == 0
        simnvml.recover_gpu(m, 1)
    simnvml.hang_gpu(m, 1)
    machine.out.unlink()
    argv = [str(machine.tool), "cdi", "generate", f"--driver-root={m.driver_root}",
            f"--dev-root={m.root}", f"--output={machine.out}"]
    with subprocess.Popen(argv, env=clean_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as proc:
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=3)
            proc.terminate()
            assert proc.wait(timeout=10) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not os.path.lexists(machine.out)
    simnvml.recover_gpu(m, 1)
    assert machine.generate().returncode == 0


def test_a_gpu_without_its_node_is_skipped_or_denied_in_nvml_mode(machine: Machine) -> None:
    """dev/nvidia1 gone: with no devices reading NVML does not look, GPU 1's devices get
    no edits at all, and 1.20 refuses to write the spec it made (to a file or stdout);
    under ``skip`` NVML lists GPU 0 alone and so does the spec; under ``deny`` GPU 1's
    lookup answers 4 and NVML mode fails at its index, with NVML's words for 4."""
    import simnvml

    m = machine.m
    uuid0 = m.nvml_gpus[0]
    simnvml.remove_gpu_node(m, 1)
    invalid = ('failed to write spec: invalid CDI Spec: failed add device "1": invalid '
               'device, empty device edits')
    result = machine.generate()
    assert (result.returncode, last_error(result)) == (1, invalid), result.stderr
    assert not machine.out.exists()
    result = subprocess.run([str(machine.tool), "cdi", "generate", f"--driver-root={m.driver_root}",
                             f"--dev-root={m.root}"], env=clean_env(), capture_output=True,
                            text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert last_error(result) == f"failed to write CDI spec to STDOUT: {invalid}"
    gpu0 = [node("/dev/nvidia0")]
    simnvml.set_devices_reading(m, "skip")
    assert machine.devices() == {"0": gpu0, uuid0: gpu0, "all": gpu0}
    simnvml.set_devices_reading(m, "deny")
    result = machine.generate()
    assert result.returncode == 1, result.stderr
    assert last_error(result) == (FULL_GPUS + "error getting device handle for index '1': "
                                  "Insufficient Permissions")
