"""Crash safety (issue 4, item 2): SIGKILL the real `run` at every class of mutating
syscall, at several N, on a first boot and on a re-run that swaps to another driver.

How the kill points are chosen: one traced dry run of the scenario (``strace -f -b
execve -y``: the run's process and its threads, not the programs it runs, with the path
of every descriptor) records, in the order the calls were entered, every call of the
classes below. ``strace -e inject=SYSCALL:signal=KILL:when=N`` kills the first thread to
make its N-th call of SYSCALL (counted per syscall and per thread); for openat only the
N whose call creates a file count. Two kinds of point:

* by index: N on 1, 2, 3, 5, 8, 13, ... plus the last call (of the thread making the
  fewest), at most MAX_POINTS per class, and only N that some thread makes on every run
  however the copies fall between the worker threads, so every kill lands;
* by purpose: the first and last call of each class made for one of PURPOSES (the spec,
  the drop-in, the metrics file, a log line), found by the path it acts on (a call
  relative to a directory's descriptor, like the metrics file's, by the path it resolves
  to). Only calls no other thread
  can reach first are aimed at (the spec's fchmod is not: the copy workers make more),
  and the injected run's own trace must show the kill landed on that call. `write` has
  only these: by index, its points all landed on log lines. The metrics file's calls are
  counted among the calls on its own paths only (strace -P, BY_PATH): removals in the
  work dir before them vary in number from run to run (UNSTEADY).

After every kill: the driver root is absent (first boot only) or exactly one complete
generation, byte for byte the manifest a successful run makes (old or new driver); the
spec is absent (first boot only) or exactly one complete spec (old or new: a complete
spec naming the other generation's files is not torn, the next run replaces it); nothing
in /etc/cdi that containerd would read as a spec; the metrics file a complete one (the
previous run's or this run's, never cut or empty). Then the next `run` succeeds, makes the
new generation and spec, and removes every leftover. Each test prints its counts.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import pytest

from check_schema import check_report, parse_check
from invariants import (
    Call,
    accesses,
    call_path,
    fd_path,
    parse_calls,
    product_argv,
    product_env,
    run_cli,
    secure_after,  # noqa: F401  (fixture)
    unquote,
)
from unbounded_nvidia_setup import metrics
from unbounded_nvidia_setup.plan import Manifest
from unbounded_nvidia_setup.tree import manifest

import realdriver
import simgpu
import toolkit
from conftest import Cli, needs_root, needs_tool
from test_run import root_of, spec_of

pytestmark = [needs_root,
              needs_tool("strace"),
              pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
NEW = "570.133.20"

# Every class of syscall the run uses to create, write, link, rename, exchange and delete.
KILL_CLASSES: dict[str, str] = {
    "mkdir": "create a directory (generation, its subdirs, the work dir)",
    "openat": "create a file (O_CREAT: each copy, the spec, drop-in and metrics temp "
              "files, lock)",
    "copy_file_range": "copy a driver file's data (in the kernel, on the worker threads)",
    "fchown": "give a copy to root:root",
    "fchmod": "set a copy's mode (and a temp file's)",
    "utimensat": "set a copy's mtime",
    "chmod": "set a directory's mode",
    "symlink": "make a SONAME or linker-name link",
    "renameat2": "exchange the new generation with the live root",
    "rename": "first-boot rename of the generation; install spec and drop-in",
    "renameat": "install the metrics file (by name relative to its directory's fd)",
    "unlink": "delete a file or link (work dir, old generation entries)",
    "unlinkat": "delete entries of a generation or the work dir (rmtree); clear a "
                "metrics temp file a killed writer left",
    "rmdir": "delete a directory",
    "fsync": "sync the spec / drop-in / metrics temp file or their directory",
    "write": "write the spec, drop-in or metrics temp file (and log lines)",
}
LADDER = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
MAX_POINTS = 6

# What a call is for, by the path it acts on under the machine's root (strace -y names a
# descriptor's path). Every class gets a point at the first and last of its calls for
# each purpose (when strace can single that call out: see Point); `write` gets only
# these, since by index its points all landed on log lines. A new file the run writes
# is one more line here (temp file, file, directory: in that order), and its name in
# WRITES.
METRICS_DIR = "/var/lib/prometheus/node-exporter"  # metrics_dir's default, under --root
PURPOSES: dict[str, tuple[str, ...]] = {
    "spec": ("/etc/cdi/.nvidia.yaml.*.tmp", "/etc/cdi/nvidia.yaml", "/etc/cdi"),
    "drop-in": ("/etc/ld.so.conf.d/.unbounded-nvidia-setup.conf.*.tmp",
                "/etc/ld.so.conf.d/unbounded-nvidia-setup.conf", "/etc/ld.so.conf.d"),
    "metrics": (f"{METRICS_DIR}/.{metrics.FILE}.tmp", f"{METRICS_DIR}/{metrics.FILE}",
                METRICS_DIR),
    "log": ("pipe:*",),  # stderr, a pipe under these tests: one log line
}
# The CDI work dir holds nvidia-ctk's output. The early generate a run throws away when
# the root changes (cdi.Generator.discard_early) is killed wherever it is: now and then
# between creating its temp file and renaming it, and the run removes that file with the
# rest of the dir (an unlinkat each). So those removals vary in number from run to run
# (UNSTEADY, by class), by the temp files a killed nvidia-ctk left (LEFTOVERS).
UNSTEADY: dict[str, tuple[str, ...]] = {"unlinkat": ("/run/unbounded-nvidia-setup/*",)}
LEFTOVERS = ("/run/unbounded-nvidia-setup/*.tmp",)
# Purposes whose calls all name fixed paths or descriptors of them: their points are
# counted among the calls on those paths only (strace -P), so no call before them can
# move them. The metrics file is written after the work dir is removed; the spec's and
# the drop-in's temp files have random names (tree.write_atomically), and no unsteady call comes
# before their points (class_points checks).
BY_PATH: dict[str, tuple[str, ...]] = {"metrics": PURPOSES["metrics"]}
# Classes a scenario makes no call of, and why; any other empty point list fails (CI).
NOT_MADE = {("first-boot", "renameat2"): "no live root to exchange with: the first "
            "generation is renamed into place"}
# The files each scenario writes atomically (the drop-in is already right on a swap; every
# run writes the metrics): each must have an aimed point at every step below, and `write`
# one at a log line besides. The metrics file is renamed by renameat (relative to its
# directory's descriptor), the others by rename. (The spec's and drop-in's temp files'
# fchmod cannot be aimed at: the copy workers make more fchmod calls; the metrics
# file's is, by path.)
ATOMIC_STEPS = ("openat", "write", "fsync", "rename")
RENAME_BY = {"metrics": "renameat"}  # the syscall of the "rename" step, when not rename
WRITES: dict[str, set[str]] = {"first-boot": {"spec", "drop-in", "metrics"},
                               "new-driver": {"spec", "metrics"}}


# --------------------------------------------------------------------------------------
# Machines with two drivers to swap between


@dataclass
class Swapper:
    """A machine and staging for two driver versions; `use(v)` swaps the staging dirs
    (one rename each) and the kernel module version, as a host driver update would."""

    m: simgpu.SimMachine
    stages: dict[str, Path]
    module: dict[str, str]
    current: str
    good: dict[str, tuple[Manifest, bytes]] = field(default_factory=dict)
    metrics_shape: frozenset[str] = frozenset()  # of a complete metrics file (learn)

    def use(self, version: str) -> None:
        if version == self.current:
            return
        host = self.m.root / "run/host-nvidia"
        os.rename(host, self.stages[self.current])
        os.rename(self.stages[version], host)
        (self.m.root / "proc/driver/nvidia/version").write_text(self.module[version])
        self.current = version

    def other(self) -> str:
        return next(v for v in self.stages if v != self.current)

    def prepare(self, scenario: str) -> str:
        """Set the machine up for one run of `scenario`: a "first-boot" of the current
        driver, or a host update to the other one. Returns the version the run must end
        with."""
        if scenario == "first-boot":
            first_boot(self.m)
        else:
            self.use(self.other())
        return self.current

    def learn(self) -> None:
        """Run once per version: the exact root and spec a good run makes for each."""
        for _ in range(2):
            version = self.other()
            self.use(version)
            out = run_cli(self.m.root, "run")
            assert out.code == 0, out.stderr
            self.good[version] = (manifest_of(self.m), spec_of(self.m).read_bytes())
        shape = metrics_shape(metrics_of(self.m).read_bytes())
        assert shape, "no metrics written"
        self.metrics_shape = shape


def metrics_of(m: simgpu.SimMachine) -> Path:
    return m.root / METRICS_DIR.lstrip("/") / metrics.FILE


def metrics_shape(text: bytes) -> frozenset[str]:
    """What every complete metrics file has, whichever run wrote it: its lines with the
    values taken out (sample values, label values: the driver version differs). Empty
    when a line is cut or a sample's value is not a number: a torn file."""
    if not text.endswith(b"\n"):
        return frozenset()
    shape = set()
    for line in text.decode(errors="replace").splitlines():
        if not line.startswith("#"):
            line, _, number = line.rpartition(" ")
            try:
                float(number)
            except ValueError:
                return frozenset()
        shape.add(re.sub(r'="(?:[^"\\]|\\.)*"', '=""', line))
    return frozenset(shape)


