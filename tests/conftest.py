"""Shared fixtures: the real CLI as a subprocess, and simulated GPU machines."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

import procdriver  # noqa: E402  (tests/ is on the path from here on)

import debian_ldconfig  # noqa: E402  (found through the path just set)
import elfbuild  # noqa: E402  (found through the path just set)
import realdriver  # noqa: E402  (found through the path just set)
import simgpu  # noqa: E402  (found through the path just set)
import toolkit  # noqa: E402  (found through the path just set)

# The nvidia-ctk the GPU scenarios run (tests/toolkit.py), and the hook it names in specs.
NVIDIA_CTK = toolkit.NVIDIA_CTK
os.environ["PATH"] = toolkit.path_with_hook()


@pytest.fixture(scope="session", autouse=True)
def _host_dev_as_found() -> Iterator[None]:
    """In real-tool mode the real NVML that nvidia-ctk loads mknods /dev/nvidiactl in this
    host's /dev when it is missing (the stand-in never does): leave /dev as found."""
    made = toolkit.REAL and not os.path.lexists("/dev/nvidiactl")
    yield
    if made and os.path.lexists("/dev/nvidiactl"):
        os.unlink("/dev/nvidiactl")


@pytest.fixture(params=("target", "walk", "any"))
def nvml_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each documented reading of NVML's lookups by UUID (tests/simnvml.py, READINGS)
    for every machine the test makes with simgpu.make_machine: a test that uses this
    runs once per reading (issue 31)."""
    import simnvml

    reading: str = request.param
    assert reading in simnvml.READINGS
    make = simgpu.make_machine

    def made(*args: Any, **kwargs: Any) -> simgpu.SimMachine:
        m = make(*args, **kwargs)
        if m.nvml_gpus:
            simnvml.set_reading(m, reading)
        return m

    monkeypatch.setattr(simgpu, "make_machine", made)
    return reading


def stand_in_only(why: str) -> pytest.MarkDecorator:
    """Skip in real-tool mode: the case needs what only the stand-in can do (``why``)."""
    return pytest.mark.skipif(toolkit.REAL, reason=f"only the nvidia-ctk stand-in can {why}")


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def errors(self) -> list[str]:
        return [line for line in self.lines if line.startswith("error: ")]

    @property
    def warnings(self) -> list[str]:
        return [line for line in self.lines if line.startswith("warning: ")]


def invoke(root: Path | None, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120, proc_driver: bool = False) -> Outcome:
    """The CLI as a subprocess. ``proc_driver``: in a private mount namespace where the
    machine's proc/driver is the host's /proc/driver (tests/procdriver.py), as nvidia-ctk
    needs to find a simulated machine's MIG caps."""
    argv = [sys.executable, "-m", "unbounded_nvidia_setup"]
    if root is not None:
        argv += ["--root", str(root)]
    argv += args
    if proc_driver:
        if root is None:
            raise ValueError("proc_driver=True needs the machine's root")
        why = procdriver.available()
        if why is not None:
            unmet(f"a private /proc/driver: {why}")
        argv = procdriver.in_private_proc_driver(root, argv)
    full_env = {**os.environ, **(env or {})}
    full_env.pop("NOTIFY_SOCKET", None)
    full_env.pop("JOURNAL_STREAM", None)
    proc = subprocess.run(argv, capture_output=True, text=True, env=full_env,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    out = Outcome(proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return out


Cli = Callable[..., Outcome]


@pytest.fixture
def cli() -> Cli:
    return invoke


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points a test made; unmounted (lazily) whatever the test's outcome."""
    done: list[Path] = []
    yield done
    for path in reversed(done):
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    """A simulated GPU machine with the default test config (suites that need other
    settings define their own `m`)."""
    machine = simgpu.make_machine(tmp_path / "root")
    machine.write_config()
    return machine


@pytest.fixture(scope="session")
def so_cache(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Compiles (once per SONAME) a real shared object with that DT_SONAME; libnvidia-ml
    (libnvidia-ml.so.1) is the simulated NVML (tests/simnvml.c). Used by the
    nvidia-ctk and nvidia-cdi-hook stand-in tests."""
    if shutil.which("gcc") is None:
        unmet("gcc is needed to build real ELF shared objects")
    directory = tmp_path_factory.mktemp("so")
    plain = directory / "empty.c"
    plain.write_text("int fake_symbol;\n")
    nvml = directory / "nvml.c"
    nvml.write_text(elfbuild.nvml_source())
    built: dict[str, Path] = {}

    def build(soname: str) -> Path:
        if soname not in built:
            out = directory / f"{soname}.bin"
            source = nvml if soname == elfbuild.NVML_SONAME else plain
            subprocess.run(
                ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(source)],
                check=True,
            )
            built[soname] = out
        return built[soname]

    return build


# Under CI (the environment variable CI set, non-empty: .ci/run sets it) a test that
# cannot run here fails instead of skipping, so a CI run without root or without a tool
# the suite names cannot pass with part of the suite skipped. Elsewhere it skips, saying
# why, as before.
CI = bool(os.environ.get("CI"))


def unmet(reason: str) -> NoReturn:
    """Skip with ``reason``, or fail with it when $CI is set (call from a test or fixture)."""
    if CI:
        pytest.fail(f"{reason} [CI is set: this test must run, not skip]", pytrace=False)
    pytest.skip(reason)


def needs(ok: bool, reason: str) -> pytest.MarkDecorator:
    """A mark: unless ``ok``, the test skips with ``reason`` (fails under CI). Checked in
    ``pytest_runtest_setup`` below, before any fixture of the test runs."""
    return pytest.mark.needs(ok=ok, reason=reason)


def needs_tool(name: str, why: str = "") -> pytest.MarkDecorator:
    """A mark: the program ``name`` must be on PATH or be that absolute path."""
    found = os.access(name, os.X_OK) if os.path.isabs(name) else shutil.which(name) is not None
    return needs(found, f"{name} not installed{why} (tests/install-deps installs it)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        if not mark.kwargs["ok"]:
            unmet(str(mark.kwargs["reason"]))


needs_root = needs(os.geteuid() == 0, "needs root (mknod, chown)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``device_plugin`` run NVIDIA's real device plugin, which only
    UNB_TEST_DEVICE_PLUGIN names (tests/toolkit.py): without it they are deselected, not
    skipped, so that `make test` stays free of skips on every machine."""
    if toolkit.plugin_binary() is not None:
        return
    kept = [item for item in items if item.get_closest_marker("device_plugin") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture
def aarch64_ldconfig(tmp_path: Path) -> str:
    """The config key `ldconfig` for a simulated aarch64 machine: Debian's real arm64
    ldconfig run by qemu user emulation, through a wrapper script (the product runs the
    key as one program). This machine's own ldconfig cannot stand in: it says "is for
    unknown machine 183" to every aarch64 library and leaves it out of the cache. Skips
    when qemu or the package cannot be had; fails instead when $CI is set."""
    qemu = shutil.which("qemu-aarch64-static")
    try:
        if qemu is None:
            raise realdriver.RealDriverUnavailable(
                "qemu-aarch64-static not found (tests/install-deps installs qemu-user-static)")
        ldconfig = debian_ldconfig.fetch_ldconfig("arm64")
    except realdriver.RealDriverUnavailable as e:
        if CI:
            raise  # CI must check the aarch64 linker cache for real
        pytest.skip(f"aarch64 ldconfig unavailable: {e}")
    wrapper = tmp_path / "ldconfig-aarch64"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(qemu)} {shlex.quote(str(ldconfig))} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


# The GPU fault tests' machine (tests/test_lost_gpu.py, tests/test_gpu_faults.py).
@pytest.fixture(params=("target", "walk", "any"))
def reading(request: pytest.FixtureRequest) -> str:
    """Each reading of NVML's lookups by UUID (simnvml.READINGS), for `four`."""
    value: str = request.param
    return value


@pytest.fixture
def four(tmp_path: Path, reading: str) -> simgpu.SimMachine:
    """Four GPUs in NVML mode (the product's default, no --mode), NVML read as
    ``reading``."""
    import simnvml

    assert reading in simnvml.READINGS
    m = simgpu.make_machine(tmp_path / "root")
    for minor in (2, 3):
        simnvml.add_gpu(m, minor)
    simnvml.set_reading(m, reading)
    m.write_config()
    assert len(m.nvml_gpus) == 4
    return m
