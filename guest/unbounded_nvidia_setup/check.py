"""`check` and `status` as a person or a host agent reads them: the report of state.py
rendered as text, JSON or the status summary. Nothing here reads the machine."""

from __future__ import annotations

import json
from typing import Any

from . import consumers, log
from .config import Machine
from .gpus import status_lines
from .outcome import when, when_at
from .problems import Problem
from .state import Report


def render_text(report: Report) -> str:
    """`check`: a line per problem, the cause of a wait first; what a pending setup
    rebuilds in one line; then the outcome and the verdict."""
    causes, pending = report.causes()
    lines = [f"{p.code}: {log.one_line(p.message)}" for p in causes]
    if pending:
        lines.append(_pending_line(pending))
    lines.append("ok" if report.ok else
                 f"{len(causes)} problem{'' if len(causes) == 1 else 's'}")
    lines.append(f"verdict: {report.verdict}")
    return "\n".join(lines)


def _pending_line(pending: list[Problem]) -> str:
    counts: dict[str, int] = {}
    for p in pending:
        counts[p.code] = counts.get(p.code, 0) + 1
    codes = ", ".join(c if n == 1 else f"{c} x{n}" for c, n in counts.items())
    return (f"pending: what the setup rebuilds when it runs ({codes}): not to act on "
            "while it waits")


def render_json(report: Report) -> str:
    """`check --json` (docs/check.schema.json)."""
    return json.dumps(report.to_json(), indent=2)


def _setup_line(machine: Machine, report: Report) -> str:
    """The unit's state as `systemctl status` tells it, when systemd answered: active,
    activating with what it waits for (its own STATUS=, how long included) or the retry
    it is due, failed; else what the lock says."""
    unit = report.unit.describe() if report.unit is not None else None
    if report.setup_running:
        return (unit or "in progress") + (f" (a run or clean holds {machine.lock_file}: the "
                                          "state below may be changing)")
    return unit or "not running"


def _last_run_line(report: Report) -> str:
    last = report.last_run
    if last is None:
        return "none recorded since boot"
    if last.failed:
        return (f"`{last.command}` failed at {when(last)} (exit {last.exit_code}): "
                f"{log.one_line(last.error or 'no error line recorded')}")
    line = f"`{last.command}` succeeded at {when(last)}"
    if last.reload_exit_code is not None:
        line += (f"; a reload since failed (exit {last.reload_exit_code}: "
                 f"{log.one_line(last.reload_error or 'no error line recorded')}) and "
                 "changed nothing")
    return line


def _plugin_line(plugin: dict[str, Any] | None) -> str:
    """What the device plugin's spec lists and when it was written: what it does beyond
    that is docs/operations.md's, never predicted here."""
    if not plugin:
        return "no spec"
    listed = plugin.get("gpus")
    return (f"{plugin['path']}, written {when_at(plugin['written_at'])}"
            + ("" if listed is None else f", lists {', '.join(listed) or 'no GPU'}"))


def render_status(machine: Machine, report: Report) -> str:
    root = report.sections.get("driver_root", {})
    spec = report.sections.get("cdi_spec", {})
    plugin = report.sections.get("device_plugin_spec")
    lines = [
        # First: while a run or clean holds the lock, what follows may be half replaced.
        f"Setup:          {log.one_line(_setup_line(machine, report))}",
        f"Last run:       {_last_run_line(report)}",
        f"GPU:            {'present' if report.gpu else 'none'}",
        f"Kernel module:  {report.module_version or 'not readable'}",
        f"Driver version: {report.driver_version or '-'}",
    ]
    if report.gpu:
        lines += [
            f"Driver root:    {root.get('path')} "
            + (f"({len(root.get('libraries', []))} libraries)" if root.get("present")
               else "(missing)"),
            f"Helpers:        {', '.join(root.get('helpers', [])) or '-'}",
            f"CDI spec:       {spec.get('path')} "
            + (f"(devices: {', '.join(spec.get('devices', [])) or 'none'})"
               if spec.get("present") else "(missing)"),
            f"Device plugin:  {_plugin_line(plugin)}",
        ]
        lines += status_lines(report.sections.get("gpus", {}))
        lines += consumers.status_lines(report.sections.get("nvidia_specs", {}).get("specs", []))
    image = report.sections.get("image")
    if image:
        lines.append(f"Image:          {image['root']}, a stopped machine (its /proc is empty): "
                     f"package {image['package'] or 'not installed by dpkg'}")
        lines += [f"  {name}: {state}" for name, state in image["units"].items()]
    if report.left_out:
        lines.append(f"Left out:       {len(report.left_out)} staged "
                     f"{'library' if len(report.left_out) == 1 else 'libraries'} (the host's "
                     "driver installation is damaged)")
        lines += [f"  {log.one_line(left.path)}: {left.reason}" for left in report.left_out]
    causes, pending = report.causes()
    lines.append(f"Problems:       {len(causes) or 'none'}")
    lines += [f"  [{p.code}] {log.one_line(p.message)}" for p in causes]
    if pending:
        lines.append(f"  {_pending_line(pending)}")
    return "\n".join(lines)
