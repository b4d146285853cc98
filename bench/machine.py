"""The simulated machines and their payload, the user's baseline script, a reboot's reset.

Machines come from tests/simgpu.py (real gcc-built ELF objects with the names, SONAMEs
and sizes of a 550 datacenter driver, ~0.8 GB of staging at scale 1.0) and use the
nvidia-ctk stand-in tests/fakes/nvidia-ctk in its default mode, NVML (the simulated
libnvidia-ml, tests/simnvml.c, answers for the GPUs), as a GPU node runs. The host library
dir is topped up with unrelated entries (hard links of a real unrelated library plus
their SONAME symlinks) to 3,000 or 30,000 directory entries; hard links cost no tmpfs
space, and the tool must decide by name without opening them anyway."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.proc import QUICK_TIMEOUT, TOOL, BenchError, ldconfig_path, log, run

import simgpu

GIB = 1 << 30
SMALL_STAGING = 3_000
LARGE_STAGING = 30_000


@dataclass
class Bench:
    """One simulated machine and what the benchmark learned about it."""

    label: str
    sim: simgpu.SimMachine
    staging_entries: int
    payload_bytes: int = 0
    baseline: Path | None = None  # the user's script for this machine
    ctk_argv: list[str] = field(default_factory=list)  # as the tool ran it
    copy_lines: list[str] = field(default_factory=list)  # the baseline's copy, into "$D"

    @property
    def root(self) -> Path:
        return self.sim.root

    def tool_argv(self) -> list[str]:
        return [str(TOOL), "--root", str(self.root), "run"]


def count_entries(dirs: Sequence[Path]) -> int:
    total = 0
    for top in dirs:
        for _dir, subdirs, files in os.walk(top):
            total += len(subdirs) + len(files)
    return total


def build_machine(parent: Path, label: str, scale: float, entries: int) -> Bench:
    """simgpu's realistic machine, its host library dir topped up to `entries` entries
    (all staging dirs counted) with unrelated libraries and their SONAME links."""
    start = time.monotonic()
    root = parent / label
    sim = simgpu.make_machine(root, scale=scale, unrelated=40)
    sim.write_config()
    existing = count_entries(sim.staging)
    source = sim.lib_dir / "libz.so.1.2.13"  # a real unrelated ELF library (200 KB x scale)
    if not source.is_file():
        raise BenchError(f"simgpu no longer makes {source.name}; adjust bench/machine.py")
    i = 0
    while existing < entries:
        name = f"libsimfill{i}.so.{i % 9}.{i % 7}.{i % 5}"
        os.link(source, sim.lib_dir / name)
        existing += 1
        if existing < entries:
            os.symlink(name, sim.lib_dir / f"libsimfill{i}.so.{i % 9}")
            existing += 1
        i += 1
    bench = Bench(label, sim, count_entries(sim.staging))
    log(f"machine {label}: scale {scale:g}, {bench.staging_entries} staging entries, "
        f"{tree_bytes(root) / GIB:.2f} GiB ({time.monotonic() - start:.1f} s)")
    return bench


def tree_bytes(root: Path) -> int:
    seen: set[int] = set()
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(directory, name))
            if st.st_ino not in seen and not os.path.islink(os.path.join(directory, name)):
                seen.add(st.st_ino)
                total += st.st_size
    return total


def reset(bench: Bench) -> None:
    """What a reboot clears: the driver root (and any generation), the spec (as the brief
    asks), ld.so.cache and the tool's work dir. The ld.so.conf.d drop-in stays (/etc)."""
    nvidia = bench.root / "run" / "nvidia"
    if nvidia.is_dir():
        for name in os.listdir(nvidia):
            path = nvidia / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    work = bench.root / "run" / "unbounded-nvidia-setup"
    if work.exists():
        shutil.rmtree(work)
    for path in (bench.sim.cdi_spec, bench.root / "etc" / "ld.so.cache"):
        path.unlink(missing_ok=True)


