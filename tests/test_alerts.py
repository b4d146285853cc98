"""The example alerting rules (docs/alerts.yml) under Prometheus's own rule evaluator,
`promtool test rules`: against hand-written series (tests/alerts-test.yml), and against
the series a real `run` and `check --metrics` wrote, so a renamed metric or label
breaks these tests and not a fleet's alerting."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from check_schema import check_report
from unbounded_nvidia_setup.metrics import FILE

import simgpu
from conftest import Cli, needs_root, needs_tool

PROMTOOL = "/usr/bin/promtool"
REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "docs" / "alerts.yml"
ALERTS = ("NvidiaSetupFailing", "NvidiaSetupDrift", "NvidiaSetupDegraded",
          "NvidiaSetupNoUsableGpu", "NvidiaSetupReloadFailing", "NvidiaSetupCheckStale",
          "NvidiaDriverVersionMismatch", "NvidiaConsumerSpecStale")

pytestmark = needs_tool(PROMTOOL, " (Debian's prometheus)")


def promtool(*args: str) -> None:
    out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_are_valid_and_pass_their_unit_tests() -> None:
    promtool("check", "rules", str(RULES))
    promtool("test", "rules", str(REPO / "tests" / "alerts-test.yml"))
    names = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert sorted(names) == sorted(ALERTS)
    tested = set(re.findall(r"alertname: (\w+)", (REPO / "tests/alerts-test.yml").read_text()))
    assert tested == set(ALERTS)


def _annotations(alert: str, labels: dict[str, str], value: float) -> dict[str, str]:
    """The rule's annotations with its {{ $labels.x }} / {{ $value }} filled in."""
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                if r["alert"] == alert)
    out = {}
    for key, template in rule["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
        out[key] = text.replace("{{ $value }}", f"{value:g}")
    return out


def _series_from(path: Path) -> list[dict[str, str]]:
    """Every sample of a real metrics file as promtool input, constant for 20 minutes."""
    series = []
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            labels = {**s.labels, "instance": "node"}
            text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            series.append({"series": f"{s.name}{{{text}}}", "values": f"{s.value:g}x20"})
    return series


def _run_promtool_test(tmp_path: Path, series: list[dict[str, str]],
                       expected: dict[str, list[dict[str, object]]]) -> None:
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "15m", "alertname": name,
                             "exp_alerts": expected.get(name, [])} for name in ALERTS]}]}
    path = tmp_path / "generated-test.yml"
    path.write_text(yaml.safe_dump(tests))
    promtool("test", "rules", str(path))


@needs_root
def test_alerts_on_what_a_real_tampered_machine_reports(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    textfile = m.root / "var/lib/prometheus/node-exporter"
    textfile.mkdir(parents=True)
    assert cli(m.root, "run").code == 0
    _run_promtool_test(tmp_path, _series_from(textfile / FILE), {})  # healthy: silence

    (m.driver_lib_dir / f"libcuda.so.{m.version}").chmod(0o666)
    (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").unlink()
    assert cli(m.root, "check", "--metrics").code == 1
    counts: dict[str, int] = {}
    for p in check_report(cli(m.root, "check", "--json"))["problems"]:
        counts[p["code"]] = counts.get(p["code"], 0) + 1
    assert {"root-bad-mode", "ldconf-missing"} <= set(counts)
    drift: list[dict[str, object]] = []
    for code, n in sorted(counts.items()):
        labels = {"instance": "node", "code": code, "severity": "warning"}
        drift.append({"exp_labels": labels,
                      "exp_annotations": _annotations("NvidiaSetupDrift", labels, n)})
    _run_promtool_test(tmp_path, _series_from(textfile / FILE), {"NvidiaSetupDrift": drift})
    assert cli(m.root, "run").code == 0  # repaired (and the root secure again)


@needs_root
def test_alerts_on_a_real_failing_run(tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config(staging_wait_seconds=0)
    textfile = m.root / "var/lib/prometheus/node-exporter"
    textfile.mkdir(parents=True)
    shutil.rmtree(m.root / "run/host-nvidia")
    assert cli(m.root, "run").code == 75
    labels = {"instance": "node", "severity": "critical"}
    failing: list[dict[str, object]] = [
        {"exp_labels": labels, "exp_annotations": _annotations("NvidiaSetupFailing", labels, 0)}]
    _run_promtool_test(tmp_path, _series_from(textfile / FILE), {"NvidiaSetupFailing": failing})
