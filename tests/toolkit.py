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


PLUGIN_ENV = "UNB_TEST_DEVICE_PLUGIN"
# NVIDIA's k8s-device-plugin v0.20.0, built from NVIDIA's source, beside the checkout
SHARED_PLUGIN = (Path(__file__).resolve().parent.parent.parent / "shared" / "k8s-device-plugin"
                 / "bin" / "nvidia-device-plugin")


def plugin_binary() -> Path | None:
    """NVIDIA's real ``nvidia-device-plugin``: the one ``UNB_TEST_DEVICE_PLUGIN`` names,
    else ``../shared/k8s-device-plugin/bin/nvidia-device-plugin`` beside the checkout;
    None when that is not an executable file (a fresh clone has no ../shared)."""
    value = os.environ.get(PLUGIN_ENV)
    path = Path(value) if value else SHARED_PLUGIN
    return path if path.is_file() and os.access(path, os.X_OK) else None
