"""Staging mistakes are staging errors (issue 16): every staged input that the staging fuzz
(tests/stagingfuzz.py, docs/reliability.md) saw end in "the new driver root failed
verification (...); this is a bug", in a traceback, or in an error blaming something
else (the filesystem, a missing file that is there), built here with real gcc-made ELF
files.

The rule (docs/staging-contract.md, "What a staged library must be"): a libcuda.so.<ver>
or libnvidia-ml.so.<ver> that cannot be the driver's refuses the run, naming the file
(exit 1, nothing live changed, `check` says staging-invalid naming it); any other
library whose DT_SONAME cannot be its link's name is left out with a warning naming the
file; a damaged ELF header refuses the run whatever the library.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from invariants import secure_after  # noqa: F401  (fixture)

import elfbuild
import elfmutate
import simgpu
import stagingfuzz
from conftest import Cli, needs_root
from test_failures import fails_cleanly
from test_run import check_json, root_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = simgpu.MULTIARCH
HINT = "reinstall the driver on the host"


@pytest.fixture
def m(tmp_path: Path) -> simgpu.SimMachine:
    machine = simgpu.make_machine(tmp_path / "root")
    machine.write_config(staging_wait_seconds=0, lock_timeout_seconds=5)
    return machine


@pytest.fixture
def live(m: simgpu.SimMachine, cli: Cli) -> simgpu.SimMachine:
    """After one good run: the root, spec and drop-in a refused run must leave alone."""
    assert cli(m.root, "run").code == 0
    return m


def staged(m: simgpu.SimMachine, name: str) -> Path:
    """A staging file as the tool names it (its real path)."""
    return Path(os.path.realpath(m.lib_dir)) / name


def edit(path: Path, change: Callable[[bytes], bytes | None]) -> None:
    data = change(path.read_bytes())
    assert data is not None
    stagingfuzz.rewrite(path, data)


def refused_naming(cli: Cli, m: simgpu.SimMachine, path: Path, what: str,
                   hint: str = HINT) -> None:
    """`run`: exit 1, one line naming `path` and saying `what`, with the hint to fix the
    host; root, spec and drop-in byte for byte as before. `check --json`: staging-invalid,
    its message naming the file."""
    error = fails_cleanly(cli, m, 1, what)
    assert str(path) in error and hint in error, error
    assert "this is a bug" not in error
    report = check_json(cli, m)
    problems = report["problems"]
    assert isinstance(problems, list)
    invalid = [p for p in problems if p["code"] == "staging-invalid"]
    assert len(invalid) == 1, problems
    assert str(path) in invalid[0]["message"] and what in invalid[0]["message"], invalid


def left_out(cli: Cli, m: simgpu.SimMachine, path: Path, what: str) -> None:
    """`run` succeeds without the library at `path` (the root may have its own link of
    that name), one warning naming it and saying `what`; `check` finds nothing wrong."""
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    warnings = [line for line in out.lines if line.startswith("warning: ")]
    assert len(warnings) == 1 and str(path) in warnings[0] and what in warnings[0], out.lines
    lib = root_of(m) / "lib" / MA
    copy = lib / path.relative_to(os.path.realpath(m.lib_dir))
    assert not os.path.lexists(copy) or os.path.islink(copy)
    # Left out is part of the state (issue 21): listed by `check --json` with its
    # reason, counted in the metrics, shown by `status`; the verdict is unchanged.
    report = check_json(cli, m)
    assert report["ok"] is True
    listed = report["left_out"]
    assert isinstance(listed, list) and [x["path"] for x in listed] == [str(path)], listed
    assert what in listed[0]["reason"], listed
    status = cli(m.root, "status").stdout
    assert "Left out:       1 staged library" in status and str(path) in status, status
    metrics = m.root / "var/lib/prometheus/node-exporter"
    metrics.mkdir(parents=True, exist_ok=True)
    assert cli(m.root, "check", "--metrics").code == 0
    text = (metrics / "unbounded_nvidia_setup.prom").read_text()
    assert "\nunbounded_nvidia_setup_staging_left_out_files 1\n" in text, text


# --------------------------------------------------------------------------------------
# libcuda and libnvidia-ml: refused, naming the file


STALE = simgpu.DEFAULT_STALE[0]


@pytest.mark.parametrize("base,soname", [
    ("libcuda", None),  # the example (fuzz: DT_SONAME removed, no PT_DYNAMIC, ...)
    ("libnvidia-ml", None),
    ("libcuda", "libcuda"),  # the other example: no .so in it
    ("libnvidia-ml", "libnvidia-ml"),
    ("libcuda", "libcuda.so"),  # its linker name
    ("libcuda", "libcuda.so.2"),
    ("libnvidia-ml", "libnvidia-ml.so.{ver}"),  # its own file name
    ("libcuda", f"libcuda.so.{STALE}"),
    # Was "cannot build the driver root ...: File name too long; check the filesystem".
    ("libcuda", "libcuda.so." + "1" * 296),
])
def test_required_library_with_a_wrong_soname(live: simgpu.SimMachine, cli: Cli, base: str,
                                              soname: str | None) -> None:
    """Before: "the new driver root failed verification (... libcuda.so.1 does not point
    to libcuda.so.<ver>); this is a bug" (the root's libcuda.so.1 link is made from the
    SONAME)."""
    path = staged(live, f"{base}.so.{live.version}")
    if soname is not None:
        soname = soname.format(ver=live.version)
    elfbuild.compile_so(path, soname)
    want = "has no DT_SONAME" if soname is None else f"has DT_SONAME {soname!r}"
    refused_naming(cli, live, path, f"incomplete driver state: {path.name} is not usable: "
                   f"staging file {path} {want}, not {base}.so.1")


@pytest.mark.parametrize("damage,what", [
    (elfmutate.header("<H", 16, 2), "is ET_EXEC, not a shared library (ET_DYN)"),
    (elfmutate.header("<H", 18, 183), "is a 64-bit aarch64 ELF file, not 64-bit x86_64"),
    (elfmutate.header("<B", 4, 1), "is a 32-bit x86_64 ELF file, not 64-bit x86_64"),
    (lambda data: b"", "is not an ELF file"),
], ids=["ET_EXEC", "aarch64", "ELFCLASS32", "empty"])
def test_required_library_that_is_no_shared_object_of_this_machine(
        live: simgpu.SimMachine, cli: Cli, damage: Callable[[bytes], bytes | None],
        what: str) -> None:
    """Before: "incomplete driver state: libnvidia-ml.so.<ver> not in any staging dir", of
    a file that is there; now the line names it and says what it is."""
    path = staged(live, f"libnvidia-ml.so.{live.version}")
    edit(path, damage)
    refused_naming(cli, live, path, f"staging file {path} {what}")


# --------------------------------------------------------------------------------------
# Damaged ELF headers: refused whatever the library (they were tracebacks)


@pytest.mark.parametrize("name,damage,what", [
    ("libnvidia-cfg.so.{ver}", elfmutate.dynamic_field(32, 1 << 40),
     "dynamic segment at offset"),  # MemoryError
    ("libnvidia-cfg.so.{ver}", elfmutate.dynamic_field(32, (1 << 64) - 1),
     "dynamic segment at offset"),  # OverflowError
    ("libcuda.so.{ver}", elfmutate.header("<Q", 32, (1 << 64) - 1),
     "program header table at offset 18446744073709551615"),  # ValueError from seek
    ("vdpau/libvdpau_nvidia.so.{ver}", lambda data: elfmutate.soname_value(data, 1 << 63),
     "DT_SONAME string at offset"),  # ValueError from seek
], ids=["dynamic-size-2**40", "dynamic-size-2**64-1", "phoff-2**64-1", "soname-offset-2**63"])
def test_header_offsets_past_the_file(live: simgpu.SimMachine, cli: Cli, name: str,
                                      damage: Callable[[bytes], bytes | None],
                                      what: str) -> None:
    """Before: a traceback (MemoryError, OverflowError, "ValueError: cannot fit 'int'
    into an offset-sized integer"), exit 1 without a line saying which file."""
    path = staged(live, name.format(ver=live.version))
    edit(path, damage)
    refused_naming(cli, live, path, f"damaged ELF file {path}: {what}")


# --------------------------------------------------------------------------------------
# Other libraries: left out with a warning naming the file


@pytest.mark.parametrize("name,soname,what", [
    # Before: "... failed verification (.../libnvidia-cfg is not an NVIDIA driver file);
    # this is a bug".
    ("libnvidia-cfg.so.{ver}", "libnvidia-cfg", "is not a library name (no .so in it)"),
    ("vdpau/libvdpau_nvidia.so.{ver}", "libvdpau_nvidia",
     "is not a library name (no .so in it)"),
    ("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland",
     "is not a library name (no .so in it)"),
    # Before: "cannot build the driver root in .../run/nvidia: File name too long; check
    # the filesystem".
    ("libnvidia-cfg.so.{ver}", "libnvidia-cfg.so." + "1" * 300,
     "is longer than a file name can be (255 bytes)"),
])
def test_library_whose_soname_cannot_be_a_link_name(live: simgpu.SimMachine, cli: Cli,
                                                    name: str, soname: str,
                                                    what: str) -> None:
    path = staged(live, name.format(ver=live.version))
    elfbuild.compile_so(path, soname)
    left_out(cli, live, path, what)


def test_copy_of_libcuda_claiming_its_linker_name(live: simgpu.SimMachine, cli: Cli) -> None:
    """A stray copy (libcuda.so.<ver>.bak) whose DT_SONAME is libcuda.so: its link would
    be the root's libcuda.so, which must lead to libcuda.so.1. Before: "... failed
    verification (.../libcuda.so points to libcuda.so.<ver>.bak, whose DT_SONAME is
    libcuda.so, not libcuda.so.1); this is a bug"."""
    path = staged(live, f"libcuda.so.{live.version}.bak")
    elfbuild.compile_so(path, "libcuda.so")
    left_out(cli, live, path, "is the linker name the driver root links to libcuda.so.1")


@pytest.mark.parametrize("name,soname", [
    ("libcuda.so.1", None),
    ("libnvidia-ml.so.1", "libnvidia-ml.so.7"),
    ("libcuda.so", "libcuda.so"),
])
def test_regular_file_where_the_root_has_its_own_link(live: simgpu.SimMachine, cli: Cli,
                                                      name: str, soname: str | None) -> None:
    """The host's libcuda.so.1 link replaced by a regular file of another SONAME. Before:
    "... failed verification (.../libcuda.so.1 does not point to libcuda.so.<ver>); this
    is a bug"."""
    path = staged(live, name)
    path.unlink()
    elfbuild.compile_so(path, soname)
    left_out(cli, live, path, "the driver root has its own link there")


def test_plain_copy_where_the_root_has_its_own_link(live: simgpu.SimMachine,
                                                    cli: Cli) -> None:
    """libcuda.so.1 copied instead of linked (cp -L): the same library, left out without
    a warning, the root unchanged."""
    path = staged(live, "libcuda.so.1")
    path.unlink()
    shutil.copy(staged(live, f"libcuda.so.{live.version}"), path)
    out = cli(live.root, "run")
    assert out.code == 0 and not [x for x in out.lines if x.startswith("warning")], out.lines
    assert os.readlink(root_of(live) / "lib" / MA / "libcuda.so.1") == \
        f"libcuda.so.{live.version}"
    assert check_json(cli, live)["left_out"] == []  # nothing is wrong with the host


def test_a_refused_first_boot_shows_its_cause_in_check_and_metrics(
        m: simgpu.SimMachine, cli: Cli) -> None:
    """No live root yet, a libcuda without DT_SONAME: `check` says staging-invalid with
    the run's own line (not only what is missing), and the run's metrics say the same,
    so a host agent can tell "repair the host's driver" from "wait"."""
    path = staged(m, f"libcuda.so.{m.version}")
    elfbuild.compile_so(path, None)
    metrics = m.root / "var/lib/prometheus/node-exporter"
    metrics.mkdir(parents=True)
    out = cli(m.root, "run")
    assert out.code == 1 and len(out.errors) == 1, out.stderr
    line = out.errors[0].removeprefix("error: ")
    report = check_json(cli, m)
    problems = report["problems"]
    assert isinstance(problems, list)
    invalid = [p["message"] for p in problems if p["code"] == "staging-invalid"]
    assert len(invalid) == 1 and line.startswith(invalid[0]), (line, problems)
    assert str(path) in invalid[0]
    text = (metrics / "unbounded_nvidia_setup.prom").read_text()
    assert 'check_problems{code="staging-invalid"} 1\n' in text, text
    assert "unbounded_nvidia_setup_run_success 0\n" in text, text


@pytest.mark.parametrize("name,soname", [
    ("libnvidia-cfg.so.{ver}", "libnvidia-cfg.so.1"),
    ("vdpau/libvdpau_nvidia.so.{ver}", "libvdpau_nvidia.so.1"),
])
def test_file_named_as_another_librarys_soname(live: simgpu.SimMachine, cli: Cli, name: str,
                                               soname: str) -> None:
    """The host's libnvidia-cfg.so.1 link replaced by a library whose own DT_SONAME is
    libnvidia-cfg.so.9: the loader asking for libnvidia-cfg.so.1 would open it. Two files
    claim one SONAME: refused as ambiguous, naming both. Before: the run built, swapped and
    generated, then its end-state proof failed ("the live state is wrong after setup:
    [ldcache-stale] ... resolves libnvidia-cfg.so.1 to ..."), on every retry."""
    library = staged(live, name.format(ver=live.version))
    path = library.parent / soname
    path.unlink()
    elfbuild.compile_so(path, soname.replace(".so.1", ".so.9"))
    refused_naming(cli, live, path, f"ambiguous driver files for {soname}: {library} has that "
                   f"DT_SONAME and {path}, a file of that name, has DT_SONAME "
                   f"'{soname.replace('.so.1', '.so.9')}'",
                   hint="remove the extra copies on the host or fix its SONAME links")
