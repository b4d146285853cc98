"""``make rehearsal``: a GPU node machine booted in systemd-nspawn, without a GPU.

Builds what the boot tests build (tests/boot/harness.py): the cached Debian trixie rootfs
(tests/rootfs.py) as an overlay, the product .deb installed with ``dpkg --root``,
nvidia-ctk in /usr/bin (NVIDIA's when ``UNB_TEST_NVIDIA_CTK`` names it, as ``make
rehearsal`` does where ``../shared`` has it; else the suite's stand-in; either runs in
management mode, ``nvidia_ctk_args: ["--mode=management"]``, as there is no NVML here), a
simulated GPU host (tests/simgpu.py: driver files, device nodes, a GPU host kernel's
/proc/devices and /proc/driver/nvidia/version) and stand-in containerd and kubelet
services. Then it boots the machine and walks through what an operator should see,
printing each command and what the node says:

1. the boot: devices bound, no staging mounted. The unit waits for staging
   (``staging_wait_seconds: 10`` here, 60 by default), exits 75 when the wait is over and
   systemd retries it; containerd and kubelet do not start;
2. the staging arrives (a read-only bind mount at /run/host-nvidia): the unit becomes
   active, then containerd starts, then kubelet; ``check`` says ``ready``;
3. ``systemctl restart unbounded-nvidia-setup``: kubelet and containerd stop, the setup
   reruns, they start again;
4. a GPU's device node appears, then ``systemctl reload unbounded-nvidia-setup``: only
   the CDI spec is regenerated (it names the new node); containerd and kubelet keep
   running.

The machine is left running. The printout ends with how to enter it and how to tear it
down (``make rehearsal-clean``). Everything lives under ``--dir`` (default
/var/lib/unbounded-nvidia-setup-rehearsal): ``rootfs/`` (an overlay mount), ``host/``
(the simulated host), ``<name>.console.log`` and ``machine.json`` (the PIDs teardown
uses). tests/boot/test_rehearsal.py runs :func:`rehearse` and :func:`teardown` end to
end.

Why it is built this way, for an operator repeating it by hand:

* /proc/devices and /proc/driver/nvidia/version: this host has no NVIDIA kernel driver,
  and a machine reads the host kernel's. nspawn binds over /proc after entering the
  rootfs, so the fake files live inside the rootfs
  (``/var/lib/unbounded-nvidia-setup-tests/proc-{devices,driver}``) and are bound with
  ``--bind-ro=/var/lib/...:/proc/devices`` (a host path fails: "Failed to stat").
* The rootfs holds systemd, systemd-sysv, dbus, python3, python3-yaml and
  python3-sdnotify (tests/rootfs.py: INCLUDE); ``dpkg --root`` does not fetch
  dependencies.
* The host's staging directories are bound at boot below
  ``/var/lib/unbounded-nvidia-setup-rehearsal/host-nvidia`` inside the machine, where the
  tool does not look; "the staging arrives" is one ``mount --bind -o ro`` of that
  directory at /run/host-nvidia inside the machine, so all three staging dirs appear at
  once. (The host's PID 1 here is not systemd: no ``machinectl bind``.)
* NVIDIA's nvidia-ctk needs management mode: its default mode asks NVML, and there is no
  GPU to answer.

Command line (root; ``make rehearsal`` / ``make rehearsal-clean`` / ``make
rehearsal-shell`` run these): ``PYTHONPATH=tests python -m boot.rehearsal --deb DEB
[--dir DIR] [--name NAME]``, ``... --clean``, ``... --shell``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hostcmd
import rootfs
from check_schema import parse_check

import toolkit
from .harness import (
    CONTAINERD,
    KUBELET,
    NODE_UNITS,
    SETUP,
    Node,
    missing_requirements,
    new_node,
)
from .nspawn import GUEST_ENV, Bind, Machine, is_nspawn_of, now_us, stop_detached

DEFAULT_DIR = Path("/var/lib/unbounded-nvidia-setup-rehearsal")
DEFAULT_NAME = "uns-rehearsal"
STATE = "machine.json"
# Inside the machine: where the host's staging dirs are bound at boot, not yet mounted
# where the tool looks.
HIDDEN_STAGING = "/var/lib/unbounded-nvidia-setup-rehearsal/host-nvidia"
STAGING = "/run/host-nvidia"
STAGING_WAIT = 10  # staging_wait_seconds in the machine's config (default 60)
SPEC = "/etc/cdi/nvidia.yaml"
PROPS = ("ActiveState", "SubState", "Result", "NRestarts", "MainPID", "StatusText",
         "ExecMainStatus", "ActiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic")
STEP_TIMEOUT = 90.0

Out = Callable[[str], None]


def _print(text: str) -> None:
    print(text, flush=True)


@dataclass
class Seen:
    """What the node showed at the end of one step (the test asserts on these)."""

    step: str
    units: dict[str, dict[str, str]]  # systemctl show of setup, containerd, kubelet
    check: dict[str, Any]  # check --json
    check_exit: int
    status_exit: int
    jobs: list[str]  # units with a queued job
    at_us: int  # CLOCK_MONOTONIC (systemd's) when the step's action was taken
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return str(self.check.get("verdict"))

    def state(self, unit: str) -> str:
        u = self.units[unit]
        return f"{u.get('ActiveState')}/{u.get('SubState')}"


@dataclass
class Rehearsal:
    base: Path
    name: str
    nspawn_pid: int
    leader: int
    toolkit: str
    console_log: Path
    steps: list[Seen]


class Walk:
    """The booted machine and the printout of what it says."""

    def __init__(self, m: Machine, out: Out) -> None:
        self.m = m
        self.out = out

    def run(self, *argv: str, show: bool = True) -> subprocess.CompletedProcess[str]:
        res = self.m.exec(*argv, check=False)
        if show:
            self.out(f"  # {shlex.join(argv)}")
            for line in (res.stdout + res.stderr).rstrip("\n").splitlines():
                self.out(f"    {line}")
            self.out(f"    (exit {res.returncode})")
        return res

    def units(self) -> dict[str, dict[str, str]]:
        return {u: self.m.show(u, *PROPS) for u in NODE_UNITS}

    def jobs(self) -> list[str]:
        text = self.m.systemctl("list-jobs", "--plain", "--no-legend").stdout
        return [line.split()[1] for line in text.splitlines() if len(line.split()) > 1]

    def look(self, step: str, at_us: int, **extra: Any) -> Seen:
        """Print what an operator would look at, and record it."""
        self.run("systemctl", "status", "--no-pager", "--lines=5", SETUP)
        units = self.units()
        self.out("  # systemctl show --property=ActiveState,SubState,NRestarts,MainPID "
                 + " ".join(NODE_UNITS))
        for unit, p in units.items():
            self.out(f"    {unit}: {p.get('ActiveState')}/{p.get('SubState')} "
                     f"NRestarts={p.get('NRestarts')} MainPID={p.get('MainPID')}")
        jobs = self.jobs()
        self.out(f"  # systemctl list-jobs\n    {' '.join(jobs) or '(no jobs)'}")
        status = self.run("unbounded-nvidia-setup", "status")
        self.run("unbounded-nvidia-setup", "check")
        res = self.run("unbounded-nvidia-setup", "check", "--json", show=False)
        try:  # the suite's one parser: the schema and the exit status held against it
            report = parse_check(res.stdout, res.returncode)
        except (AssertionError, ValueError) as e:
            report = {"verdict": None, "unparsed": f"{res.stdout}{res.stderr}\n{e}"}
        codes = sorted({str(p.get("code")) for p in report.get("problems") or []})
        self.out(f"  # unbounded-nvidia-setup check --json\n    verdict "
                 f"{report.get('verdict')}, exit {res.returncode}, problems: "
                 f"{', '.join(codes) or 'none'}")
        return Seen(step, units, report, res.returncode, status.returncode, jobs, at_us,
                    dict(extra, status=status.stdout))

    def wait(self, probe: Callable[[], bool], what: str) -> None:
        self.m.wait_until(probe, timeout=STEP_TIMEOUT, what=what, interval=0.2,
                          units=NODE_UNITS)


def prepare(base: Path, deb: Path, out: Out = _print) -> Node:
    """The rootfs with the .deb, nvidia-ctk and a config, and the simulated host: the
    boot tests' node (harness.new_node), with its staging not bound at /run/host-nvidia."""
    out(f"== 0. Build: the trixie rootfs (tests/rootfs.py, cached), {deb.name} installed "
        f"with dpkg --root, {toolkit.NAME} in /usr/bin, a simulated GPU host")
    node = new_node(base, deb, staging_wait_seconds=STAGING_WAIT)
    node.staging = {}  # bound elsewhere below (machine()): it arrives in step 2
    config = (node.rootfs / "etc/unbounded/nvidia-setup.yaml").read_text()
    out(f"  rootfs {node.rootfs} (overlay over {rootfs.tree_path()}), host {node.host}")
    out("  /etc/unbounded/nvidia-setup.yaml:")
    for line in config.splitlines():
        out(f"    {line}")
    return node


