"""Test copies of the NVIDIA Container Toolkit's nvidia-cdi-refresh units (toolkit >= 1.18).

nvidia-container-toolkit-base installs ``nvidia-cdi-refresh.service`` and
``nvidia-cdi-refresh.path`` in /usr/lib/systemd/system and enables both (its preset); its
``nvidia-ctk cdi generate`` writes ``/var/run/cdi/nvidia.yaml``, which the CDI cache ranks
above our ``/etc/cdi/nvidia.yaml``. nvidia-mig-manager's hooks run ``systemctl restart
nvidia-cdi-refresh.service`` after a MIG reconfiguration.

:data:`SERVICE` and :data:`PATH_UNIT` follow the shape of the toolkit's v1.20 units (its
conditions, start limit, environment, ``ExecCondition=`` on the NVIDIA kernel module in
``modules.dep``, ``nvidia-smi -L`` then the generation, ``Restart=on-failure``, its
capability set), with one change: the generation is a shell that writes
:data:`STAND_IN_TEXT` to the output path the real unit gives nvidia-ctk, so a test sees
at once whether the toolkit's own generation ran. :func:`install` puts them in a rootfs,
enabled, and makes their conditions true there (an ``nvidia-smi`` stand-in, a
``modules.dep`` naming ``nvidia.ko`` for the running kernel): without our drop-ins they
would run and write that file.
"""

from __future__ import annotations

import os
from pathlib import Path

SERVICE_NAME = "nvidia-cdi-refresh.service"
PATH_NAME = "nvidia-cdi-refresh.path"
OUTPUT = "/var/run/cdi/nvidia.yaml"
STAND_IN_TEXT = "stand-in\n"
UNIT_DIR = "usr/lib/systemd/system"

SERVICE = f"""\
# Test copy of the NVIDIA Container Toolkit's unit (v1.20 shape); only the generation
# is a stand-in that writes {OUTPUT} the way `nvidia-ctk cdi generate` would.
[Unit]
Description=Refresh NVIDIA CDI specification file (test copy)
ConditionPathExists=|/usr/bin/nvidia-smi
ConditionPathExists=|/usr/sbin/nvidia-smi
ConditionPathExists=|/usr/lib/wsl/lib/nvidia-smi
ConditionPathExists=/usr/bin/nvidia-ctk
StartLimitBurst=5
StartLimitIntervalSec=10s

[Service]
Type=oneshot
Environment=NVIDIA_CTK_CDI_OUTPUT_FILE_PATH={OUTPUT}
EnvironmentFile=-/etc/nvidia-container-toolkit/nvidia-cdi-refresh.env
ExecCondition=/bin/sh -c '/usr/bin/grep -qE "/(nvidia|nvidia-current)[.]ko" \\
    /lib/modules/%v/modules.dep || [ -e /dev/dxg ]'
ExecStart=/bin/sh -c '/usr/bin/nvidia-smi -L || /usr/sbin/nvidia-smi -L'
ExecStart=/bin/sh -c 'mkdir -p /var/run/cdi && echo stand-in > "$$NVIDIA_CTK_CDI_OUTPUT_FILE_PATH"'
CapabilityBoundingSet=CAP_SYS_MODULE CAP_SYS_ADMIN CAP_MKNOD
Restart=on-failure
RestartSec=1s

[Install]
WantedBy=multi-user.target
"""

PATH_UNIT = """\
# Test copy of the NVIDIA Container Toolkit's path unit (v1.20 shape).
[Unit]
Description=Trigger CDI refresh on NVIDIA driver or toolkit install / upgrade events (test copy)

[Path]
PathChanged=/lib/modules/%v/modules.dep
PathChanged=/lib/modules/%v/modules.dep.bin
PathChanged=/usr/bin/nvidia-ctk

[Install]
WantedBy=multi-user.target
"""

NVIDIA_SMI = """\
#!/bin/sh
# Test stand-in for nvidia-smi in /usr/bin (the toolkit unit's condition and first step).
echo "GPU 0: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)"
"""


def install(root: Path, *, nvidia_ctk: bool = True) -> None:
    """Both units in ``root``'s /usr/lib/systemd/system, enabled as the toolkit's preset
    does, with what makes them run: /usr/bin/nvidia-smi, a ``modules.dep`` naming
    ``nvidia.ko`` for the running kernel (a machine shares the host's), and with
    ``nvidia_ctk`` a do-nothing /usr/bin/nvidia-ctk when there is none."""
    unit_dir = root / UNIT_DIR
    (unit_dir / SERVICE_NAME).write_text(SERVICE)
    (unit_dir / PATH_NAME).write_text(PATH_UNIT)
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in (SERVICE_NAME, PATH_NAME):
        link = wants / unit
        if not link.is_symlink():
            link.symlink_to(f"/{UNIT_DIR}/{unit}")
    smi = root / "usr/bin/nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    ctk = root / "usr/bin/nvidia-ctk"
    if nvidia_ctk and not ctk.exists():
        ctk.write_text("#!/bin/sh\nexit 0\n")
        ctk.chmod(0o755)
    modules = root / "lib/modules" / os.uname().release
    modules.mkdir(parents=True, exist_ok=True)
    (modules / "modules.dep").write_text("kernel/drivers/video/nvidia.ko:\n")
