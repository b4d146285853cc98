"""Which NVIDIA Container Toolkit the tests run: the stand-ins, or a real one when asked.

By default every GPU scenario (the simulated machines, the end-to-end pods, the demo and
the boot suite) runs the project's stand-ins, ``tests/fakes/nvidia-ctk`` and
``tests/fakes/nvidia-cdi-hook``: NVIDIA's tools cannot be installed on the test machines.
When ``UNB_TEST_NVIDIA_CTK`` names a real ``nvidia-ctk`` (an absolute path, with its
``nvidia-cdi-hook`` in the same directory), the same scenarios run with the real pair
instead, and the cases that only a stand-in can play (failure injection) skip, each with
its reason (docs/reliability.md, "Real-tool mode").

Both nvidia-ctks write hooks that call the ``nvidia-cdi-hook`` they find on ``PATH``
(NVIDIA's ``ResolveNVIDIACDIHookPath``), so :func:`path_with_hook` puts the chosen hook's
directory first on a ``PATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "UNB_TEST_NVIDIA_CTK"
FAKES = Path(__file__).resolve().parent / "fakes"
STAND_IN_NVIDIA_CTK = FAKES / "nvidia-ctk"
STAND_IN_NVIDIA_CDI_HOOK = FAKES / "nvidia-cdi-hook"


class ToolkitError(RuntimeError):
    """``UNB_TEST_NVIDIA_CTK`` does not name a usable real toolkit."""


def select(value: str | None) -> tuple[Path, Path]:
    """(nvidia-ctk, nvidia-cdi-hook) for a value of ``UNB_TEST_NVIDIA_CTK`` (None or empty:
    the stand-ins)."""
    if not value:
        return STAND_IN_NVIDIA_CTK, STAND_IN_NVIDIA_CDI_HOOK
    ctk = Path(value)
    if not ctk.is_absolute():
        raise ToolkitError(f"{ENV}={value}: not an absolute path (name the real nvidia-ctk)")
    hook = ctk.parent / "nvidia-cdi-hook"
    for tool in (ctk, hook):
        if not (tool.is_file() and os.access(tool, os.X_OK)):
            raise ToolkitError(f"{ENV}={value}: {tool} is not an executable file (the real "
                               "nvidia-ctk with nvidia-cdi-hook beside it is needed)")
    return ctk, hook


NVIDIA_CTK, NVIDIA_CDI_HOOK = select(os.environ.get(ENV))
REAL = NVIDIA_CTK != STAND_IN_NVIDIA_CTK
NAME = f"the real nvidia-ctk ({NVIDIA_CTK})" if REAL else "the nvidia-ctk stand-in"


def path_with_hook(path: str | None = None) -> str:
    """``path`` (default: this process's PATH) with the chosen nvidia-cdi-hook's directory
    first, so that the specs nvidia-ctk writes call that hook."""
    rest = os.environ.get("PATH", "") if path is None else path
    first = str(NVIDIA_CDI_HOOK.parent)
    return first if not rest else f"{first}{os.pathsep}{rest}"


# NVIDIA's real device plugin (k8s-device-plugin), for the tests marked ``device_plugin``
# (tests/test_device_plugin.py): only when UNB_TEST_DEVICE_PLUGIN names it (.ci/run's
# real-tool step does, from ../shared), never found by itself, so that `make test` runs
# the same suite on every machine; without it those tests are deselected (conftest.py).
PLUGIN_ENV = "UNB_TEST_DEVICE_PLUGIN"


def plugin_binary() -> Path | None:
    """The ``nvidia-device-plugin`` that UNB_TEST_DEVICE_PLUGIN names (an absolute path to
    an executable file), or None when it is unset or empty."""
    value = os.environ.get(PLUGIN_ENV)
    if not value:
        return None
    binary = Path(value)
    if not (binary.is_absolute() and binary.is_file() and os.access(binary, os.X_OK)):
        raise ToolkitError(f"{PLUGIN_ENV}={value}: not an absolute path to an executable "
                           "file (name NVIDIA's nvidia-device-plugin)")
    if not REAL:
        # Its spec names NVIDIA's hooks (disable-device-node-modification among them),
        # which the nvidia-cdi-hook stand-in does not run: pods would fail for that.
        raise ToolkitError(f"{PLUGIN_ENV} needs NVIDIA's nvidia-ctk and nvidia-cdi-hook too: "
                           "set UNB_TEST_NVIDIA_CTK as well (.ci/run's real-tool step does)")
    return binary