def machine(node: Node, name: str) -> Machine:
    binds = [*node.binds(), Bind(node.host / "run/host-nvidia", HIDDEN_STAGING, read_only=True)]
    m = Machine(node.rootfs, binds=binds, name=name, log_dir=node.log_dir)
    node.machines.append(m)
    return m


def walk(m: Machine, out: Out = _print) -> list[Seen]:
    """Steps 1 to 4 on the booted machine ``m``; what each showed."""
    w = Walk(m, out)
    seen = []
    out("\n== 1. Boot: the GPU's device nodes are bound, the driver staging is not mounted")
    out(f"  systemd-nspawn {' '.join(shlex.quote(a) for a in m.argv()[1:])}")
    booted = m.started_us or now_us()

    def waiting() -> bool:
        p = m.show(SETUP, "ActiveState", "SubState", "StatusText")
        return (p["ActiveState"], p["SubState"]) == ("activating", "start") \
            and p["StatusText"] != ""

    w.wait(waiting, "the setup waiting for the staging")
    time.sleep(3)
    seen.append(w.look("waiting", booted))

    out(f"\n== 1b. {STAGING_WAIT} s later the wait is over: the run exits 75 and systemd "
        "retries it; containerd and kubelet still wait")
    w.wait(lambda: int(m.prop(SETUP, "NRestarts") or 0) >= 1, "the setup's first retry")
    seen.append(w.look("retrying", booted))
    w.run("journalctl", "--no-pager", "--boot", "--output=cat", "--unit", SETUP)

    out(f"\n== 2. The staging arrives: {HIDDEN_STAGING} (the host's three staging dirs) "
        f"bound read-only at {STAGING}")
    staged = now_us()
    w.run("mkdir", "-p", STAGING)
    w.run("mount", "--bind", "-o", "ro", HIDDEN_STAGING, STAGING)
    w.wait(lambda: all(m.is_active(u) for u in NODE_UNITS), "setup, containerd, kubelet active")
    seen.append(w.look("staged", staged))
    after = {u: (int(seen[-1].units[u][prop] or 0) - staged) / 1000 for u, prop in (
        (SETUP, "ActiveEnterTimestampMonotonic"), (CONTAINERD, "ExecMainStartTimestampMonotonic"),
        (KUBELET, "ExecMainStartTimestampMonotonic"))}
    out(f"  after the mount: setup active {after[SETUP]:.0f} ms, containerd started "
        f"{after[CONTAINERD]:.0f} ms, kubelet started {after[KUBELET]:.0f} ms")
    w.run("ls", "-l", "/run/nvidia/driver", "/etc/cdi")

    out("\n== 3. systemctl restart unbounded-nvidia-setup: kubelet and containerd stop, the "
        "setup reruns, they start again")
    before = {u: m.prop(u, "MainPID") for u in (CONTAINERD, KUBELET)}
    restarted = now_us()
    res = w.run(*hostcmd.in_guest(hostcmd.commands()["restart"]))
    w.wait(lambda: all(m.is_active(u) for u in NODE_UNITS), "setup, containerd, kubelet active")
    seen.append(w.look("restarted", restarted, command_exit=res.returncode,
                       pids_before=before))

    out("\n== 4. A GPU's device node appears (/dev/nvidia2, as the host would bind it), "
        "then systemctl reload unbounded-nvidia-setup: only the CDI spec is regenerated")
    before = {u: m.prop(u, "MainPID") for u in (CONTAINERD, KUBELET)}
    had = "/dev/nvidia2" in m.read_text(SPEC)
    w.run("mknod", "-m", "0666", "/dev/nvidia2", "c", "195", "2")
    reloaded = now_us()
    res = w.run("systemctl", "reload", SETUP)
    has = "/dev/nvidia2" in m.read_text(SPEC)
    out(f"  /dev/nvidia2 in {SPEC}: before {'yes' if had else 'no'}, after "
        f"{'yes' if has else 'no'}")
    seen.append(w.look("reloaded", reloaded, command_exit=res.returncode, pids_before=before,
                       spec_had_node=had, spec_has_node=has))
    return seen


