"""Boot a machine rootfs with systemd-nspawn and drive it from the host with nsenter.

The host's PID 1 is not systemd, so ``machinectl`` cannot reach the guest; the guest's
PID 1 (systemd, a child of the nspawn process) is found in ``/proc`` and every command
runs as ``nsenter -t <guest PID 1> -a -- <argv>`` with a clean environment.

Usage::

    with Machine(rootfs, binds=[Bind(src, "/run/host-nvidia/0", read_only=True)]) as m:
        m.wait_until(lambda: m.is_active("containerd.service"), timeout=60,
                     what="containerd active")
        print(m.show("kubelet.service", "MainPID", "ActiveState"))
        m.exec("unbounded-nvidia-setup", "check", "--json")

``Machine.__exit__`` always stops the machine: ``systemctl poweroff`` in the guest, then
SIGRTMIN+4 to the guest's systemd, then SIGKILL to the guest's PID 1 (which kills
everything in the guest's PID namespace) and to nspawn's session, each step bounded in
time; an atexit hook kills machines a dying test process left running. The mounts
nspawn makes live in its own mount namespace and disappear with it.

Gotchas found on a Debian bookworm host with a hybrid cgroup layout (v1 controllers plus
``/sys/fs/cgroup/unified``) and systemd 252's nspawn booting a trixie (systemd 257) guest:

* ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1`` gives the guest a pure cgroup v2 tree. Without
  it the trixie guest gets the host's hybrid layout (systemd >= 256 deprecates cgroup v1)
  and logs errors ("Failed to create symlink /sys/fs/cgroup/cpu: File exists", "Failed
  to attach 1 to compat systemd cgroup '/init.scope'").
* ``--keep-unit`` is needed when the host is not systemd (else "Failed to open system
  bus"); ``--register=no`` likewise (no machined).
* ``--console=passive``: nothing reads the console; the boot messages still reach
  nspawn's stdout, which goes to ``<log_dir>/<name>.console.log``.
* nsenter'ed commands inherit the caller's environment (a pyenv PATH, a pager, colours):
  :data:`GUEST_ENV` replaces it.
* nsenter'ed processes stay in the caller's cgroup, outside the guest's cgroup tree; they
  are not guest services (``systemctl`` talks to the guest's systemd over its private
  socket, which works).
* Device nodes made with ``mknod`` on the host and bound with ``--bind=`` appear in the
  guest's ``/dev`` as character devices. Nothing opens them (there is no NVIDIA kernel
  driver; the product and the nvidia-ctk stand-in only ``stat`` them), so device cgroup
  rules do not matter; the guest's systemd logs "Failed to open libbpf, cgroup BPF
  features disabled" here anyway.
* Binds whose target is below ``/proc`` are made after nspawn has entered the guest's
  root: their source must be a path inside the rootfs (a host path fails with "Failed to
  stat ...: No such file or directory", also with the ``+`` prefix).
* nspawn leaves an empty ``/run/systemd/nspawn/propagate/<name>`` behind ("Attempted to
  remove disk file system ... and we can't allow that"); :meth:`Machine.close` removes it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

T = TypeVar("T")

NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
GUEST_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "HOME": "/root",
    "PAGER": "cat",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
    "SYSTEMD_LESS": "",
}
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

BOOT_TIMEOUT = 60.0  # nspawn started -> guest systemd answers systemctl
COMMAND_TIMEOUT = 120.0  # one nsenter'ed command
POWEROFF_TIMEOUT = 30.0  # `systemctl poweroff` -> nspawn exited
SIGNAL_TIMEOUT = 10.0  # each of the harder stop steps

_names = itertools.count()
_RUNNING: set[Machine] = set()


@atexit.register
def _stop_leftovers() -> None:
    """Last resort (a test process exiting without its finalizers): kill what is left."""
    for machine in list(_RUNNING):
        with contextlib.suppress(Exception):
            machine.kill()


class BootError(RuntimeError):
    """The machine did not boot, or a guest command failed."""


@dataclass(frozen=True)
class Bind:
    """A host path bound into the guest (``--bind=`` / ``--bind-ro=``)."""

    source: Path
    target: str
    read_only: bool = False

    def option(self) -> str:
        for text in (str(self.source), self.target):
            if ":" in text:
                raise ValueError(f"':' in a bind path is not supported: {text}")
        flag = "--bind-ro" if self.read_only else "--bind"
        return f"{flag}={self.source}:{self.target}"


def now_us() -> int:
    """The host's CLOCK_MONOTONIC in microseconds: systemd's *TimestampMonotonic clock."""
    return time.monotonic_ns() // 1000


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy (returned); TimeoutError after
    ``timeout`` seconds, naming ``what`` and, when given, ``describe()`` of the state."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            state = f"; state: {describe()}" if describe is not None else ""
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}{state}")
        time.sleep(interval)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as fh:
                kids += [int(k) for k in fh.read().split()]
    return kids


def _pid_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _guest_inits(nspawn_pid: int) -> list[int]:
    """Children of nspawn that are PID 1 of another PID namespace (the guest's init)."""
    mine = _pid_ns("self")
    found = []
    for kid in _children(nspawn_pid):
        ns = _pid_ns(kid)
        if ns is None or ns == mine:
            continue
        try:
            with open(f"/proc/{kid}/status") as fh:
                nspid = next((ln.split()[1:] for ln in fh if ln.startswith("NSpid:")), [])
        except OSError:
            continue
        if nspid[-1:] == ["1"]:
            found.append(kid)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass(eq=False)
class Machine:
    """One booted systemd-nspawn machine. Use as a context manager (boots on enter)."""

    root: Path
    binds: Sequence[Bind] = ()
    name: str = ""
    log_dir: Path | None = None
    extra_args: Sequence[str] = ()
    boot_timeout: float = BOOT_TIMEOUT

    leader: int | None = field(default=None, init=False)  # guest PID 1, host PID
    started_us: int | None = field(default=None, init=False)  # when nspawn was started
    console_log: Path | None = field(default=None, init=False)
    # nspawn's exit status once stopped; 0 after a clean poweroff, -9 after SIGKILL
    exit_status: int | None = field(default=None, init=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_fh: IO[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"uns-test-{os.getpid()}-{next(_names)}"

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Machine:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def argv(self) -> list[str]:
        return [
            "systemd-nspawn",
            "--directory", str(self.root),
            "--machine", self.name,
            "--boot",
            "--register=no",
            "--keep-unit",
            "--console=passive",
            "--private-network",
            "--link-journal=no",
            "--resolv-conf=off",
            "--timezone=off",
            *(b.option() for b in self.binds),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        """Start nspawn, find the guest's PID 1, wait until its systemd answers."""
        if self._proc is not None:
            raise BootError(f"{self.name} already started")
        log_dir = self.log_dir or self.root.parent
        log_dir.mkdir(parents=True, exist_ok=True)
        self.console_log = log_dir / f"{self.name}.console.log"
        self._log_fh = open(self.console_log, "ab")  # noqa: SIM115 (closed in close())
        env = {**os.environ, **NSPAWN_ENV, "PATH": HOST_PATH}
        self.started_us = now_us()
        _RUNNING.add(self)
        self._proc = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, stdout=self._log_fh,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        self.leader = wait_until(
            self._find_leader, timeout=self.boot_timeout, what=f"{self.name}: guest PID 1",
            interval=0.05, describe=self.console_tail,
        )  # fmt: skip
        remaining = max(1.0, self.boot_timeout - (now_us() - self.started_us) / 1e6)
        wait_until(
            self._systemd_answers, timeout=remaining, what=f"{self.name}: systemd answering",
            interval=0.1, describe=self.console_tail,
        )  # fmt: skip

    def _find_leader(self) -> int | None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise BootError(
                f"systemd-nspawn exited with {self._proc.returncode} before the guest "
                f"booted:\n{self.console_tail()}"
            )
        found = _guest_inits(self._proc.pid)
        return found[0] if found else None

    def _systemd_answers(self) -> bool:
        res = self.exec("systemctl", "show", "--property=SystemState", "--value",
                        check=False, timeout=10)
        return res.returncode == 0 and res.stdout.strip() != ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def poweroff(self, timeout: float = POWEROFF_TIMEOUT) -> int | None:
        """Shut the guest down cleanly; harder steps if it does not go. Returns nspawn's
        exit status (None if it could not be reaped)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None and self.leader is not None and _alive(self.leader):
            with contextlib.suppress(Exception):
                self.exec("systemctl", "poweroff", "--no-block", check=False, timeout=10)
            self._wait_exit(timeout)
        if proc.poll() is None and self.leader is not None and _alive(self.leader):
            # systemd's own "poweroff" signal, in case the bus request was lost.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.leader, signal.SIGRTMIN + 4)
            self._wait_exit(SIGNAL_TIMEOUT)
        self.kill()
        self.exit_status = proc.returncode
        return proc.returncode

    def _wait_exit(self, timeout: float) -> None:
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the guest's PID 1 (the kernel then kills every process in its PID
        namespace and nspawn exits), then nspawn's whole session if it lingers; reap."""
        proc = self._proc
        if proc is None:
            return
        if self.leader is None and proc.poll() is None:
            found = _guest_inits(proc.pid)  # a boot that timed out early
            self.leader = found[0] if found else None
        if self.leader is not None and _alive(self.leader):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.leader, signal.SIGKILL)
            self._wait_exit(SIGNAL_TIMEOUT)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            self._wait_exit(SIGNAL_TIMEOUT)
        if self.leader is not None:
            leader = self.leader
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not _alive(leader), timeout=SIGNAL_TIMEOUT,
                           what="guest PID 1 gone", interval=0.05)

    def close(self) -> None:
        """Stop the machine (see :meth:`poweroff`) and release what it used."""
        try:
            self.poweroff()
        finally:
            _RUNNING.discard(self)
            self._proc = None
            if self._log_fh is not None:
                self._log_fh.close()
                self._log_fh = None
            with contextlib.suppress(OSError):
                os.rmdir(f"/run/systemd/nspawn/propagate/{self.name}")

    def detach(self) -> tuple[int, int]:
        """Leave the machine running after this process ends (``make rehearsal``): no
        stop at exit or in :meth:`close`. Returns (nspawn's PID, the guest's PID 1), what
        :func:`stop_detached` needs to stop it later, from any process."""
        if self._proc is None or self.leader is None or not self.running:
            raise BootError(f"{self.name} is not running")
        pid, leader = self._proc.pid, self.leader
        _RUNNING.discard(self)
        self._proc = None  # close() and the atexit hook leave it alone from here on
        if self._log_fh is not None:
            self._log_fh.close()  # nspawn keeps its own descriptor of the console log
            self._log_fh = None
        return pid, leader

    def reboot(self) -> None:
        """Power off and boot the same rootfs again (a host reboot, as the guest sees it)."""
        self.close()
        self.leader = None
        self.start()

    def console_tail(self, lines: int = 30) -> str:
        if self.console_log is None or not self.console_log.exists():
            return "(no console log)"
        text = self.console_log.read_bytes().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # -- commands in the guest ---------------------------------------------------------

    def exec(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = COMMAND_TIMEOUT,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the guest (all its namespaces, its root) and capture output.
        ``check``: raise BootError on a non-zero exit."""
        if self.leader is None or not self.running:
            raise BootError(f"{self.name} is not running")
        cmd = ["nsenter", "--target", str(self.leader), "--all", "--", *argv]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False,
            input=input, stdin=None if input is not None else subprocess.DEVNULL,
            env={**GUEST_ENV, **(env or {})},
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise BootError(
                f"{self.name}: `{shlex.join(argv)}` exited {proc.returncode}\n"
                f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
            )
        return proc

    def systemctl(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return self.exec("systemctl", "--no-pager", *args, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict (missing properties are absent)."""
        res = self.exec("systemctl", "show", "--no-pager", unit,
                        *(f"--property={p}" for p in props))
        out: dict[str, str] = {}
        for line in res.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                out[key] = value
        return out

    def prop(self, unit: str, name: str) -> str:
        return self.show(unit, name).get(name, "")

    def mono(self, unit: str, name: str) -> int:
        """A ``*TimestampMonotonic`` property in microseconds (0: never happened)."""
        return int(self.prop(unit, name) or 0)

    def active_state(self, unit: str) -> str:
        return self.prop(unit, "ActiveState")

    def is_active(self, unit: str) -> bool:
        return self.active_state(unit) == "active"

    def states(self, *units: str) -> dict[str, str]:
        """``{unit: "ActiveState/SubState"}``, for messages and polling."""
        return {u: "/".join(self.show(u, "ActiveState", "SubState").values()) for u in units}

    def journal(self, *args: str, unit: str | None = None) -> str:
        argv = ["journalctl", "--no-pager", "--boot", "--quiet"]
        if unit is not None:
            argv += ["--unit", unit]
        return self.exec(*argv, *args).stdout

    def read_text(self, path: str) -> str:
        """A file as the guest sees it (works for its /run, unlike reading the rootfs)."""
        return self.exec("cat", "--", path).stdout

    def exists(self, path: str) -> bool:
        return self.exec("test", "-e", path, check=False).returncode == 0

    def wait_until(
        self,
        probe: Callable[[], T | None],
        *,
        timeout: float,
        what: str,
        interval: float = 0.2,
        units: Sequence[str] = (),
    ) -> T:
        """:func:`wait_until`, naming the states of ``units`` on timeout; fails at once
        when the machine died."""

        def guarded() -> T | None:
            if not self.running:
                raise BootError(f"{self.name} stopped while waiting for {what}:\n"
                                f"{self.console_tail()}")
            return probe()

        def describe() -> str:
            return repr(self.states(*units)) if units else ""

        return wait_until(guarded, timeout=timeout, what=f"{self.name}: {what}",
                          interval=interval, describe=describe if units else None)


def is_nspawn_of(pid: int, name: str) -> bool:
    """Whether ``pid`` is (still) the systemd-nspawn that runs machine ``name``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return (_alive(pid) and any(a.endswith(b"systemd-nspawn") for a in argv[:1])
            and name.encode() in argv)


def stop_detached(nspawn_pid: int, leader: int, name: str,
                  timeout: float = POWEROFF_TIMEOUT) -> bool:
    """Stop a machine that :meth:`Machine.detach` left running, from any process, with
    :meth:`Machine.poweroff`'s steps: ``systemctl poweroff`` in the guest, SIGRTMIN+4 to
    its systemd, SIGKILL to its PID 1 and to nspawn's session. False when nothing of it
    was running any more (PIDs that now belong to other processes are left alone)."""
    if not is_nspawn_of(nspawn_pid, name):
        return False

    def gone(wait: float) -> bool:
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not _alive(nspawn_pid), timeout=wait, what="nspawn gone",
                       interval=0.1)
        return not _alive(nspawn_pid)

    guest = leader in _guest_inits(nspawn_pid)
    if guest:
        with contextlib.suppress(Exception):
            subprocess.run(["nsenter", "--target", str(leader), "--all", "--", "systemctl",
                            "poweroff", "--no-block"], env=GUEST_ENV, timeout=10,
                           capture_output=True, stdin=subprocess.DEVNULL, check=False)
    if not gone(timeout if guest else 0.1) and guest:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGRTMIN + 4)
        if not gone(SIGNAL_TIMEOUT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(leader, signal.SIGKILL)
    if not gone(SIGNAL_TIMEOUT):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(nspawn_pid, signal.SIGKILL)  # started in its own session
        gone(SIGNAL_TIMEOUT)
    with contextlib.suppress(OSError):
        os.rmdir(f"/run/systemd/nspawn/propagate/{name}")
    return True


@contextlib.contextmanager
def booted(
    root: Path, binds: Sequence[Bind] = (), *, log_dir: Path | None = None
) -> Iterator[Machine]:
    """``with booted(root, binds) as m:`` — a :class:`Machine`, always stopped after."""
    with Machine(root, binds=binds, log_dir=log_dir) as machine:
        yield machine
