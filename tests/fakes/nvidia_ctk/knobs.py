"""The FAKE_NVIDIA_CTK_* test knobs, which make the stand-in misbehave or pretend on request.

(There is no knob for GPUs: NVML's answers are the driver root's libnvidia-ml's, which on
a simulated machine is tests/simnvml.c, reading the machine's GPUs.)

  FAKE_NVIDIA_CTK_VERSION=1.17.8   version to impersonate (default 1.20.0)
  FAKE_NVIDIA_CTK_LOG=<file>       append ``json.dumps(sys.argv[1:])`` + newline per call
  FAKE_NVIDIA_CTK_HANG=1           ``cdi generate`` sleeps forever before discovery/writing
  FAKE_NVIDIA_CTK_SIGNAL=KILL|SEGV ``cdi generate`` kills itself with that signal
  FAKE_NVIDIA_CTK_CORRUPT=garbage|nokind|wrongkind|nodevices|staging
                                   after a successful generation, write a broken spec
                                   instead (unparsable / no kind / kind example.com/device /
                                   no devices / libcuda's mount hostPath under
                                   /run/host-nvidia/0) and exit 0
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from .edits import MOUNT_OPTIONS
from .filepath import go_join
from .version import DEFAULT_VERSION, Version

CORRUPTIONS = ("garbage", "nokind", "wrongkind", "nodevices", "staging")
GARBAGE_SPEC = '---\ncdiVersion: "0.5.0\nkind: nvidia.com/gpu\ndevices: [\n  {name: all,\n'
STAGING_PREFIX = "/run/host-nvidia/0"


class KnobError(Exception):
    """Misuse of this stand-in's own FAKE_NVIDIA_CTK_* knobs (exit 2)."""


def corruption() -> str:
    """FAKE_NVIDIA_CTK_CORRUPT: how to break the spec that is written ('': not at all)."""
    how = os.environ.get("FAKE_NVIDIA_CTK_CORRUPT", "")
    if how and how not in CORRUPTIONS:
        raise KnobError(f"FAKE_NVIDIA_CTK_CORRUPT={how}: expected one of {CORRUPTIONS}")
    return how


def corrupt(spec: dict[str, Any], how: str) -> dict[str, Any] | str:
    if how == "garbage":
        return GARBAGE_SPEC
    if how == "nokind":
        del spec["kind"]
    elif how == "wrongkind":
        spec["kind"] = "example.com/device"
    elif how == "nodevices":
        spec["devices"] = []
    elif how == "staging":
        mounts = spec["containerEdits"].setdefault("mounts", [])
        target = next((m for m in mounts if "/libcuda.so." in m["containerPath"]), None)
        if target is None:
            target = {
                "containerPath": "/lib/x86_64-linux-gnu/libcuda.so.1",
                "options": list(MOUNT_OPTIONS),
            }
            mounts.append(target)
        target["hostPath"] = go_join(STAGING_PREFIX, posixpath.basename(target["containerPath"]))
    return spec


def apply_process_knobs() -> None:
    """FAKE_NVIDIA_CTK_SIGNAL / FAKE_NVIDIA_CTK_HANG (before anything is discovered/written)."""
    name = os.environ.get("FAKE_NVIDIA_CTK_SIGNAL", "")
    if name:
        signum = {"KILL": signal.SIGKILL, "SEGV": signal.SIGSEGV}.get(name.upper())
        if signum is None:
            raise KnobError(f"FAKE_NVIDIA_CTK_SIGNAL={name}: expected KILL or SEGV")
        sys.stdout.flush()
        sys.stderr.flush()
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)  # also overrides faulthandler's handler
        os.kill(os.getpid(), signum)
        time.sleep(5)  # not reached: the signal is delivered first
    if os.environ.get("FAKE_NVIDIA_CTK_HANG", "") not in ("", "0"):
        while True:
            time.sleep(3600)


def impersonated_version() -> str:
    """FAKE_NVIDIA_CTK_VERSION as given (parse_version checks it)."""
    return os.environ.get("FAKE_NVIDIA_CTK_VERSION", DEFAULT_VERSION)


def parse_version(text: str) -> Version:
    match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+.][0-9A-Za-z.-]*)?", text)
    if not match:
        raise KnobError(f"FAKE_NVIDIA_CTK_VERSION={text!r} is not a version like 1.20.0")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def log_invocation(argv: Sequence[str]) -> None:
    path = os.environ.get("FAKE_NVIDIA_CTK_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(list(argv)) + "\n")