def _state_file(base: Path) -> Path:
    return base / STATE


def enter_argv(leader: int) -> list[str]:
    return ["nsenter", "--target", str(leader), "--all", "--", "/usr/bin/env", "-i",
            f"TERM={os.environ.get('TERM', 'xterm')}", "HOME=/root",
            "/bin/bash", "--login"]


def rehearse(base: Path = DEFAULT_DIR, deb: Path | None = None, name: str = DEFAULT_NAME,
             out: Out = _print) -> Rehearsal:
    """Build, boot, walk through steps 1 to 4 and leave the machine running (an earlier
    rehearsal in ``base`` is torn down first)."""
    problems = missing_requirements()
    if problems:
        raise SystemExit("make rehearsal cannot run here: " + "; ".join(problems))
    if deb is None or not deb.is_file():
        raise SystemExit(f"no .deb at {deb} (make deb)")
    if base.exists():
        out(f"== tearing down the earlier rehearsal in {base}")
        teardown(base, out)
    node = prepare(base, deb, out)
    m = machine(node, name)
    try:
        m.start()
        steps = walk(m, out)
        pid, leader = m.detach()
    except BaseException:
        out(f"\nfailed; console log: {m.console_log}")
        m.close()
        rootfs.remove_rootfs(node.rootfs)
        raise
    assert m.console_log is not None
    _state_file(base).write_text(json.dumps(
        {"name": name, "nspawn_pid": pid, "leader": leader, "rootfs": str(node.rootfs),
         "console_log": str(m.console_log), "toolkit": toolkit.NAME}, indent=1) + "\n")
    enter = shlex.join(enter_argv(leader))
    out(f"""
== The machine {name} is left running ({toolkit.NAME}).
  Get a shell in it:   make rehearsal-shell      (= {enter})
  One command in it:   nsenter --target {leader} --all -- systemctl status unbounded-nvidia-setup
                       nsenter --target {leader} --all -- journalctl -b -u unbounded-nvidia-setup
  (machinectl and systemd-run -M cannot reach it: the machine is not registered with
  systemd-machined; this host's PID 1 is not systemd.)
  Console log:         {m.console_log}
  Tear it down:        make rehearsal-clean      (powers it off, unmounts and removes {base})""")
    return Rehearsal(base, name, pid, leader, toolkit.NAME, m.console_log, steps)


