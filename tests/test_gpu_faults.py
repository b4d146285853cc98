"""The GPU fault model, complete over what NVIDIA's generate asks NVML (issue 35).

Issue 31 degraded a node whose GPU failed its NVML handle lookup. Beside it, each of
these still darkened the node (`run` exit 1 on every retry, containerd and kubelet never
started): an nvidia-ctk older than the hook flags (1.17) beside a lost GPU; a GPU whose
handle opens but whose later calls fail (MIG mode, UUID, minor, PCI info, name: what a
GSP timeout looks like); and a GPU whose NVML calls block. And `check` said more than
the node shows: a healthy node's `served` was the listed count, not read from the spec;
the device plugin's spec was never compared with the GPUs the run found unusable.

Every test runs under each documented reading of NVML's lookups by UUID
(simnvml.READINGS), with the stand-in and, in `.ci/run`'s real-tool step, NVIDIA's
nvidia-ctk 1.20 (both load the simulated NVML, tests/simnvml.c).
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
from test_lost_gpu import assert_serves, check_json, gpu_nodes, nodes_by_device, per_gpu_expected
from test_run import codes, load_spec

pytestmark = needs_root


def unusable(report: dict[str, Any]) -> list[tuple[int, str | None, int, str | None]]:
    return [(g["index"], g["device"], g["nvml_error"], g["query"])
            for g in report["gpus"]["unusable"]]


# ------------------------------------------------------------- nvidia-ctk 1.17 (point 1)


def older_nvidia_ctk(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """The tests' nvidia-ctk as 1.17 shows itself: its `--version`, and urfave/cli's
    refusal of the hook flags that 1.18 added; everything else is the tool itself."""
    wrapper = tmp_path / "nvidia-ctk-1.17"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "args = sys.argv[1:]\n"
        "if args == ['--version']:\n"
        "    print('NVIDIA Container Toolkit CLI version 1.17.8\\ncommit: 0000000')\n"
        "    sys.exit(0)\n"
        "for a in args:\n"
        "    if a.split('=')[0] in ('--enable-hook', '--disable-hook'):\n"
        "        print(f'Incorrect Usage: flag provided but not defined: {a.split(\"=\")[0][1:]}',"
        " file=sys.stderr)\n"
        "        sys.exit(1)\n"
        f"os.execv({str(toolkit.NVIDIA_CTK)!r}, [{str(toolkit.NVIDIA_CTK)!r}, *args])\n")
    wrapper.chmod(0o755)
    m.write_config(nvidia_ctk=str(wrapper))


def test_an_older_nvidia_ctk_with_a_lost_gpu_degrades(four: simgpu.SimMachine, cli: Cli,
                                                       tmp_path: Path, reading: str) -> None:
    """Today's product follows only the first generate: 1.17 fails it on the hook flags,
    the retry without them fails on the lost GPU, and the run dies on every retry."""
    older_nvidia_ctk(four, tmp_path)
    assert cli(four.root, "run").code == 0
    simnvml.lose_gpu(four, 2)
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    assert "predates the hook flags" in out.stderr
    assert_serves(four, [0, 1, 3], per_gpu_expected(reading, [0, 1, 3], [2]))
    report = check_json(cli, four)
    assert report["verdict"] == "degraded" and codes(report) == {"gpu-lost"}, report
    assert unusable(report) == [(2, "/dev/nvidia2", 15, "nvmlDeviceGetHandleByIndex_v2")]


# ------------------------------------------------ a GPU whose later calls fail (point 2)

# simnvml.fail_query's names -> the call the product names (the versioned symbol).
LATER_CALLS = {
    "nvmlDeviceGetName": "nvmlDeviceGetName",
    "nvmlDeviceGetMigMode": "nvmlDeviceGetMigMode",
    "nvmlDeviceGetUUID": "nvmlDeviceGetUUID",
    "nvmlDeviceGetMinorNumber": "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetPciInfo": "nvmlDeviceGetPciInfo_v3",
}


@pytest.mark.parametrize("call", list(LATER_CALLS))
def test_a_gpu_whose_later_call_fails_degrades(four: simgpu.SimMachine, cli: Cli,
                                               reading: str, call: str) -> None:
    """Its handle opens, but one of the calls nvidia-ctk's NVML mode makes of it next
    answers Unknown Error: nvidia-ctk's `all` fails ("error getting MIG mode: Unknown
    Error"), and today's product, which judged a GPU by its handle alone, found every
    GPU usable and died. The GPU is named with the call that failed."""
    simnvml.fail_query(four, 2, call, 999)
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    served = gpu_nodes(load_spec(four))
    assert served == {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia3"}, nodes_by_device(
        load_spec(four))
    report = check_json(cli, four)
    assert report["verdict"] == "degraded" and codes(report) == {"gpu-unusable"}, report
    assert unusable(report) == [(2, "/dev/nvidia2", 999, LATER_CALLS[call])]
    assert LATER_CALLS[call] in report["problems"][0]["message"]
    assert (report["gpus"]["listed"], report["gpus"]["served"]) == (4, 3)


# ----------------------------------------------------------- a GPU that blocks (point 3)


@pytest.mark.parametrize("call", [None, "nvmlDeviceGetMigMode"])
def test_a_gpu_whose_nvml_blocks_degrades(four: simgpu.SimMachine, cli: Cli, reading: str,
                                          call: str | None) -> None:
    """A GPU whose GSP stopped answering: its calls block. nvidia-ctk is killed at its
    timeout, and today's product failed the run that way on every retry. NVML is asked
    GPU by GPU, each call within nvml_gpu_timeout_seconds: the GPU is named with how long
    it was given, and the others are served, within the run's budget."""
    four.write_config(nvidia_ctk_timeout_seconds=4, nvml_gpu_timeout_seconds=1,
                      run_timeout_seconds=60)
    simnvml.hang_gpu(four, 2, call)
    out = cli(four.root, "run", timeout=90)
    assert out.code == 0, out.stderr
    # Per-GPU devices where the lookups by UUID of the others do not reach the GPU that
    # blocks: the `--device-id` try asks in NVML mode, never by index, and a GPU given by
    # UUID is never asked its MIG mode (nvidia-ctk 1.20, lib-nvml.go).
    assert_serves(four, [0, 1, 3],
                  per_gpu_expected(reading, [0, 1, 3], [2]) if call is None else True)
    report = check_json(cli, four)
    assert report["verdict"] == "degraded" and codes(report) == {"gpu-unusable"}, report
    gpu, = report["gpus"]["unusable"]
    assert (gpu["index"], gpu["device"], gpu["nvml_error"], gpu["timeout_seconds"]) == (
        2, "/dev/nvidia2", 10, 1), gpu
    assert gpu["query"] == (call or "nvmlDeviceGetHandleByIndex_v2"), gpu
    assert "did not answer" in report["problems"][0]["message"] and "within 1 s" in \
        report["problems"][0]["message"], report["problems"]


