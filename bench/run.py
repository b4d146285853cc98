#!/usr/bin/env python3
"""`make bench`: how fast `unbounded-nvidia-setup run` is on a realistic GPU machine,
measured side by side with what a user would otherwise write (issue 5).

Everything happens on a tmpfs this script mounts itself, in a private mount namespace
(`unshare --mount`), so the mount disappears even if the benchmark is killed; it is
also unmounted explicitly on every exit path. Needs root (mount, mknod).

Machines come from tests/simgpu.py (real gcc-built ELF objects with the names, SONAMEs
and sizes of a 550 datacenter driver, ~0.8 GB of staging at scale 1.0) and use the
nvidia-ctk stand-in tests/fakes/nvidia-ctk with `--mode=management`. The host library
dir is topped up with unrelated entries (hard links of a real unrelated library plus
their SONAME symlinks) to 3,000 or 30,000 directory entries; hard links cost no tmpfs
space, and the tool must decide by name without opening them anyway.

Figures (all runs ALTERNATE, A B A B ..., and every ratio is a ratio of medians taken
in the same invocation):

  cold/baseline  `run` with no driver root, spec or ld.so.cache (what every boot does)
                 vs a shell script a user would write: `cp -a` of exactly the files and
                 links the tool puts in the root, the same nvidia-ctk stand-in with the
                 same arguments, `ldconfig -r`.
  warm/cold      `run` again with nothing changed vs cold.
  scan           cold with 30,000 staging entries vs cold with 3,000.
  cross-fs       the node's layout: staging on another filesystem than /run/nvidia (a
                 host directory bind-mounted into the machine, /run a tmpfs), made by a
                 second tmpfs mounted on <root>/run/nvidia for the sample. Linux refuses
                 copy_file_range across filesystems (EXDEV) and the tool copies with
                 sendfile; `cp -a` falls back to read/write. Cold runs and the baseline
                 alternate, each on one filesystem and across two (not a target:
                 reported).
  metrics        cold and warm runs with node_exporter's textfile directory present
                 (the tool writes its metrics file) vs absent, alternating; issue 10's
                 limit is 3% (reported, not a target).
  rss            peak RSS of the tool's own process in a cold run (VmHWM; see peak_rss),
                 at scale 1.0 and with the payload doubled (scale 2.0).
  version        `unbounded-nvidia-setup --version` vs `python -c pass`, same interpreter.
  payload growth cold and baseline at scale 1.0 and 2.0, alternating (not a target).

Everything stays warm the same way for both sides: staging, roots and specs are in RAM
(tmpfs); the interpreter, nvidia-ctk and ldconfig are in the page cache and every Python
child has a filled bytecode cache (see use_pycache) after untimed warm-up runs. The page
cache is never dropped. The benchmark also reports how much CPU other processes used
meanwhile: on 2 cores that moves the figures, cold/baseline most.

Writes bench/results.json and bench/results.md; prints one summary line and PASS/FAIL
per target, and exits 0 whatever the figures are (it is a measurement). Exit 1 means
the benchmark itself broke (a run failed, the tool built the wrong tree, ...), exit 2
a usage problem (not root, no venv).

`--profile` instead runs one cold run with a timeline of its log lines, one under
`python -X importtime`, one under cProfile, and times the parts (interpreter start,
nvidia-ctk, ldconfig, the bare copy) on their own.

Lint: `.venv/bin/ruff check bench && MYPYPATH=tests .venv/bin/mypy --strict bench/run.py`
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import pstats
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import simgpu  # noqa: E402

VENV_BIN = REPO / ".venv" / "bin"
PYTHON = VENV_BIN / "python"
TOOL = VENV_BIN / "unbounded-nvidia-setup"
RESULTS_JSON = REPO / "bench" / "results.json"
RESULTS_MD = REPO / "bench" / "results.md"

MB = 1_000_000  # RSS is reported in MB = 10^6 bytes (stricter than MiB against "48 MB")
GIB = 1 << 30
TMPFS_SIZE = "5g"  # largest phase: x1 and x2 machines with their roots, ~4.4 GB
SMALL_STAGING = 3_000
LARGE_STAGING = 30_000
RUN_TIMEOUT = 300.0  # one tool or baseline run
QUICK_TIMEOUT = 30.0  # --version, python -c pass, helpers
HARD_LIMIT = 1500  # seconds: SIGALRM ends a benchmark that hangs anyway (cleanup runs)
NS_MARK = "UNBOUNDED_NVIDIA_BENCH_NS"

# (key, label, limit): figures[key] must be <= limit.
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("cold_baseline", "cold/baseline", 1.0),
    ("warm_cold", "warm/cold", 0.5),
    ("scan", "scan (30k/3k entries)", 1.1),
    ("rss_mb", "peak RSS, MB", 48.0),
    ("rss_x2_mb", "peak RSS x2 payload, MB", 48.0),
    ("rss_growth", "RSS x2/x1 (flat)", 1.05),
    ("version", "--version / python -c pass", 1.5),
)


class BenchError(Exception):
    """The benchmark itself broke: exit 1 with this message."""


class Interrupted(BaseException):
    """SIGTERM, SIGHUP or SIGALRM: unwind so every mount and process is cleaned up."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name}")


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Processes: every one bounded in time, killed with its process group on any way out


