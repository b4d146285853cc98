"""Metrics for node_exporter's textfile collector, read back the way a fleet reads them:
the real prometheus-node-exporter serves the directory, the test scrapes it over HTTP,
prometheus_client's parser (an oracle the tool never imports) reads the text, and
promtool lints it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from check_schema import check_report, codes_in_schema, codes_in_source
from invariants import product_argv, product_env
from unbounded_nvidia_setup.metrics import FILE, LOCK
from unbounded_nvidia_setup.problems import PROBLEM_CODES

import simgpu
import simnvml
from conftest import Cli, needs_root, needs_tool

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
PROMTOOL = "/usr/bin/promtool"
REPO = Path(__file__).resolve().parent.parent
PRODUCT = REPO / "guest" / "unbounded_nvidia_setup"
MA = "x86_64-linux-gnu"
P = "unbounded_nvidia_setup_"

pytestmark = [needs_root, needs_tool(NODE_EXPORTER, " (Debian's prometheus-node-exporter)"),
              needs_tool(PROMTOOL, " (Debian's prometheus)")]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def textfile_dir(m: simgpu.SimMachine) -> Path:
    """The default metrics_dir, under --root like every other path."""
    return m.root / "var/lib/prometheus/node-exporter"


class NodeExporter:
    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.url = f"http://127.0.0.1:{port}/metrics"

    def scrape(self) -> Samples:
        """Our samples, after checking node_exporter read every file without error."""
        with urllib.request.urlopen(self.url, timeout=10) as response:
            text = response.read().decode()
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "node_textfile_scrape_error":
                    assert s.value == 0, "node_exporter could not parse a .prom file"
                if s.name.startswith(P):
                    samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def exporter(m: simgpu.SimMachine) -> Iterator[NodeExporter]:
    """The real node_exporter with only the textfile collector, on the machine's
    default metrics_dir; stopped (killed if it must be) whatever the test's outcome."""
    directory = textfile_dir(m)
    directory.mkdir(parents=True)
    port = _free_port()
    proc = subprocess.Popen(
        [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}",
         "--collector.disable-defaults", "--collector.textfile",
         f"--collector.textfile.directory={directory}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "node_exporter did not start listening"
                time.sleep(0.05)
        yield NodeExporter(directory, port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(P + name, tuple(sorted(labels.items())))]


def problem_series(samples: Samples) -> dict[str, float]:
    return {dict(k[1])["code"]: v for k, v in samples.items() if k[0] == P + "check_problems"}


def driver_files(m: simgpu.SimMachine) -> tuple[int, int]:
    sizes = [p.lstat().st_size for p in m.driver_root.rglob("*")
             if p.is_file() and not p.is_symlink()]
    return len(sizes), sum(sizes)


def promtool_check(path: Path) -> None:
    with path.open("rb") as f:
        out = subprocess.run([PROMTOOL, "check", "metrics"], stdin=f, capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out


def test_every_problem_code_has_a_series() -> None:
    """The metrics name exactly the codes the product emits (the same set the schema and
    docs/problems.md must hold, tests/test_contract.py): a new code without a series would
    read as "absent" to every alert."""
    source, unreadable = codes_in_source()
    assert unreadable == []
    assert len(PROBLEM_CODES) == len(set(PROBLEM_CODES))
    assert set(PROBLEM_CODES) == source == codes_in_schema()
    assert {"root-wrong-link", "ldcache-stale"} <= source


def test_run_metrics_match_what_the_run_did(m: simgpu.SimMachine, cli: Cli,
                                            exporter: NodeExporter) -> None:
    before = time.time()
    out = cli(m.root, "run")
    after = time.time()
    # The run's own warnings (nvidia-ctk's routine ones are notices, level=warning inside).
    assert out.code == 0 and not out.warnings, out.stderr
    promtool_check(exporter.directory / FILE)
    s = exporter.scrape()
    assert value(s, "run_success") == 1 and value(s, "run_exit_code") == 0
    assert value(s, "run_swapped") == 1
    assert before <= value(s, "run_timestamp_seconds") <= after
    assert 0 < value(s, "run_duration_seconds") <= after - before
    assert value(s, "driver_info", driver_version=m.version, module_version=m.version) == 1
    assert value(s, "gpu_present") == 1
    assert value(s, "gpus") == value(s, "gpus_served") == len(m.nvml_gpus) == 2
    files, size = driver_files(m)
    assert files > 10 and size > 0
    assert (value(s, "driver_root_files"), value(s, "driver_root_bytes")) == (files, size)
    assert value(s, "check_ok") == 1
    assert before <= value(s, "check_timestamp_seconds") <= value(s, "run_timestamp_seconds")
    assert problem_series(s) == dict.fromkeys(PROBLEM_CODES, 0)
    assert sorted(p.name for p in exporter.directory.iterdir()) == [LOCK, FILE]

    assert cli(m.root, "run").code == 0  # nothing to change: nothing swapped
    s = exporter.scrape()
    assert value(s, "run_swapped") == 0 and value(s, "run_success") == 1


def test_check_metrics_on_a_tampered_machine(m: simgpu.SimMachine, cli: Cli,
                                             exporter: NodeExporter) -> None:
    assert cli(m.root, "run").code == 0
    ran = exporter.scrape()
    cuda = m.driver_lib_dir / f"libcuda.so.{m.version}"
    cuda.chmod(0o666)
    (m.cdi_spec).unlink()
    path = exporter.directory / FILE
    ino = path.stat().st_ino
    assert cli(m.root, "check").code == 1
    assert path.stat().st_ino == ino  # without --metrics, check writes nothing

    before = time.time()
    out = cli(m.root, "check", "--metrics")
    assert out.code == 1
    report = check_report(cli(m.root, "check", "--json"))
    want = dict.fromkeys(PROBLEM_CODES, 0)
    for p in report["problems"]:
        want[p["code"]] += 1
    assert want["root-bad-mode"] == 1 and want["spec-missing"] == 1
    promtool_check(path)
    s = exporter.scrape()
    assert value(s, "check_ok") == 0
    assert problem_series(s) == want
    assert value(s, "check_timestamp_seconds") >= before
    assert value(s, "driver_info", driver_version=m.version, module_version=m.version) == 1
    # The run's families are the last run's, carried over unchanged.
    assert {k: v for k, v in s.items() if k[0].startswith(P + "run_")} == \
        {k: v for k, v in ran.items() if k[0].startswith(P + "run_")}

    assert cli(m.root, "run").code == 0  # repaired: the run's end-state check says so
    s = exporter.scrape()
    assert value(s, "check_ok") == 1 and problem_series(s) == dict.fromkeys(PROBLEM_CODES, 0)


def test_a_lost_gpu_is_a_degraded_node_in_the_metrics(m: simgpu.SimMachine, cli: Cli,
                                                       exporter: NodeExporter) -> None:
    """Four GPUs, GPU 2 lost (NVML: GPU_IS_LOST): the run succeeds serving three, and the
    node reads as degraded without parsing problems: gpus 4, gpus_served 3, one gpu-lost;
    the check is not ok, the run a success. The GPU back, a run serves all four."""
    for minor in (2, 3):
        simnvml.add_gpu(m, minor)
    simnvml.lose_gpu(m, 2)
    m.write_config()
    assert cli(m.root, "run").code == 0
    promtool_check(exporter.directory / FILE)
    s = exporter.scrape()
    assert (value(s, "gpus"), value(s, "gpus_served")) == (4, 3)
    assert value(s, "check_ok") == 0 and value(s, "run_success") == 1
    assert problem_series(s) == {**dict.fromkeys(PROBLEM_CODES, 0), "gpu-lost": 1}
    assert cli(m.root, "check", "--metrics").code == 3  # check's own view (degraded): the same

    def untimed(samples: Samples) -> Samples:
        return {k: v for k, v in samples.items() if k[0] != P + "check_timestamp_seconds"}

    assert untimed(exporter.scrape()) == untimed(s)

    simnvml.recover_gpu(m, 2)
    assert cli(m.root, "run").code == 0
    s = exporter.scrape()
    assert (value(s, "gpus"), value(s, "gpus_served")) == (4, 4)
    assert value(s, "check_ok") == 1
    assert problem_series(s) == dict.fromkeys(PROBLEM_CODES, 0)


def test_a_failing_run_writes_its_exit_code(m: simgpu.SimMachine, cli: Cli,
                                            exporter: NodeExporter) -> None:
    assert cli(m.root, "run").code == 0
    ran = exporter.scrape()
    m.write_config(staging_wait_seconds=0)
    shutil.rmtree(m.root / "run/host-nvidia")
    out = cli(m.root, "run")
    assert out.code == 75
    s = exporter.scrape()
    assert value(s, "run_success") == 0 and value(s, "run_exit_code") == 75
    assert value(s, "run_timestamp_seconds") > value(ran, "run_timestamp_seconds")
    # It proved no end state: the last check's families stay as they were.
    assert value(s, "check_timestamp_seconds") == value(ran, "check_timestamp_seconds")

    m.write_config(nvidia_ctk="/nonexistent/nvidia-ctk")
    assert cli(m.root, "run").code == 1
    assert value(exporter.scrape(), "run_exit_code") == 1


def test_a_run_rolled_back_at_its_end_state_keeps_the_last_check(
        m: simgpu.SimMachine, cli: Cli, exporter: NodeExporter, tmp_path: Path) -> None:
    """Its end-state report described a state the rollback undid: not a check result."""
    from test_ldconfig import corrupting_ldconfig

    assert cli(m.root, "run").code == 0
    ran = exporter.scrape()
    corrupting_ldconfig(m, tmp_path, m.version)
    out = cli(m.root, "run")
    assert out.code == 1 and "the live state is wrong after setup" in out.stderr
    s = exporter.scrape()
    assert value(s, "run_success") == 0 and value(s, "run_exit_code") == 1
    assert value(s, "check_timestamp_seconds") == value(ran, "check_timestamp_seconds")
    assert value(s, "check_ok") == 1
    m.write_config()
    assert cli(m.root, "run").code == 0  # repaired


def test_a_run_refused_for_a_shadowing_conf_file_records_why(
        m: simgpu.SimMachine, cli: Cli, exporter: NodeExporter) -> None:
    """Refused before changing anything (tests/test_ldshadow.py), the run records what
    check sees: on a first boot no check has run yet (the timer's first is 5 min after
    boot, ordered after the setup unit), so the run's file is where the cause shows."""
    from test_ldshadow import install_cuda_compat

    conf = install_cuda_compat(m)
    before = time.time()
    assert cli(m.root, "run").code == 1
    promtool_check(exporter.directory / FILE)
    s = exporter.scrape()
    assert value(s, "run_success") == 0 and value(s, "run_exit_code") == 1
    assert value(s, "check_ok") == 0 and value(s, "check_timestamp_seconds") >= before
    series = problem_series(s)
    assert series["ldcache-shadowed"] == 1 and series["root-missing"] == 1, series
    # The drift check says the same, and that the run failed: the run cannot name its
    # own failure before it has ended (outcome.py), a check after it can.
    assert cli(m.root, "check", "--metrics").code == 1
    assert problem_series(exporter.scrape()) == series | {"setup-failed": 1}

    conf.unlink()
    assert cli(m.root, "run").code == 0
    s = exporter.scrape()
    assert value(s, "check_ok") == 1 and problem_series(s) == dict.fromkeys(PROBLEM_CODES, 0)


@needs_tool("strace")
def test_a_run_killed_while_writing_leaves_the_previous_file(
        m: simgpu.SimMachine, cli: Cli, exporter: NodeExporter) -> None:
    """SIGKILL between writing the temp file and renaming it: node_exporter keeps serving
    the previous file whole, and the next writer clears the temp file away.

    `-P` confines the injection to the temp file's own fsync: strace counts `when=` per
    process, so a count of the main process's fsyncs also killed ldconfig, a child that
    makes as many, and the run failed before it reached the metrics at all."""
    assert cli(m.root, "run").code == 0
    path = exporter.directory / FILE
    previous = path.read_bytes()
    proc = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=fsync",
                           "-P", str(exporter.directory / f".{FILE}.tmp"),
                           "-e", "inject=fsync:signal=KILL:when=1",
                           *product_argv(m.root, "run")], capture_output=True, text=True,
                          env=product_env(), timeout=120)
    assert proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), proc.stderr
    assert path.read_bytes() == previous
    assert (exporter.directory / f".{FILE}.tmp").exists()  # killed where we meant
    assert value(exporter.scrape(), "run_success") == 1
    assert cli(m.root, "check", "--metrics").code == 0
    assert sorted(p.name for p in exporter.directory.iterdir()) == [LOCK, FILE]
    promtool_check(path)


