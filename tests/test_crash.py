"""Crashes and concurrency: SIGKILL the real process at mutating syscalls (strace fault
injection), and race runs against each other and against `check`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from unbounded_nvidia_setup.verify import root_problems

import simgpu
from conftest import Cli, needs_root
from test_failures import new_driver
from test_run import root_of, spec_of

pytestmark = [needs_root, pytest.mark.skipif(shutil.which("strace") is None,
                                             reason="strace not installed")]
MA = "x86_64-linux-gnu"
NEW = "570.133.20"
# Every class of syscall the run uses to create, write, link, rename, exchange and delete.
SYSCALLS = ["mkdir", "copy_file_range", "fchmod", "utimensat", "symlink", "renameat2",
            "rename", "unlink", "unlinkat", "rmdir", "fsync", "write"]


def assert_whole(m: simgpu.SimMachine, versions: tuple[str, ...]) -> str | None:
    """The live root is absent or one complete generation; the spec absent or complete;
    nothing in /etc/cdi that containerd could take for a spec. Returns the root's version."""
    root = root_of(m)
    version = None
    if os.path.lexists(root):
        libs = {p.name for p in (root / "lib" / MA).iterdir()}
        found = [v for v in versions if f"libcuda.so.{v}" in libs]
        assert len(found) == 1, libs
        version = found[0]
        assert root_problems(root, f"lib/{MA}", version) == []
        wanted = {n.replace(m.version, version) for n in m.expected_libs}
        assert wanted <= {str(p.relative_to(root / "lib" / MA))
                          for p in (root / "lib" / MA).rglob("*")}
    cdi = spec_of(m).parent
    if cdi.exists():
        specs = [p.name for p in cdi.iterdir() if p.name.endswith((".yaml", ".json"))]
        assert specs in ([], ["nvidia.yaml"])
        if specs:
            import yaml

            doc = yaml.safe_load(spec_of(m).read_text())
            assert doc["kind"] == "nvidia.com/gpu" and doc["devices"]
    return version


def run_killed(m: simgpu.SimMachine, syscall: str, when: int) -> int:
    argv = ["strace", "-f", "-qq", "-o", "/dev/null",
            "-e", f"inject={syscall}:signal=KILL:when={when}",
            sys.executable, "-m", "unbounded_nvidia_setup", "--root", str(m.root), "run"]
    return subprocess.run(argv, capture_output=True, timeout=120).returncode


@pytest.mark.parametrize("syscall", SYSCALLS)
@pytest.mark.parametrize("scenario", ["first-boot", "new-driver"])
def test_sigkill_at_every_mutating_step_leaves_whole_state(
        tmp_path: Path, cli: Cli, syscall: str, scenario: str) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    if scenario == "new-driver":
        assert cli(m.root, "run").code == 0
        new_driver(m, tmp_path, NEW)
    versions = (m.version, NEW)
    for when in (1, 3):
        run_killed(m, syscall, when)
        assert_whole(m, versions)
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    expected = NEW if scenario == "new-driver" else m.version
    assert assert_whole(m, versions) == expected
    assert not list(root_of(m).parent.glob(".driver.*"))
    assert json.loads(cli(m.root, "check", "--json").stdout)["ok"] is True


def test_concurrent_runs_and_checks_serialize(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()

    def one(i: int) -> tuple[str, int, str]:
        if i % 3 == 2:
            out = cli(m.root, "check", "--json")
            return "check", out.code, out.stdout
        out = cli(m.root, "run")
        return "run", out.code, out.stderr

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(one, range(12)))
    for kind, code, text in results:
        if kind == "run":
            assert code == 0, text
        else:
            report = json.loads(text)
            codes = {p["code"] for p in report["problems"]}
            # Before the first run: nothing yet. After: whole. Never anything torn.
            assert codes <= {"root-missing", "spec-missing", "ldconf-missing"}, codes
    assert assert_whole(m, (m.version,)) == m.version
    assert json.loads(cli(m.root, "check", "--json").stdout)["ok"] is True