def assert_metrics_whole(s: Swapper) -> None:
    """The metrics file is a complete one (the previous run's or this run's): never
    missing, empty or cut, whatever the run was doing when it died."""
    path = metrics_of(s.m)
    assert path.is_file(), "metrics file missing"
    assert metrics_shape(path.read_bytes()) == s.metrics_shape, "torn metrics file"


def manifest_of(m: simgpu.SimMachine) -> Manifest:
    have = manifest(root_of(m))
    assert have is not None
    return have


def swapper(tmp_path: Path, real: realdriver.RealDriver | None = None) -> Swapper:
    m = simgpu.make_machine(tmp_path / "root", stale_versions=())
    # The real driver's libnvidia-ml answers Driver Not Loaded on this GPU-less host, and
    # nvidia-ctk's NVML mode then fails, the stand-in's as NVIDIA's (tests/simnvml.c is
    # the simulated driver's only): its swaps generate in management mode, as on
    # tests/test_realdriver.py's machines.
    m.write_config(**({} if real is None else {"nvidia_ctk_args": ["--mode=management"]}))
    # node_exporter's textfile directory: every run writes the metrics file there.
    (m.root / METRICS_DIR.lstrip("/")).mkdir(parents=True)
    version_file = m.root / "proc/driver/nvidia/version"
    module = {m.version: version_file.read_text()}
    other = tmp_path / "stage-other"
    if real is None:
        b = simgpu.make_machine(tmp_path / "other", version=NEW, stale_versions=())
        shutil.move(b.root / "run/host-nvidia", other)
        module[NEW] = (b.root / "proc/driver/nvidia/version").read_text()
        version = NEW
    else:
        realdriver.stage_real_driver(other / "0", real, bin_dir=other / "1",
                                     firmware_dir=other / "2", hardlink=True)
        module[real.version] = module[m.version].replace(m.version, real.version)
        version = real.version
    return Swapper(m, {m.version: tmp_path / "stage-current", version: other}, module,
                   m.version)