def teardown(base: Path = DEFAULT_DIR, out: Out = _print) -> None:
    """Power off the machine a rehearsal left in ``base`` and remove ``base``."""
    state: dict[str, Any] = {}
    if _state_file(base).is_file():
        state = json.loads(_state_file(base).read_text())
        if stop_detached(int(state["nspawn_pid"]), int(state["leader"]), str(state["name"])):
            out(f"  stopped machine {state['name']} (systemd-nspawn PID {state['nspawn_pid']})")
    root = base / "rootfs"
    if root.exists() or (base / ".rootfs.overlay").exists():
        rootfs.remove_rootfs(root)
    if base.exists():
        shutil.rmtree(base)
    out(f"  removed {base}")


def shell(base: Path = DEFAULT_DIR) -> int:
    state = json.loads(_state_file(base).read_text()) if _state_file(base).is_file() else {}
    if not state or not is_nspawn_of(int(state["nspawn_pid"]), str(state["name"])):
        print(f"no rehearsal machine running from {base} (make rehearsal)", file=sys.stderr)
        return 1
    argv = enter_argv(int(state["leader"]))
    os.execvpe(argv[0], argv, {**GUEST_ENV, **os.environ})
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--name", default=DEFAULT_NAME)
    parser.add_argument("--deb", type=Path)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--clean", action="store_true", help="tear the rehearsal down")
    what.add_argument("--shell", action="store_true", help="a shell in the machine")
    args = parser.parse_args(argv)
    if args.clean:
        teardown(args.dir)
        return 0
    if args.shell:
        return shell(args.dir)
    rehearse(args.dir, args.deb, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