@dataclass(frozen=True)
class Done:
    argv: list[str]
    seconds: float
    returncode: int
    output: str
    hwm_kib: int = 0  # highest VmHWM seen while polling (0: not polled)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _vm_hwm_kib(pid: int) -> int:
    """VmHWM of a live process (0 once it has exited and released its memory)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(argv: Sequence[str], *, timeout: float = RUN_TIMEOUT, check: bool = True,
        poll_hwm: bool = False, env: dict[str, str] | None = None) -> Done:
    """Run argv with output to a temp file (no pipe to drain, nothing to skew timing);
    wall time from just before fork to just after wait."""
    args = [str(a) for a in argv]
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=env if env is not None else _child_env())
        # A blocking wait, bounded by a watchdog thread: Popen.wait(timeout=) polls with
        # sleeps of up to 50 ms, which would quantize every figure.
        expired = threading.Event()

        def watchdog() -> None:
            expired.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, watchdog)
        timer.daemon = True
        timer.start()
        hwm = 0
        try:
            if poll_hwm:  # only for RSS runs, never for timed ones
                while proc.poll() is None:
                    hwm = max(hwm, _vm_hwm_kib(proc.pid))
                    time.sleep(0.002)
            proc.wait()
            seconds = time.perf_counter() - start
        finally:
            timer.cancel()
            _kill(proc)
        if expired.is_set():
            raise BenchError(f"{shlex.join(args)} did not finish within {timeout:g} s")
        out.seek(0)
        output = out.read().decode(errors="replace")
    done = Done(args, seconds, proc.returncode, output, hwm)
    if check and proc.returncode != 0:
        tail = "\n  ".join(output.strip().splitlines()[-8:])
        raise BenchError(f"{shlex.join(args)} exited {proc.returncode}:\n  {tail}")
    return done


_pycache: Path | None = None  # bytecode cache of every Python child (see use_pycache)


def use_pycache(directory: Path) -> None:
    """Give every Python child a writable bytecode cache under `directory`.

    An installed package has one (dh_python byte-compiles at install), but a checkout
    run with PYTHONDONTWRITEBYTECODE=1 (as some CI and agent shells set) compiles the
    product's modules from source on every start: tens of ms that no user pays. With
    PYTHONPYCACHEPREFIX the cache lives on the benchmark's tmpfs and nothing is written
    into the source tree; the untimed warm-up runs fill it."""
    global _pycache
    directory.mkdir(exist_ok=True)
    _pycache = directory


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("NOTIFY_SOCKET", "JOURNAL_STREAM", "PYTHONPROFILEIMPORTTIME",
                "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", NS_MARK):
        env.pop(key, None)
    if _pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = str(_pycache)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # before the tmpfs: write nothing anywhere
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    return env


# --------------------------------------------------------------------------------------
# The tmpfs, in a private mount namespace


def enter_private_namespace(argv: list[str]) -> None:
    """Re-exec under `unshare --mount --propagation private`: the tmpfs then lives only
    as long as this process tree, whatever kills it. Falls back to the current namespace."""
    if os.environ.get(NS_MARK) or not shutil.which("unshare"):
        return
    try:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True, timeout=QUICK_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return
    if probe.returncode != 0:
        return
    os.environ[NS_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "--",
                          sys.executable, str(Path(__file__).resolve()), *argv])


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    mnt = Path(tempfile.mkdtemp(prefix="unbounded-nvidia-bench."))
    try:
        run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)],
            timeout=QUICK_TIMEOUT)
        try:
            yield mnt
        finally:
            done = run(["umount", str(mnt)], timeout=QUICK_TIMEOUT, check=False)
            if done.returncode != 0:
                log(f"umount {mnt} failed ({done.output.strip()}); detaching it lazily")
                run(["umount", "-l", str(mnt)], timeout=QUICK_TIMEOUT, check=False)
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


# --------------------------------------------------------------------------------------
# Machines


@dataclass
class Bench:
    """One simulated machine and what the benchmark learned about it."""

    label: str
    sim: simgpu.SimMachine
    staging_entries: int
    payload_bytes: int = 0
    baseline: Path | None = None  # the user's script for this machine
    ctk_argv: list[str] = field(default_factory=list)  # as the tool ran it
    copy_lines: list[str] = field(default_factory=list)  # the baseline's copy, into "$D"

    @property
    def root(self) -> Path:
        return self.sim.root

    def tool_argv(self) -> list[str]:
        return [str(TOOL), "--root", str(self.root), "run"]


def count_entries(dirs: Sequence[Path]) -> int:
    total = 0
    for top in dirs:
        for _dir, subdirs, files in os.walk(top):
            total += len(subdirs) + len(files)
    return total


def build_machine(parent: Path, label: str, scale: float, entries: int) -> Bench:
    """simgpu's realistic machine, its host library dir topped up to `entries` entries
    (all staging dirs counted) with unrelated libraries and their SONAME links."""
    start = time.monotonic()
    root = parent / label
    sim = simgpu.make_machine(root, scale=scale, unrelated=40)
    sim.write_config()
    existing = count_entries(sim.staging)
    source = sim.lib_dir / "libz.so.1.2.13"  # a real unrelated ELF library (200 KB x scale)
    if not source.is_file():
        raise BenchError(f"simgpu no longer makes {source.name}; adjust bench/run.py")
    i = 0
    while existing < entries:
        name = f"libsimfill{i}.so.{i % 9}.{i % 7}.{i % 5}"
        os.link(source, sim.lib_dir / name)
        existing += 1
        if existing < entries:
            os.symlink(name, sim.lib_dir / f"libsimfill{i}.so.{i % 9}")
            existing += 1
        i += 1
    bench = Bench(label, sim, count_entries(sim.staging))
    log(f"machine {label}: scale {scale:g}, {bench.staging_entries} staging entries, "
        f"{tree_bytes(root) / GIB:.2f} GiB ({time.monotonic() - start:.1f} s)")
    return bench


def tree_bytes(root: Path) -> int:
    seen: set[int] = set()
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(directory, name))
            if st.st_ino not in seen and not os.path.islink(os.path.join(directory, name)):
                seen.add(st.st_ino)
                total += st.st_size
    return total


def reset(bench: Bench) -> None:
    """What a reboot clears: the driver root (and any generation), the spec (as the brief
    asks), ld.so.cache and the tool's work dir. The ld.so.conf.d drop-in stays (/etc)."""
    nvidia = bench.root / "run" / "nvidia"
    if nvidia.is_dir():
        for name in os.listdir(nvidia):
            path = nvidia / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    work = bench.root / "run" / "unbounded-nvidia-setup"
    if work.exists():
        shutil.rmtree(work)
    for path in (bench.sim.cdi_spec, bench.root / "etc" / "ld.so.cache"):
        path.unlink(missing_ok=True)


