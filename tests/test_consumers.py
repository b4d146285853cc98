"""The root passes each consumer's own acceptance (issue 38, point 2).

NVIDIA's consumers of a driver root take it or leave it by checks of their own, written
in their code; these tests run those checks as that code states them against a root the
product's real ``run`` built (FACTS.md, "NVIDIA's GPU Operator and DRA driver against a
driver root like ours"). The sources, as read (each check below names its file):

* DRA driver, kubernetes-sigs/dra-driver-nvidia-gpu at 95932046683 (2026-08-07):
  ``hack/kubelet-plugin-prestart.sh`` (the kubelet plugin's init container),
  ``cmd/gpu-kubelet-plugin/root.go`` and ``cmd/compute-domain-kubelet-plugin/root.go``
  (device root; nvidia-imex-ctl), ``cmd/compute-domain-daemon/main.go`` (runs
  ``nvidia-imex`` and ``nvidia-imex-ctl``).
* GPU Operator, NVIDIA/gpu-operator at a22dbf671f2 (2026-08-21):
  ``cmd/nvidia-validator/main.go`` (validateHostDriver, validateDriverContainer) and
  ``internal/driver/root.go`` (Root.findFile, GetDevRoot).

The nvidia-smi they run is NVIDIA's real one, Debian trixie's 550 (tests/realdriver.py:
downloaded once with the machine's own apt mirrors, then read from the cache); the
root's libnvidia-ml.so.1 is the simulated NVML (tests/simnvml.c), which answers from the
simulated machine the root belongs to. NVIDIA's code runs in a container where the root
is mounted; here it runs on this host against the root's own path (the DRA script's
``/driver-root`` is a link to it, as the script makes one), and a found file must
resolve inside the root, which is what makes the container's view the same.

Each check is also run against copies of the root broken on purpose
(test_the_checks_fail_a_root_broken_on_purpose): what NVIDIA's code refuses, they refuse.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from invariants import assert_secure_state, secure_after  # noqa: F401  (fixture)

import elfbuild
import realdriver
import simgpu
import simnvml
from conftest import invoke, needs_root, needs_tool
from realmachine import real_machine
from test_realdriver import fetch
from test_run import root_of

pytestmark = [needs_root, needs_tool("find")]

# hack/kubelet-plugin-prestart.sh: where it looks, below /driver-root.
DRA_BIN_DIRS = ("opt/bin", "usr/bin", "usr/sbin", "bin", "sbin")
DRA_LIB_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
                "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")
# internal/driver/root.go: GetDriverLibraryPath, GetNvidiaSMIPath (each after "/").
OPERATOR_LIB_DIRS = ("/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                     "/lib64", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
OPERATOR_BIN_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
# cmd/nvidia-validator/main.go: hostNvidiaSMISearchPaths, probed under /host first.
HOST_NVIDIA_SMI = ("/usr/bin/nvidia-smi", "/usr/sbin/nvidia-smi", "/bin/nvidia-smi",
                   "/sbin/nvidia-smi", "/usr/lib/wsl/lib/nvidia-smi", "/opt/bin/nvidia-smi")
# cmd/compute-domain-kubelet-plugin/root.go: getNvidiaImexCtlPath (after "/").
DRA_IMEX_DIRS = ("/opt/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin")
IMEX_HELPERS = ("nvidia-imex", "nvidia-imex-ctl")
LIBDIR = f"lib/{simgpu.MULTIARCH}"
EM_AARCH64, EM_X86_64 = 183, 62
ET_EXEC, ET_DYN = 2, 3


# --------------------------------------------------------------------------------------
# The checks, as NVIDIA's code states them


def inside(path: str | Path, root: Path) -> bool:
    """Whether ``path``, every link followed, is in ``root`` (itself resolved)."""
    return os.path.realpath(path).startswith(os.path.realpath(root) + "/")


def _first_found(*args: str) -> str | None:
    """``find ARGS 2> /dev/null | head -n1``: the first line, or None."""
    proc = subprocess.run(["find", *args], capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    return lines[0] if lines else None


@dataclass
class Prestart:
    """One attempt of the DRA kubelet plugin's init container
    (hack/kubelet-plugin-prestart.sh, validate_and_exit_on_success)."""

    nvidia_smi: str | None  # NV_PATH
    libnvidia_ml: str | None  # NV_LIB_PATH
    run: subprocess.CompletedProcess[str] | None  # env -i LD_PRELOAD=... nvidia-smi --version

    @property
    def passed(self) -> bool:
        """The script's own test: both found, and nvidia-smi exited 0 (``exit 0``)."""
        return self.run is not None and self.run.returncode == 0


