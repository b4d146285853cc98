"""The CDI spec: generate with nvidia-ctk, validate, install atomically."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import log
from .config import Machine, load_yaml
from .ldconf import write_atomically
from .log import die
from .run import Result, Started, find_program, run, start
from .spec import KIND, spec_problems
from .tree import remove_tree

# Hooks a GPU pod needs from this root; the rest (cuda-compat, chmod, …) change container
# content we do not own. The flags exist from nvidia-ctk 1.18.
HOOK_FLAGS = ["--disable-hook", "all", "--enable-hook", "create-symlinks",
              "--enable-hook", "update-ldcache"]
HOOKS_SINCE = (1, 18)
_VERSION = re.compile(r"version\s+v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class Ctk:
    exe: str
    version: tuple[int, int, int]


def version_probe(machine: Machine) -> tuple[str, Started]:
    """Start `nvidia-ctk --version`: it runs while the driver root is built, and its answer
    is needed before anything live changes."""
    exe = find_program(machine.config.nvidia_ctk, "nvidia_ctk")
    return exe, start([exe, "--version"], timeout=machine.config.nvidia_ctk_timeout_seconds)


def parse_version(exe: str, result: Result) -> Ctk:
    m = _VERSION.search(result.stdout)
    if not result.ok or not m:
        die(f"cannot tell the version of {exe} ({result.why() if not result.ok else 'no version'})",
            hint="install a working NVIDIA Container Toolkit")
    return Ctk(exe, (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)))


def generate_argv(machine: Machine, ctk: Ctk, output: Path) -> list[str]:
    argv = [ctk.exe, "cdi", "generate", f"--driver-root={machine.driver_root}",
            f"--dev-root={machine.root}", "--format=yaml", f"--output={output}"]
    if ctk.version >= HOOKS_SINCE:
        argv += HOOK_FLAGS
    return argv + list(machine.config.nvidia_ctk_args)


def generate(machine: Machine, ctk: Ctk, driver_version: str, helpers: tuple[str, ...]) -> bytes:
    """A validated spec for the live driver root. Generated outside /etc/cdi: nvidia-ctk
    appends `.yaml` to other names, and containerd must never see a half-written spec."""
    timeout = machine.config.nvidia_ctk_timeout_seconds
    # A fixed work dir under /run (we hold the lock): a run killed mid-way leaves nothing
    # that the next run does not remove.
    work = machine.work_dir
    remove_tree(work)
    try:
        work.mkdir(mode=0o700, parents=True)
    except OSError as e:
        die(f"cannot create {work}: {e.strerror}", hint="/run must be writable for root")
    try:
        output = work / "nvidia.yaml"
        result = run(generate_argv(machine, ctk, output), timeout=timeout)
        if not result.ok:
            die(f"nvidia-ctk cdi generate failed ({result.why()})",
                hint="the previous driver root and spec were kept; see the journal for its "
                     "output")
        try:
            data = output.read_bytes()
        except OSError:
            die(f"nvidia-ctk cdi generate wrote no spec at {output}",
                hint="check the nvidia_ctk_args in the config")
    finally:
        remove_tree(work)
    import yaml

    try:
        doc = load_yaml(data)
    except yaml.YAMLError:
        die("nvidia-ctk wrote a spec that is not valid YAML; it was not installed",
            hint="check the NVIDIA Container Toolkit version")
    problems = spec_problems(doc, machine, code="spec", where="generated spec", kind=KIND,
                             version=driver_version, helpers=helpers)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        die(f"{problems[0].message}{more}; it was not installed",
            hint="the previous driver root and spec were kept; check the NVIDIA Container "
                 "Toolkit version")
    return data


def install(machine: Machine, data: bytes) -> bool:
    path = machine.cdi_spec
    try:
        changed = write_atomically(path, data)
    except OSError as e:
        die(f"cannot install the CDI spec {path}: {e.strerror}",
            hint=f"make {path.parent} writable for root; the previous driver root and spec "
                 "were kept")
    if changed:
        log.info(f"installed {path}")
    return changed


def remove_shadow(machine: Machine) -> None:
    """nvidia-cdi-refresh (NVIDIA Container Toolkit >= 1.18) writes /var/run/cdi/nvidia.yaml,
    which outranks /etc/cdi for the same device names: a leftover one would win over ours."""
    shadow = machine.at("/var/run/cdi") / machine.cdi_spec.name
    try:
        if os.path.samefile(shadow, machine.cdi_spec):
            return
        shadow.unlink()
    except FileNotFoundError:
        return
    except OSError as e:
        die(f"cannot remove {shadow}: {e.strerror}",
            hint="remove it by hand; it outranks the spec this tool installs")
    log.warn(f"removed {shadow}: it outranked {machine.cdi_spec} (nvidia-cdi-refresh?)")
