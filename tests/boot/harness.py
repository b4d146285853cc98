"""Helpers of the boot tests: the product .deb, machine nodes (rootfs with the .deb, the
nvidia-ctk stand-in and a config, plus a simulated GPU host bound in), reading unit
states, the stand-in services' log and ``check --json``, and boot timing records.

Requirements (root, systemd-nspawn, debootstrap, nsenter, overlayfs, dpkg-buildpackage
for ``make deb``): when one is missing every boot test skips with the reason, except
when the environment variable ``CI`` is set (non-empty): then they fail, so CI cannot
pass with the boot tests silently skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import hostcmd
import rootfs
from check_schema import parse_check

import elfbuild
import realdriver
import realmachine
import simgpu
import simnvml
import toolkit
from .nspawn import HOST_PATH, Bind, Machine

REPO = Path(__file__).resolve().parents[2]
SETUP = "unbounded-nvidia-setup.service"
CONTAINERD = "containerd.service"
KUBELET = "kubelet.service"
NODE_UNITS = (SETUP, CONTAINERD, KUBELET)
SERVICES_LOG = rootfs.SERVICES_LOG
GUEST_PROC_DRIVER = "/var/lib/unbounded-nvidia-setup-tests/proc-driver"
GUEST_PROC_DEVICES = "/var/lib/unbounded-nvidia-setup-tests/proc-devices"
PACKAGE = "unbounded-nvidia-setup"
MAKE_TIMEOUT = 600.0
DPKG_TIMEOUT = 180.0
TOOLS = ("systemd-nspawn", "debootstrap", "nsenter", "dpkg", "dpkg-buildpackage", "tar",
         "mount", "make", "flock")


def _missing_requirements() -> list[str]:
    problems = []
    if os.geteuid() != 0:
        problems.append("not root (systemd-nspawn, mknod, mount and dpkg --root need root)")
    missing = [t for t in TOOLS if shutil.which(t, path=HOST_PATH) is None]
    if missing:
        problems.append(f"missing {', '.join(missing)} (run tests/install-deps as root)")
    if os.geteuid() == 0 and not _has_overlayfs():
        problems.append("no overlayfs in this kernel")
    return problems


def _has_overlayfs() -> bool:
    try:
        with open("/proc/filesystems") as fh:
            if any(line.split()[-1] == "overlay" for line in fh if line.strip()):
                return True
    except OSError:
        return False
    return subprocess.run(["modprobe", "overlay"], capture_output=True, check=False,
                          timeout=30).returncode == 0


def missing_requirements() -> list[str]:
    """What keeps boot tests (and ``make rehearsal``) from running here; empty: nothing."""
    return _missing_requirements()


def require_boot_support() -> None:
    """Skip (or fail when $CI is set) unless boot tests can run here."""
    problems = _missing_requirements()
    if problems:
        require(False, "boot tests cannot run: " + "; ".join(problems))


def require(ok: bool, reason: str) -> None:
    """Skip with ``reason`` unless ``ok``; fail instead when $CI is set."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(reason + " [CI is set: boot tests must run, not skip]", pytrace=False)
    pytest.skip(reason)


# -- the product package -----------------------------------------------------------------


def pyproject_version() -> str:
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    assert found, "no version in pyproject.toml"
    return found.group(1)


def build_deb(version: str | None = None, dist: Path | None = None) -> Path:
    """``make deb [VERSION=..] [DIST=..]`` in the repo; the path of the .deb it wrote."""
    version = version or pyproject_version()
    dist = dist or REPO / "dist"
    argv = ["make", "-C", str(REPO), "--no-print-directory", "deb", f"VERSION={version}",
            f"DIST={dist}"]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=MAKE_TIMEOUT,
                          env=env, stdin=subprocess.DEVNULL, check=False)
    deb = dist / f"{PACKAGE}_{version}_all.deb"
    if proc.returncode != 0 or not deb.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        pytest.fail(f"`make deb VERSION={version}` failed ({proc.returncode}), "
                    f"no {deb}:\n{tail}", pytrace=False)
    return deb


