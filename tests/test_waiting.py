"""What the operator and the host agent read while a node boots, waits and retries
(issue 36), without a booted machine: the journal's lines, the words of a failed run,
and `check` and `status` while a start is pending. (The booted side, systemd's own
states and a second boot, is tests/boot/test_boot.py's.)

Each journal here is the product's stderr and stdout written to one file whose device
and inode JOURNAL_STREAM names, as systemd does for a service (log.is_journal).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import simgpu
import toolkit
from conftest import Cli, needs_root
from test_lost_gpu import check_json

pytestmark = needs_root


def journal(root: Path, *args: str, notify: Path | None = None) -> tuple[int, list[str]]:
    """The command as a unit runs it: stdout and stderr the journal's one stream; with
    ``notify``, systemd's notification socket."""
    with tempfile.TemporaryFile() as f:
        st = os.fstat(f.fileno())
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        if notify is not None:
            env["NOTIFY_SOCKET"] = str(notify)
        proc = subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root",
                               str(root), *args], stdout=f, stderr=f, env=env,
                              stdin=subprocess.DEVNULL, timeout=120)
        f.seek(0)
        text = f.read().decode()
    assert "Traceback" not in text, text
    return proc.returncode, text.splitlines()


def notifications(sock: socket.socket) -> list[str]:
    got = []
    sock.settimeout(0.1)
    try:
        while True:
            got.append(sock.recv(4096).decode())
    except TimeoutError:
        return got


@pytest.fixture
def notify(tmp_path: Path) -> tuple[Path, socket.socket]:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    return path, sock


def empty_staging(m: simgpu.SimMachine) -> None:
    """The host's bind mounts not made yet: the staging directories are there, empty."""
    for top in m.staging:
        for path in sorted(top.rglob("*"), reverse=True):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()


def test_a_staging_wait_tells_the_journal_once_and_systemd_every_second(
        m: simgpu.SimMachine, notify: tuple[Path, socket.socket]) -> None:
    """Before: a line a second for the whole wait (33 lines in a 30 s wait), and the
    failure twice (plain, then `Failed: …`). Now the journal hears of the wait when it
    starts, when what it waits for changes and at doubling intervals (10 s, 20 s, ...),
    and of the failure once; STATUS= still says every second how long it has waited."""
    empty_staging(m)
    m.write_config(staging_wait_seconds=4)
    path, sock = notify
    code, lines = journal(m.root, "run", notify=path)
    assert code == 75, lines
    waits = [line for line in lines if "Waiting for driver staging" in line]
    assert len(waits) == 1, lines
    errors = [line for line in lines if line.startswith("<3>")]
    assert len(errors) == 1 and "staging is not ready" in errors[0], lines
    assert not any("Failed:" in line for line in lines), lines
    sent = notifications(sock)
    assert len([n for n in sent if n.startswith("STATUS=Waiting for driver staging")]) >= 3, sent
    assert sent[-1].startswith("STATUS=Failed: NVIDIA devices present but driver staging"), sent


def failing_nvidia_ctk(m: simgpu.SimMachine, tmp_path: Path) -> None:
    """An nvidia-ctk whose generate fails as a Go program does: a logrus error line."""
    wrapper = tmp_path / "nvidia-ctk-failing"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "if 'generate' in sys.argv:\n"
        "    print('time=\"2026-12-07T00:00:00Z\" level=error msg=\"failed to generate CDI "
        "spec: failed to create discoverer: no such thing\"', file=sys.stderr)\n"
        "    sys.exit(1)\n"
        f"os.execv({str(toolkit.NVIDIA_CTK)!r}, [{str(toolkit.NVIDIA_CTK)!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    m.write_config(nvidia_ctk=str(wrapper))


def test_a_failed_first_boot_says_nothing_was_kept(m: simgpu.SimMachine, cli: Cli,
                                                    tmp_path: Path) -> None:
    """Before: "the previous driver root and spec were kept; its errors and warnings are
    in the journal above this line" on a first boot, which had no previous root, and in
    `systemctl status`'s Status: line, where nothing is above; `check` then said "what
    is live is what the run before it left"."""
    failing_nvidia_ctk(m, tmp_path)
    out = cli(m.root, "run")
    assert out.code == 1, out.stderr
    error, = out.errors
    assert "nothing was installed: there was no driver root before this run" in error, error
    assert "kept" not in error.replace("was kept", "") and "above this line" not in error
    assert "journalctl -u unbounded-nvidia-setup" in error, error
    report = check_json(cli, m)
    failed, = [p for p in report["problems"] if p["code"] == "setup-failed"]
    assert failed["message"].endswith("no driver root or spec is live"), failed
    # A node that was Ready keeps its root and spec, and says so.
    m.write_config()
    assert cli(m.root, "run").code == 0
    failing_nvidia_ctk(m, tmp_path)
    out = cli(m.root, "run")
    assert out.code == 1 and "the previous driver root and spec were kept" in out.errors[0]
    failed, = [p for p in check_json(cli, m)["problems"] if p["code"] == "setup-failed"]
    assert failed["message"].endswith("what is live is what the run before it left"), failed


