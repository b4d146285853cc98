"""`check --root IMAGE` on a machine image that is not running: what can be told offline.

A root whose /proc is empty has no kernel behind it: a stopped or never-booted image
(or a running machine's tree seen from outside, where its /proc is not mounted). Its
driver root, spec and drop-in live in /run and /etc of a machine that runs; an image
holds none of them, and that is no fault. So `check` reports what an image can get
wrong: the package's units and drop-ins present, the setup and its drift check enabled,
and the package dpkg has installed (the config was parsed already). It never advises
`run` or `clean`, which would change the image.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Machine
    from .problems import Problem

SYSTEM = "/usr/lib/systemd/system"
PACKAGE = "unbounded-nvidia-setup"
# The package's units and drop-ins (packaging/debian), and the ones it enables with the
# target that wants them.
FILES = ("unbounded-nvidia-setup.service", "unbounded-nvidia-setup-check.service",
         "unbounded-nvidia-setup-check.timer",
         "containerd.service.d/10-unbounded-nvidia-setup.conf",
         "kubelet.service.d/10-unbounded-nvidia-setup.conf",
         "nvidia-cdi-refresh.service.d/10-unbounded-nvidia-setup.conf",
         "nvidia-cdi-refresh.path.d/10-unbounded-nvidia-setup.conf")
ENABLED = (("unbounded-nvidia-setup.service", "multi-user.target"),
           ("unbounded-nvidia-setup-check.timer", "timers.target"))


def is_image(machine: Machine) -> bool:
    """A `--root` with no kernel's view in it: its /proc missing or empty (a running
    machine's, even one whose /proc/devices cannot be read, has more)."""
    if machine.is_live:
        return False
    try:
        return not os.listdir(machine.at("/proc"))
    except OSError:
        return True


def package_version(machine: Machine) -> str | None:
    """The version dpkg's status file records as installed; None without one."""
    try:
        with open(machine.at("/var/lib/dpkg/status"), "rb") as f:
            text = f.read(1 << 24).decode(errors="replace")
    except OSError:
        return None
    for stanza in text.split("\n\n"):
        fields = dict(line.partition(": ")[::2] for line in stanza.splitlines()
                      if not line.startswith(" "))
        if fields.get("Package") == PACKAGE and "installed" in fields.get("Status", ""):
            return fields.get("Version")
    return None


def report(machine: Machine) -> tuple[dict[str, Any], list[Problem]]:
    """`check`'s `image` section and the image's problems."""
    from .problems import Problem

    root = str(machine.root)
    units: dict[str, str] = {}
    problems = []
    for name in FILES:
        path = machine.at(f"{SYSTEM}/{name}")
        units[name] = "present" if os.path.isfile(path) else "missing"
        if units[name] == "missing":
            problems.append(Problem(
                "image-unit-missing", f"{path} is missing from the image: the package is "
                f"not installed whole; install it with `dpkg --root {root} -i "
                f"{PACKAGE}_<version>_all.deb`", str(path)))
    for name, target in ENABLED:
        link = machine.at(f"/etc/systemd/system/{target}.wants/{name}")
        if units.get(name) == "present" and not os.path.lexists(link):
            units[name] = "disabled"
            problems.append(Problem(
                "image-unit-disabled", f"{name} is not enabled in the image ({link} is "
                f"missing): it would not run at boot; `systemctl --root {root} enable "
                f"{name}`", str(link)))
        elif units.get(name) == "present":
            units[name] = "enabled"
    return {"root": root, "package": package_version(machine), "units": units}, problems