# -------------------------------------------------------- what the node shows (point 4)


def test_served_is_read_from_the_spec_on_a_healthy_node(four: simgpu.SimMachine,
                                                         cli: Cli) -> None:
    """A MIG-enabled GPU without MIG devices is not in the spec (NVML mode's `all`
    never lists it); today's `check` counted it served on a healthy node."""
    simnvml.enable_mig(four, 1, [])
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    assert "/dev/nvidia1" not in gpu_nodes(load_spec(four))
    report = check_json(cli, four)
    assert report["verdict"] == "ready", report
    assert (report["gpus"]["listed"], report["gpus"]["served"]) == (4, 3), report["gpus"]
    status = cli(four.root, "status")
    assert "the spec serves 3 of 4 GPUs" in status.stdout, status.stdout


def plugin_spec(m: simgpu.SimMachine, minors: list[int]) -> Path:
    """A spec as NVIDIA's device plugin writes it at its start (its kind, a device per
    GPU UUID, each with its /dev/nvidia<N>, the control nodes in the common edits)."""
    path = m.root / "var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    driver = m.root / "run/nvidia/driver"
    lib = next(driver.glob(f"lib/{m.multiarch}/libcuda.so.*.*"))
    ml = next(driver.glob(f"lib/{m.multiarch}/libnvidia-ml.so.*.*"))
    doc = {
        "cdiVersion": "0.5.0", "kind": "k8s.device-plugin.nvidia.com/gpu",
        "devices": [{"name": m.nvml_gpus[n], "containerEdits": {"deviceNodes": [
            {"path": f"/dev/nvidia{n}", "hostPath": str(m.root / f"dev/nvidia{n}")}]}}
            for n in minors],
        "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidiactl",
                             "hostPath": str(m.root / "dev/nvidiactl")}],
            "mounts": [{"hostPath": str(p), "containerPath": str(p.relative_to(driver)),
                        "options": ["ro", "nosuid", "nodev", "bind"]} for p in (lib, ml)]}}
    path.write_text(json.dumps(doc))
    return path