def tree_names(root: Path) -> dict[str, str]:
    """Files and links below `root`: relative path -> "f" or "l <final target name>"."""
    result: dict[str, str] = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                real = Path(os.path.realpath(path))
                if not real.is_file() or not real.is_relative_to(root.resolve()):
                    raise BenchError(f"{path} does not resolve to a file in {root}")
                result[rel] = f"l {real.name}"
            else:
                result[rel] = "f"
    return result


def expected_names(sim: simgpu.SimMachine) -> dict[str, str]:
    libdir = f"lib/{sim.multiarch}"
    want = {f"{libdir}/{n}": "f" for n in sim.expected_libs}
    want |= {f"{libdir}/{n}": f"l {Path(t).name}" for n, t in sim.expected_links.items()}
    want |= {f"usr/bin/{h}": "f" for h in sim.helpers}
    want |= {f"lib/firmware/{f}": "f" for f in sim.firmware}
    return want


def check_tool_tree(bench: Bench) -> None:
    have = tree_names(bench.sim.driver_root)
    want = expected_names(bench.sim)
    if have != want:
        extra = sorted(set(have) - set(want))[:5]
        missing = sorted(set(want) - set(have))[:5]
        differ = sorted(k for k in set(want) & set(have) if want[k] != have[k])[:5]
        raise BenchError(f"the tool built an unexpected driver root for {bench.label}: "
                         f"missing {missing}, extra {extra}, different {differ}")
    bench.payload_bytes = sum(
        (bench.sim.driver_root / rel).stat().st_size for rel, kind in have.items()
        if kind == "f")


def _staging_source(sim: simgpu.SimMachine, rel: str) -> Path:
    libdir = f"lib/{sim.multiarch}/"
    if rel.startswith(libdir):
        return sim.lib_dir / rel.removeprefix(libdir)
    if rel.startswith("usr/bin/") and sim.bin_dir is not None:
        return sim.bin_dir / rel.removeprefix("usr/bin/")
    if rel.startswith("lib/firmware/") and sim.firmware_dir is not None:
        return sim.firmware_dir / rel.removeprefix("lib/firmware/")
    raise BenchError(f"no staging source for {rel}")



def ctk_argv_from_log(output: str) -> list[str]:
    """The `nvidia-ctk cdi generate` command line exactly as the tool logged it."""
    for line in output.splitlines():
        _, sep, command = line.partition("running: ")
        if sep and " cdi generate " in command:
            return shlex.split(command)
    raise BenchError("the tool did not log its `nvidia-ctk cdi generate` command line")


def write_baseline(bench: Bench, directory: Path) -> Path:
    """The ExecStart= script a user would write: cp -a exactly the files and links the
    tool put in its root (grouped per destination dir), the same nvidia-ctk command line
    (output straight to /etc/cdi), ldconfig -r. The ld.so.conf.d drop-in the tool wrote
    stays in /etc across boots, as the user's own would."""
    sim = bench.sim
    driver = sim.driver_root
    groups: dict[str, list[str]] = {}
    links: list[tuple[str, str]] = []
    for rel in sorted(tree_names(driver)):
        source = _staging_source(sim, rel)
        if (driver / rel).is_symlink() and not source.is_symlink():
            links.append((os.readlink(driver / rel), rel))  # the host has no such link
        else:
            groups.setdefault(str(Path(rel).parent), []).append(str(source))
    argv = []
    for arg in bench.ctk_argv:
        if arg.startswith("--output="):
            arg = f"--output={sim.cdi_spec}"
        elif arg.startswith(("--driver-root=", "--dev-root=")):
            value = arg.partition("=")[2]
            if value not in (str(sim.driver_root), str(sim.root)):
                raise BenchError(f"unexpected {arg} in the tool's nvidia-ctk command")
        argv.append(arg)
    q = shlex.quote
    copy = ["mkdir -p " + " ".join(f'"$D"/{q(d)}' for d in sorted(groups))]
    for dest, sources in sorted(groups.items()):
        copy.append("cp -a " + " ".join(q(s) for s in sources) + f' "$D"/{q(dest)}/')
    for target, rel in links:
        copy.append(f'ln -s {q(target)} "$D"/{q(rel)}')
    bench.copy_lines = copy
    lines = [
        "#!/bin/sh",
        "# What a user would otherwise write as ExecStart= (bench/run.py).",
        "set -eu",
        f"D={q(str(driver))}",
        *copy,
        f"mkdir -p {q(str(sim.cdi_spec.parent))}",
        shlex.join(argv),
        f"{q(ldconfig_path())} -r {q(str(sim.root))}",
    ]
    script = directory / f"baseline-{bench.label}.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def check_baseline_tree(bench: Bench) -> None:
    """The script's result is usable: the same names as the tool's root, every link
    resolving inside it, a spec naming libcuda in the root, an ld.so.cache with libcuda."""
    have = tree_names(bench.sim.driver_root)
    want = expected_names(bench.sim)
    if have != want:
        raise BenchError(f"the baseline script built a different tree for {bench.label}")
    spec = bench.sim.cdi_spec.read_text()
    if f"{bench.sim.driver_lib_dir}/libcuda.so.{bench.sim.version}" not in spec:
        raise BenchError("the baseline's spec does not mount libcuda from the root")
    cache = (bench.root / "etc" / "ld.so.cache").read_bytes()
    if b"libcuda.so.1" not in cache:
        raise BenchError("the baseline's ldconfig did not cache libcuda.so.1")


