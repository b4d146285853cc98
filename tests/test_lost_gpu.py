"""One lost GPU degrades a node, it never darkens it (issue 27, point 2).

A GPU that falls off the bus (Xid 79) answers NVML_ERROR_GPU_IS_LOST, and nvidia-ctk
1.20's NVML mode then fails the whole generate at its index (FACTS.md). The machines
here have four GPUs that answer the simulated NVML (tests/simnvml.c), which the nvidia-ctk
stand-in and, in real-tool mode, NVIDIA's nvidia-ctk load alike; simnvml.lose_gpu makes
one answer 15. The run must still exit 0 with a spec for the healthy GPUs, `all`
included, and `check` must say `degraded`, naming the lost one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import simgpu
import simnvml
import toolkit
from conftest import Cli, needs_root
from test_run import check_json, codes, load_spec, snapshot

pytestmark = needs_root


@pytest.fixture
def four(tmp_path: Path) -> simgpu.SimMachine:
    """Four GPUs in NVML mode (the product's default, no --mode)."""
    m = simgpu.make_machine(tmp_path / "root")
    for minor in (2, 3):
        simnvml.add_gpu(m, minor)
    m.write_config()
    assert len(m.nvml_gpus) == 4
    return m


def nodes_by_device(doc: dict[str, Any]) -> dict[str, list[str]]:
    return {d["name"]: sorted(n["path"] for n in d["containerEdits"].get("deviceNodes", []))
            for d in doc["devices"]}


def gpu_nodes(doc: dict[str, Any]) -> set[str]:
    """Every /dev/nvidia<N> (a GPU's own node) any device or the spec's edits name."""
    found = {n["path"] for n in doc.get("containerEdits", {}).get("deviceNodes", [])}
    for device in doc["devices"]:
        found |= {n["path"] for n in device["containerEdits"].get("deviceNodes", [])}
    return {p for p in found if p.removeprefix("/dev/nvidia").isdigit()}


def assert_serves(m: simgpu.SimMachine, healthy: list[int]) -> None:
    """The spec serves exactly the GPUs at ``healthy`` minors (index = minor here: the
    simulated GPUs' bus ids follow their minors), `all` among its devices."""
    doc = load_spec(m)
    devices = nodes_by_device(doc)
    assert devices["all"] == sorted(f"/dev/nvidia{n}" for n in healthy), devices
    assert gpu_nodes(doc) == {f"/dev/nvidia{n}" for n in healthy}, devices
    for n in healthy:
        assert devices[str(n)] == [f"/dev/nvidia{n}"], devices
        assert devices[m.nvml_gpus[n]] == [f"/dev/nvidia{n}"], devices
    assert set(devices) == {"all", *map(str, healthy), *(m.nvml_gpus[n] for n in healthy)}


def assert_degraded(cli: Cli, m: simgpu.SimMachine, lost: list[int]) -> dict[str, Any]:
    report: dict[str, Any] = check_json(cli, m)
    assert report["verdict"] == "degraded" and report["ok"] is False, report
    assert codes(report) == {"gpu-lost"}, report["problems"]
    assert sorted(p["path"] for p in report["problems"]) == sorted(
        str(m.root / f"dev/nvidia{n}") for n in lost)
    gpus = report["gpus"]
    assert gpus["listed"] == 4 and gpus["served"] == 4 - len(lost), gpus
    assert [(g["index"], g["uuid"], g["device"]) for g in gpus["lost"]] == [
        (n, m.nvml_gpus[n], f"/dev/nvidia{n}") for n in lost], gpus
    assert [g["bus_id"] for g in gpus["lost"]] == [simnvml.gpu_bus_id(n) for n in lost], gpus
    return report


def test_a_healthy_node_serves_every_gpu(four: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(four.root, "run").code == 0
    assert_serves(four, [0, 1, 2, 3])
    report = check_json(cli, four)
    assert report["verdict"] == "ready", report
    assert report["gpus"] == {"listed": 4, "served": 4, "lost": []}


def test_one_lost_gpu_on_a_fresh_boot_degrades_the_node(four: simgpu.SimMachine,
                                                        cli: Cli) -> None:
    """Today's product fails every retry here: containerd and kubelet never start."""
    simnvml.lose_gpu(four, 2)
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    assert_serves(four, [0, 1, 3])
    warning, = [line for line in out.stderr.splitlines() if line.startswith("warning: GPU ")]
    assert "GPU 2" in warning and four.nvml_gpus[2] in warning, warning
    report = assert_degraded(cli, four, [2])
    problem, = report["problems"]
    assert four.nvml_gpus[2] in problem["message"] and "/dev/nvidia2" in problem["message"]
    status = cli(four.root, "status")
    assert "serving 3 of 4 GPUs" in status.stdout, status.stdout


def test_a_ready_node_that_loses_a_gpu_and_restarts_degrades(four: simgpu.SimMachine,
                                                             cli: Cli) -> None:
    """Today's restart fails (the previous spec stays, containerd and kubelet stay down)
    and check still says `ready`: it validates the previous spec."""
    assert cli(four.root, "run").code == 0
    simnvml.lose_gpu(four, 1)
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    assert_serves(four, [0, 2, 3])
    assert_degraded(cli, four, [1])


def test_a_reload_after_a_lost_gpu_degrades(four: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(four.root, "run").code == 0
    simnvml.lose_gpu(four, 0)
    out = cli(four.root, "run", "--spec-only")
    assert out.code == 0, out.stderr
    assert_serves(four, [1, 2, 3])
    assert_degraded(cli, four, [0])


@pytest.mark.parametrize("command", [("run",), ("run", "--spec-only")])
def test_a_gpu_that_comes_back_returns_the_node_to_ready(
        four: simgpu.SimMachine, cli: Cli, command: tuple[str, ...]) -> None:
    simnvml.lose_gpu(four, 3)
    assert cli(four.root, "run").code == 0
    assert_degraded(cli, four, [3])
    simnvml.recover_gpu(four, 3)
    # Nothing has asked NVML again yet: check reads files, and the spec still lacks it.
    assert check_json(cli, four)["verdict"] == "degraded"
    out = cli(four.root, *command)
    assert out.code == 0, out.stderr
    assert_serves(four, [0, 1, 2, 3])
    report = check_json(cli, four)
    assert report["verdict"] == "ready", report
    status = cli(four.root, "status").stdout
    assert "GPUs:           serving 4 of 4 GPUs\n" in status, status


@pytest.mark.parametrize("lost", [[1, 2], [0, 3], [1, 2, 3]])
def test_several_lost_gpus(four: simgpu.SimMachine, cli: Cli, lost: list[int]) -> None:
    for n in lost:
        simnvml.lose_gpu(four, n)
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    assert_serves(four, [n for n in range(4) if n not in lost])
    assert_degraded(cli, four, lost)
    assert f"serving {4 - len(lost)} of 4 GPUs" in cli(four.root, "status").stdout


def test_every_gpu_lost_keeps_the_node_not_ready(four: simgpu.SimMachine, cli: Cli) -> None:
    """No healthy GPU: nothing to serve, the failure stands and says why."""
    for n in range(4):
        simnvml.lose_gpu(four, n)
    out = cli(four.root, "run")
    assert out.code == 1 and len(out.errors) == 1, out.stderr
    assert "GPU is lost" in out.errors[0], out.errors
    assert not four.cdi_spec.exists()
    assert check_json(cli, four)["verdict"] == "broken"


def test_an_nvml_that_cannot_initialise_is_not_a_lost_gpu(four: simgpu.SimMachine,
                                                          cli: Cli) -> None:
    """Driver Not Loaded: NVML answers for no GPU at all. That stays not Ready, as
    before: the node's driver is broken, not one GPU, and nothing is served."""
    assert cli(four.root, "run").code == 0
    before = snapshot(four)
    simnvml.silence_nvml(four)
    out = cli(four.root, "run")
    assert out.code == 1 and len(out.errors) == 1, out.stderr
    assert "is lost" not in out.stderr
    assert snapshot(four) == before
    report = check_json(cli, four)
    assert report["verdict"] == "broken" and "gpu-lost" not in codes(report), report


def logging_nvidia_ctk(m: simgpu.SimMachine, tmp_path: Path) -> Path:
    """The tests' nvidia-ctk (the stand-in or NVIDIA's) behind a wrapper that appends
    each call's arguments to the returned file, one JSON list per line, then execs it."""
    log_file, wrapper = tmp_path / "ctk.log", tmp_path / "nvidia-ctk"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(log_file)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"os.execv({str(toolkit.NVIDIA_CTK)!r}, [{str(toolkit.NVIDIA_CTK)!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    m.write_config(nvidia_ctk=str(wrapper))
    return log_file


def test_a_healthy_run_calls_nvidia_ctk_generate_once(four: simgpu.SimMachine, cli: Cli,
                                                      tmp_path: Path) -> None:
    """The fallback costs nothing on a healthy node; a lost GPU costs one more call."""
    log_file = logging_nvidia_ctk(four, tmp_path)

    def generates() -> list[list[str]]:
        calls = [json.loads(line) for line in log_file.read_text().splitlines()]
        log_file.unlink()
        return [c for c in calls if "generate" in c]

    assert cli(four.root, "run").code == 0
    healthy = generates()
    assert len(healthy) == 1 and not any(a.startswith("--device-id") for a in healthy[0])
    simnvml.lose_gpu(four, 2)
    assert cli(four.root, "run").code == 0
    first, second = generates()
    assert not any(a.startswith("--device-id") for a in first)
    ids = [a for a in second if a.startswith("--device-id=")]
    assert ids == ["--device-id=" + ",".join(four.nvml_gpus[n] for n in (0, 1, 3))], second


def test_config_that_chooses_the_devices_keeps_its_choice(four: simgpu.SimMachine,
                                                         cli: Cli) -> None:
    """nvidia_ctk_args with --device-id: the operator chose; the product does not
    replace that choice, and a lost GPU among it fails the run as nvidia-ctk says."""
    four.write_config(nvidia_ctk_args=["--device-id=all"])
    simnvml.lose_gpu(four, 2)
    out = cli(four.root, "run")
    assert out.code == 1 and "GPU is lost" in out.errors[0], out.stderr
