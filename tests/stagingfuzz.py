"""A fuzz of staged driver files (issue 16): ELF headers, DT_SONAME strings and file
names mutated over a real staged driver (tests/realmachine.py) or a simulated one
(tests/simgpu.py), each case run through the real CLI (`run`, then `check --json` when
the run did not end well).

The question every case answers: does a staging mistake end as a staging error (exit 1,
one line naming the file, nothing live changed), or as something else: the verification
branch that says "this is a bug", a traceback, a failure of the run's end-state proof,
or a refusal that changed the live state anyway?

Mutations never write into a staged file: the staging dir is a tree of hard links
(`cp -al`) to a pristine copy (itself hard links into the real-driver cache), and a
mutated file is written under a new inode.

tests/test_staging_fuzz.py runs a bounded, seeded sample of the cases in the suite.
Exploration (docs/reliability.md, "Staging fuzz"):

    .venv/bin/python tests/stagingfuzz.py [--real] [--all | --cases N] [--seed S] [--jobs J]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# tests/ on the path, for the command line: the imports below are test modules.
sys.path.insert(0, str(Path(__file__).parent))

from check_schema import parse_check

import simgpu
import toolkit
from elfmutate import (
    DT_DEBUG,
    DT_SONAME,
    DT_STRTAB,
    dynamic_field,
    header,
    layout,
    no_dynamic,
    put,
    retag,
    soname_of_needed,
    soname_string_at,
    soname_value,
    truncate,
    two_sonames,
    with_soname,
)

BUG = "this is a bug"
# What a run says when it fails after planning accepted the staging (reconcile.py,
# cdi.py): nvidia-ctk failed on the root, or the spec it wrote did not validate. Only
# planning's refusals name a staged file and come before anything is built.
AFTER_THE_BUILD = ("nvidia-ctk cdi generate failed", "nvidia-ctk cdi generate wrote no spec",
                   "nvidia-ctk wrote a spec", "; it was not installed")
# The run's status lines once planning is done: a build, or the spec for a live root
# that already matches.
PAST_PLANNING = ("Building driver root for driver", "Generating the CDI spec")


# --------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Context:
    version: str
    stale: str
    lib: Path  # the staging library dir


Action = Callable[[Path, Context], None]


class NotApplicable(Exception):
    """The file has nothing this mutation changes (no DT_NEEDED, no DT_SONAME, ...)."""


@dataclass(frozen=True)
class Case:
    target: str  # a file of the staging library dir (relative to it)
    mutation: str
    action: Action

    @property
    def label(self) -> str:
        return f"{self.target}: {self.mutation}"


def rewrite(path: Path, data: bytes) -> None:
    """`path` holds `data` now, under a new inode (never writing through a hard link)."""
    mode = path.stat().st_mode & 0o7777
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def bytes_case(target: str, mutation: str,
               change: Callable[[bytes], bytes | None]) -> Case | None:
    def act(lib: Path, ctx: Context) -> None:
        path = lib / target
        new = change(path.read_bytes())
        if new is None:
            raise NotApplicable(f"{mutation} does not apply to {target}")
        rewrite(path, new)
    return Case(target, mutation, act)


def soname_strings(target: str, soname: str | None, ctx: Context) -> dict[str, bytes]:
    """DT_SONAME strings to try in `target` (a file name with `.so` in it)."""
    stem = target.rsplit("/", 1)[-1].split(".so", 1)[0]
    base = target.rsplit("/", 1)[-1]
    other = "libnvidia-ml.so.1" if stem == "libcuda" else "libcuda.so.1"
    return {
        "empty": b"",
        "stem only (no .so)": stem.encode(),
        "no .so, dashed": f"{stem}-so-1".encode(),
        "with a slash": f"sub/{soname or base}".encode(),
        "leading ../": f"../{soname or base}".encode(),
        "..": b"..",
        ".": b".",
        "another driver library's SONAME": other.encode(),
        "libc.so.6": b"libc.so.6",
        "same stem, .so only": f"{stem}.so".encode(),
        "same stem, .so.2": f"{stem}.so.2".encode(),
        "same stem, driver version": f"{stem}.so.{ctx.version}".encode(),
        "same stem, stale version": f"{stem}.so.{ctx.stale}".encode(),
        "its own file name": base.encode(),
        "very long (300)": f"{stem}.so.{'1' * 296}".encode(),
        "very long (5000, unterminated)": f"{stem}.so.{'1' * 5000}".encode(),
        "non-UTF-8": f"{stem}.so.1".encode() + b"\xff",
        "newline": f"{stem}.so.1\nlibc.so.6".encode(),
        "space": f"{stem}.so 1".encode(),
    }


def elf_cases(target: str, soname: str | None, ctx: Context) -> list[Case]:
    cases: list[Case | None] = []
    for what, string in soname_strings(target, soname, ctx).items():
        # Unterminated: bytes up to the end of the file, and no NUL within 4096 of them.
        cases.append(bytes_case(target, f"DT_SONAME {what}",
                                with_soname(string, terminated="unterminated" not in what)))
    cases += [
        bytes_case(target, "DT_SONAME removed", lambda d: retag(d, DT_SONAME, DT_DEBUG)),
        bytes_case(target, "DT_SONAME at a DT_NEEDED string", soname_of_needed),
        bytes_case(target, "two DT_SONAMEs", two_sonames),
        bytes_case(target, "DT_SONAME offset 2**63", lambda d: soname_value(d, 1 << 63)),
        bytes_case(target, "DT_SONAME offset 2**64-1", lambda d: soname_value(d, (1 << 64) - 1)),
        bytes_case(target, "DT_STRTAB removed", lambda d: retag(d, DT_STRTAB, DT_DEBUG)),
        bytes_case(target, "DT_STRTAB outside the segments", _strtab_far),
        bytes_case(target, "no PT_DYNAMIC", no_dynamic),
        bytes_case(target, "PT_DYNAMIC offset 2**64-1", dynamic_field(8, (1 << 64) - 1)),
        bytes_case(target, "PT_DYNAMIC offset past the end", dynamic_field(8, 1 << 40)),
        bytes_case(target, "PT_DYNAMIC size 2**64-1", dynamic_field(32, (1 << 64) - 1)),
        bytes_case(target, "PT_DYNAMIC size 2**40", dynamic_field(32, 1 << 40)),
        bytes_case(target, "PT_DYNAMIC size 0", dynamic_field(32, 0)),
        bytes_case(target, "ELFCLASS32", header("<B", 4, 1)),
        bytes_case(target, "big-endian", header("<B", 5, 2)),
        bytes_case(target, "bad class byte", header("<B", 4, 7)),
        bytes_case(target, "e_machine EM_386", header("<H", 18, 3)),
        bytes_case(target, "e_machine EM_AARCH64", header("<H", 18, 183)),
        bytes_case(target, "e_machine 0xffff", header("<H", 18, 0xFFFF)),
        bytes_case(target, "e_type ET_EXEC", header("<H", 16, 2)),
        bytes_case(target, "e_type ET_REL", header("<H", 16, 1)),
        bytes_case(target, "e_type 0xfe00", header("<H", 16, 0xFE00)),
        bytes_case(target, "e_phoff 2**64-1", header("<Q", 32, (1 << 64) - 1)),
        bytes_case(target, "e_phoff 2**63", header("<Q", 32, 1 << 63)),
        bytes_case(target, "e_phoff past the end", header("<Q", 32, 1 << 40)),
        bytes_case(target, "e_phnum 0", header("<H", 56, 0)),
        bytes_case(target, "e_phnum 0xffff", header("<H", 56, 0xFFFF)),
        bytes_case(target, "e_phentsize 0", header("<H", 54, 0)),
        bytes_case(target, "e_phentsize 0xffff", header("<H", 54, 0xFFFF)),
        bytes_case(target, "truncated to 4 bytes", truncate(lambda d: 4)),
        bytes_case(target, "truncated to 20 bytes", truncate(lambda d: 20)),
        bytes_case(target, "truncated to 64 bytes", truncate(lambda d: 64)),
        bytes_case(target, "truncated in the program headers",
                   truncate(lambda d: layout(d).phoff + 60)),
        bytes_case(target, "truncated in the dynamic segment",
                   truncate(lambda d: (layout(d).dynamic[0].offset + 40)
                            if layout(d).dynamic else None)),
        bytes_case(target, "truncated in the SONAME string", truncate(soname_string_at)),
        bytes_case(target, "truncated to half", truncate(lambda d: len(d) // 2)),
    ]
    return [c for c in cases if c is not None]


def _strtab_far(data: bytes) -> bytes | None:
    entry = layout(data).first(DT_STRTAB)
    if entry is None:
        return None
    out = bytearray(data)
    put(out, entry.offset + 8, "<Q", 1 << 50)
    return bytes(out)


def file_case(target: str, mutation: str, act: Action) -> Case:
    return Case(target, mutation, act)


def _renamed(target: str, new: str, *, keep: bool) -> Action:
    """`target` under the name `new`: a copy beside it (`keep`) or the file moved."""
    def act(lib: Path, ctx: Context) -> None:
        dest = lib / new.format(ver=ctx.version)
        if dest == lib / target:
            raise NotApplicable(f"{target} already has that name")
        if os.path.lexists(dest):
            dest.unlink()
        if keep:
            shutil.copyfile(lib / target, dest)
        else:
            os.rename(lib / target, dest)
    return act


def _copy_as(target: str, new: str) -> Action:
    return _renamed(target, new, keep=True)


def _copy_changed(target: str, new: str, change: Callable[[bytes], bytes | None]) -> Action:
    """A copy of `target` named `new`, its ELF changed by `change`."""
    def act(lib: Path, ctx: Context) -> None:
        data = change((lib / target).read_bytes())
        if data is None:
            raise NotApplicable(f"cannot change a copy of {target}")
        dest = lib / new.format(ver=ctx.version)
        if os.path.lexists(dest):
            dest.unlink()
        dest.write_bytes(data)
    return act


def _move_to(target: str, new: str) -> Action:
    return _renamed(target, new, keep=False)


def _relink(name: str, to: str) -> Action:
    def act(lib: Path, ctx: Context) -> None:
        link = lib / name
        if os.path.lexists(link):
            link.unlink()
        os.symlink(to.format(ver=ctx.version, stale=ctx.stale), link)
    return act


def _unlink(name: str) -> Action:
    def act(lib: Path, ctx: Context) -> None:
        (lib / name).unlink()
    return act


def name_cases(target: str, soname: str | None, version: str) -> list[Case]:
    """File-name mistakes around `target`."""
    base = target.rsplit("/", 1)[-1]
    stem = base.split(".so", 1)[0]
    sub = "vdpau/" if target.startswith("vdpau/") else ""
    other = "" if sub else "vdpau/"
    cases = [
        file_case(target, "copy named .bak", _copy_as(target, f"{target}.bak")),
        file_case(target, "copy with a longer version", _copy_as(target, f"{target}.1")),
        file_case(target, "copy named with .so only", _copy_as(target, f"{sub}{stem}.so")),
        file_case(target, f"copy in {other or 'the top dir'}",
                  _copy_as(target, f"{other}{base}")),
        file_case(target, f"moved to {other or 'the top dir'}",
                  _move_to(target, f"{other}{base}")),
        file_case(target, "renamed without its version", _move_to(target, f"{sub}{stem}.so.1")),
        file_case(target, "copy named like another driver library",
                  _copy_as(target, f"{sub}libnvidia-zzz.so.{{ver}}")),
    ]
    linker = f"{stem}.so"
    cases += [
        file_case(target, "copy named .bak, DT_SONAME the linker name",
                  _copy_changed(target, f"{target}.bak",
                                with_soname(linker.encode()))),
        file_case(target, "copy named .bak, no DT_SONAME",
                  _copy_changed(target, f"{target}.bak",
                                lambda d: retag(d, DT_SONAME, DT_DEBUG))),
        file_case(target, "copy named as the linker name, DT_SONAME the linker name",
                  _copy_changed(target, f"{sub}{linker}",
                                with_soname(linker.encode()))),
        file_case(target, "copy named as the linker name, no DT_SONAME",
                  _copy_changed(target, f"{sub}{linker}",
                                lambda d: retag(d, DT_SONAME, DT_DEBUG))),
    ]
    if soname and soname != base:
        cases += [
            file_case(target, "SONAME link replaced by a copy without DT_SONAME",
                      _copy_changed(target, f"{sub}{soname}",
                                    lambda d: retag(d, DT_SONAME, DT_DEBUG))),
            file_case(target, "SONAME link replaced by a copy with DT_SONAME .so.9",
                      _copy_changed(target, f"{sub}{soname}",
                                    with_soname(f"{stem}.so.9".encode()))),
            file_case(target, "SONAME link replaced by a copy",
                      _copy_as(target, f"{sub}{soname}")),
            file_case(target, "SONAME link removed", _unlink(f"{sub}{soname}")),
            file_case(target, "SONAME link to the stale version",
                      _relink(f"{sub}{soname}", f"{stem}.so.{{stale}}")),
            file_case(target, "SONAME link to another library",
                      _relink(f"{sub}{soname}", "libnvidia-cfg.so.{ver}"
                              if stem != "libnvidia-cfg" else "libcuda.so.{ver}")),
        ]
    return cases


def all_cases(libs: dict[str, str | None], ctx: Context) -> list[Case]:
    """Every case over every target library: `libs` maps a staged file (relative to the
    library dir) to its DT_SONAME."""
    out: list[Case] = []
    for target, soname in sorted(libs.items()):
        out += elf_cases(target, soname, ctx)
        out += name_cases(target, soname, ctx.version)
    return out


# --------------------------------------------------------------------------------------
# Machines and runs


@dataclass
class Outcome:
    case: str
    # ok (built, proven, live) | refused (by planning: nothing built) | bug (the new root
    # failed verification) | end-state (built, swapped in, the end-state proof failed,
    # rolled back) | rolled-back (built, then nvidia-ctk or the spec's validation failed,
    # rolled back) | traceback | build-error | changed-live | other | n/a
    # | check-invalid (`check --json` after the run broke its schema)
    kind: str
    code: int
    error: str
    check: list[dict[str, object]] = field(default_factory=list)


def targets(version: str, real: bool) -> dict[str, str | None]:
    """The libraries mutated: required, optional with a SONAME link, internal (SONAME =
    file name), unversioned, in vdpau/, and (real 535) one without a DT_SONAME."""
    libs: dict[str, str | None] = {
        f"libcuda.so.{version}": "libcuda.so.1",
        f"libnvidia-ml.so.{version}": "libnvidia-ml.so.1",
        f"libnvidia-cfg.so.{version}": "libnvidia-cfg.so.1",
        f"libnvidia-eglcore.so.{version}": f"libnvidia-eglcore.so.{version}",
        "libnvidia-api.so.1": "libnvidia-api.so.1",
        f"vdpau/libvdpau_nvidia.so.{version}": "libvdpau_nvidia.so.1",
    }
    if real:
        libs[f"libnvidia-vulkan-producer.so.{version}"] = None
    else:
        libs["libnvidia-egl-wayland.so.1.1.13"] = "libnvidia-egl-wayland.so.1"
    return libs


def snapshot(root: Path) -> tuple[object, ...]:
    """The live state a refused run must leave as it was: the driver root's entries
    (names, types, sizes, mtimes, link targets), the spec's and the drop-in's bytes."""
    live = root / "run/nvidia/driver"
    entries = []
    if live.is_dir():
        for path in sorted(live.rglob("*")):
            st = path.lstat()
            entries.append((str(path.relative_to(live)), st.st_mode, st.st_size,
                            st.st_mtime_ns, os.readlink(path) if path.is_symlink() else None))
    files = [root / "etc/cdi/nvidia.yaml", root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"]
    return (tuple(entries), *(p.read_bytes() if p.exists() else None for p in files))


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{toolkit.path_with_hook()}"}
    env.pop("NOTIFY_SOCKET", None)
    env.pop("JOURNAL_STREAM", None)
    return subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root", str(root),
                           *args], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)


def classify(case: str, proc: subprocess.CompletedProcess[str], changed: bool) -> Outcome:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    error = errors[-1] if errors else ""
    if "Traceback" in proc.stderr:
        kind, error = "traceback", proc.stderr.strip().splitlines()[-1]
    elif BUG in proc.stderr or "failed verification" in error:
        kind = "bug"
    elif proc.returncode == 0:
        kind = "ok"
    elif "the live state is wrong after setup" in error:
        kind = "end-state"
    elif "cannot build the driver root" in error:  # a staged name blamed on the filesystem
        kind = "build-error"
    elif changed:
        kind = "changed-live"
    elif (any(word in error for word in AFTER_THE_BUILD)
          or any(step in proc.stderr for step in PAST_PLANNING)):
        kind = "rolled-back"
    elif proc.returncode == 1 and len(errors) == 1 and "; " in error:
        kind = "refused"
    else:
        kind = "other"
    return Outcome(case, kind, proc.returncode, error)


class Bench:
    """One machine, its pristine staging library dir, and a way to run a case on it."""

    def __init__(self, where: Path, real: bool, nvidia_ctk: str | None = None,
                 first_boot: bool = False) -> None:
        """`first_boot`: every case starts without a live root, spec or drop-in (a build
        that fails on its own files, such as two entries at one path, shows only then);
        otherwise with those of a good run (a refusal must leave them as they were)."""
        self.real = real
        self.first_boot = first_boot
        if real:
            import realdriver
            from realmachine import real_machine

            drv = realdriver.fetch_real_driver()
            self.m = real_machine(where, drv)
            self.stale = "525.147.05"
        else:
            self.m = simgpu.make_machine(where / "root")
            self.stale = self.m.stale_versions[0]
        self.m.write_config(staging_wait_seconds=0, lock_timeout_seconds=5)
        first = cli(self.m.root, "run")
        assert first.returncode == 0, first.stderr
        if nvidia_ctk is not None:  # later runs: fail fast after the build and the swap
            self.m.write_config(staging_wait_seconds=0, lock_timeout_seconds=5,
                                nvidia_ctk=nvidia_ctk)
        self.pristine = where / "pristine"
        subprocess.run(["cp", "-al", str(self.m.lib_dir), str(self.pristine)], check=True)
        self.ctx = Context(self.m.version, self.stale, self.m.lib_dir)

    def cases(self) -> list[Case]:
        return all_cases(targets(self.m.version, self.real), self.ctx)

    def reset(self) -> None:
        shutil.rmtree(self.m.lib_dir)
        subprocess.run(["cp", "-al", str(self.pristine), str(self.m.lib_dir)], check=True)
        if self.first_boot:
            shutil.rmtree(self.m.root / "run/nvidia/driver", ignore_errors=True)
            for state in ("etc/cdi/nvidia.yaml", "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"):
                (self.m.root / state).unlink(missing_ok=True)

    def run(self, case: Case, *, check: bool = True) -> Outcome:
        self.reset()
        try:
            case.action(self.m.lib_dir, self.ctx)
        except NotApplicable as e:
            return Outcome(case.label, "n/a", 0, str(e))
        before = snapshot(self.m.root)
        proc = cli(self.m.root, "run")
        out = classify(case.label, proc, proc.returncode != 0
                       and snapshot(self.m.root) != before)
        if check and out.kind not in ("ok",):
            report = cli(self.m.root, "check", "--json")
            try:
                out.check = parse_check(report.stdout, report.returncode)["problems"]
            except Exception as e:  # a finding of its own: the report is kept, not raised
                if out.kind == "refused":  # a worse outcome of the run itself stays
                    out.kind = "check-invalid"
                out.check = [{"code": "check-invalid", "message": f"{e}"[:300]}]
        return out


# The outcomes a staged input may have: accepted (built, proven, live), refused by
# planning (nothing built, nothing live changed), or a mutation that does not apply.
FINE = frozenset({"ok", "refused", "n/a"})


def sample(cases: list[Case], n: int | None, seed: int) -> list[Case]:
    if n is None or n >= len(cases):
        return cases
    return random.Random(seed).sample(cases, n)


def explore(real: bool, n: int | None, seed: int, jobs: int,
            first_boot: bool = False) -> Iterator[Outcome]:
    with tempfile.TemporaryDirectory(prefix="stagingfuzz.") as tmp:
        benches = [Bench(Path(tmp) / str(i), real, first_boot=first_boot)
                   for i in range(jobs)]
        chosen = sample(benches[0].cases(), n, seed)
        by_label = {c.label: c for c in chosen}
        free = list(benches)

        def one(label: str) -> Outcome:
            bench = free.pop()
            try:
                return bench.run(by_label[label])
            finally:
                free.append(bench)

        with ThreadPoolExecutor(jobs) as pool:
            yield from pool.map(one, list(by_label))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="the real Debian 535 driver")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--first-boot", action="store_true",
                        help="no live root, spec or drop-in before each case")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args(argv)
    start = time.monotonic()
    results: list[Outcome] = []
    for out in explore(args.real, None if args.all else args.cases, args.seed, args.jobs,
                       args.first_boot):
        results.append(out)
        mark = "" if out.kind in FINE else "  <=="
        print(f"{out.kind:12} {out.code:3} {out.case} | {out.error[:160]}{mark}", flush=True)
    counts: dict[str, int] = {}
    for out in results:
        counts[out.kind] = counts.get(out.kind, 0) + 1
    print(f"{len(results)} cases in {time.monotonic() - start:.0f} s: {counts}")
    if args.json:
        args.json.write_text(json.dumps([vars(o) for o in results], indent=1))
    return 1 if set(counts) - FINE else 0


if __name__ == "__main__":
    sys.exit(main())
