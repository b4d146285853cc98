"""Crash safety (issue 4, item 2): SIGKILL the real `run` at every class of mutating
syscall, at several N, on a first boot and on a re-run that swaps to another driver.

How the kill points are chosen: one traced dry run of the scenario (``strace -f -b
execve``: the run's process and its threads, not the programs it runs) records, in the
order the calls were entered, every call of the classes below. ``strace -e
inject=SYSCALL:signal=KILL:when=N`` kills the first thread to make its N-th call of
SYSCALL (counted per syscall and per thread), so every N up to the largest count is a kill
point; for openat only the N whose call creates a file count. N follows 1, 2, 3, 5, 8,
13, ... up to the count, plus the last call (of the thread making the fewest), at most
MAX_POINTS per class. A kill run that exits without SIGKILL (thread timing changed) is
counted as missed, and its state checked all the same.

After every kill: the driver root is absent (first boot only) or exactly one complete
generation, byte for byte the manifest a successful run makes (old or new driver); the
spec is absent (first boot only) or exactly one complete spec (old or new: a complete
spec naming the other generation's files is not torn, the next run replaces it); nothing
in /etc/cdi that containerd would read as a spec. Then the next `run` succeeds, makes the
new generation and spec, and removes every leftover. Each test prints its counts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from check_schema import check_report, parse_check
from invariants import (
    parse_calls,
    product_argv,
    product_env,
    run_cli,
    secure_after,  # noqa: F401  (fixture)
)
from unbounded_nvidia_setup.plan import Manifest
from unbounded_nvidia_setup.tree import manifest

import realdriver
import simgpu
from conftest import Cli, needs_root
from test_run import root_of, spec_of

pytestmark = [needs_root,
              pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed"),
              pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
NEW = "570.133.20"

# Every class of syscall the run uses to create, write, link, rename, exchange and delete.
KILL_CLASSES: dict[str, str] = {
    "mkdir": "create a directory (generation, its subdirs, the work dir)",
    "openat": "create a file (O_CREAT: each copy, the spec and drop-in temp files, lock)",
    "copy_file_range": "copy a driver file's data (in the kernel, on the worker threads)",
    "fchown": "give a copy to root:root",
    "fchmod": "set a copy's mode (and a temp file's)",
    "utimensat": "set a copy's mtime",
    "chmod": "set a directory's mode",
    "symlink": "make a SONAME or linker-name link",
    "renameat2": "exchange the new generation with the live root",
    "rename": "first-boot rename of the generation; install spec and drop-in",
    "unlink": "delete a file or link (work dir, old generation entries)",
    "unlinkat": "delete entries of a generation or the work dir (rmtree)",
    "rmdir": "delete a directory",
    "fsync": "sync the spec / drop-in temp file or their directory",
    "write": "write the spec or drop-in temp file (and log lines)",
}
# (scenario, class) the run never calls: a first boot has no live root to exchange with
# (it renames the new generation into place).
NO_CALLS = {("first-boot", "renameat2")}
LADDER = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
MAX_POINTS = 6


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


def manifest_of(m: simgpu.SimMachine) -> Manifest:
    have = manifest(root_of(m))
    assert have is not None
    return have


def swapper(tmp_path: Path, real: realdriver.RealDriver | None = None) -> Swapper:
    m = simgpu.make_machine(tmp_path / "root", stale_versions=())
    m.write_config()
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
    """What a fresh machine has: no driver root, no spec, no drop-in, no linker cache."""
    for path in (m.root / "run/nvidia", m.root / "run/unbounded-nvidia-setup"):
        shutil.rmtree(path, ignore_errors=True)
    for directory in (m.root / "etc/cdi", m.root / "etc/ld.so.conf.d"):
        if directory.exists():
            for entry in directory.iterdir():
                entry.unlink()
    for path in (m.root / "etc/ld.so.cache",):
        if path.exists():
            path.unlink()


# --------------------------------------------------------------------------------------
# Kill points


def trace_counts(m: simgpu.SimMachine, classes: list[str]) -> dict[str, list[int]]:
    """Kill points of a `run` on `m` as it is now (the run happens: leave `m` as needed)."""
    with tempfile.TemporaryDirectory(prefix="unb-profile-") as tmp:
        out = Path(tmp) / "trace"
        proc = subprocess.run(
            ["strace", "-f", "-b", "execve", "-qq", "-o", str(out), "-e",
             f"trace={','.join(classes)},execve", *product_argv(m.root, "run")],
            capture_output=True, text=True, env=product_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr
        text = out.read_text(errors="surrogateescape")
    calls = parse_calls(text)
    assert any(c.name in classes for c in calls), f"nothing parsed from {text[:300]!r}"
    main = calls[0].pid
    others = {c.pid for c in calls if c.name == "execve"} - {main}
    count: dict[str, Counter[int]] = defaultdict(Counter)
    first: dict[str, dict[int, bool]] = defaultdict(dict)  # class -> N -> run's own call?
    for call in calls:
        if call.name not in classes:
            continue
        count[call.name][call.pid] += 1
        n = count[call.name][call.pid]
        if n not in first[call.name]:
            mutating = call.name != "openat" or "O_CREAT" in "".join(call.args[2:3])
            first[call.name][n] = call.pid not in others and mutating
    points: dict[str, list[int]] = {}
    for cls in classes:
        valid = [n for n, ours in sorted(first[cls].items()) if ours]
        if cls == "openat":  # the k-th file creation, k on the ladder
            picked = [valid[k - 1] for k in LADDER if k <= len(valid)]
        else:
            picked = [n for n in LADDER if n in valid]
        # The last call of the thread that makes fewest: reached whichever way the
        # worker threads share the copies.
        last = min(count[cls].values(), default=0)
        if cls == "openat" and valid:
            last = valid[-1]
        if last in valid and last not in picked:
            picked.append(last)
        if len(picked) > MAX_POINTS:
            picked = [*picked[: MAX_POINTS - 1], picked[-1]]
        points[cls] = picked
    return points


_PROFILES: dict[str, dict[str, list[int]]] = {}


def kill_points(scenario: str, s: Swapper) -> dict[str, list[int]]:
    """Profiled once per scenario (the machines of a scenario are all alike)."""
    if scenario not in _PROFILES:
        s.prepare(scenario)
        _PROFILES[scenario] = trace_counts(s.m, list(KILL_CLASSES))
    return _PROFILES[scenario]


def run_killed(m: simgpu.SimMachine, syscall: str, when: int) -> bool:
    """A `run` SIGKILLed at its `when`-th `syscall`; True when it was killed there."""
    argv = ["strace", "-f", "-b", "execve", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}",
            "-e", f"inject={syscall}:signal=KILL:when={when}", *product_argv(m.root, "run")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=product_env(), timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    wait_for_orphans(m.root)
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


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
    missed: int = 0  # runs not killed there (thread timing): state checked all the same
    points: list[int] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # what failed, at which point


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
    assert os.listdir(m.root / "etc/ld.so.conf.d") == ["unbounded-nvidia-setup.conf"]


def kill_matrix(s: Swapper, scenario: str, syscall: str, points: list[int]) -> Tally:
    """Kill at every point; a point whose state or recovery is wrong is recorded in
    `broken` (the callers fail on it) and the next point still runs."""
    tally = Tally(points=points)
    for when in points:
        target = s.prepare(scenario)
        killed = run_killed(s.m, syscall, when)
        tally.tried += killed
        tally.missed += not killed
        try:
            assert_whole(s, may_be_absent=scenario == "first-boot")
            recovered(s, target)
        except AssertionError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            tally.broken.append(f"N={when}{'' if killed else ' (not killed)'}: {first}")
            continue
        tally.held += killed
    return tally


def show(scenario: str, syscall: str, tally: Tally) -> None:
    print(f"KILLPOINTS {scenario} {syscall}: at N={tally.points} tried={tally.tried} "
          f"held={tally.held} missed={tally.missed} broken={len(tally.broken)}")


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
    if (scenario, syscall) in NO_CALLS:
        assert points == [], f"a {scenario} run now makes {syscall} calls: kill it there too"
        return
    # Never a skip: a class the run stops using must be looked at, not silently dropped.
    assert points, f"a {scenario} run makes no {syscall} call of its own any more"
    tally = kill_matrix(s, scenario, syscall, points)
    show(scenario, syscall, tally)
    assert tally.broken == []
    assert tally.tried >= 1, "no kill point was reached"
    assert tally.held == tally.tried
    assert check_report(run_cli(s.m.root, "check", "--json"))["ok"] is True


REAL_CLASSES = ("mkdir", "openat", "copy_file_range", "symlink", "renameat2", "rename",
                "unlinkat", "fsync", "write")


def test_sigkill_while_swapping_to_the_real_driver(tmp_path: Path) -> None:
    """The same, swapping between a simulated 550 driver and the real Debian 535 one
    (about 300 MB of real libraries): kill points at the first and last call of each
    class."""
    try:
        real = realdriver.fetch_real_driver("amd64")
    except realdriver.RealDriverUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"real NVIDIA files unavailable: {e}")
    s = swapper(tmp_path, real)
    s.learn()
    s.use(s.other())
    profile = trace_counts(s.m, list(REAL_CLASSES))
    total = Tally()
    for syscall in REAL_CLASSES:
        points = profile[syscall]
        points = sorted({points[0], points[-1]}) if points else []
        tally = kill_matrix(s, "new-driver", syscall, points)
        show("real-driver", syscall, tally)
        total.tried += tally.tried
        total.held += tally.held
        total.missed += tally.missed
        total.broken += [f"{syscall} {b}" for b in tally.broken]
    show("real-driver", "all", total)
    assert total.broken == []
    assert total.tried >= len(REAL_CLASSES)
    assert total.held == total.tried


def test_killed_atomic_writes_leave_no_temp_files(two_drivers: Swapper) -> None:
    """Regression: a run killed between writing and renaming the spec or drop-in temp
    file (at every fsync) left `.nvidia.yaml.*.tmp` / `.unbounded-nvidia-setup.conf.*.tmp`
    behind for good; the next run must remove them."""
    s = two_drivers
    for when in kill_points("first-boot", s)["fsync"]:
        first_boot(s.m)
        assert run_killed(s.m, "fsync", when)
        assert_whole(s, may_be_absent=True)
        recovered(s, s.current)


# --------------------------------------------------------------------------------------
# Concurrency (more in test_concurrency.py)


def test_concurrent_runs_and_checks_serialize(tmp_path: Path, cli: Cli) -> None:
    """8 runs and 4 checks at once on a fresh machine: every check sees the state before
    the first run (exactly root, spec and drop-in missing) or after it (whole, the full
    library list), never one in between (a root without its spec or drop-in)."""
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()

    def one(i: int) -> tuple[str, int, str]:
        if i % 3 == 2:
            out = cli(m.root, "check", "--json")
            check_report(out)
            return "check", out.code, out.stdout
        out = cli(m.root, "run")
        return "run", out.code, out.stderr

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(one, range(12)))
    final = check_report(cli(m.root, "check", "--json"))
    assert final["ok"] is True
    seen = Counter[str]()
    for kind, code, text in results:
        if kind == "run":
            assert code == 0, text
            continue
        report = parse_check(text, code)
        codes = sorted(p["code"] for p in report["problems"])
        if report["ok"]:
            assert code == 0 and report["driver_root"] == final["driver_root"]
            seen["whole"] += 1
        elif report["setup_running"]:
            # A run held the lock: the check read without waiting (issue 11); whatever
            # it saw half done is "not ready yet", never "broken".
            assert report["verdict"] == "not-ready-yet", report
            seen["during"] += 1
        else:
            assert code == 1 and codes == ["ldconf-missing", "root-missing", "spec-missing"], codes
            seen["before"] += 1
    assert sum(seen.values()) == 4, seen


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path: Path) -> Iterator[None]:
    yield
    wait_for_orphans(tmp_path)