def tree_names(root: Path) -> dict[str, str]:
    """Files and links below `root`: relative path -> "f" or "l <final target name>"."""
    result: dict[str, str] = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                real = Path(os.path.realpath(path))
                if not real.is_file() or not real.is_relative_to(root.resolve()):
                    raise BenchError(f"{path} does not resolve to a file in {root}")
                result[rel] = f"l {real.name}"
            else:
                result[rel] = "f"
    return result


def expected_names(sim: simgpu.SimMachine) -> dict[str, str]:
    libdir = f"lib/{sim.multiarch}"
    want = {f"{libdir}/{n}": "f" for n in sim.expected_libs}
    want |= {f"{libdir}/{n}": f"l {Path(t).name}" for n, t in sim.expected_links.items()}
    want |= {f"usr/bin/{h}": "f" for h in sim.helpers}
    want |= {f"lib/firmware/{f}": "f" for f in sim.firmware}
    return want


def check_tool_tree(bench: Bench) -> None:
    have = tree_names(bench.sim.driver_root)
    want = expected_names(bench.sim)
    if have != want:
        extra = sorted(set(have) - set(want))[:5]
        missing = sorted(set(want) - set(have))[:5]
        differ = sorted(k for k in set(want) & set(have) if want[k] != have[k])[:5]
        raise BenchError(f"the tool built an unexpected driver root for {bench.label}: "
                         f"missing {missing}, extra {extra}, different {differ}")
    bench.payload_bytes = sum(
        (bench.sim.driver_root / rel).stat().st_size for rel, kind in have.items()
        if kind == "f")


def _staging_source(sim: simgpu.SimMachine, rel: str) -> Path:
    libdir = f"lib/{sim.multiarch}/"
    if rel.startswith(libdir):
        return sim.lib_dir / rel.removeprefix(libdir)
    if rel.startswith("usr/bin/") and sim.bin_dir is not None:
        return sim.bin_dir / rel.removeprefix("usr/bin/")
    if rel.startswith("lib/firmware/") and sim.firmware_dir is not None:
        return sim.firmware_dir / rel.removeprefix("lib/firmware/")
    raise BenchError(f"no staging source for {rel}")


def ldconfig_path() -> str:
    return shutil.which("ldconfig", path=_child_env()["PATH"]) or "ldconfig"


def ctk_argv_from_log(output: str) -> list[str]:
    """The `nvidia-ctk cdi generate` command line exactly as the tool logged it."""
    for line in output.splitlines():
        _, sep, command = line.partition("running: ")
        if sep and " cdi generate " in command:
            return shlex.split(command)
    raise BenchError("the tool did not log its `nvidia-ctk cdi generate` command line")


def write_baseline(bench: Bench, directory: Path) -> Path:
    """The ExecStart= script a user would write: cp -a exactly the files and links the
    tool put in its root (grouped per destination dir), the same nvidia-ctk command line
    (output straight to /etc/cdi), ldconfig -r. The ld.so.conf.d drop-in the tool wrote
    stays in /etc across boots, as the user's own would."""
    sim = bench.sim
    driver = sim.driver_root
    groups: dict[str, list[str]] = {}
    links: list[tuple[str, str]] = []
    for rel in sorted(tree_names(driver)):
        source = _staging_source(sim, rel)
        if (driver / rel).is_symlink() and not source.is_symlink():
            links.append((os.readlink(driver / rel), rel))  # the host has no such link
        else:
            groups.setdefault(str(Path(rel).parent), []).append(str(source))
    argv = []
    for arg in bench.ctk_argv:
        if arg.startswith("--output="):
            arg = f"--output={sim.cdi_spec}"
        elif arg.startswith(("--driver-root=", "--dev-root=")):
            value = arg.partition("=")[2]
            if value not in (str(sim.driver_root), str(sim.root)):
                raise BenchError(f"unexpected {arg} in the tool's nvidia-ctk command")
        argv.append(arg)
    q = shlex.quote
    copy = ["mkdir -p " + " ".join(f'"$D"/{q(d)}' for d in sorted(groups))]
    for dest, sources in sorted(groups.items()):
        copy.append("cp -a " + " ".join(q(s) for s in sources) + f' "$D"/{q(dest)}/')
    for target, rel in links:
        copy.append(f'ln -s {q(target)} "$D"/{q(rel)}')
    bench.copy_lines = copy
    lines = [
        "#!/bin/sh",
        "# What a user would otherwise write as ExecStart= (bench/run.py).",
        "set -eu",
        f"D={q(str(driver))}",
        *copy,
        f"mkdir -p {q(str(sim.cdi_spec.parent))}",
        shlex.join(argv),
        f"{q(ldconfig_path())} -r {q(str(sim.root))}",
    ]
    script = directory / f"baseline-{bench.label}.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def check_baseline_tree(bench: Bench) -> None:
    """The script's result is usable: the same names as the tool's root, every link
    resolving inside it, a spec naming libcuda in the root, an ld.so.cache with libcuda."""
    have = tree_names(bench.sim.driver_root)
    want = expected_names(bench.sim)
    if have != want:
        raise BenchError(f"the baseline script built a different tree for {bench.label}")
    spec = bench.sim.cdi_spec.read_text()
    if f"{bench.sim.driver_lib_dir}/libcuda.so.{bench.sim.version}" not in spec:
        raise BenchError("the baseline's spec does not mount libcuda from the root")
    cache = (bench.root / "etc" / "ld.so.cache").read_bytes()
    if b"libcuda.so.1" not in cache:
        raise BenchError("the baseline's ldconfig did not cache libcuda.so.1")