def test_a_refused_attempt_logs_what_it_leaves_out_once(m: simgpu.SimMachine) -> None:
    """Before: "leaving out stale driver files of …" twice per attempt where planning
    refuses the staging (the run's plan, then the plan of the report that the refusal
    records for the metrics, which `check` makes too)."""
    nvml, = [p for top in m.staging for p in top.glob(f"libnvidia-ml.so.{m.version}")]
    nvml.unlink()
    code, lines = journal(m.root, "run")
    assert code == 1 and "libnvidia-ml.so" in lines[-1], lines
    assert len([line for line in lines if "leaving out stale driver files" in line]) == 1, lines


def test_a_drift_check_tick_writes_nothing_unless_something_changed(
        tmp_path: Path, cli: Cli) -> None:
    """Before: every tick of the drift check (every 5 minutes, on every node) wrote each
    staged name it ignores, the stale versions it leaves out, `ok` and the verdict: 7
    lines on this healthy node. Now a tick whose problems are the last check's writes
    nothing; `check` lists what staging leaves out instead (`left_out`)."""
    m = simgpu.make_machine(tmp_path / "root", hostile=True)
    m.write_config(metrics_dir="/metrics")
    (m.root / "metrics").mkdir()
    assert journal(m.root, "run")[0] == 0
    for _ in range(2):
        code, lines = journal(m.root, "check", "--metrics", "--reload-if-degraded")
        assert (code, lines) == (0, []), lines
    report = check_json(cli, m)
    names = [left["path"] for left in report["left_out"]
             if left["reason"] == "not a plain file name"]
    assert any("with space" in name for name in names), report["left_out"]
    # Something changed: the tick says what, once.
    m.cdi_spec.unlink()
    code, lines = journal(m.root, "check", "--metrics", "--reload-if-degraded")
    assert code == 1 and "spec-missing" in "\n".join(lines), lines
    assert journal(m.root, "check", "--metrics", "--reload-if-degraded") == (1, [])
    # A person at a terminal, or a host agent reading a pipe, always gets the report.
    out = cli(m.root, "check", "--metrics")
    assert "verdict: broken" in out.stdout, out.stdout


def reboot(m: simgpu.SimMachine) -> None:
    """What a reboot of a Ready node takes away: /run (the driver root, the run's record,
    the work dir); /etc keeps the spec and the drop-in. The devices are bound again at
    once, the staging is mounted later (the host agent's order)."""
    import shutil

    for path in (m.root / "run/nvidia", m.root / "run/unbounded-nvidia-setup"):
        shutil.rmtree(path, ignore_errors=True)
    (m.root / "run/unbounded-nvidia-setup.last-run").unlink(missing_ok=True)
    empty_staging(m)


def test_a_second_boot_waiting_for_staging_names_the_staging_first(
        m: simgpu.SimMachine, cli: Cli) -> None:
    """Before: `not-ready-yet` with 8 problems, root-missing and the spec's hostPaths and
    libraries, every one a leftover of the last boot whose advice is a restart; not one
    named the staging the node waits for. Now the staging is the problem, and what the
    last boot left is pending: rebuilt once the staging is there."""
    assert cli(m.root, "run").code == 0
    reboot(m)
    report = check_json(cli, m)
    assert report["verdict"] == "not-ready-yet", report
    assert [p["code"] for p in report["problems"]] == ["staging-missing"], report["problems"]
    pending = {p["code"] for p in report["pending"]}
    assert "root-missing" in pending and "spec-missing-host-path" in pending, pending
    out = cli(m.root, "check")
    assert out.stdout.splitlines()[0].startswith("staging-missing: "), out.stdout
    assert "pending: what the setup rebuilds" in out.stdout and out.code == 1, out.stdout
    status = cli(m.root, "status").stdout
    assert "Problems:       1\n  [staging-missing]" in status, status