def test_no_gpu_run_says_so(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root", gpu=False)
    m.write_config()
    textfile_dir(m).mkdir(parents=True)
    assert cli(m.root, "run").code == 0
    text = (textfile_dir(m) / FILE).read_text()
    promtool_check(textfile_dir(m) / FILE)
    assert f"{P}gpu_present 0\n" in text and f"{P}run_success 1\n" in text
    assert f"{P}check_ok 1\n" in text


def test_no_directory_means_no_file_and_no_message(m: simgpu.SimMachine, cli: Cli) -> None:
    out = cli(m.root, "run")
    assert out.code == 0 and not out.warnings and "metrics" not in out.stderr
    assert not (m.root / "var/lib/prometheus").exists()
    assert cli(m.root, "check", "--metrics").code == 0


def test_empty_metrics_dir_turns_metrics_off(m: simgpu.SimMachine, cli: Cli) -> None:
    textfile_dir(m).mkdir(parents=True)
    m.write_config(metrics_dir="")
    assert cli(m.root, "run").code == 0
    assert cli(m.root, "check", "--metrics").code == 0
    assert list(textfile_dir(m).iterdir()) == []


def test_metrics_dir_must_be_absolute(m: simgpu.SimMachine, cli: Cli) -> None:
    m.write_config(metrics_dir="var/lib")
    out = cli(m.root, "run")
    assert out.code == 2 and "metrics_dir" in out.stderr


def _warned_once(stderr: str) -> None:
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "metrics not written" in warnings[0], stderr


def test_read_only_directory_never_fails_a_run(m: simgpu.SimMachine, cli: Cli,
                                               mounts: list[Path]) -> None:
    directory = textfile_dir(m)
    directory.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)],
                   check=True)
    mounts.append(directory)
    out = cli(m.root, "run")
    assert out.code == 0
    _warned_once(out.stderr)
    assert "Read-only file system" in out.stderr
    out = cli(m.root, "check", "--metrics")
    assert out.code == 0
    _warned_once(out.stderr)