def prepare(bench: Bench, scripts: Path) -> None:
    """Untimed warm-up: a cold and a warm run of the tool (and check its tree), then the
    baseline once (and check its tree), whose root stays until the first timed run."""
    reset(bench)
    first = run(bench.tool_argv())
    check_tool_tree(bench)
    bench.ctk_argv = ctk_argv_from_log(first.output)
    run(bench.tool_argv())
    check_tool_tree(bench)
    bench.baseline = write_baseline(bench, scripts)
    reset(bench)
    run(["/bin/sh", str(bench.baseline)])
    check_baseline_tree(bench)


@contextlib.contextmanager
def other_filesystem(bench: Bench) -> Iterator[Path]:
    """/run/nvidia of `bench` on a tmpfs of its own while the block runs, as on a node
    where staging is the host's filesystem. The root the previous run left is deleted
    first (a mount over it would hide it, not free it)."""
    reset(bench)
    nvidia = bench.root / "run" / "nvidia"
    nvidia.mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0755", "tmpfs", str(nvidia)],
        timeout=QUICK_TIMEOUT)
    try:
        if os.stat(nvidia).st_dev == os.stat(bench.sim.lib_dir).st_dev:
            raise BenchError(f"{nvidia} is still on the staging's filesystem")
        yield nvidia
    finally:
        if run(["umount", str(nvidia)], timeout=QUICK_TIMEOUT, check=False).returncode != 0:
            run(["umount", "-l", str(nvidia)], timeout=QUICK_TIMEOUT, check=False)


def prepare_cross_filesystem(bench: Bench) -> None:
    """Untimed: the tool and the baseline build the same trees across filesystems."""
    with other_filesystem(bench):
        run(bench.tool_argv())
        check_tool_tree(bench)
    with other_filesystem(bench):
        assert bench.baseline is not None
        run(["/bin/sh", str(bench.baseline)])
        check_baseline_tree(bench)


def remove_machine(bench: Bench) -> None:
    shutil.rmtree(bench.root)


# --------------------------------------------------------------------------------------
# Measurements


@dataclass
class Series:
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


# Every timed cold or baseline run starts by deleting the root its machine's previous run
# left, right before it. This VM reports freed memory to its host (virtio-balloon free
# page reporting), so memory freed seconds earlier costs host page faults to touch again,
# while memory freed just now does not: without this symmetry the order of the runs
# would decide the figures.
def timed_cold(bench: Bench) -> float:
    reset(bench)
    return run(bench.tool_argv()).seconds


def timed_baseline(bench: Bench) -> float:
    reset(bench)
    assert bench.baseline is not None
    return run(["/bin/sh", str(bench.baseline)]).seconds


# The command's entry point run inside `python -c`, with `before_exit` (Python, using
# `out`, the file to write) run in a hook on os._exit: the command ends there, never
# returning from main() or running atexit handlers. `setup` and `start` run before it.
_IN_PROCESS = """\
import os, sys
out = sys.argv.pop(1)
sys.argv[0] = "unbounded-nvidia-setup"
real_exit = os._exit
{setup}


def hooked_exit(code):
{before_exit}
    real_exit(code)


os._exit = hooked_exit
{start}
from unbounded_nvidia_setup.__main__ import main
main()
"""


def run_in_process(bench: Bench, out: Path, before_exit: str, *, setup: str = "",
                   start: str = "", poll_hwm: bool = False) -> Done:
    """A cold run of `bench` through _IN_PROCESS; `out` must have been written."""
    reset(bench)
    out.unlink(missing_ok=True)
    code = _IN_PROCESS.format(setup=setup, start=start,
                              before_exit=textwrap.indent(textwrap.dedent(before_exit), "    "))
    done = run([str(PYTHON), "-c", code, str(out), "--root", str(bench.root), "run"],
               poll_hwm=poll_hwm)
    if not out.exists():
        raise BenchError(f"the in-process wrapper wrote nothing to {out}: does the command "
                         "still end in os._exit? adjust _IN_PROCESS in bench/run.py")
    return done


@dataclass(frozen=True)
class Rss:
    kib: int  # VmHWM at the end of the run, read by the process itself
    polled_kib: int  # highest VmHWM the benchmark saw from outside (a lower bound)
    seconds: float


def peak_rss(bench: Bench, scratch: Path) -> Rss:
    """VmHWM of the command's own process: the peak resident set of this address space
    only. Children (nvidia-ctk, ldconfig) have their own and do not count; the copy
    threads share it and do. ru_maxrss is NOT used: Linux folds the pre-exec address space
    (the forking benchmark's) into it at execve."""
    out = scratch / "rss"
    done = run_in_process(bench, out, """
        with open("/proc/self/status") as f:
            hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
        with open(out, "w") as f:
            f.write(str(hwm))
    """, poll_hwm=True)
    return Rss(int(out.read_text()), done.hwm_kib, done.seconds)


def python_floor_rss(scratch: Path) -> int:
    out = scratch / "rss"
    code = ("import sys\nwith open('/proc/self/status') as f:\n"
            "    h = next(l.split()[1] for l in f if l.startswith('VmHWM:'))\n"
            "open(sys.argv[1], 'w').write(h)\n")
    run([str(PYTHON), "-c", code, str(out)], timeout=QUICK_TIMEOUT)
    return int(out.read_text())


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    def first_line(argv: list[str]) -> str:
        try:
            done = run(argv, timeout=QUICK_TIMEOUT, check=False)
        except (BenchError, OSError):
            return "unknown"
        return done.output.strip().splitlines()[0] if done.output.strip() else "unknown"

    commit = first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--", "guest"],
                timeout=QUICK_TIMEOUT, check=False).output.strip()
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": model,
        "memory": mem,
        "kernel": platform.release(),
        "os": _os_release(),
        "python": first_line([str(PYTHON), "--version"]),
        "cp": first_line(["cp", "--version"]),
        "ldconfig": first_line(["ldconfig", "--version"]),
        "filesystem": f"tmpfs (size={TMPFS_SIZE}, mounted by the benchmark)",
        "product": first_line([str(TOOL), "--version"]),
        "commit": commit + (" + uncommitted changes in guest/" if dirty else ""),
        "loadavg_start": round(os.getloadavg()[0], 2),
    }


