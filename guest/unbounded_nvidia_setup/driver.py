"""Discover → plan: the exact driver root the staging mounts call for."""

from __future__ import annotations

from pathlib import Path

from . import discover, log, plan
from .config import Machine
from .discover import Inspected, Staged


def _inspect_all(staged: list[Staged]) -> list[Inspected]:
    return [i for s in staged if (i := discover.inspect(s)) is not None]


def plan_from_staging(machine: Machine, dirs: list[Path], module_version: str | None, *,
                      say: bool = True) -> plan.Plan:
    """The plan the staging calls for. `say`: log what it leaves out, once per run; `check`
    and `status` (False) report it instead (Plan.left_out), so a drift check's tick
    writes nothing to the journal for a staging that did not change."""
    info, warn = (log.info, log.warn) if say else (log.debug, log.debug)
    found = discover.scan(machine, dirs)
    version = plan.driver_version(module_version, found.libraries, found.links)
    stale = plan.stale_versions(version, found.libraries)
    if stale:
        info(f"leaving out stale driver files of {', '.join(sorted(stale))}")
    libraries = _inspect_all(plan.drop_stale(found.libraries, stale))
    for item in libraries:
        elf = item.elf
        if elf is None:
            log.debug(f"ignoring {item.staged.path}: not an ELF file")
        elif elf.bits != 64 or elf.machine != machine.arch:
            log.debug(f"ignoring {item.staged.path}: {elf.bits}-bit {elf.machine}, "
                      f"not 64-bit {machine.arch}")
    # A damaged libcuda or libnvidia-ml refuses the run here, naming the file:
    # select_libraries leaves out what it cannot link, and the run would then call it
    # missing.
    plan.check_required(libraries, version, machine.arch)
    selection = plan.select_libraries(libraries, found.links, version, machine.arch,
                                      machine.config.extra_library_prefixes)
    left_out = [plan.LeftOut(path, why) for path, why in found.ignored] + selection.left_out
    for left in left_out:
        warn(f"ignoring {left.path}: {left.reason}")
    helpers = _inspect_all(found.helpers)
    firmware = [(v, i) for v, s in found.firmware
                if v == version and (i := discover.inspect(s)) is not None]
    return plan.make_plan(selection.chosen, helpers, firmware, version, machine.arch,
                          machine.libdir, tuple(left_out))