def first_boot(m: simgpu.SimMachine) -> None:
    """What a fresh machine has: no driver root, no spec, no drop-in, no linker cache;
    Debian's own conf files stay."""
    for path in (m.root / "run/nvidia", m.root / "run/unbounded-nvidia-setup"):
        shutil.rmtree(path, ignore_errors=True)
    for directory in (m.root / "etc/cdi", m.root / "etc/ld.so.conf.d"):
        if directory.exists():
            for entry in directory.iterdir():
                if entry.name not in ("libc.conf", f"{m.multiarch}.conf"):
                    entry.unlink()
    for path in (m.root / "etc/ld.so.cache",):
        if path.exists():
            path.unlink()


# --------------------------------------------------------------------------------------
# Kill points


@dataclass(frozen=True)
class Point:
    """A place to kill or fail a run: the `when`-th call of `syscall` (strace counts per
    thread, so the first thread to make its `when`-th such call is hit). `path` is what
    the profiled call there acted on (under the machine's root, as "/etc/..."); `purpose`
    the PURPOSES entry it matched, set only when no other thread makes `when` such calls,
    so the point always lands on that very call and the test checks that it did."""

    syscall: str
    when: int
    path: str
    purpose: str | None = None
    # strace's path filter (-P; paths under the machine's root, as "/etc/..."): `when`
    # counts only the calls that touch one of these (by a path argument or a
    # descriptor's path), as strace counts them.
    only: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = "P" if self.only else ""
        return f"{self.when}{where}({self.purpose})" if self.purpose else str(self.when)


def where(call: Call, root: Path) -> str:
    """The path `call` acted on, relative to the machine's root ("/etc/cdi/nvidia.yaml"),
    or as strace names it outside the root ("pipe:[…]")."""
    path = call_path(call) or "?"
    if path == str(root) or path.startswith(f"{root}/"):
        return "/" + os.path.relpath(path, root).removeprefix(".")
    return path


def purpose_of(path: str) -> str | None:
    return next((name for name, globs in PURPOSES.items()
                 if any(fnmatch.fnmatchcase(path, g) for g in globs)), None)


def choose_points(calls: list[Call], root: Path, classes: list[str]) -> dict[str, list[Point]]:
    """The kill points of each class in a traced run (calls in the order entered)."""
    main = calls[0].pid
    spawned = {c.pid for c in calls if c.name == "execve"} - {main}
    return {cls: class_points(cls, [c for c in calls if c.name == cls and c.pid not in spawned],
                              main, root)  # not a child before exec
            for cls in classes}


def touches(call: Call, paths: tuple[str, ...]) -> bool:
    """Whether strace's path filter (-P `paths`) passes `call`: a descriptor argument
    whose path (-y) is one of them, or a path argument that is one of them as written."""
    return any(fd_path(arg) in paths or (arg[:1] == '"' and unquote(arg) in paths)
               for arg in call.args)