def test_full_directory_never_fails_a_run(m: simgpu.SimMachine, cli: Cli,
                                          mounts: list[Path]) -> None:
    directory = textfile_dir(m)
    directory.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)],
                   check=True)
    mounts.append(directory)
    with (directory / "filler").open("wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    out = cli(m.root, "run")
    assert out.code == 0
    _warned_once(out.stderr)
    assert "No space left on device" in out.stderr
    assert sorted(p.name for p in directory.iterdir()) == [LOCK, "filler"]  # no temp file left


def test_symlinked_directory_is_not_followed(m: simgpu.SimMachine, cli: Cli,
                                             tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    textfile_dir(m).parent.mkdir(parents=True)
    textfile_dir(m).symlink_to(outside)
    out = cli(m.root, "run")
    assert out.code == 0
    _warned_once(out.stderr)
    assert "symlink" in out.stderr
    assert list(outside.iterdir()) == []


def test_fifo_or_symlink_by_our_name_neither_blocks_nor_leads_out(
        m: simgpu.SimMachine, cli: Cli, tmp_path: Path) -> None:
    directory = textfile_dir(m)
    directory.mkdir(parents=True)
    os.mkfifo(directory / FILE)
    # check reads the previous file for the run's families: a FIFO must not block it.
    out = cli(m.root, "check", "--metrics", timeout=60)
    assert out.code == 1 and "warning" not in out.stderr
    assert (directory / FILE).is_file() and not (directory / FILE).is_symlink()
    promtool_check(directory / FILE)

    outside = tmp_path / "outside.prom"
    outside.write_text("untouched\n")
    (directory / FILE).unlink()
    (directory / FILE).symlink_to(outside)
    assert cli(m.root, "check", "--metrics", timeout=60).code == 1
    (directory / FILE).unlink()
    os.mkfifo(directory / FILE)
    assert cli(m.root, "run", timeout=60).code == 0
    assert outside.read_text() == "untouched\n"
    assert (directory / FILE).is_file() and not (directory / FILE).is_symlink()
    assert sorted(p.name for p in directory.iterdir()) == [LOCK, FILE]
