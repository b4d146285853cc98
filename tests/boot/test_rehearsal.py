"""``make rehearsal`` end to end (issue 36, point 6): the same code
(tests/boot/rehearsal.py: :func:`rehearse`, then :func:`teardown`, what ``make
rehearsal-clean`` runs), on its own directory and machine name. Asserts on what each
step showed in unit states (``systemctl show``), verdicts and exit codes (``check
--json``), never on the wording of ``status`` or ``check``."""

from __future__ import annotations

import os
from pathlib import Path

from .harness import CONTAINERD, KUBELET, SETUP
from .nspawn import is_nspawn_of
from .rehearsal import Seen, rehearse, teardown

NODE = (CONTAINERD, KUBELET)


def _start_us(seen: Seen, unit: str) -> int:
    return int(seen.units[unit]["ExecMainStartTimestampMonotonic"] or 0)


def test_rehearsal_shows_the_gate_and_is_torn_down(tmp_path: Path, product_deb: Path) -> None:
    base = tmp_path / "rehearsal"
    lines: list[str] = []
    done = None
    try:
        done = rehearse(base, product_deb, f"uns-rehearsal-test-{os.getpid()}", lines.append)
        print("\n".join(lines))  # pytest -s: the operator's printout
        steps = {s.step: s for s in done.steps}
        assert list(steps) == ["waiting", "retrying", "staged", "restarted", "reloaded"]

        # 1. Staging not mounted: the setup is starting, containerd and kubelet wait for it.
        for name in ("waiting", "retrying"):
            s = steps[name]
            assert s.state(SETUP).startswith("activating/"), s.units[SETUP]
            for unit in NODE:
                assert s.state(unit) == "inactive/dead", (name, s.units[unit])
                assert unit in s.jobs, (name, s.jobs)
            assert (s.verdict, s.check_exit) == ("not-ready-yet", 1), (name, s.check)
            assert s.check["unit"]["active_state"] == "activating", s.check
            assert s.status_exit == 0, name
        assert steps["waiting"].units[SETUP]["NRestarts"] == "0"
        assert int(steps["retrying"].units[SETUP]["NRestarts"]) >= 1
        # What the operator and the host agent read meanwhile (issue 36): the staging
        # the node waits for is the first problem, what the setup will build is pending
        # apart, and `status` tells the unit's state as `systemctl status` does, with
        # the retry and its own STATUS=.
        for name in ("waiting", "retrying"):
            s = steps[name]
            assert s.check["problems"][0]["code"] == "staging-missing", (name, s.check)
            assert not [p for p in s.check["problems"]
                        if p["code"].startswith(("root-", "spec-", "ldconf-"))], s.check
            assert "root-missing" in {p["code"] for p in s.check["pending"]}, s.check
            setup = next(ln for ln in s.extra["status"].splitlines() if ln.startswith("Setup:"))
            assert setup.split(None, 1)[1].startswith("activating ("), setup
        waiting = steps["waiting"].check["unit"]
        assert waiting["status_text"].startswith("Waiting for driver staging"), waiting
        assert waiting["n_restarts"] == 0, waiting
        assert "retry" in next(ln for ln in steps["retrying"].extra["status"].splitlines()
                               if ln.startswith("Setup:"))

        # 2. The staging arrives: setup, then containerd, then kubelet; ready.
        s = steps["staged"]
        assert s.state(SETUP) == "active/exited" and s.units[SETUP]["Result"] == "success"
        setup_done = int(s.units[SETUP]["ActiveEnterTimestampMonotonic"])
        assert s.at_us <= setup_done <= _start_us(s, CONTAINERD) <= _start_us(s, KUBELET)
        for unit in NODE:
            assert s.state(unit) == "active/running", s.units[unit]
        assert s.jobs == []
        assert (s.verdict, s.check_exit, s.status_exit) == ("ready", 0, 0), s.check
        assert s.check["unit"]["active_state"] == "active", s.check

        # 3. Restart: containerd and kubelet were restarted behind the setup; ready.
        s = steps["restarted"]
        assert s.extra["command_exit"] == 0
        for unit in NODE:
            assert s.state(unit) == "active/running", s.units[unit]
            assert s.units[unit]["MainPID"] != s.extra["pids_before"][unit], unit
            assert _start_us(s, unit) >= s.at_us
        assert int(s.units[SETUP]["ActiveEnterTimestampMonotonic"]) <= _start_us(s, CONTAINERD)
        assert (s.verdict, s.check_exit, s.status_exit) == ("ready", 0, 0), s.check

        # 4. Reload: the new device node reaches the spec; nothing else restarted.
        s = steps["reloaded"]
        assert s.extra["command_exit"] == 0
        assert (s.extra["spec_had_node"], s.extra["spec_has_node"]) == (False, True)
        assert s.state(SETUP) == "active/exited"
        for unit in NODE:
            assert s.units[unit]["MainPID"] == s.extra["pids_before"][unit], unit
        assert (s.verdict, s.check_exit, s.status_exit) == ("ready", 0, 0), s.check

        # Left running, with what an operator needs to find it again.
        assert is_nspawn_of(done.nspawn_pid, done.name)
        assert (base / "machine.json").is_file() and done.console_log.is_file()
        text = "\n".join(lines)
        assert f"nsenter --target {done.leader} --all" in text
        assert "make rehearsal-clean" in text and "make rehearsal-shell" in text
    finally:
        teardown(base, lines.append)
    assert not base.exists()
    if done is not None:
        assert not is_nspawn_of(done.nspawn_pid, done.name)
        assert not os.path.exists(f"/run/systemd/nspawn/propagate/{done.name}")
