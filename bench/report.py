"""results.json, results.md and the PASS/FAIL table, from the result data alone."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def _shown(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render_table(result: dict[str, Any]) -> list[str]:
    rows = [("target", "measured", "limit", "result")]
    for t in result["targets"]:
        rows.append((t["label"], f"{t['value']:.2f}", f"<= {t['limit']:g}",
                     "PASS" if t["pass"] else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    med = result["medians_seconds"]
    ex = result["extra"]
    out = ["# Benchmark results (`make bench`)", "",
           f"`{result['summary']}`", "",
           "| target | measured | limit | result |", "|---|---|---|---|"]
    for t in result["targets"]:
        out.append(f"| {t['label']} | {t['value']:.2f} | ≤ {t['limit']:g} | "
                   f"{'PASS' if t['pass'] else 'FAIL'} |")
    pay = result["payload_bytes"]
    ent = result["staging_entries"]
    # The quartiles show the noise each median sits in (this VM's copies sometimes take
    # several times as long, in kernel time, for either side).
    out += ["", "| run | median | middle half of the samples |", "|---|---|---|"]
    labels = {
        "cold": f"cold `run`, {ent['small']} staging entries, {pay['x1'] / 1e6:.0f} MB payload",
        "baseline": "baseline script (cp -a, nvidia-ctk, ldconfig), same machine",
        "warm": "warm `run` (nothing changed)",
        "cold_30k": f"cold `run`, {ent['large']} staging entries",
        "cold_x1": "cold `run`, payload x1, alternating with x2",
        "cold_x2": f"cold `run`, payload x2 ({pay['x2'] / 1e6:.0f} MB)",
        "baseline_x1": "baseline script, payload x1, alternating with x2",
        "baseline_x2": "baseline script, payload x2",
        "version": "`unbounded-nvidia-setup --version`",
        "module_version": "`python -m unbounded_nvidia_setup --version`",
        "python_pass": "`python -c pass` (same interpreter)",
        "cold_same_fs": "cold `run`, alternating with the three below",
        "baseline_same_fs": "baseline script, alternating with the cross-fs runs",
        "cold_xfs": "cold `run`, /run/nvidia on another filesystem than staging (sendfile)",
        "baseline_xfs": "baseline script, /run/nvidia on another filesystem than staging",
        "cold_metrics_off": "cold `run`, no metrics dir, alternating with metrics on",
        "cold_metrics_on": "cold `run`, metrics written to node_exporter's directory",
        "warm_metrics_off": "warm `run`, no metrics dir",
        "warm_metrics_on": "warm `run`, metrics written",
    }
    for key, label in labels.items():
        q1, _, q3 = statistics.quantiles(result["samples_seconds"][key], n=4)
        out.append(f"| {label} | {_shown(med[key])} | {_shown(q1)} - {_shown(q3)} |")
    out += ["", f"Payload growth: cold x2/x1 {ex['cold_x2_over_x1']:.2f}, baseline x2/x1 "
            f"{ex['baseline_x2_over_x1']:.2f}; cold/baseline {ex['cold_baseline_x1_phase2']:.2f} "
            f"at x1 and {ex['cold_baseline_x2']:.2f} at x2; marginal cost "
            f"{ex['cold_seconds_per_gb']:.2f} s/GB "
            f"(baseline {ex['baseline_seconds_per_gb']:.2f} s/GB), fixed part of a cold run "
            f"{ex['cold_fixed_seconds']:.2f} s. Staging growth: "
            f"{ex['scan_ms_per_1000_entries']:.1f} ms per 1000 entries. Peak RSS floor of "
            f"`python -c pass`: {ex['python_floor_rss_mb']:.1f} MB.", "",
            f"Staging on another filesystem than /run/nvidia (the node's layout: "
            f"copy_file_range fails with EXDEV, the tool copies with sendfile, `cp -a` with "
            f"read/write): cold/baseline {ex['cold_baseline_xfs']:.2f} (same-fs in the same "
            f"rounds {ex['cold_baseline_same_fs_phase']:.2f}); cross-fs / same-fs: cold "
            f"{ex['cold_xfs_over_same_fs']:.2f}, baseline "
            f"{ex['baseline_xfs_over_same_fs']:.2f}.", "",
            f"Metrics on / off (node_exporter's textfile directory present or not): cold "
            f"{ex['cold_metrics_on_over_off']:.3f}, warm {ex['warm_metrics_on_over_off']:.3f}.",
            "",
            f"Rounds: {result['rounds']['pairs']} (cold/warm/baseline/30k), "
            f"{result['rounds']['pairs_x2']} (x1/x2 payload), "
            f"{result['rounds']['pairs_xfs']} (same-fs/cross-fs), "
            f"{result['rounds']['pairs_metrics']} (metrics off/on), "
            f"{result['rounds']['rounds_version']} (--version), alternating. Machine: "
            f"{m['nproc']} CPUs ({m['cpu']}), {m['memory']}, kernel {m['kernel']}, "
            f"{m['os']}, {m['python']}, {m['filesystem']}; product {m['product']} at "
            f"{m['commit']}; load average {m['loadavg_start']} at start, "
            f"{m['loadavg_end']} at end, other processes used {m['other_cpu_percent']}% of "
            f"the CPUs meanwhile; {m['bench_seconds']:.0f} s in all.", ""]
    return "\n".join(out)


def write(result: dict[str, Any], json_path: Path, md_path: Path) -> None:
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(render_markdown(result))
