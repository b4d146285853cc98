"""The other NVIDIA consumers' specs (issue 38, point 3): the GPU Operator's toolkit
operand writes a management spec, NVIDIA's DRA driver a spec per claim, each from the live
driver root when its pod starts. After a swap to another driver they name files the root
no longer has. `check` names each such spec, its consumer and the pod to restart
(`consumer-spec-stale`); `status` lists every NVIDIA spec; neither is ever rewritten.

The specs are written by nvidia-ctk as those consumers write theirs (NVIDIA's own in
real-tool mode: `.ci/run`), before and after a driver upgrade through a run that swaps
the root.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from check_schema import check_report
from invariants import run_cli
from test_crash import Swapper, swapper

import toolkit
from conftest import needs_root

pytestmark = needs_root

MANAGEMENT = "var/run/cdi/management.nvidia.com-gpu.yaml"
CLAIM = "var/run/cdi/k8s.gpu.nvidia.com-claim_6b3c1e0a-5d1f-4c55-9a51-2f1f0d2a9c11.yaml"


def consumer_spec(s: Swapper, name: str, vendor: str, klass: str) -> Path:
    """What the consumer's pod writes when it starts: nvidia-ctk over the live root, in
    management mode, under its own kind (`--vendor`/`--class`), with the paths as the
    node sees them."""
    out = s.m.root / name
    out.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        [str(toolkit.NVIDIA_CTK), "cdi", "generate", "--mode=management",
         f"--driver-root={s.m.root}/run/nvidia/driver", f"--dev-root={s.m.root}",
         f"--vendor={vendor}", f"--class={klass}", f"--output={out}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": toolkit.path_with_hook()})
    assert res.returncode == 0, res.stderr
    return out


def check(s: Swapper) -> dict[str, object]:
    return check_report(run_cli(s.m.root, "check", "--json"))


def stale(report: dict[str, object]) -> dict[str, str]:
    problems = report["problems"]
    assert isinstance(problems, list)
    return {p["path"]: p["message"] for p in problems if p["code"] == "consumer-spec-stale"}


def test_consumer_specs_left_on_a_replaced_root_are_named(tmp_path: Path) -> None:
    s = swapper(tmp_path)
    assert run_cli(s.m.root, "run").code == 0
    first = s.current
    management = consumer_spec(s, MANAGEMENT, "management.nvidia.com", "gpu")
    claim = consumer_spec(s, CLAIM, "k8s.gpu.nvidia.com", "claim")
    texts = {p: p.read_bytes() for p in (management, claim)}
    report = check(s)
    assert stale(report) == {} and report["verdict"] == "ready", report["problems"]
    found = {x["path"]: x for x in report["nvidia_specs"]["specs"]}  # type: ignore[index]
    assert found[str(management)]["consumer"] == "gpu-operator-toolkit", found
    assert found[str(claim)]["consumer"] == "dra-driver-claim", found
    assert found[str(management)]["driver_versions"] == [first], found
    assert all(x["matches_live_root"] for x in found.values()), found
    status = run_cli(s.m.root, "status").stdout
    assert f"gpu-operator-toolkit {management}: {first}; matches the live root" in status, status

    s.use(s.other())  # the host's driver upgrade, then the unit's restart
    assert run_cli(s.m.root, "run", "--force").code == 0
    report = check(s)
    named = stale(report)
    assert set(named) == {str(management), str(claim)}, report["problems"]
    assert f"driver {first}" in named[str(management)], named
    assert "nvidia-container-toolkit pod" in named[str(management)], named
    assert "kubelet plugin pod" in named[str(claim)], named
    assert report["verdict"] == "broken" and report["ok"] is False
    status = run_cli(s.m.root, "status").stdout
    assert f"dra-driver-claim {claim}: {first}; stale:" in status, status
    # Never ours to rewrite or remove.
    assert {p: p.read_bytes() for p in (management, claim)} == texts

    # The consumer's pod restarted: its spec, written again from the live root, is right.
    consumer_spec(s, MANAGEMENT, "management.nvidia.com", "gpu")
    consumer_spec(s, CLAIM, "k8s.gpu.nvidia.com", "claim")
    report = check(s)
    assert stale(report) == {} and report["ok"] is True, report["problems"]


def test_a_spec_that_is_not_nvidias_is_not_read(tmp_path: Path) -> None:
    """Another vendor's spec in /etc/cdi mounting whatever it likes is none of ours."""
    s = swapper(tmp_path)
    assert run_cli(s.m.root, "run").code == 0
    other = s.m.root / "etc/cdi/vendor.example.com-fpga.yaml"
    other.write_text("cdiVersion: 0.5.0\nkind: vendor.example.com/fpga\ndevices:\n"
                     "- name: all\n  containerEdits:\n    mounts:\n"
                     "    - hostPath: /run/nvidia/driver/gone.so\n"
                     "      containerPath: /gone.so\n")
    report = check(s)
    assert report["ok"] is True, report["problems"]
    assert str(other) not in {x["path"] for x in report["nvidia_specs"]["specs"]}  # type: ignore[index]


def test_a_refresh_spec_of_our_kind_is_not_taken_for_ours(tmp_path: Path) -> None:
    """/var/run/cdi/nvidia.yaml has our file name and kind, but it is nvidia-cdi-refresh's
    (check names it spec-shadowed): status must not call it ours."""
    s = swapper(tmp_path)
    assert run_cli(s.m.root, "run").code == 0
    shadow = s.m.root / "var/run/cdi/nvidia.yaml"
    shadow.parent.mkdir(parents=True, exist_ok=True)
    shadow.write_bytes((s.m.root / "etc/cdi/nvidia.yaml").read_bytes())
    report = check(s)
    found = {x["path"]: x["consumer"] for x in report["nvidia_specs"]["specs"]}  # type: ignore[index]
    assert found == {str(s.m.root / "etc/cdi/nvidia.yaml"): "unbounded-nvidia-setup",
                     str(shadow): "other"}, found
    problems = report["problems"]
    assert isinstance(problems, list)
    assert "spec-shadowed" in {p["code"] for p in problems}