def _os_release() -> str:
    with contextlib.suppress(OSError), open("/etc/os-release") as f:
        for line in f:
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return "unknown"


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds all CPUs spent busy since boot, CPU seconds of this process and its
    waited-for descendants): their difference over a period is other people's load."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    ours = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return busy, ours


def _check_memory(need_gib: float) -> None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) / (1 << 20)
                if have < need_gib:
                    raise BenchError(f"needs about {need_gib:g} GiB of free memory for its "
                                     f"tmpfs, {have:.1f} GiB available")


def metrics_dir(bench: Bench) -> Path:
    """node_exporter's textfile directory under the machine (the config's default
    `metrics_dir`): the tool writes metrics exactly when it exists."""
    return bench.root / "var/lib/prometheus/node-exporter"


def set_metrics(bench: Bench, on: bool) -> None:
    if on:
        metrics_dir(bench).mkdir(parents=True, exist_ok=True)
    else:
        shutil.rmtree(metrics_dir(bench), ignore_errors=True)


def benchmark(pairs: int, pairs_x2: int, rounds_version: int,
              pairs_xfs: int, pairs_metrics: int) -> dict[str, Any]:
    _check_memory(6.0)
    info = machine_info()
    if info["loadavg_start"] > 0.7:
        log(f"load average {info['loadavg_start']} at start: other work competes for the "
            "2 cores; alternation keeps the ratios fair, absolute times suffer")
    series: dict[str, Series] = {k: Series() for k in (
        "version", "python_pass", "module_version", "cold", "warm", "baseline", "cold_30k",
        "cold_x1", "cold_x2", "baseline_x1", "baseline_x2", "cold_same_fs", "cold_xfs",
        "baseline_same_fs", "baseline_xfs", "cold_metrics_off", "cold_metrics_on",
        "warm_metrics_off", "warm_metrics_on")}
    rss: dict[str, list[Rss]] = {"x1": [], "x2": []}
    payload: dict[str, int] = {}
    entries: dict[str, int] = {}
    started = time.monotonic()
    busy_start, ours_start = _busy_seconds()

    with tmpfs(TMPFS_SIZE) as mnt:
        use_pycache(mnt / "pycache")
        scripts = mnt / "scripts"
        scripts.mkdir()
        log(f"--version vs python -c pass: {rounds_version} alternating rounds")
        version_cmds = {
            "version": [str(TOOL), "--version"],
            "python_pass": [str(PYTHON), "-c", "pass"],
            "module_version": [str(PYTHON), "-m", "unbounded_nvidia_setup", "--version"],
        }
        for cmd in version_cmds.values():  # fill the bytecode and page caches
            run(cmd, timeout=QUICK_TIMEOUT)
        for _ in range(rounds_version):
            for key, cmd in version_cmds.items():
                series[key].samples.append(run(cmd, timeout=QUICK_TIMEOUT).seconds)

        small = build_machine(mnt, "staging3k", 1.0, SMALL_STAGING)
        large = build_machine(mnt, "staging30k", 1.0, LARGE_STAGING)
        for bench in (small, large):
            prepare(bench, scripts)
        payload["x1"] = small.payload_bytes
        entries["small"], entries["large"] = small.staging_entries, large.staging_entries
        floor_kib = python_floor_rss(scripts)

        log(f"cold / warm / baseline / cold with 30k entries: {pairs} alternating rounds")
        for i in range(pairs):
            series["cold"].samples.append(timed_cold(small))
            series["warm"].samples.append(run(small.tool_argv()).seconds)
            series["baseline"].samples.append(timed_baseline(small))
            series["cold_30k"].samples.append(timed_cold(large))
            log(f"  round {i + 1}: cold {series['cold'].samples[-1]:.2f} s, warm "
                f"{series['warm'].samples[-1]:.2f} s, baseline "
                f"{series['baseline'].samples[-1]:.2f} s, cold 30k "
                f"{series['cold_30k'].samples[-1]:.2f} s")
        remove_machine(large)

        # Metrics on (node_exporter's directory exists) vs off (it does not: no file, no
        # error), cold and warm, the order flipped every round.
        log(f"metrics on / off: cold and warm, {pairs_metrics} alternating rounds")
        for i in range(pairs_metrics):
            for on in (False, True) if i % 2 == 0 else (True, False):
                set_metrics(small, on)
                key = "on" if on else "off"
                series[f"cold_metrics_{key}"].samples.append(timed_cold(small))
                series[f"warm_metrics_{key}"].samples.append(run(small.tool_argv()).seconds)
            log(f"  round {i + 1}: cold {series['cold_metrics_off'].samples[-1]:.3f} s / "
                f"{series['cold_metrics_on'].samples[-1]:.3f} s, warm "
                f"{series['warm_metrics_off'].samples[-1]:.3f} s / "
                f"{series['warm_metrics_on'].samples[-1]:.3f} s (metrics off / on)")
        if not any(metrics_dir(small).glob("*.prom")):
            raise BenchError("the tool wrote no metrics file with metrics on")
        set_metrics(small, False)

        log(f"staging on another filesystem: cold and baseline, same-fs / cross-fs, "
            f"{pairs_xfs} alternating rounds")
        prepare_cross_filesystem(small)
        for i in range(pairs_xfs):
            series["cold_same_fs"].samples.append(timed_cold(small))
            with other_filesystem(small):
                series["cold_xfs"].samples.append(timed_cold(small))
            series["baseline_same_fs"].samples.append(timed_baseline(small))
            with other_filesystem(small):
                series["baseline_xfs"].samples.append(timed_baseline(small))
            log(f"  round {i + 1}: cold {series['cold_same_fs'].samples[-1]:.2f} s / "
                f"{series['cold_xfs'].samples[-1]:.2f} s, baseline "
                f"{series['baseline_same_fs'].samples[-1]:.2f} s / "
                f"{series['baseline_xfs'].samples[-1]:.2f} s (same-fs / cross-fs)")

        # Payload growth: the x1 machine again, alternating with one whose files are twice
        # as large (same names, same staging entries), so both sizes see the same load.
        double = build_machine(mnt, "scale2", 2.0, SMALL_STAGING)
        prepare(double, scripts)
        payload["x2"] = double.payload_bytes
        log(f"payload x1 / x2: cold and baseline, {pairs_x2} alternating rounds")
        for i in range(pairs_x2):
            series["cold_x1"].samples.append(timed_cold(small))
            series["cold_x2"].samples.append(timed_cold(double))
            series["baseline_x1"].samples.append(timed_baseline(small))
            series["baseline_x2"].samples.append(timed_baseline(double))
            log(f"  round {i + 1}: cold {series['cold_x1'].samples[-1]:.2f} s / "
                f"{series['cold_x2'].samples[-1]:.2f} s, baseline "
                f"{series['baseline_x1'].samples[-1]:.2f} s / "
                f"{series['baseline_x2'].samples[-1]:.2f} s")
        for _ in range(3):
            rss["x1"].append(peak_rss(small, scripts))
            rss["x2"].append(peak_rss(double, scripts))
        remove_machine(small)
        remove_machine(double)

    info["loadavg_end"] = round(os.getloadavg()[0], 2)
    info["bench_seconds"] = round(time.monotonic() - started, 1)
    busy_end, ours_end = _busy_seconds()
    other = (busy_end - busy_start) - (ours_end - ours_start)
    info["other_cpu_percent"] = round(
        max(0.0, 100 * other / (info["bench_seconds"] * info["nproc"])), 1)
    if info["other_cpu_percent"] > 10:
        log(f"other processes used {info['other_cpu_percent']}% of the CPUs during the "
            "benchmark: figures that rely on the second core (cold/baseline) suffer most")
    return summarize(info, series, rss, floor_kib, payload, entries,
                     {"pairs": pairs, "pairs_x2": pairs_x2, "rounds_version": rounds_version,
                      "pairs_xfs": pairs_xfs, "pairs_metrics": pairs_metrics})