def dpkg_install(root: Path, deb: Path) -> None:
    """Offline install into a machine rootfs, as docs/host-integration.md writes it."""
    proc = subprocess.run(
        hostcmd.argv("install", ROOTFS=str(root), DEB=str(deb)),
        capture_output=True, text=True, timeout=DPKG_TIMEOUT, stdin=subprocess.DEVNULL,
        env={"PATH": HOST_PATH, "LC_ALL": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"},
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"dpkg --root={root} -i {deb.name} failed "
                             f"({proc.returncode}):\n{proc.stdout}{proc.stderr}")


# -- nodes: rootfs + simulated GPU host ------------------------------------------------


@dataclass
class Node:
    """A machine rootfs with the product installed, and the host side bound into it."""

    rootfs: Path
    host: Path  # the simulated host (simgpu layout): staging dirs and device nodes
    sim: simgpu.SimMachine
    log_dir: Path
    gpu: bool
    # /run/host-nvidia/<name> in the guest -> host directory bound there (read-only)
    staging: dict[str, Path] = field(default_factory=dict)
    # bind the simulated /proc/driver (kernel module version) over the guest's
    proc_driver: bool = False
    # bind the simulated /proc/devices (the GPU host kernel's majors) over the guest's
    proc_devices: bool = False
    machines: list[Machine] = field(default_factory=list)

    def binds(self) -> list[Bind]:
        out = [Bind(src, f"/run/host-nvidia/{name}", read_only=True)
               for name, src in sorted(self.staging.items())]
        out += [Bind(self.host / "dev" / dev, f"/dev/{dev}") for dev in self.sim.devices]
        if self.proc_driver:
            # The kernel module's /proc/driver/nvidia/version, as a guest on a GPU host
            # sees it. nspawn applies binds below /proc after entering the guest's root,
            # so the source is a path in the rootfs (a host path fails: "Failed to stat").
            out.append(Bind(Path(GUEST_PROC_DRIVER), "/proc/driver", read_only=True))
        if self.proc_devices:
            # This host has no NVIDIA kernel driver: its /proc/devices, which a machine
            # reads unnamespaced, has no nvidia lines. A GPU host's has (FACTS.md).
            out.append(Bind(Path(GUEST_PROC_DEVICES), "/proc/devices", read_only=True))
        return out

    def machine(self) -> Machine:
        """A new (not yet booted) machine on this rootfs; use as a context manager."""
        m = Machine(self.rootfs, binds=self.binds(), log_dir=self.log_dir)
        self.machines.append(m)
        return m

    def config(self, **values: object) -> None:
        path = self.rootfs / "etc/unbounded/nvidia-setup.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = ["# written by tests/boot/harness.py"]
        lines += [f"{key}: {json.dumps(val)}" for key, val in values.items()]
        path.write_text("\n".join(lines) + "\n")


NodeFactory = Callable[..., Node]


def install_toolkit(root: Path) -> None:
    """The tests' nvidia-ctk and nvidia-cdi-hook (tests/toolkit.py) as /usr/bin/nvidia-ctk
    and /usr/bin/nvidia-cdi-hook, where NVIDIA's packages put them; the stand-ins' packages
    (their source, no bytecode) in the guest's dist-packages, where their launchers find
    them."""
    for tool in (toolkit.NVIDIA_CTK, toolkit.NVIDIA_CDI_HOOK):
        dest = root / "usr/bin" / tool.name
        shutil.copyfile(tool, dest)
        dest.chmod(0o755)
        package = tool.with_name(tool.name.replace("-", "_"))
        if not toolkit.REAL:
            shutil.copytree(package, root / "usr/lib/python3/dist-packages" / package.name,
                            ignore=shutil.ignore_patterns("__pycache__"))


def new_node(base: Path, deb: Path, *, gpu: bool = True,
             driver: realdriver.RealDriver | None = None, nvml: bool = False,
             gpus: int = 2, lost: Sequence[int] = (), **config: object) -> Node:
    """Under ``base`` (created): a fresh rootfs (overlay over the cached trixie tree) with
    our .deb (``dpkg --root``), the tests' nvidia-ctk and nvidia-cdi-hook in /usr/bin and
    ``/etc/unbounded/nvidia-setup.yaml`` (``nvidia_ctk_args: ["--mode=management"]`` plus
    ``config``; with ``nvml``, the simulated host's own: none, nvidia-ctk's default mode,
    where the stand-in finds its GPUs answering NVML through the bound /proc/driver), and
    a simulated host (carrying the real ``driver`` when one is given, else
    simgpu's simulated one; with ``nvml`` and a real driver, its libnvidia-ml is the
    simulated one, tests/simnvml.c, which the GPUs answer, the rest Debian's). The host
    has ``gpus`` GPUs (/dev/nvidia0 ...; simnvml.add_gpu past the first two), the ones at
    the minors ``lost`` fallen off the bus before the machine boots (simnvml.lose_gpu:
    NVML answers GPU_IS_LOST for them). With ``gpu`` its three staging dirs are bound at
    /run/host-nvidia/{0,1,2} and its device nodes at /dev/nvidia*; without, nothing is.
    Release it with :func:`destroy_node` (the ``make_node`` fixture does)."""
    return new_node_on(None, base, deb, gpu=gpu, driver=driver, nvml=nvml, gpus=gpus,
                       lost=lost, config=config)


def new_node_on(lower: Path | None, base: Path, deb: Path, *, gpu: bool = True,
                driver: realdriver.RealDriver | None = None, nvml: bool = False,
                gpus: int = 2, lost: Sequence[int] = (),
                config: dict[str, object] | None = None) -> Node:
    """:func:`new_node` over ``lower``, another cached tree than the base one (None: the
    base; tests/cri.py's has containerd)."""
    config = config or {}
    assert gpu or (gpus == 2 and not lost), "a CPU node has no GPUs to add or lose"
    base.mkdir(parents=True)
    root = base / "rootfs"
    rootfs.fresh_rootfs(root, overlay=True, lower=lower)
    host = base / "host"
    try:
        if driver is None:
            sim = simgpu.make_machine(host, gpu=gpu)
        else:
            sim = simgpu.make_machine(host, driver.version, gpu=gpu)
            realmachine.use_real_driver(sim, driver)
            if nvml and gpu:
                elfbuild.compile_so(sim.lib_dir / f"libnvidia-ml.so.{sim.version}",
                                    elfbuild.NVML_SONAME)
        if gpu:
            for minor in range(2, gpus):
                simnvml.add_gpu(sim, minor)
            for minor in lost:
                simnvml.lose_gpu(sim, minor)
        assert not (nvml and gpu) or sim.nvml_answers, "nvml=True but no GPU answers NVML"
        node = Node(rootfs=root, host=host, sim=sim, log_dir=base, gpu=gpu)
        dpkg_install(root, deb)
        install_toolkit(root)
        args = sim.nvidia_ctk_args() if nvml else ["--mode=management"]
        node.config(**{"nvidia_ctk_args": args, **config})
        if gpu:
            node.staging = {p.name: p for p in sim.staging}
            if (host / "proc/driver").is_dir():
                shutil.copytree(host / "proc/driver", root / GUEST_PROC_DRIVER.lstrip("/"))
                node.proc_driver = True
            shutil.copyfile(host / "proc/devices", root / GUEST_PROC_DEVICES.lstrip("/"))
            node.proc_devices = True
    except BaseException:
        rootfs.remove_rootfs(root)
        raise
    return node


def sync_proc_driver(node: Node) -> None:
    """The simulated host's /proc/driver changed (simnvml.lose_gpu, recover_gpu): the copy
    bound at the machine's /proc/driver follows, in place (the bind holds the directory),
    files gone from the host removed, the others rewritten."""
    src, dest = node.host / "proc/driver", node.rootfs / GUEST_PROC_DRIVER.lstrip("/")
    assert node.proc_driver and src.is_dir(), "this node binds no /proc/driver"
    for path in sorted(dest.rglob("*"), reverse=True):  # deepest first
        if not os.path.lexists(src / path.relative_to(dest)):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
    shutil.copytree(src, dest, dirs_exist_ok=True)


def destroy_node(node: Node) -> list[str]:
    """Stop every machine of ``node`` and remove its rootfs; the errors, if any."""
    errors = []
    for m in node.machines:
        try:
            m.close()
        except Exception as e:  # keep tearing down the rest
            errors.append(f"{m.name}: {e}")
    try:
        rootfs.remove_rootfs(node.rootfs)
    except Exception as e:
        errors.append(f"{node.rootfs}: {e}")
    return errors


# -- inspecting a booted node --------------------------------------------------------------

STAMP = re.compile(r"^(\S+) (start|stop) pid=(\d+) mono_us=(\d+)$")


@dataclass(frozen=True)
class Event:
    service: str  # containerd | kubelet
    what: str  # start | stop
    pid: int
    mono_us: int


def service_events(m: Machine, since_us: int = 0) -> list[Event]:
    """The stand-in services' start/stop log (persistent in the rootfs), oldest first."""
    text = m.exec("cat", SERVICES_LOG, check=False).stdout
    events = []
    for line in text.splitlines():
        found = STAMP.match(line.strip())
        if found:
            ev = Event(found[1], found[2], int(found[3]), int(found[4]))
            if ev.mono_us >= since_us:
                events.append(ev)
    return sorted(events, key=lambda e: e.mono_us)


TIMESTAMPS = ("InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic",
              "ActiveExitTimestampMonotonic", "InactiveEnterTimestampMonotonic",
              "ExecMainStartTimestampMonotonic")
PROPS = ("ActiveState", "SubState", "Result", "StatusText", "MainPID", "NRestarts",
         "ExecMainStatus", *TIMESTAMPS)


def snapshot(m: Machine, *units: str) -> dict[str, dict[str, str]]:
    return {u: m.show(u, *PROPS) for u in (units or NODE_UNITS)}


def us(props: dict[str, str], name: str) -> int:
    return int(props.get(name) or 0)


def wait_node_up(m: Machine, timeout: float = 60.0) -> dict[str, dict[str, str]]:
    """Wait until setup, containerd and kubelet are all active; their properties."""
    m.wait_until(lambda: all(m.is_active(u) for u in NODE_UNITS), timeout=timeout,
                 what="setup, containerd and kubelet active", units=NODE_UNITS)
    return snapshot(m)


def host_command(m: Machine, name: str) -> subprocess.CompletedProcess[str]:
    """docs/host-integration.md's command NAME, run in the machine (tests/hostcmd.py)."""
    return m.exec(*hostcmd.in_guest(hostcmd.commands()[name]), check=False)


def check_json(m: Machine) -> dict[str, Any]:
    """The doc's "validate" command (`check --json` in the guest), its output validated
    against the schema (tests/check_schema.py)."""
    res = host_command(m, "validate")
    assert "Traceback" not in res.stderr, res.stderr
    report = parse_check(res.stdout, res.returncode)
    # On the running system with systemd as PID 1, check always knows the unit's state.
    assert report["unit"]["name"] == SETUP, report
    return report


def is_active(m: Machine) -> str:
    """The doc's "is-active" command: the setup unit's state as it prints it."""
    res = host_command(m, "is-active")
    assert (res.returncode == 0) == (res.stdout.strip() == "active"), res
    return res.stdout.strip()


# -- timing records --------------------------------------------------------------------------

_TIMINGS: list[str] = []


def timings_file() -> Path:
    return rootfs.cache_dir().parent / "boot-timings.log"


def record_timing(test: str, m: Machine, snap: dict[str, dict[str, str]],
                  note: str = "") -> str:
    """One line: nspawn start -> setup start -> setup done -> containerd -> kubelet (ms,
    relative to nspawn's start), and setup start -> containerd start. Printed (pytest -s),
    summarised at the end of the run and appended to ~/.cache/.../boot-timings.log."""
    base = m.started_us or 0
    s, c, k = snap[SETUP], snap[CONTAINERD], snap[KUBELET]
    setup_start = us(s, "InactiveExitTimestampMonotonic")
    setup_done = us(s, "ActiveEnterTimestampMonotonic")
    ctd = us(c, "ExecMainStartTimestampMonotonic")
    kub = us(k, "ExecMainStartTimestampMonotonic")

    def rel(t: int) -> str:
        return f"{(t - base) / 1000:.0f}" if t and base else "-"

    gap = f"{(ctd - setup_start) / 1000:.0f} ms" if ctd and setup_start else "n/a"
    line = (f"{test}: setup start -> containerd start {gap} | ms after nspawn start: "
            f"setup start {rel(setup_start)}, setup done {rel(setup_done)}, "
            f"containerd {rel(ctd)}, kubelet {rel(kub)}; setup restarts "
            f"{s.get('NRestarts', '?')}" + (f"; {note}" if note else ""))
    print(line)
    _TIMINGS.append(line)
    try:
        with timings_file().open("a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    except OSError:
        pass
    return line


def timing_lines() -> list[str]:
    return list(_TIMINGS)
