"""The host agent's interface (issue 11): `check`'s verdict, derived from the live state
and the lock, on simulated machines under --root (where systemd is never asked; the boot
suite shows the unit's part); the schema of `check --json` and the one list of problem
codes that the product, the schema and docs/problems.md must agree on."""

from __future__ import annotations

import ast
import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import check_schema
import hostcmd
from invariants import (
    product_argv,
    product_env,
    secure_after,  # noqa: F401  (fixture)
)

import simgpu
from conftest import Cli, needs_root, needs_tool
from test_run import check_json, codes, root_of, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
LOCK = "run/unbounded-nvidia-setup.lock"


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    # A lock timeout far beyond the test's patience: a `check` that waited behind a
    # run would be killed by invoke()'s timeout, not answer.
    machine.write_config(staging_wait_seconds=0, lock_timeout_seconds=3600)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    assert cli(m.root, "run").code == 0
    return m


def verdict(cli: Cli, m: simgpu.SimMachine) -> tuple[str, set[str]]:
    report = check_json(cli, m)
    text = cli(m.root, "check")
    assert text.stdout.splitlines()[-1] == f"verdict: {report['verdict']}"
    assert report["schema_version"] == 1
    assert "unit" not in report  # under --root systemd is never asked
    return str(report["verdict"]), codes(report)


@pytest.fixture
def run_in_progress(live: simgpu.SimMachine) -> Iterator[None]:
    """Another process holds the lock exclusively, as a run or clean does while it works.
    A separate process (flock locks belong to the open file, but a real run is another
    process, so the test is one too). After the good run of `live`."""
    lock = live.root / LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    try:
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def test_healthy_is_ready(live: simgpu.SimMachine, cli: Cli) -> None:
    assert verdict(cli, live) == ("ready", set())
    assert check_json(cli, live)["setup_running"] is False