def summarize(info: dict[str, Any], series: dict[str, Series], rss: dict[str, list[Rss]],
              floor_kib: int, payload: dict[str, int], entries: dict[str, int],
              rounds: dict[str, int]) -> dict[str, Any]:
    med = {k: s.median for k, s in series.items()}
    rss_x1 = statistics.median(r.kib for r in rss["x1"]) * 1024 / MB
    rss_x2 = statistics.median(r.kib for r in rss["x2"]) * 1024 / MB
    figures = {
        "cold_baseline": med["cold"] / med["baseline"],
        "warm_cold": med["warm"] / med["cold"],
        "scan": med["cold_30k"] / med["cold"],
        "rss_mb": rss_x1,
        "rss_x2_mb": rss_x2,
        "rss_growth": rss_x2 / rss_x1,
        "version": med["version"] / med["python_pass"],
    }
    grown_gb = (payload["x2"] - payload["x1"]) / 1e9
    cold_per_gb = (med["cold_x2"] - med["cold_x1"]) / grown_gb
    extra = {
        "cold_baseline_x1_phase2": med["cold_x1"] / med["baseline_x1"],
        "cold_baseline_x2": med["cold_x2"] / med["baseline_x2"],
        "module_version_ratio": med["module_version"] / med["python_pass"],
        "cold_x2_over_x1": med["cold_x2"] / med["cold_x1"],
        "baseline_x2_over_x1": med["baseline_x2"] / med["baseline_x1"],
        "cold_seconds_per_gb": cold_per_gb,
        "baseline_seconds_per_gb": (med["baseline_x2"] - med["baseline_x1"]) / grown_gb,
        "cold_fixed_seconds": med["cold_x1"] - payload["x1"] / 1e9 * cold_per_gb,
        "scan_ms_per_1000_entries": (med["cold_30k"] - med["cold"]) * 1000
        / ((entries["large"] - entries["small"]) / 1000),
        "python_floor_rss_mb": floor_kib * 1024 / MB,
        "per_pair_cold_baseline": statistics.median(
            c / b for c, b in zip(series["cold"].samples, series["baseline"].samples,
                                  strict=True)),
        "cold_xfs_over_same_fs": med["cold_xfs"] / med["cold_same_fs"],
        "baseline_xfs_over_same_fs": med["baseline_xfs"] / med["baseline_same_fs"],
        "cold_baseline_same_fs_phase": med["cold_same_fs"] / med["baseline_same_fs"],
        "cold_baseline_xfs": med["cold_xfs"] / med["baseline_xfs"],
        "cold_metrics_on_over_off": med["cold_metrics_on"] / med["cold_metrics_off"],
        "warm_metrics_on_over_off": med["warm_metrics_on"] / med["warm_metrics_off"],
    }
    targets = [{"key": key, "label": label, "value": round(figures[key], 4), "limit": limit,
                "pass": figures[key] <= limit} for key, label, limit in TARGETS]
    line = (f"cold/baseline {figures['cold_baseline']:.2f} ({med['cold']:.2f} s / "
            f"{med['baseline']:.2f} s) warm/cold {figures['warm_cold']:.2f} "
            f"({med['warm']:.2f} s) scan {figures['scan']:.2f} ({med['cold_30k']:.2f} s / "
            f"{med['cold']:.2f} s) rss {rss_x1:.1f} MB (x2 payload {rss_x2:.1f} MB) "
            f"version {figures['version']:.2f}x ({med['version'] * 1000:.1f} ms / "
            f"{med['python_pass'] * 1000:.1f} ms) cross-fs cold/baseline "
            f"{extra['cold_baseline_xfs']:.2f} ({med['cold_xfs']:.2f} s / "
            f"{med['baseline_xfs']:.2f} s; same-fs in those rounds "
            f"{extra['cold_baseline_same_fs_phase']:.2f}) metrics on/off cold "
            f"{extra['cold_metrics_on_over_off']:.3f} warm "
            f"{extra['warm_metrics_on_over_off']:.3f}")
    return {
        "summary": line,
        "machine": info,
        "rounds": rounds,
        "staging_entries": entries,
        "payload_bytes": payload,
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "extra": {k: round(v, 4) for k, v in extra.items()},
        "targets": targets,
        "medians_seconds": {k: round(v, 4) for k, v in med.items()},
        "samples_seconds": {k: [round(x, 4) for x in s.samples] for k, s in series.items()},
        "rss_kib": {k: [{"vmhwm": r.kib, "polled": r.polled_kib, "seconds": round(r.seconds, 3)}
                        for r in v] for k, v in rss.items()},
    }


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