def prepare(bench: Bench, scripts: Path) -> None:
    """Untimed warm-up: a cold and a warm run of the tool (and check its tree), then the
    baseline once (and check its tree), whose root stays until the first timed run."""
    reset(bench)
    first = run(bench.tool_argv())
    check_tool_tree(bench)
    bench.ctk_argv = ctk_argv_from_log(first.output)
    run(bench.tool_argv())
    check_tool_tree(bench)
    bench.baseline = write_baseline(bench, scripts)
    reset(bench)
    run(["/bin/sh", str(bench.baseline)])
    check_baseline_tree(bench)


@contextlib.contextmanager
def other_filesystem(bench: Bench) -> Iterator[Path]:
    """/run/nvidia of `bench` on a tmpfs of its own while the block runs, as on a node
    where staging is the host's filesystem. The root the previous run left is deleted
    first (a mount over it would hide it, not free it)."""
    reset(bench)
    nvidia = bench.root / "run" / "nvidia"
    nvidia.mkdir(parents=True, exist_ok=True)
    run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0755", "tmpfs", str(nvidia)],
        timeout=QUICK_TIMEOUT)
    try:
        if os.stat(nvidia).st_dev == os.stat(bench.sim.lib_dir).st_dev:
            raise BenchError(f"{nvidia} is still on the staging's filesystem")
        yield nvidia
    finally:
        if run(["umount", str(nvidia)], timeout=QUICK_TIMEOUT, check=False).returncode != 0:
            run(["umount", "-l", str(nvidia)], timeout=QUICK_TIMEOUT, check=False)


def prepare_cross_filesystem(bench: Bench) -> None:
    """Untimed: the tool and the baseline build the same trees across filesystems."""
    with other_filesystem(bench):
        run(bench.tool_argv())
        check_tool_tree(bench)
    with other_filesystem(bench):
        assert bench.baseline is not None
        run(["/bin/sh", str(bench.baseline)])
        check_baseline_tree(bench)


def remove_machine(bench: Bench) -> None:
    shutil.rmtree(bench.root)


def metrics_dir(bench: Bench) -> Path:
    """node_exporter's textfile directory under the machine (the config's default
    `metrics_dir`): the tool writes metrics exactly when it exists."""
    return bench.root / "var/lib/prometheus/node-exporter"


def set_metrics(bench: Bench, on: bool) -> None:
    if on:
        metrics_dir(bench).mkdir(parents=True, exist_ok=True)
    else:
        shutil.rmtree(metrics_dir(bench), ignore_errors=True)