def test_no_gpu_is_no_gpu(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root", gpu=False)
    m.write_config()
    assert verdict(cli, m) == ("no-gpu", set())


def test_no_gpu_with_stale_state_is_broken(live: simgpu.SimMachine, cli: Cli) -> None:
    for dev in (live.root / "dev").glob("nvidia*"):
        dev.unlink()
    shutil.rmtree(live.root / "run/host-nvidia")  # the GPU went, and its staging with it
    assert verdict(cli, live) == ("broken", {"stale-state"})


def test_staging_without_devices_is_not_ready_yet(live: simgpu.SimMachine, cli: Cli) -> None:
    """The host staged the driver but its devices did not arrive (a kernel update broke
    the nvidia module): not a CPU node, and nothing of the state goes."""
    for dev in (live.root / "dev").glob("nvidia*"):
        dev.unlink()
    assert verdict(cli, live) == ("not-ready-yet", {"devices-not-bound"})


@pytest.mark.parametrize("tamper", ["library", "spec"])
def test_tampered_with_no_setup_running_is_broken(live: simgpu.SimMachine, cli: Cli,
                                                   tamper: str) -> None:
    if tamper == "library":
        (root_of(live) / "lib" / MA / f"libcuda.so.{live.version}").unlink()
    else:
        spec_of(live).unlink()
    got, found = verdict(cli, live)
    assert got == "broken", found
    assert ("spec-missing" in found) == (tamper == "spec")
    assert cli(live.root, "run").code == 0  # the repair the host agent triggers
    assert verdict(cli, live) == ("ready", set())


def test_missing_staging_is_not_ready_yet(live: simgpu.SimMachine, cli: Cli,
                                          tmp_path: Path) -> None:
    """The host has not (re)staged the driver: even a damaged root is "wait", because a
    run will rebuild it once staging is there."""
    shutil.move(live.root / "run/host-nvidia", tmp_path / "away")
    assert verdict(cli, live) == ("not-ready-yet", {"staging-missing"})
    (root_of(live) / "lib" / MA / f"libcuda.so.{live.version}").unlink()
    got, found = verdict(cli, live)
    assert got == "not-ready-yet" and "staging-missing" in found, found
    shutil.move(tmp_path / "away", live.root / "run/host-nvidia")
    assert cli(live.root, "run").code == 0
    assert verdict(cli, live) == ("ready", set())


def test_empty_staging_is_not_ready_yet(live: simgpu.SimMachine, cli: Cli) -> None:
    for d in (live.root / "run/host-nvidia").iterdir():
        shutil.rmtree(d)
        d.mkdir()
    assert verdict(cli, live) == ("not-ready-yet", {"staging-missing"})


@pytest.mark.usefixtures("run_in_progress")
def test_problems_while_a_run_holds_the_lock_are_not_ready_yet(
        live: simgpu.SimMachine, cli: Cli) -> None:
    """`check` does not wait behind the run (lock_timeout_seconds is an hour here) and
    says "not ready yet" for what it sees half done."""
    spec = spec_of(live).read_bytes()
    spec_of(live).unlink()
    report = check_json(cli, live)
    assert report["setup_running"] is True
    # The cause first; what the run rebuilds is pending, not a problem to act on (issue 36).
    assert report["verdict"] == "not-ready-yet" and codes(report) == {"setup-running"}, report
    pending: Any = report["pending"]
    assert [p["code"] for p in pending] == ["spec-missing"], report
    spec_of(live).write_bytes(spec)


@pytest.mark.usefixtures("run_in_progress")
def test_a_whole_state_while_a_run_holds_the_lock_is_ready(
        live: simgpu.SimMachine, cli: Cli) -> None:
    report = check_json(cli, live)
    assert (report["setup_running"], report["verdict"]) == (True, "ready")


@needs_tool("strace")
@pytest.mark.usefixtures("run_in_progress")
def test_a_read_torn_by_a_run_is_setup_running(live: simgpu.SimMachine, tmp_path: Path) -> None:
    """A run deletes the old generation after its swap while an unlocked `check` walks the
    root: the walk's lstat of a library finds it gone. strace makes exactly that call fail
    with ENOENT (found from a trace of the same check): one problem, `setup-running`,
    verdict not-ready-yet, no traceback."""
    argv = product_argv(live.root, "check", "--json")
    trace = tmp_path / "stat.trace"
    subprocess.run(["strace", "-qq", "-o", str(trace), "-e", "trace=newfstatat", *argv],
                   capture_output=True, env=product_env(), check=False, timeout=60)
    calls = [line for line in trace.read_text().splitlines() if "newfstatat(" in line]
    lib = f"{root_of(live)}/lib/{MA}/lib"
    # An lstat (not os.walk's is_dir, which takes an error for "not a directory").
    when = next(n for n, line in enumerate(calls, 1)
                if f'"{lib}' in line and line.endswith("AT_SYMLINK_NOFOLLOW) = 0"))
    proc = subprocess.run(["strace", "-qq", "-o", "/dev/null", "-e", "trace=newfstatat",
                           "-e", f"inject=newfstatat:error=ENOENT:when={when}", *argv],
                          capture_output=True, text=True, env=product_env(), timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    report = check_schema.parse_check(proc.stdout, proc.returncode)
    assert [p["code"] for p in report["problems"]] == ["setup-running"], report["problems"]
    assert report["verdict"] == "not-ready-yet" and report["setup_running"] is True


def test_check_creates_no_lock_file(m: simgpu.SimMachine, cli: Cli) -> None:
    """The probe opens the lock file read-only: a `check` before any run leaves none."""
    assert not os.path.lexists(m.root / LOCK)
    assert verdict(cli, m)[0] == "broken"
    assert not os.path.lexists(m.root / LOCK)


def test_a_shared_holder_is_not_a_run(live: simgpu.SimMachine, cli: Cli) -> None:
    """Another `check` (shared) does not make this one think a setup is running."""
    with open(live.root / LOCK) as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        assert check_json(cli, live)["setup_running"] is False


# -- the schema ------------------------------------------------------------------------


def test_schema_is_draft_2020_12_and_describes_every_key() -> None:
    from jsonschema import Draft202012Validator

    schema = check_schema.load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)

    def described(node: object, where: str) -> None:
        if isinstance(node, dict) and "properties" in node:
            for key, sub in node["properties"].items():
                assert sub.get("description"), f"{where}/{key} has no description"
                assert "type" in sub or "const" in sub or "enum" in sub, f"{where}/{key}"
                described(sub, f"{where}/{key}")
                described(sub.get("items"), f"{where}/{key}[]")

    described(schema, "")
    assert schema["properties"]["verdict"]["enum"] == list(check_schema.VERDICTS)


def test_codes_agree_between_product_schema_and_docs() -> None:
    """The rule for "codes in the code" is in tests/check_schema.py's docstring."""
    source, unreadable = check_schema.codes_in_source()
    assert unreadable == [], f"Problem(...) codes the scan cannot read: {unreadable}"
    schema = check_schema.codes_in_schema()
    docs = check_schema.codes_in_docs()
    assert len(source) >= 38  # the scan found the codes at all (38 in schema version 1)
    assert source == schema, (f"only in the product: {sorted(source - schema)}; only in the "
                              f"schema: {sorted(schema - source)}")
    assert source == docs, (f"only in the product: {sorted(source - docs)}; only in "
                            f"docs/problems.md: {sorted(docs - source)}")


def test_the_scan_reads_every_way_a_code_is_written(tmp_path: Path) -> None:
    """The scan's rule on a small module: literals, names bound to literals, *_CODES tables;
    an f-string code is reported, not missed."""
    (tmp_path / "mod.py").write_text(
        'T_CODES = {"a": "t-a"}\n'
        "def f(codes, x):\n"
        '    c = "n-one" if x else "n-two"\n'
        '    return [Problem("lit", ""), Problem(c, ""), Problem(codes["a"], ""),\n'
        '            Problem(f"{x}-made", "")]\n')
    codes, unreadable = check_schema.codes_in_source(tmp_path)
    assert codes == {"t-a", "n-one", "n-two", "lit"}
    assert unreadable == ["mod.py:5"]


def test_strict_validation_rejects_an_undescribed_key(live: simgpu.SimMachine,
                                                      cli: Cli) -> None:
    report = check_json(cli, live)
    check_schema.validate(report)
    for bad in ({**report, "extra": 1}, {**report, "verdict": "fine"},
                {**report, "problems": [{"code": "no-such-code", "message": "", "path": None}]},
                {k: v for k, v in report.items() if k != "schema_version"}):
        with pytest.raises(AssertionError, match="does not match the schema"):
            check_schema.validate(bad)
    # The shipped schema itself lets a consumer of version 1 read a later 1.x output.
    from jsonschema import Draft202012Validator

    assert Draft202012Validator(check_schema.load_schema()).is_valid({**report, "extra": 1})


def test_every_check_json_in_the_suite_goes_through_the_schema() -> None:
    """One place parses `check --json` (tests/check_schema.py): a test file that runs it
    must use that helper (or test_run.check_json / boot harness.check_json, built on it)."""
    tests = Path(__file__).parent
    helpers = ("check_report(", "parse_check(", "check_json(")
    for path in sorted(tests.rglob("*.py")):
        text = path.read_text()
        text = text.replace(ast.get_docstring(ast.parse(text), clean=False) or "", "")
        if path.name == "check_schema.py" or '"check", "--json"' not in text:
            continue
        assert any(h in text for h in helpers), f"{path} parses check --json by itself"
        by_itself = re.search(r'json\.loads\([^\n]*"check", "--json"', text)
        assert by_itself is None, f"{path}: {by_itself and by_itself.group()}"


# -- docs/host-integration.md ------------------------------------------------------------


def test_host_commands_in_the_doc_are_the_ones_the_boot_suite_runs() -> None:
    """tests/boot runs the doc's commands (tests/hostcmd.py); here, without booting: the
    doc holds exactly the commands the suite uses, each in a shape the suite can run."""
    found = hostcmd.commands()
    assert set(found) == hostcmd.USED, (f"only in the doc: {sorted(set(found) - hostcmd.USED)}"
                                        f"; only in the suite: "
                                        f"{sorted(hostcmd.USED - set(found))}")
    assert hostcmd.in_guest(found["validate"]) == [
        "/usr/bin/unbounded-nvidia-setup", "check", "--json"]
    assert hostcmd.in_guest(found["is-active"]) == [
        "systemctl", "is-active", "unbounded-nvidia-setup"]
    assert hostcmd.in_guest(found["restart"]) == [
        "systemctl", "restart", "unbounded-nvidia-setup"]
    assert hostcmd.argv("install", ROOTFS="/r", DEB="/p.deb") == [
        "dpkg", "--root=/r", "-i", "/p.deb"]
    # The boot suite itself reaches these only through hostcmd (no second copy there).
    boot = "\n".join(p.read_text() for p in (Path(__file__).parent / "boot").glob("*.py"))
    for name in ("is-active", "restart", "validate", "install"):
        assert f'"{name}"' in boot, f"tests/boot does not run host-command {name}"
    assert '"is-active", SETUP' not in boot and '"restart", SETUP' not in boot
