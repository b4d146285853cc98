"""Child processes bounded in time, the tmpfs in its own mount namespace, shared paths."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
PYTHON = VENV_BIN / "python"
TOOL = VENV_BIN / "unbounded-nvidia-setup"

TMPFS_SIZE = "5g"  # largest phase: x1 and x2 machines with their roots, ~4.4 GB
RUN_TIMEOUT = 300.0  # one tool or baseline run
QUICK_TIMEOUT = 30.0  # --version, python -c pass, helpers
NS_MARK = "UNBOUNDED_NVIDIA_BENCH_NS"


class BenchError(Exception):
    """The benchmark itself broke: exit 1 with this message."""


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


def kill(proc: subprocess.Popen[bytes]) -> None:
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
                                env=env if env is not None else child_env())
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
            kill(proc)
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


def child_env() -> dict[str, str]:
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



def ldconfig_path() -> str:
    return shutil.which("ldconfig", path=child_env()["PATH"]) or "ldconfig"



# --------------------------------------------------------------------------------------
# The tmpfs, in a private mount namespace


def enter_private_namespace(script: Path, argv: list[str]) -> None:
    """Re-exec `script` under `unshare --mount --propagation private`: the tmpfs then lives
    only as long as this process tree, whatever kills it. Falls back to the current
    namespace."""
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
                          sys.executable, str(script), *argv])


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