def class_points(cls: str, ordered: list[Call], main: int, root: Path) -> list[Point]:
    """The kill points among one class's calls (in the order entered). What may move a
    call's index from one run to the next is kept from the points: a thread is not counted
    on to reach its calls that another run may not make (LEFTOVERS), a point aimed at a
    purpose by index may not follow a call whose number varies (UNSTEADY), and the
    purposes in BY_PATH are counted among their own paths' calls only (strace -P)."""
    def matches(call: Call, globs: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(where(call, root), g) for g in globs)

    made: dict[int, list[Call]] = defaultdict(list)
    nth: dict[int, Call] = {}  # N -> the first N-th call of any thread
    for call in ordered:
        made[call.pid].append(call)
        nth.setdefault(len(made[call.pid]), call)
    per_thread = Counter({pid: len(thread) - sum(matches(c, LEFTOVERS) for c in thread)
                          for pid, thread in made.items()})  # each thread's sure reach
    # The calls that change something (an openat only when it creates).
    valid = {n: call for n, call in sorted(nth.items())
             if cls != "openat" or "O_CREAT" in "".join(call.args[2:3])}

    def exact(n: int, call: Call) -> bool:
        return all(len(thread) < n for pid, thread in made.items() if pid != call.pid)

    def aimed(n: int) -> str | None:
        call = valid[n]
        purpose = purpose_of(where(call, root)) if exact(n, call) else None
        if purpose is None or purpose in BY_PATH:
            return None  # any call there will do: a BY_PATH purpose has its own points
        unsteady = UNSTEADY.get(cls, ())
        moved = [where(c, root) for c in made[call.pid][: n - 1] if matches(c, unsteady)]
        assert not moved, (f"{cls} N={n} ({purpose}) follows calls whose number may differ "
                           f"from run to run: {moved}; aim it by path (BY_PATH)")
        return purpose

    chosen = [] if cls == "write" else ladder(cls, list(valid), per_thread, main)
    for purpose, globs in PURPOSES.items():
        mine = [n for n, call in valid.items() if exact(n, call) and matches(call, globs)]
        chosen += [mine[0], mine[-1]] if mine and purpose not in BY_PATH else []
    by_paths = [aim for purpose in BY_PATH for aim in by_path(cls, made, purpose, root)]
    taken = [call for _, call in by_paths]
    # A call both on the ladder and aimed at by path is killed once, as aimed.
    return [*(Point(cls, n, where(valid[n], root), aimed(n)) for n in sorted(set(chosen))
              if not any(valid[n] is call for call in taken)),
            *(point for point, _ in by_paths)]


def by_path(cls: str, made: dict[int, list[Call]], purpose: str,
            root: Path) -> list[tuple[Point, Call]]:
    """The first and last call of `cls` made for `purpose`, each counted among the calls
    that touch BY_PATH[purpose] (as strace -P counts them), when no other thread makes as
    many of those."""
    paths = tuple(f"{root}{p}" for p in BY_PATH[purpose])
    filtered = {pid: [c for c in thread if touches(c, paths)] for pid, thread in made.items()}
    globs = PURPOSES[purpose]
    mine = []
    for pid, thread in filtered.items():
        others = max((len(t) for p, t in filtered.items() if p != pid), default=0)
        mine += [(n, call) for n, call in enumerate(thread, 1)
                 if n > others and (cls != "openat" or "O_CREAT" in "".join(call.args[2:3]))
                 and any(fnmatch.fnmatchcase(where(call, root), g) for g in globs)]
    ends = {mine[0], mine[-1]} if mine else set()
    return [(Point(cls, n, where(call, root), purpose, BY_PATH[purpose]), call)
            for n, call in sorted(ends, key=lambda e: e[0])]