def test_a_plugin_spec_listing_an_unusable_gpu_is_named(four: simgpu.SimMachine,
                                                        cli: Cli) -> None:
    """A plugin that started while the node was healthy keeps its spec after a reload
    finds a GPU lost; today's `check` never compared the two."""
    assert cli(four.root, "run").code == 0
    path = plugin_spec(four, [0, 1, 2, 3])
    assert check_json(cli, four)["verdict"] == "ready"
    simnvml.lose_gpu(four, 2)
    assert cli(four.root, "run", "--spec-only").code == 0
    report = check_json(cli, four)
    assert report["verdict"] == "degraded", report
    assert codes(report) == {"gpu-lost", "plugin-spec-unusable-gpu"}, report["problems"]
    problem, = [p for p in report["problems"] if p["code"] == "plugin-spec-unusable-gpu"]
    assert "/dev/nvidia2" in problem["message"] and "restart the device plugin" in \
        problem["message"], problem
    assert problem["path"] == str(path)
    section = report["device_plugin_spec"]
    assert section["gpus"] == [f"/dev/nvidia{n}" for n in range(4)], section
    assert section["written_at"] == path.stat().st_mtime
    assert cli(four.root, "check").code == 3
    status = cli(four.root, "status").stdout
    assert "lists /dev/nvidia0, /dev/nvidia1, /dev/nvidia2, /dev/nvidia3" in status, status
    # A plugin restarted since writes a spec without it: nothing left to name.
    plugin_spec(four, [0, 1, 3])
    assert codes(check_json(cli, four)) == {"gpu-lost"}


# ------------------------------------------------------------ the fault path's guards


def editing_nvidia_ctk(m: simgpu.SimMachine, tmp_path: Path, *, fail_ids: bool,
                       drop_from: str, drop: str) -> None:
    """The tests' nvidia-ctk behind a wrapper that, when asked for `--device-id`s, fails
    as NVML's lookups by UUID do (``fail_ids``), and that drops the device node ``drop``
    from what it writes for the calls whose arguments hold ``drop_from``."""
    wrapper = tmp_path / "nvidia-ctk"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys, yaml\n"
        "args = sys.argv[1:]\n"
        f"if {fail_ids!r} and any(a.startswith('--device-id') for a in args):\n"
        "    print('level=error msg=\"failed to get device handle from UUID: GPU is lost\"',"
        " file=sys.stderr)\n"
        "    sys.exit(1)\n"
        f"rc = subprocess.call([{str(toolkit.NVIDIA_CTK)!r}, *args])\n"
        f"if rc == 0 and any({drop_from!r} in a for a in args):\n"
        "    out = next(a.split('=', 1)[1] for a in args if a.startswith('--output='))\n"
        "    doc = yaml.safe_load(open(out))\n"
        "    edits = [doc.get('containerEdits') or {}]\n"
        "    edits += [d['containerEdits'] for d in doc['devices']]\n"
        "    for e in edits:\n"
        "        nodes = e.get('deviceNodes') or []\n"
        f"        e['deviceNodes'] = [n for n in nodes if n['path'] != {drop!r}]\n"
        "    yaml.safe_dump(doc, open(out, 'w'))\n"
        "sys.exit(rc)\n")
    wrapper.chmod(0o755)
    m.write_config(nvidia_ctk=str(wrapper))


def test_a_degraded_spec_that_lacks_a_usable_gpu_is_refused(four: simgpu.SimMachine,
                                                             cli: Cli, tmp_path: Path) -> None:
    """The last guard (degrade.check_served): management mode's spec, narrowed, must
    serve exactly the usable GPUs. One that lacks a usable GPU is not installed."""
    assert cli(four.root, "run").code == 0
    before = load_spec(four)
    editing_nvidia_ctk(four, tmp_path, fail_ids=True, drop_from="--mode=management",
                       drop="/dev/nvidia0")
    simnvml.lose_gpu(four, 2)
    out = cli(four.root, "run")
    assert out.code == 1, out.stderr
    assert "serves other GPUs than them (/dev/nvidia0)" in out.errors[0], out.stderr
    assert load_spec(four) == before


def test_a_per_gpu_spec_that_serves_other_gpus_falls_back(four: simgpu.SimMachine, cli: Cli,
                                                          tmp_path: Path, reading: str) -> None:
    """The guard on the `--device-id` spec (degrade._serves): one that does not serve
    exactly the usable GPUs is not used; management mode's `all` serves them. (Under
    the stricter readings the lookups by UUID fail first, as NVML's header allows.)"""
    editing_nvidia_ctk(four, tmp_path, fail_ids=False, drop_from="--device-id",
                       drop="/dev/nvidia1")
    simnvml.lose_gpu(four, 2)
    out = cli(four.root, "run")
    assert out.code == 0, out.stderr
    assert "serving them through management mode's `all`" in out.stderr, out.stderr
    assert ("it served other GPUs" in out.stderr) == (reading == "target"), out.stderr
    assert_serves(four, [0, 1, 3], per_gpu=False)