def test_status_exits_0_on_a_broken_config(m: simgpu.SimMachine, cli: Cli) -> None:
    """README: `status` exits 0. Before, a config error made it exit 2 with the error
    alone; now the error is a line of the summary."""
    config = m.root / "etc/unbounded/nvidia-setup.yaml"
    config.write_text("staging_wait_seconds: soon\n")
    out = cli(m.root, "status")
    assert out.code == 0, out.stderr
    assert out.stdout.startswith("Config:         config ") and "staging_wait_seconds" in \
        out.stdout, out.stdout
    assert "Setup:          not running" in out.stdout, out.stdout
    assert cli(m.root, "check").code == 2


def test_a_stopped_image_is_checked_for_what_it_holds(tmp_path: Path, cli: Cli) -> None:
    """`--root IMAGE check` on an image that never booted: before, `broken` with
    stale-state (the spec in /etc) and advice to `run` or `clean`, either of which would
    change the image. Now the verdict is `image`: the package's units are there and
    enabled; nothing of a running machine's state is asked of it."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert cli(m.root, "run").code == 0  # an image built from a machine: its /etc has a spec
    image = m.root
    for kernel in (image / "proc/devices", image / "proc/driver"):
        if kernel.is_dir():
            import shutil

            shutil.rmtree(kernel)
        else:
            kernel.unlink()
    system = image / "usr/lib/systemd/system"
    units = ("unbounded-nvidia-setup.service", "unbounded-nvidia-setup-check.service",
             "unbounded-nvidia-setup-check.timer",
             "containerd.service.d/10-unbounded-nvidia-setup.conf",
             "kubelet.service.d/10-unbounded-nvidia-setup.conf",
             "nvidia-cdi-refresh.service.d/10-unbounded-nvidia-setup.conf",
             "nvidia-cdi-refresh.path.d/10-unbounded-nvidia-setup.conf")
    for name in units:
        (system / name).parent.mkdir(parents=True, exist_ok=True)
        (system / name).write_text("[Unit]\n")
    report = check_json(cli, m)
    assert report["verdict"] == "broken", report
    assert {p["code"] for p in report["problems"]} == {"image-unit-disabled"}, report
    for name, target in (("unbounded-nvidia-setup.service", "multi-user.target"),
                         ("unbounded-nvidia-setup-check.timer", "timers.target")):
        wants = image / f"etc/systemd/system/{target}.wants"
        wants.mkdir(parents=True, exist_ok=True)
        (wants / name).symlink_to(f"/usr/lib/systemd/system/{name}")
    report = check_json(cli, m)
    assert (report["verdict"], report["ok"], report["problems"]) == ("image", True, []), report
    assert report["image"]["units"]["unbounded-nvidia-setup.service"] == "enabled"
    out = cli(image, "check")
    assert out.code == 0 and "verdict: image" in out.stdout, out.stdout
    status = cli(image, "status").stdout
    assert "a stopped machine (its /proc is empty)" in status, status
    assert "  unbounded-nvidia-setup-check.timer: enabled" in status, status
    (system / "kubelet.service.d/10-unbounded-nvidia-setup.conf").unlink()
    out = cli(image, "check")
    assert out.code == 1 and "image-unit-missing" in out.stdout, out.stdout
    assert "clean" not in out.stdout and " run" not in out.stdout, out.stdout


def test_a_pending_start_with_nothing_else_to_say_is_setup_pending() -> None:
    """The unit's start (or retry) is pending, no run holds the lock yet, and nothing
    names a wait: the unit's own state is the cause, what the last boot left is pending;
    with the lock held, setup-running; once the unit is active, every problem is one to
    act on again."""
    from unbounded_nvidia_setup.problems import Problem
    from unbounded_nvidia_setup.state import Report
    from unbounded_nvidia_setup.unit import Unit

    left = [Problem("root-missing", "gone with /run", "/run/nvidia/driver"),
            Problem("spec-missing-host-path", "names the old root", "/etc/cdi/nvidia.yaml")]
    report = Report(gpu=True, driver_version=None, module_version="550.127.05",
                    problems=list(left))
    report.unit = Unit({"ActiveState": "activating", "SubState": "start", "NRestarts": "2",
                        "StatusText": "Looking for NVIDIA devices"})
    causes, pending = report.causes()
    assert [p.code for p in causes] == ["setup-pending"] and pending == left
    assert "activating (start), retry 2: Looking for NVIDIA devices" in causes[0].message
    assert report.verdict == "not-ready-yet" and report.to_json()["pending"][0]["code"] == \
        "root-missing"
    report.setup_running = True
    assert [p.code for p in report.causes()[0]] == ["setup-running"]
    report.setup_running = False
    report.unit = Unit({"ActiveState": "active", "SubState": "exited"})
    assert report.causes() == (left, []) and report.verdict == "broken"