def ladder(cls: str, valid: list[int], per_thread: Counter[int], main: int) -> list[int]:
    """N on LADDER (for openat: the k-th file creation, k on LADDER) and the last call
    (of the thread making the fewest), at most MAX_POINTS; only N some thread makes on
    every run, however the copies fall between the worker threads (a point beyond that
    is reached on some runs only, and an injection that never fires proves nothing)."""
    workers = [c for pid, c in per_thread.items() if pid != main]
    reach = max(per_thread.get(main, 0), -(-sum(workers) // len(workers)) if workers else 0)
    valid = [n for n in valid if n <= reach]
    if cls == "openat":
        picked = [valid[k - 1] for k in LADDER if k <= len(valid)]
        last = valid[-1] if valid else 0
    else:
        picked = [n for n in LADDER if n in valid]
        last = min(per_thread.values(), default=0)
    if last in valid and last not in picked:
        picked.append(last)
    if len(picked) > MAX_POINTS:
        picked = [*picked[: MAX_POINTS - 1], picked[-1]]
    return picked


def trace_run(m: simgpu.SimMachine, classes: list[str]) -> list[Call]:
    """The calls of `classes` a successful `run` on `m` makes, in the order entered, with
    descriptor paths (the run happens: leave `m` as needed)."""
    with tempfile.TemporaryDirectory(prefix="unb-profile-") as tmp:
        out = Path(tmp) / "trace"
        proc = subprocess.run(
            ["strace", "-f", "-b", "execve", "-qq", "-y", "-o", str(out), "-e",
             f"trace={','.join(classes)},execve", *product_argv(m.root, "run")],
            capture_output=True, text=True, env=product_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr
        text = out.read_text(errors="surrogateescape")
    calls = parse_calls(text)
    assert any(c.name in classes for c in calls), f"nothing parsed from {text[:300]!r}"
    return calls


def profile(m: simgpu.SimMachine, classes: list[str]) -> dict[str, list[Point]]:
    """Kill points of a `run` on `m` as it is now."""
    return choose_points(trace_run(m, classes), m.root, classes)


_PROFILES: dict[str, dict[str, list[Point]]] = {}


def kill_points(scenario: str, s: Swapper) -> dict[str, list[Point]]:
    """Profiled once per scenario (the machines of a scenario are all alike). Fails when
    a file the scenario writes lacks a point at a step of its atomic write (the blind
    spot of points picked by index), or that step went missing from the product."""
    if scenario not in _PROFILES:
        s.prepare(scenario)
        points = profile(s.m, list(KILL_CLASSES))
        for step in ATOMIC_STEPS:
            for purpose in sorted(WRITES[scenario] | ({"log"} if step == "write" else set())):
                syscall = RENAME_BY.get(purpose, step) if step == "rename" else step
                have = {p.purpose for p in points[syscall] if p.purpose}
                assert purpose in have, (
                    f"{scenario}: no {syscall} point for {purpose}; the {syscall} calls "
                    f"aimable: {[p.path for p in points[syscall]]}")
        _PROFILES[scenario] = points
    return _PROFILES[scenario]


def points_or_fail(scenario: str, syscall: str, points: list[Point]) -> list[Point]:
    """An empty list is a test that proves nothing: under CI it fails; elsewhere (another
    Python may make other calls) it skips."""
    if not points:
        message = f"a {scenario} run makes no {syscall} call of its own to inject into"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return points


@dataclass
class Injected:
    """A run with a fault injected at one point: its exit status, stderr, and the calls
    strace hit (SIGKILLed: result "?"; failed: "= -1 E... (INJECTED)")."""

    code: int
    stderr: str
    hits: list[tuple[Call, str]]  # (call, where it acted)

    @property
    def killed(self) -> bool:
        return self.code in (-signal.SIGKILL, 128 + signal.SIGKILL)

    def landed(self, point: Point) -> bool:
        """The fault hit the call the point was chosen for (any call, without purpose)."""
        if point.purpose is None:
            return bool(self.hits)
        return any(purpose_of(path) == point.purpose for _, path in self.hits)


def run_injected(m: simgpu.SimMachine, point: Point, action: str) -> Injected:
    """A `run` with strace injecting `action` ("signal=KILL", "error=ENOSPC") at `point`,
    traced with fd paths (-y) to see which calls it hit."""
    syscall = point.syscall
    with tempfile.TemporaryDirectory(prefix="unb-inject-") as tmp:
        out = Path(tmp) / "trace"
        argv = ["strace", "-f", "-b", "execve", "-qq", "-y", "-o", str(out),
                *(f"--trace-path={m.root}{p}" for p in point.only),
                "-e", f"trace={syscall}", "-e", f"inject={syscall}:{action}:when={point.when}",
                *product_argv(m.root, "run")]
        proc = subprocess.run(argv, capture_output=True, text=True, env=product_env(),
                              timeout=120)
        calls = parse_calls(out.read_text(errors="surrogateescape"))
    assert "Traceback" not in proc.stderr, proc.stderr
    wait_for_orphans(m.root)
    if action.startswith("signal="):
        hit = [c for c in calls if c.args and c.result == "?"]
    else:
        hit = [c for c in calls if c.result.endswith("(INJECTED)")]
    return Injected(proc.returncode, proc.stderr, [(c, where(c, m.root)) for c in hit])


def wait_for_orphans(root: Path, timeout: float = 20) -> None:
    """Children of a killed run (ldconfig, nvidia-ctk) finish on their own; in a real
    unit systemd kills them with the cgroup. Wait, so the next run does not race them."""
    needle = str(root).encode()
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if needle in cmdline:
                    alive.append(pid)
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes of a killed run still alive: {alive}"
        time.sleep(0.05)


def assert_whole(s: Swapper, *, may_be_absent: bool) -> str | None:
    """The live root is absent or exactly one good generation, the spec absent or exactly
    one good spec, nothing in /etc/cdi containerd would read. Returns the root's version."""
    m = s.m
    have = manifest(root_of(m))
    version = None
    if have is None:
        assert may_be_absent and not os.path.lexists(root_of(m)), "driver root missing"
    else:
        matches = [v for v, (want, _) in s.good.items() if want == have]
        assert len(matches) == 1, "driver root is not one complete generation"
        version = matches[0]
    cdi = spec_of(m).parent
    if cdi.exists():
        specs = sorted(p.name for p in cdi.iterdir() if p.name.endswith((".yaml", ".json")))
        assert specs in ([], ["nvidia.yaml"]), specs
    if spec_of(m).exists():
        assert spec_of(m).read_bytes() in {spec for _, spec in s.good.values()}, "torn spec"
    else:
        assert may_be_absent, "spec missing"
    return version


@dataclass
class Tally:
    tried: int = 0  # kills that landed at their point
    held: int = 0  # of those, the ones after which the state was whole and recovered
    missed: int = 0  # runs not killed there: state checked all the same
    points: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # what failed, at which point
    purposes: Counter[str] = field(default_factory=Counter)


def recovered(s: Swapper, version: str) -> None:
    """The next run succeeds with exactly the generation and spec of `version` and removes
    every leftover: generations, the work dir, temp files of the atomic writes."""
    m = s.m
    out = run_cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert manifest_of(m) == s.good[version][0]
    assert spec_of(m).read_bytes() == s.good[version][1]
    assert os.listdir(root_of(m).parent) == ["driver"]
    assert not os.path.lexists(m.root / "run/unbounded-nvidia-setup")
    assert os.listdir(m.root / "etc/cdi") == ["nvidia.yaml"]
    assert sorted(os.listdir(m.root / "etc/ld.so.conf.d")) == [  # Debian's, and ours
        "libc.conf", "unbounded-nvidia-setup.conf", "x86_64-linux-gnu.conf"]
    assert sorted(os.listdir(metrics_of(m).parent)) == [metrics.LOCK, metrics.FILE]
    assert_metrics_whole(s)


def kill_matrix(s: Swapper, scenario: str, points: list[Point],
                targets: list[str] | None = None) -> Tally:
    """Kill at every point; a point whose state or recovery is wrong is recorded in
    `broken` (the callers fail on it) and the next point still runs. `targets`: the
    version each point's run must swap to (its point was profiled on that swap); when
    the next swap would go the other way, a plain run swaps first."""
    tally = Tally(points=[str(p) for p in points])
    for i, point in enumerate(points):
        if targets is not None and s.other() != targets[i]:
            s.use(s.other())
            out = run_cli(s.m.root, "run")
            assert out.code == 0, out.stderr
        target = s.prepare(scenario)
        previous = metrics_of(s.m).read_bytes()
        run = run_injected(s.m, point, "signal=KILL")
        if point.purpose is not None:  # singled out: the kill must land on that call
            assert run.killed and run.landed(point), (
                f"{point.syscall} N={point}: exit {run.code}, hit {[w for _, w in run.hits]}")
            tally.purposes[point.purpose] += 1
        tally.tried += run.killed
        tally.missed += not run.killed
        try:
            assert_whole(s, may_be_absent=scenario == "first-boot")
            assert_metrics_whole(s)
            if point.purpose == "metrics" and point.path == PURPOSES["metrics"][0]:
                # Killed at a call on the temp file: the new file is not in place yet.
                assert metrics_of(s.m).read_bytes() == previous, "metrics changed early"
            recovered(s, target)
        except AssertionError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            tally.broken.append(f"N={point}{'' if run.killed else ' (not killed)'}: {first}")
            continue
        tally.held += run.killed
    return tally


def show(scenario: str, syscall: str, tally: Tally) -> None:
    aimed = " ".join(f"{k}={v}" for k, v in sorted(tally.purposes.items()))
    print(f"KILLPOINTS {scenario} {syscall}: at N={tally.points} tried={tally.tried} "
          f"held={tally.held} missed={tally.missed} broken={len(tally.broken)} "
          f"aimed: {aimed or '-'}")


# --------------------------------------------------------------------------------------
# The matrix


@pytest.fixture
def two_drivers(tmp_path: Path) -> Swapper:
    s = swapper(tmp_path)
    s.learn()
    return s


@pytest.mark.parametrize("syscall", list(KILL_CLASSES))
@pytest.mark.parametrize("scenario", ["first-boot", "new-driver"])
def test_sigkill_at_every_mutating_step_leaves_whole_state(
        two_drivers: Swapper, syscall: str, scenario: str) -> None:
    s = two_drivers
    points = kill_points(scenario, s)[syscall]
    if (scenario, syscall) in NOT_MADE:
        assert not points, f"{syscall} now made on a {scenario}: kill there too"
        return
    tally = kill_matrix(s, scenario, points_or_fail(scenario, syscall, points))
    show(scenario, syscall, tally)
    assert tally.broken == []
    # Every point is one some thread reaches on every run (see ladder): a run that was
    # not killed tested nothing.
    assert tally.missed == 0, "a kill point was not reached"
    assert tally.held == tally.tried == len(points)
    assert check_report(run_cli(s.m.root, "check", "--json"))["ok"] is True


REAL_CLASSES = ("mkdir", "openat", "copy_file_range", "symlink", "renameat2", "rename",
                "renameat", "unlinkat", "fsync", "write")


def test_sigkill_while_swapping_to_the_real_driver(tmp_path: Path) -> None:
    """The same, swapping between a simulated 550 driver and the real Debian 535 one
    (about 300 MB of real libraries), both ways: kill points at the first and last call
    of each class, and at every call singled out by its purpose (the spec's and the
    metrics file's write among them)."""
    try:
        real = realdriver.fetch_real_driver("amd64")
    except realdriver.RealDriverUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real NVIDIA files unavailable: {e}")
    s = swapper(tmp_path, real)
    s.learn()
    # The two swaps make different numbers of calls (the real driver has many more files
    # to verify before the metrics are written): each point is profiled on, and run on,
    # the swap to one version. Both directions, alternating, so no run is spent on
    # turning back.
    profiles = {}
    for _ in range(2):
        target = s.prepare("new-driver")
        profiles[target] = profile(s.m, list(REAL_CLASSES))
    total = Tally()
    planned = 0
    for syscall in REAL_CLASSES:
        jobs = []
        for target, points in profiles.items():
            indexed = [p for p in points[syscall] if not p.only]
            ends = indexed[:1] + indexed[-1:]
            chosen = sorted({*ends, *(p for p in points[syscall] if p.purpose)},
                            key=lambda p: p.when)
            jobs.append([(target, p) for p in chosen])
        order = [job for pair in zip_longest(*jobs) for job in pair if job is not None]
        assert order, f"{syscall}: no kill point on either swap"
        planned += len(order)
        tally = kill_matrix(s, "new-driver", [p for _, p in order], [t for t, _ in order])
        show("real-driver", syscall, tally)
        total.tried += tally.tried
        total.held += tally.held
        total.missed += tally.missed
        total.broken += [f"{syscall} {b}" for b in tally.broken]
        total.purposes += tally.purposes
    show("real-driver", "all", total)
    assert total.broken == []
    # Every planned kill landed (a point no run reached tested nothing) and every one held.
    assert total.missed == 0, "a kill point was not reached"
    assert total.held == total.tried == planned
    assert total.purposes["spec"] >= 3  # its write, fsync and rename at least
    assert total.purposes["metrics"] >= 4  # its openat, write, fsyncs and renameat


def test_killed_atomic_writes_leave_no_temp_files(two_drivers: Swapper) -> None:
    """Regression: a run killed between writing and renaming the spec or drop-in temp
    file (at its write or any fsync) left `.nvidia.yaml.*.tmp` /
    `.unbounded-nvidia-setup.conf.*.tmp` behind for good; the next run must remove them
    (and the metrics temp file, which the next writer clears).
    A kill at a temp file's own call is seen to leave one, so the removal is tested."""
    s = two_drivers
    found = kill_points("first-boot", s)
    points = found["fsync"] + [p for p in found["write"] if p.purpose in WRITES["first-boot"]]
    left = 0
    for point in points:
        first_boot(s.m)
        run = run_injected(s.m, point, "signal=KILL")
        assert run.killed, f"{point.syscall} N={point} not reached: {run.stderr}"
        if point.path.endswith(".tmp"):
            temp = s.m.root / point.path.lstrip("/")
            assert list(temp.parent.glob(".*.tmp")), f"N={point}: no temp file left to test"
            left += 1
        assert_whole(s, may_be_absent=True)
        recovered(s, s.current)
    assert left >= len(WRITES["first-boot"]), points


@pytest.mark.parametrize("scenario", ["first-boot", "new-driver"])
def test_atomic_writes_sync_the_data_before_the_rename_and_the_rename_after(
        two_drivers: Swapper, scenario: str) -> None:
    """A kill cannot show what a power cut would: a file renamed into place before its
    data reached the disk comes back empty. So, from a trace: for each file the scenario
    writes (WRITES), the run creates the temp file, writes it, fsyncs it, renames it over
    the file and fsyncs the directory, in that order, and nothing else on those paths."""
    s = two_drivers
    s.prepare(scenario)
    calls = trace_run(s.m, ["openat", "write", "fsync", "rename", "renameat"])
    for purpose in sorted(WRITES[scenario]):
        temp, final, directory = PURPOSES[purpose]
        steps: list[str] = []
        for call in calls:
            paths = [where(call, s.m.root)] + [
                "/" + os.path.relpath(a.path, s.m.root) for a in accesses([call])[1:]]
            if (call.name in ("rename", "renameat")
                    and fnmatch.fnmatchcase(paths[0], temp)):
                steps.append("rename" if paths[-1] == final else f"rename to {paths[-1]}")
            elif fnmatch.fnmatchcase(paths[0], temp):
                steps.append(f"{call.name} temp")
            elif call.name == "fsync" and paths[0] == directory:
                steps.append("fsync dir")
        steps = [step for i, step in enumerate(steps) if i == 0 or step != steps[i - 1]]
        assert steps == ["openat temp", "write temp", "fsync temp", "rename", "fsync dir"], (
            purpose, steps)


def test_calls_relative_to_a_directory_descriptor_are_placed_by_the_path_they_reach(
        tmp_path: Path) -> None:
    """The metrics file is written by name relative to its directory's descriptor; strace
    -y shows that descriptor as `3</dir>`. Each of those calls, as this strace prints
    them, is placed at the file it acted on and so found for its purpose."""
    d = f"{tmp_path}{METRICS_DIR}"
    tmp, name = f".{metrics.FILE}.tmp", metrics.FILE
    text = "\n".join([
        f'7 unlinkat(3<{d}>, "{tmp}", 0) = -1 ENOENT (No such file or directory)',
        f'7 openat(3<{d}>, "{tmp}", O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, 0644)'
        f" = 4<{d}/{tmp}>",
        f'7 write(4<{d}/{tmp}>, "# HELP unbounded_nvidia_setup_ru"..., 4820) = 4820',
        f"7 fsync(4<{d}/{tmp}>) = 0",
        f'7 renameat(3<{d}>, "{tmp}", 3<{d}>, "{name}") = 0',
        f"7 fsync(3<{d}>) = 0"])
    calls = parse_calls(text)
    temp, final, directory = PURPOSES["metrics"]
    assert [where(c, tmp_path) for c in calls] == [temp] * 5 + [directory]
    assert {purpose_of(where(c, tmp_path)) for c in calls} == {"metrics"}
    assert [a.path for a in accesses(calls[4:5])] == [f"{d}/{tmp}", f"{d}/{name}"]
    assert final == f"{METRICS_DIR}/{name}"


def test_a_leftover_of_a_killed_nvidia_ctk_moves_no_kill_point(two_drivers: Swapper) -> None:
    """CI failed once at the metrics file's unlinkat: the profiled run had removed one
    file more than the run killed after it (the early generate, thrown away as the root
    changed, had been killed between creating its temp file in the work dir and renaming
    it), so the kill fell past the run's last unlinkat. Here the profiled run has such a
    leftover and the killed runs have none: every point is still reached, and each aimed
    one lands on its call."""
    s = two_drivers
    s.prepare("new-driver")
    work = s.m.root / "run/unbounded-nvidia-setup"
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    (work / "spec.4242.123456789.tmp").write_text("cdiVersion: ")  # nvidia-ctk's, cut
    points = profile(s.m, ["unlinkat"])["unlinkat"]
    assert any(p.purpose == "metrics" and p.only for p in points), points
    for point in points:
        target = s.prepare("new-driver")
        run = run_injected(s.m, point, "signal=KILL")
        assert run.killed, f"N={point} not reached: {run.stderr[-300:]}"
        if point.purpose is not None:
            assert run.landed(point), f"N={point}: hit {[w for _, w in run.hits]}"
        recovered(s, target)


# --------------------------------------------------------------------------------------
# Concurrency (more in test_concurrency.py)


# What a first boot's `check` may report while a run holds the lock: the run replaces the
# root, the drop-in, the linker cache and the spec each in one step, so a lock-free read
# sees each missing or whole, never half made.
BEFORE = ["ldconf-missing", "root-missing", "spec-missing"]
IN_BETWEEN = {*BEFORE, "ldcache-stale", "setup-running"}


def held_nvidia_ctk(tmp_path: Path) -> tuple[Path, Path]:
    """A wrapper for the tests' nvidia-ctk that waits (at most 60 s) until the file it
    returns beside it exists: a run is held with its root, drop-in and linker cache made
    and its spec not yet, the in-between state a lock-free check may meet."""
    go = tmp_path / "go"
    wrapper = tmp_path / "held-nvidia-ctk"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'i=0; while [ ! -e "{go}" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n'
        f'exec "{toolkit.NVIDIA_CTK}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, go


def test_concurrent_runs_and_checks_serialize(tmp_path: Path, cli: Cli) -> None:
    """8 runs at once on a fresh machine, and checks started one after another from two
    threads until the runs are done. The first run to get the lock is held at nvidia-ctk
    until a check has seen it there (held_nvidia_ctk).

    The runs serialise: one builds, seven find the root already there. A check that got
    the shared lock sees the state before the first run (exactly root, spec and drop-in
    missing) or after it (whole, the full library list), never one in between. A check
    that found a run holding the lock read without it (issue 11) and says so
    (`setup_running`): it may see the in-between state, but only one made of whole parts:
    verdict `not-ready-yet`, problems only missing parts, and a root it sees has the full
    library list, or only `setup-running` when the root changed under its reads (the
    swap). A check breaking a rule counts as torn; there must be none, and the
    in-between state must have been seen (else the run was never held there)."""
    m = simgpu.make_machine(tmp_path / "root")
    wrapper, go = held_nvidia_ctk(tmp_path)
    m.write_config(nvidia_ctk=str(wrapper))
    seen = Counter[str]()
    torn: list[str] = []
    reports: list[dict[str, Any]] = []
    tally = threading.Lock()

    def classify(code: int, text: str) -> str:
        report = parse_check(text, code)
        reports.append(report)
        # What the run will rebuild is pending while it holds the lock (issue 36), the
        # cause (setup-running) first: the state read is both lists together.
        codes = sorted({p["code"] for p in report["problems"] + report["pending"]})
        root = report.get("driver_root") or {}
        if report["ok"]:
            return "whole"
        if not report["setup_running"]:
            return "before" if code == 1 and codes == BEFORE else "torn"
        if report["verdict"] != "not-ready-yet" or not set(codes) <= IN_BETWEEN:
            return "torn"
        if "root-missing" in codes:
            return "during, before the root"
        if codes == ["setup-running"]:  # the root was swapped in while it read it
            return "during, changed while read"
        return "in-between" if root.get("libraries") else "torn"

    with ThreadPoolExecutor(max_workers=8) as pool:
        runs = [pool.submit(cli, m.root, "run") for _ in range(8)]

        def checks() -> None:
            while not all(r.done() for r in runs):
                out = cli(m.root, "check", "--json")
                check_report(out)
                kind = classify(out.code, out.stdout)
                with tally:
                    seen[kind] += 1
                if kind == "torn":
                    torn.append(out.stdout)
                if kind == "in-between":
                    go.touch()

        with ThreadPoolExecutor(max_workers=2) as checkers:
            for f in [checkers.submit(checks) for _ in range(2)]:
                f.result()
        outs = [r.result() for r in runs]
    print(f"CONCURRENCY runs-and-checks: {sum(seen.values())} checks, {dict(seen)}")
    assert torn == [], torn
    for out in outs:
        assert out.code == 0, out.stderr
    assert sum("now holds driver" in out.stderr for out in outs) == 1
    assert sum("not rebuilt" in out.stderr for out in outs) == 7
    final = check_report(cli(m.root, "check", "--json"))
    assert final["ok"] is True
    full = final["driver_root"]["libraries"]
    # Every root a check saw, whole or in between, had the full library list.
    assert all((r.get("driver_root") or {}).get("libraries") in (None, [], full)
               for r in reports), "a check saw a root with another library list"
    assert seen["in-between"] >= 1, seen


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path: Path) -> Iterator[None]:
    yield
    wait_for_orphans(tmp_path)
