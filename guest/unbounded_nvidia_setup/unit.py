"""The setup unit as systemd shows it (`systemctl show`), for `check` and `status`: a
pending start or retry, its restarts, its result, and its own last STATUS= (what it
waits for, and how long). Only asked on the running system with systemd as its init."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .log import Failure

if TYPE_CHECKING:
    from .config import Machine

UNIT = "unbounded-nvidia-setup.service"


class Unit:
    """The setup unit as systemd shows it (`systemctl show`): a pending start or retry,
    its restarts, its result, and its own last STATUS= (what it waits for, and how
    long)."""

    __slots__ = ("active", "restarts", "result", "status", "sub")

    def __init__(self, props: dict[str, str]) -> None:
        self.active = props.get("ActiveState", "")
        self.sub = props.get("SubState", "")
        restarts = props.get("NRestarts", "")
        self.restarts = int(restarts) if restarts.isdigit() else 0
        self.result = props.get("Result", "")
        self.status = props.get("StatusText", "")

    @property
    def pending(self) -> bool:
        """A start, or an automatic restart after a failure, is on its way."""
        return self.active == "activating"

    def describe(self) -> str:
        """`activating (auto-restart), retry 3 pending: Failed: …`, as `systemctl
        status` reads."""
        state = f"{self.active} ({self.sub})"
        if self.sub == "auto-restart":
            state += f", retry {self.restarts + 1} pending"
        elif self.active == "activating" and self.restarts:
            state += f", retry {self.restarts}"
        elif self.active == "failed" and self.result:
            state += f", result {self.result}"
        return f"{state}: {self.status}" if self.status else state


def unit_state(machine: Machine) -> Unit | None:
    """The setup unit as systemd shows it, when this is the running system and systemd is
    its init; None otherwise, and whenever systemctl cannot answer (absent, hung, no
    bus): the verdict then rests on the files and the lock alone."""
    if not machine.is_live or not os.path.isdir("/run/systemd/system"):
        return None
    import shutil

    from .budget import Limit
    from .run import run

    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    try:
        result = run([systemctl, "show", "--property=ActiveState,SubState,NRestarts,Result,"
                      "StatusText", UNIT], limit=Limit(10), quiet=True)
    except Failure:
        return None
    props = dict(line.partition("=")[::2] for line in result.stdout.splitlines())
    if not result.ok or not props.get("ActiveState"):
        return None
    return Unit(props)
