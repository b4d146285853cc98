"""A simulated GPU host carrying the real NVIDIA userspace (tests/realdriver.py) as its
current driver, beside simgpu's stale driver, unrelated libraries and hostile entries."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import realdriver
import simgpu


def real_machine(tmp_path: Path, drv: realdriver.RealDriver, *,
                 keep_hostile: bool = False) -> simgpu.SimMachine:
    """A simulated host whose current driver is replaced by the real one. With
    `keep_hostile`, simgpu's hostile entries and its setuid library stay beside the real
    files, and the machine's expectations are rewritten for the real file set."""
    m = simgpu.make_machine(tmp_path / "root", version=drv.version, hostile=True,
                            stale_versions=("525.147.05",))
    use_real_driver(m, drv, keep_hostile=keep_hostile)
    m.write_config()
    return m


def use_real_driver(m: simgpu.SimMachine, drv: realdriver.RealDriver, *,
                    keep_hostile: bool = False) -> None:
    """Replace the simulated current driver of ``m`` (made with ``version=drv.version``)
    by the real files, hard-linked from the cache; see :func:`real_machine`."""
    for name in [*m.expected_libs, *m.expected_links]:
        path = m.lib_dir / name
        kept = keep_hostile and (name in m.hostile or "setuid" in name)
        if os.path.lexists(path) and not kept:
            path.unlink()
    assert m.bin_dir is not None and m.firmware_dir is not None
    for helper in m.helpers:
        (m.bin_dir / helper).unlink()
    shutil.rmtree(m.firmware_dir / "nvidia" / drv.version)
    realdriver.stage_real_driver(m.lib_dir, drv, bin_dir=m.bin_dir,
                                 firmware_dir=m.firmware_dir, hardlink=True)
    if keep_hostile:
        m.expected_libs = {realdriver._staged_name(p): None for p in drv.libraries}
        m.expected_libs.update({n: s for n, s in m.optional_libs.items() if "setuid" in n})
        m.expected_libs[f"libnvidia-setuid.so.{drv.version}"] = "libnvidia-setuid.so.1"
        m.helpers = sorted(p.name for p in drv.helpers)