# --------------------------------------------------------------------------------------
# --profile


def timeline(bench: Bench) -> list[str]:
    """One cold run with each log line stamped with when it arrived."""
    reset(bench)
    lines: list[str] = []
    start = time.perf_counter()
    proc = subprocess.Popen(bench.tool_argv(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=_child_env())
    timer = threading.Timer(RUN_TIMEOUT, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            text = raw.decode(errors="replace").rstrip()
            lines.append(f"  +{time.perf_counter() - start:6.3f} s  {text}")
        proc.wait()
    finally:
        timer.cancel()
        _kill(proc)
    lines.append(f"  +{time.perf_counter() - start:6.3f} s  (exit {proc.returncode})")
    return lines


_IMPORT = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


def _imports(output: str) -> list[tuple[int, int, int, str]]:
    """(self us, cumulative us, depth, module) per `-X importtime` line."""
    rows = []
    for line in output.splitlines():
        m = _IMPORT.match(line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)))
    return rows


def import_costs(bench: Bench, top: int) -> list[str]:
    reset(bench)
    rows = _imports(run([str(PYTHON), "-X", "importtime", str(TOOL), "--root", str(bench.root),
                         "run"]).output)
    startup = _imports(run([str(PYTHON), "-X", "importtime", "-c", "pass"],
                           timeout=QUICK_TIMEOUT).output)
    version = _imports(run([str(PYTHON), "-X", "importtime", str(TOOL), "--version"],
                           timeout=QUICK_TIMEOUT).output)
    before = {r[3] for r in startup}
    out = [f"  cold run: all imports {sum(r[0] for r in rows) / 1000:.1f} ms ({len(rows)} "
           f"modules); `python -c pass` imports {sum(r[0] for r in startup) / 1000:.1f} ms",
           "  top-level imports of the run by cumulative time:"]
    outer = sorted((r for r in rows if r[2] == 1), key=lambda r: -r[1])[:top]
    out += [f"    {r[1] / 1000:7.1f} ms  {r[3]}" for r in outer]
    out.append("  any depth, by cumulative time (nested imports are part of their parent):")
    out += [f"    {r[1] / 1000:7.1f} ms  {'  ' * (r[2] - 1)}{r[3]}"
            for r in sorted(rows, key=lambda r: -r[1])[:top]]
    out.append("  modules by self time:")
    out += [f"    {r[0] / 1000:7.1f} ms  {r[3]}" for r in sorted(rows, key=lambda r: -r[0])[:top]]
    extra = [r for r in version if r[3] not in before]
    out.append(f"  `unbounded-nvidia-setup --version` imports beyond `python -c pass`: "
               f"{sum(r[0] for r in extra) / 1000:.1f} ms")
    out += [f"    {r[0] / 1000:7.1f} ms self  {r[1] / 1000:7.1f} ms cum  {'  ' * (r[2] - 1)}"
            f"{r[3]}" for r in extra]
    return out


def _shown(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def cprofile_costs(bench: Bench, scratch: Path, top: int) -> list[str]:
    # Not `python -m cProfile`: it writes its file after the program returns, which the
    # command never does.
    prof = scratch / "cold.prof"
    run_in_process(bench, prof, """
        profiler.disable()
        profiler.dump_stats(out)
    """, setup="import cProfile\nprofiler = cProfile.Profile()", start="profiler.enable()")
    stats = pstats.Stats(str(prof))
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = (
        stats.stats)  # type: ignore[attr-defined]
    out = ["  the product's functions by cumulative time (main thread only: copies on worker "
           "threads show as the wait in the function that waits for them):"]
    mine = sorted(((cum, calls, path, line, name)
                   for (path, line, name), (_cc, calls, _tt, cum, _callers) in raw.items()
                   if f"{os.sep}unbounded_nvidia_setup{os.sep}" in path),
                  key=lambda r: -r[0])
    out += [f"    {cum * 1000:8.1f} ms  {os.path.basename(path)}:{line}({name}) x{calls}"
            for cum, calls, path, line, name in mine[:top]]
    for sort, label in (("cumulative", "by cumulative time"), ("tottime", "by own time")):
        buf = io.StringIO()
        pstats.Stats(str(prof), stream=buf).strip_dirs().sort_stats(sort).print_stats(top)
        body = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(body) if ln.lstrip().startswith("ncalls")), 0)
        out.append(f"  cProfile, top {top} {label}:")
        out += ["    " + ln for ln in body[start:]]
    return out


