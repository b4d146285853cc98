"""Shared fixtures: the real CLI as a subprocess, and simulated GPU machines."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FAKE_CTK = TESTS / "fakes" / "nvidia-ctk"
sys.path.insert(0, str(TESTS))


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def errors(self) -> list[str]:
        return [line for line in self.lines if line.startswith("error: ")]


def invoke(root: Path | None, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> Outcome:
    argv = [sys.executable, "-m", "unbounded_nvidia_setup"]
    if root is not None:
        argv += ["--root", str(root)]
    full_env = {**os.environ, **(env or {})}
    full_env.pop("NOTIFY_SOCKET", None)
    full_env.pop("JOURNAL_STREAM", None)
    proc = subprocess.run([*argv, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    out = Outcome(proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return out


Cli = Callable[..., Outcome]


@pytest.fixture
def cli() -> Cli:
    return invoke


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points a test made; unmounted (lazily) whatever the test's outcome."""
    done: list[Path] = []
    yield done
    for path in reversed(done):
        subprocess.run(["umount", "-l", str(path)], check=False)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, chown)")