def dra_prestart(root: Path, scratch: Path) -> Prestart:
    """hack/kubelet-plugin-prestart.sh against ``root``: ``/driver-root`` is a link to it
    (the script's ``ln -s``; here ``scratch/driver-root``); nvidia-smi is the first
    ``find <dirs> -maxdepth 1 -type f -name nvidia-smi`` (no -L: a link is no regular
    file, issue #1201), libnvidia-ml.so.1 the first ``find -L <dirs> -maxdepth 1 -type f
    -name libnvidia-ml.so.1`` (links followed); with both, it runs
    ``env -i LD_PRELOAD=<libnvidia-ml.so.1> <nvidia-smi> --version``."""
    link = scratch / "driver-root"
    link.symlink_to(root)
    smi = _first_found(*(f"{link}/{d}" for d in DRA_BIN_DIRS),
                       "-maxdepth", "1", "-type", "f", "-name", "nvidia-smi")
    lib = _first_found("-L", *(f"{link}/{d}" for d in DRA_LIB_DIRS),
                       "-maxdepth", "1", "-type", "f", "-name", "libnvidia-ml.so.1")
    run = None
    if smi is not None and lib is not None:
        run = subprocess.run(["env", "-i", f"LD_PRELOAD={lib}", smi, "--version"],
                             capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    return Prestart(smi, lib, run)


def find_file(root: Path, name: str, search_in: tuple[str, ...], *,
              regular: bool = False) -> str | None:
    """Root.findFile: ``filepath.Join(root, d, name)`` for d in "/" and then
    ``search_in``, ``filepath.EvalSymlinks`` (every link followed; an error, such as a
    dangling link, skips d); the first that resolves. ``regular``: skip a result that is
    no regular file, as the DRA driver's copies (cmd/*-kubelet-plugin/root.go) do; the
    GPU Operator's (internal/driver/root.go) does not."""
    for d in ("/", *search_in):
        try:
            resolved = os.path.realpath(os.path.normpath(f"{root}/{d}/{name}"), strict=True)
        except OSError:
            continue
        if regular and not stat.S_ISREG(os.stat(resolved).st_mode):
            continue
        return resolved
    return None


def dev_root(root: Path) -> str:
    """GetDevRoot (internal/driver/root.go, cmd/gpu-kubelet-plugin/root.go): the root
    when ``os.Stat(root/dev)`` is a directory, else "/"."""
    return str(root) if os.path.isdir(root / "dev") else "/"


def host_nvidia_smi(host: Path) -> str | None:
    """resolveHostNvidiaSMI("/host") (cmd/nvidia-validator/main.go): the first search
    path that opens inside the host's root as a non-empty executable regular file. The
    validator goes to the driver root only when there is none."""
    for path in HOST_NVIDIA_SMI:
        candidate = host / path.lstrip("/")
        if not inside(candidate, host) or not candidate.exists():
            continue
        st = candidate.stat()
        if stat.S_ISREG(st.st_mode) and st.st_size and st.st_mode & 0o111:
            return path
    return None


@dataclass
class Validation:
    """validateDriverContainer's validateDriver (cmd/nvidia-validator/main.go)."""

    libnvidia_ml: str | None  # driverRoot.GetDriverLibraryPath()
    nvidia_smi: str | None  # driverRoot.GetNvidiaSMIPath()
    code: int | None  # nvidia-smi's exit status (None: not run, or it could not start)
    stdout: str

    @property
    def passed(self) -> bool:
        return self.code == 0


def operator_validate(root: Path, *, skip_gpu_init: bool) -> Validation:
    """The validator with ``driver.enabled=false`` (no driver container): libnvidia-ml.so.1
    and nvidia-smi found in the root by internal/driver/root.go, then
    ``exec.Command(nvidia-smi, nvidiaSMIArgs()...)`` with LD_PRELOAD set to that library:
    no chroot, the validator's own libc. Its arguments: none, or ``--version`` with
    ``driver-validation-skip-gpu-init``. The environment is a container's plain one."""
    lib = find_file(root, "libnvidia-ml.so.1", OPERATOR_LIB_DIRS)
    smi = find_file(root, "nvidia-smi", OPERATOR_BIN_DIRS)
    if lib is None or smi is None:
        return Validation(lib, smi, None, "")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LD_PRELOAD": lib}
    try:
        proc = subprocess.run([smi, *(["--version"] if skip_gpu_init else [])], env=env,
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except OSError as e:  # cmd.Run's error: the file cannot be executed
        return Validation(lib, smi, None, str(e))
    return Validation(lib, smi, proc.returncode, proc.stdout)


def elf_header(path: str | Path) -> tuple[int, int]:
    """(e_type, e_machine) of a little-endian ELF file."""
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and head[5] == 1, f"{path} is no little-endian ELF file"
    e_type, e_machine = struct.unpack_from("<HH", head, 16)
    return e_type, e_machine


# --------------------------------------------------------------------------------------
# The machine: simulated GPUs and NVML, NVIDIA's real nvidia-smi, the product's root


@pytest.fixture(scope="module")
def smi_driver() -> realdriver.RealDriver:
    """Debian trixie's 550 (its nvidia-smi has --version; bookworm's 535 has none)."""
    return fetch("amd64", "trixie")


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory,
            smi_driver: realdriver.RealDriver) -> simgpu.SimMachine:
    """Two simulated H100s, the simulated NVML of the real driver's version in the
    staging, NVIDIA's real nvidia-smi beside it; the root built by ``run``. Shared by the
    tests below, which only read it."""
    m = simgpu.make_machine(tmp_path_factory.mktemp("consumers") / "root",
                            version=smi_driver.version)
    assert m.bin_dir is not None and m.nvml_answers
    real_smi = next(p for p in smi_driver.helpers if p.name == "nvidia-smi")
    staged = m.bin_dir / "nvidia-smi"
    staged.unlink()
    shutil.copyfile(real_smi, staged)
    staged.chmod(0o755)
    m.write_config()
    out = invoke(m.root, "run")
    assert out.code == 0, out.stderr
    assert_secure_state(m.root)
    assert (root_of(m) / "usr/bin/nvidia-smi").read_bytes() == real_smi.read_bytes()
    return m


def gpu_bus_ids(m: simgpu.SimMachine) -> list[str]:
    """The machine's GPUs' PCI bus ids as nvidia-smi prints them (8 domain digits)."""
    return ["0000" + simnvml.bus_of(m, minor) for minor in (0, 1)]


def versions(stdout: str) -> dict[str, str]:
    """``nvidia-smi --version``'s "<what> version : <value>" lines."""
    return {k.strip(): v.strip() for k, v in re.findall(r"^([^:\n]+?) *: *(.*)$", stdout, re.M)}


# --------------------------------------------------------------------------------------
# 1. DRA kubelet plugin prestart


def test_the_dra_kubelet_plugins_prestart_passes(machine: simgpu.SimMachine,
                                                 smi_driver: realdriver.RealDriver,
                                                 tmp_path: Path) -> None:
    """hack/kubelet-plugin-prestart.sh: a regular nvidia-smi in usr/bin, a
    libnvidia-ml.so.1 that resolves to a regular file inside the root, and
    ``env -i LD_PRELOAD=<it> <nvidia-smi> --version`` exits 0: NVIDIA's nvidia-smi,
    alone with the root's NVML (the simulated one), reads the driver through it."""
    root = root_of(machine)
    check = dra_prestart(root, tmp_path)
    link = tmp_path / "driver-root"
    assert check.nvidia_smi == f"{link}/usr/bin/nvidia-smi"
    assert check.libnvidia_ml == f"{link}/{LIBDIR}/libnvidia-ml.so.1"
    assert inside(check.libnvidia_ml, root)
    assert os.path.realpath(check.libnvidia_ml) == str(
        root / LIBDIR / f"libnvidia-ml.so.{machine.version}")
    assert check.run is not None
    assert check.passed, (check.run.returncode, check.run.stdout, check.run.stderr)
    said = versions(check.run.stdout)
    assert said["NVIDIA-SMI version"] == smi_driver.version
    assert said["DRIVER version"] == machine.version  # the root's NVML answered
    assert said["NVML version"] == machine.version.rsplit(".", 1)[0]


# --------------------------------------------------------------------------------------
# 2. GPU Operator validator, driver root mode (driver.enabled=false)


def test_the_gpu_operator_validator_finds_and_runs_the_roots_driver(
        machine: simgpu.SimMachine) -> None:
    """cmd/nvidia-validator/main.go: the host has no nvidia-smi of its own (so the
    validator does not ``chroot /host nvidia-smi``), internal/driver/root.go finds the
    root's libnvidia-ml.so.1 and nvidia-smi (EvalSymlinks: the real files, inside the
    root), and that nvidia-smi, run with LD_PRELOAD and no chroot, exits 0: plainly (the
    default, listing the machine's GPUs) and with ``--version``
    (driver-validation-skip-gpu-init)."""
    root = root_of(machine)
    assert host_nvidia_smi(machine.root) is None
    plain = operator_validate(root, skip_gpu_init=False)
    assert plain.libnvidia_ml == str(root / LIBDIR / f"libnvidia-ml.so.{machine.version}")
    assert plain.nvidia_smi == str(root / "usr/bin/nvidia-smi")
    for found in (plain.libnvidia_ml, plain.nvidia_smi):
        assert inside(found, root) and stat.S_ISREG(os.lstat(found).st_mode)
    assert plain.passed, plain.stdout
    assert f"Driver Version: {machine.version}" in plain.stdout
    for bus in gpu_bus_ids(machine):
        assert bus in plain.stdout, plain.stdout
    quick = operator_validate(root, skip_gpu_init=True)
    assert quick.passed, quick.stdout
    assert versions(quick.stdout)["DRIVER version"] == machine.version


# --------------------------------------------------------------------------------------
# 3. Device root


def test_the_root_has_no_dev_so_both_take_slash_as_device_root(
        machine: simgpu.SimMachine) -> None:
    """GetDevRoot (internal/driver/root.go; cmd/gpu-kubelet-plugin/root.go): a root
    with a ``dev/`` is its own device root. Ours has none, so the validator's
    driver-ready says NVIDIA_DEV_ROOT=/ and the DRA plugins read the host's /dev."""
    root = root_of(machine)
    assert not os.path.lexists(root / "dev")
    assert dev_root(root) == "/"


# --------------------------------------------------------------------------------------
# 4. IMEX on a GB200/GB300 host


@pytest.fixture(params=("x86_64", "aarch64"))
def imex_machine(request: pytest.FixtureRequest,
                 tmp_path: Path) -> tuple[simgpu.SimMachine, int]:
    """A machine whose host bin staging holds nvidia-imex and nvidia-imex-ctl (NVIDIA's
    separate nvidia-imex package) beside the driver's helpers, and its ELF e_machine.
    x86_64: the simulated driver, the two as gcc-built programs. aarch64 (GB200/GB300
    hosts are Grace, arm64): Debian's real arm64 driver, run with Debian's arm64
    ldconfig, the two as copies of one of its real arm64 programs (Debian ships no
    nvidia-imex), each padded apart."""
    if request.param == "x86_64":
        m = simgpu.make_machine(tmp_path / "root")
        assert m.bin_dir is not None
        for name in IMEX_HELPERS:
            elfbuild.compile_exe(m.bin_dir / name, 16 * 1024, tag=f"{name} (simulated)")
        m.write_config()
        return m, EM_X86_64
    ldconfig = request.getfixturevalue("aarch64_ldconfig")
    drv = fetch("arm64")
    m = real_machine(tmp_path, drv)
    assert m.bin_dir is not None
    data = next(p for p in drv.helpers if p.name == "nvidia-cuda-mps-control").read_bytes()
    for name in IMEX_HELPERS:
        elfbuild.write_file(m.bin_dir / name, data, len(data) + 4096, mode=0o755)
    simgpu.debian_linker_files(m.root, "aarch64-linux-gnu")
    m.write_config(arch="aarch64", ldconfig=ldconfig, nvidia_ctk_args=["--mode=management"])
    return m, EM_AARCH64


@pytest.mark.usefixtures("secure_after")
def test_a_gb200_staging_gives_the_root_nvidia_imex_and_nvidia_imex_ctl(
        imex_machine: tuple[simgpu.SimMachine, int]) -> None:
    """The compute-domain daemon runs ``nvidia-imex`` and ``nvidia-imex-ctl``
    (cmd/compute-domain-daemon/main.go) and its kubelet plugin finds nvidia-imex-ctl in
    the root as it finds nvidia-smi (cmd/compute-domain-kubelet-plugin/root.go:
    EvalSymlinks, then a regular file only): each is in the root's usr/bin as an
    executable regular file of the machine's architecture, the staged file's bytes."""
    m, machine_type = imex_machine
    assert m.bin_dir is not None
    out = invoke(m.root, "run")
    assert out.code == 0, out.stderr
    root = root_of(m)
    for name in IMEX_HELPERS:
        found = find_file(root, name, DRA_IMEX_DIRS, regular=True)
        assert found == str(root / "usr/bin" / name), found
        st = os.lstat(found)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755
        e_type, e_machine = elf_header(found)
        assert e_type in (ET_EXEC, ET_DYN) and e_machine == machine_type
        assert Path(found).read_bytes() == (m.bin_dir / name).read_bytes()
        if machine_type == EM_X86_64:  # this host runs it
            proc = subprocess.run([found], capture_output=True, text=True, timeout=30)
            assert proc.returncode == 0 and proc.stdout == f"{name} (simulated)\n"


def test_without_nvidia_imex_staged_the_root_has_none(machine: simgpu.SimMachine) -> None:
    """A host without the nvidia-imex package: the root has no nvidia-imex-ctl, and the
    compute-domain plugin's lookup fails, as it should (it looks lazily, for a host whose
    admin runs IMEX)."""
    for name in IMEX_HELPERS:
        assert find_file(root_of(machine), name, DRA_IMEX_DIRS, regular=True) is None


# --------------------------------------------------------------------------------------
# The checks refuse what NVIDIA's code refuses


def broken_copy(m: simgpu.SimMachine, where: Path, *, driver: bool = True) -> Path:
    """A copy of ``m``'s root at ``where/run/nvidia/driver`` (links kept as they are),
    returned. ``driver``: ``where/dev`` and ``where/proc`` lead to ``m``'s, so the
    copy's simulated NVML reads ``m``'s driver (it reads the machine its own path is
    in); without them it meets no loaded driver."""
    root = where / "run/nvidia/driver"
    shutil.copytree(root_of(m), root, symlinks=True)
    if driver:
        (where / "dev").symlink_to(m.root / "dev")
        (where / "proc").symlink_to(m.root / "proc")
    return root


def _link_nvidia_smi(root: Path, m: simgpu.SimMachine) -> None:
    """Debian's own layout: usr/bin/nvidia-smi a link to usr/lib/nvidia/nvidia-smi."""
    (root / "usr/lib/nvidia").mkdir(parents=True)
    os.rename(root / "usr/bin/nvidia-smi", root / "usr/lib/nvidia/nvidia-smi")
    (root / "usr/bin/nvidia-smi").symlink_to("../lib/nvidia/nvidia-smi")


def _absolute_nvml(root: Path, m: simgpu.SimMachine) -> None:
    """libnvidia-ml.so.1 -> an absolute path: here, the file of the root it was copied
    from, outside this one (in a container an absolute target resolves in the
    container's own tree, never the root)."""
    link = root / LIBDIR / "libnvidia-ml.so.1"
    link.unlink()
    link.symlink_to(root_of(m) / LIBDIR / f"libnvidia-ml.so.{m.version}")


def _dangling_nvml(root: Path, m: simgpu.SimMachine) -> None:
    (root / LIBDIR / f"libnvidia-ml.so.{m.version}").unlink()


def _unexecutable_nvidia_smi(root: Path, m: simgpu.SimMachine) -> None:
    (root / "usr/bin/nvidia-smi").chmod(0o644)


def _dev_dir(root: Path, m: simgpu.SimMachine) -> None:
    (root / "dev").mkdir()


BREAKAGES = {
    # name: (change, DRA prestart passes, validator passes, libnvidia-ml inside, dev root /)
    "intact-copy": (None, True, True, True, True),
    "nvidia-smi-a-link": (_link_nvidia_smi, False, True, True, True),
    "libnvidia-ml-absolute": (_absolute_nvml, True, True, False, True),
    "libnvidia-ml-dangling": (_dangling_nvml, False, False, False, True),
    "nvidia-smi-not-executable": (_unexecutable_nvidia_smi, False, False, True, True),
    "no-driver-loaded": (None, False, False, True, True),
    "root-with-dev": (_dev_dir, True, True, True, False),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_the_checks_fail_a_root_broken_on_purpose(machine: simgpu.SimMachine, tmp_path: Path,
                                                  breakage: str) -> None:
    """Each check above, against a copy of the root broken one way: a linked nvidia-smi
    fails the DRA script's ``-type f`` (issue #1201) but not the validator's EvalSymlinks;
    an absolute libnvidia-ml.so.1 link runs here but leaves the root; a dangling one is
    found by neither; an nvidia-smi that cannot be executed, or an NVML that meets no
    loaded driver (nvidia-smi exits 9), fails both; a ``dev/`` makes the root its own
    device root. The intact copy passes everything, so the copying is not what fails."""
    change, dra_ok, operator_ok, lib_inside, slash = BREAKAGES[breakage]
    root = broken_copy(machine, tmp_path / "copy", driver=breakage != "no-driver-loaded")
    if change is not None:
        change(root, machine)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    dra = dra_prestart(root, scratch)
    assert dra.passed == dra_ok, dra
    validation = operator_validate(root, skip_gpu_init=True)
    assert validation.passed == operator_ok, validation
    found = [p for p in (dra.libnvidia_ml, validation.libnvidia_ml) if p is not None]
    assert (bool(found) and all(inside(p, root) for p in found)) == lib_inside, found
    assert (dev_root(root) == "/") == slash
    if breakage == "no-driver-loaded":
        assert dra.run is not None and dra.run.returncode == 9
