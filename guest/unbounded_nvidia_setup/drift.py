"""The drift check's reload on a node that serves fewer GPUs than it has.

Only NVML can tell that a GPU is usable again (a host-side reset), and only a run asks
it, so `check --reload-if-degraded` (the drift check's timer) asks systemd for the
reload that does. Each reload asks NVML again, against a GPU the host may be resetting
(`nvidia-smi -r` needs a GPU without clients), so the asking backs off while nothing
changes (issue 31).
"""

from __future__ import annotations

import os

from . import log, outcome
from .config import Machine
from .log import Failure
from .state import UNIT

# The drift check's reloads on a degraded node back off: each asks NVML again, against
# a GPU the host may be resetting (`nvidia-smi -r` needs a GPU without clients). The
# first is asked at once; then 5 min (the timer's interval), doubling up to an hour. A
# change in what the kernel shows of the GPUs asks at once again.
RELOAD_BACKOFF_SECONDS = 300.0
RELOAD_BACKOFF_MAX_SECONDS = 3600.0


def reload_wait(last: outcome.Outcome) -> float:
    """Seconds after the last asking of NVML before the drift check asks again."""
    attempts = last.gpus.attempts
    if attempts == 0:
        return 0.0
    return min(RELOAD_BACKOFF_SECONDS * 2.0 ** (attempts - 1), RELOAD_BACKOFF_MAX_SECONDS)


def reload_due(last: outcome.Outcome | None, now: float, kernel: str | None) -> bool:
    """Whether the drift check asks for a reload now: the live spec leaves GPUs out,
    and the kernel's view of the GPUs changed or the backoff has passed."""
    if last is None or last.failed or not last.gpus.degraded:
        return False
    if kernel is not None and last.gpus.kernel is not None and kernel != last.gpus.kernel:
        return True
    return now - last.last_attempt >= reload_wait(last)


def ask_for_reload(machine: Machine) -> None:
    """`systemctl reload --no-block` of the setup unit, for the drift check on a degraded
    node: only NVML can tell that a lost GPU is back (a host-side reset), and only a run
    asks it, so the timer's check asks for the reload that does (issue 27). It never
    waits for it; a unit that is not active (a failed boot) cannot be reloaded and says
    so in one warning."""
    if not machine.is_live or not os.path.isdir("/run/systemd/system"):
        log.warn("not the running system under systemd: no reload asked for")
        return
    import shutil

    from .budget import Limit
    from .run import run

    systemctl = shutil.which("systemctl")
    if systemctl is None:
        log.warn("systemctl not found: no reload asked for")
        return
    try:
        result = run([systemctl, "reload", "--no-block", UNIT], limit=Limit(10))
    except Failure as e:
        log.warn(f"could not ask for `systemctl reload {UNIT}`: {e.message}")
        return
    if result.ok:
        log.info(f"degraded: asked for `systemctl reload {UNIT}`, which serves a GPU that "
                 "is back")
    else:
        log.warn(f"`systemctl reload {UNIT}` failed ({result.why()})")