def components(bench: Bench, scratch: Path, repeat: int) -> list[str]:
    """The parts of a cold run timed on their own (median of `repeat`)."""
    sim = bench.sim
    reset(bench)
    run(bench.tool_argv())  # a live root for nvidia-ctk and ldconfig to work on
    copy_dest = scratch / "copy-dest"
    copy_script = scratch / "copy-only.sh"
    copy_script.write_text("\n".join(["#!/bin/sh", "set -eu",
                                      f"D={shlex.quote(str(copy_dest))}",
                                      *bench.copy_lines]) + "\n")
    ctk_out = scratch / "ctk.yaml"
    ctk = [a if not a.startswith("--output=") else f"--output={ctk_out}"
           for a in bench.ctk_argv]

    def copy_only() -> float:
        reset(bench)  # room on the tmpfs, and freshly freed memory as for the other runs
        if copy_dest.exists():
            shutil.rmtree(copy_dest)
        return run(["/bin/sh", str(copy_script)]).seconds

    parts: list[tuple[str, Callable[[], float]]] = [
        ("python -c pass", lambda: run([str(PYTHON), "-c", "pass"]).seconds),
        ("unbounded-nvidia-setup --version", lambda: run([str(TOOL), "--version"]).seconds),
        ("python -c 'import unbounded_nvidia_setup.cli, .reconcile' (eager imports)",
         lambda: run([str(PYTHON), "-c", "import unbounded_nvidia_setup.cli, "
                      "unbounded_nvidia_setup.reconcile"]).seconds),
        ("nvidia-ctk --version", lambda: run([bench.ctk_argv[0], "--version"]).seconds),
        ("nvidia-ctk cdi generate (same args)", lambda: run(ctk).seconds),
        ("ldconfig -r R", lambda: run([ldconfig_path(), "-r", str(sim.root)]).seconds),
        ("warm run", lambda: run(bench.tool_argv()).seconds),
        ("cp -a of the driver files only", copy_only),
        ("cold run", lambda: timed_cold(bench)),
        ("baseline script", lambda: timed_baseline(bench)),
    ]
    out = [f"  each part alone, median of {repeat} (ms):"]
    for label, measure in parts:
        samples = [measure() for _ in range(repeat)]
        out.append(f"    {statistics.median(samples) * 1000:8.1f}  {label}")
        if copy_dest.exists():
            shutil.rmtree(copy_dest)
    return out


def profile(top: int, repeat: int, entries: int, scale: float) -> None:
    with tmpfs(TMPFS_SIZE) as mnt:
        use_pycache(mnt / "pycache")
        scripts = mnt / "scripts"
        scripts.mkdir()
        bench = build_machine(mnt, f"staging{entries}", scale, entries)
        prepare(bench, scripts)
        sections: list[tuple[str, Callable[[], list[str]]]] = [
            ("timeline of one cold run (log lines as they arrive)", lambda: timeline(bench)),
            ("python -X importtime, one cold run", lambda: import_costs(bench, top)),
            ("cProfile, one cold run", lambda: cprofile_costs(bench, scripts, top)),
            ("components", lambda: components(bench, scripts, repeat)),
        ]
        for title, make in sections:
            print(f"\n== {title}", flush=True)
            print("\n".join(make()), flush=True)
        reset(bench)


# --------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=31,
                        help="alternating rounds at scale 1.0 (default 31)")
    parser.add_argument("--pairs-xfs", type=int, default=11,
                        help="alternating rounds of same-fs and cross-fs cold runs and the "
                             "cross-fs baseline (default 11)")
    parser.add_argument("--pairs-metrics", type=int, default=21,
                        help="alternating rounds of cold and warm runs with metrics off and "
                             "on (default 21)")
    parser.add_argument("--pairs-x2", type=int, default=11,
                        help="alternating rounds of payload x1 and x2 (default 11)")
    parser.add_argument("--version-rounds", type=int, default=60,
                        help="alternating rounds of --version vs python -c pass (default 60)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one cold run instead (timeline, importtime, cProfile, "
                             "parts timed alone); writes no results")
    parser.add_argument("--top", type=int, default=20, help="rows per --profile table")
    parser.add_argument("--entries", type=int, default=SMALL_STAGING,
                        help=f"staging entries of the --profile machine (default {SMALL_STAGING})")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="payload scale of the --profile machine (default 1.0; at most 2)")
    parser.add_argument("--no-write", action="store_true",
                        help="print only; do not write bench/results.{json,md}")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (it mounts a tmpfs and creates device nodes)", file=sys.stderr)
        return 2
    if not TOOL.exists():
        print(f"bench: {TOOL} missing; run `make venv`", file=sys.stderr)
        return 2
    if min(args.pairs, args.pairs_x2, args.version_rounds, args.pairs_xfs,
           args.pairs_metrics) < 1:
        print("bench: rounds must be at least 1", file=sys.stderr)
        return 2
    if not (0 < args.scale <= 2 and 0 < args.entries <= 100_000):
        print("bench: --scale must be in (0, 2], --entries in (0, 100000]", file=sys.stderr)
        return 2
    enter_private_namespace(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, _on_signal)
    signal.alarm(HARD_LIMIT)
    try:
        if args.profile:
            profile(args.top, 3, args.entries, args.scale)
            return 0
        result = benchmark(args.pairs, args.pairs_x2, args.version_rounds, args.pairs_xfs,
                           args.pairs_metrics)
    except BenchError as e:
        print(f"bench: FAILED: {e}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"bench: interrupted ({e or 'SIGINT'}); mounts and processes cleaned up",
              file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    print(result["summary"])
    print("\n".join(render_table(result)))
    if not args.no_write:
        RESULTS_JSON.write_text(json.dumps(result, indent=2) + "\n")
        RESULTS_MD.write_text(render_markdown(result))
        print(f"wrote {RESULTS_JSON.relative_to(REPO)} and {RESULTS_MD.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
