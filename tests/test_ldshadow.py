"""A linker search order that finds a driver SONAME before the driver root (issue 16,
point 5): a CUDA forward-compat package in the machine, whose conf file sorts before the
drop-in and names a directory with a libcuda.so.1 of another version.

What glibc does, seen with the real ldconfig and ld.so (docs/architecture.md, "The
linker's search order"): ldconfig reads /etc/ld.so.conf top to bottom, expands each
`include` glob in byte order of the file names, and lists a SONAME found in several
directories once per directory, in that order; ld.so loads the first. So
/etc/ld.so.conf.d/000_cuda.conf outranks unbounded-nvidia-setup.conf, and
zz-cuda.conf does not. The product does not try to outrank it: it refuses before changing
anything and names the conf file, and `check` names it even with no driver root."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from invariants import secure_after  # noqa: F401  (fixture)
from unbounded_nvidia_setup import searchorder
from unbounded_nvidia_setup.config import Config, Machine
from unbounded_nvidia_setup.linker import dropin_text

import elfbuild
import simgpu
from conftest import Cli, Outcome, needs_root
from test_run import check_json, codes, root_of, snapshot, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"
COMPAT = "/usr/local/cuda-12.9/compat"
COMPAT_VERSION = "575.57.08"
DRIVER_LIBDIR = f"/run/nvidia/driver/lib/{MA}"
DROPIN = "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"


def install_cuda_compat(m: simgpu.SimMachine, conf_name: str = "000_cuda.conf") -> Path:
    """What a CUDA forward-compat package puts into the machine: its libcuda.so.1 and
    libnvidia-ptxjitcompiler.so.1 of another driver version, a conf file naming their
    directory, and the ldconfig of its postinst. Returns the conf file."""
    compat = m.root / COMPAT.lstrip("/")
    for soname in ("libcuda.so.1", "libnvidia-ptxjitcompiler.so.1"):
        name = f"{soname.rsplit('.so', 1)[0]}.so.{COMPAT_VERSION}"
        elfbuild.compile_so(compat / name, soname)
        os.symlink(name, compat / soname)
    conf = m.root / "etc/ld.so.conf.d" / conf_name
    conf.write_text(f"{COMPAT}\n")
    subprocess.run([LDCONFIG, "-r", str(m.root)], check=True)
    return conf


def cache_first(m: simgpu.SimMachine, soname: str) -> str:
    """Where the machine's ld.so finds `soname`: the first x86-64 entry of its cache."""
    out = subprocess.run([LDCONFIG, "-p", "-C", str(m.root / "etc/ld.so.cache")],
                         capture_output=True, text=True, check=True).stdout
    first: str = re.findall(rf"\t{re.escape(soname)} \([^)]*x86-64[^)]*\) => (\S+)", out)[0]
    return first


# --------------------------------------------------------------------------------------
# The search order, read as glibc's ldconfig reads it


def ldconfig_order(root: Path) -> list[tuple[str, str, int]]:
    """(directory, conf file, line) in the order the real ldconfig searches them: its
    verbose listing, building nothing (-N) and touching no link (-X)."""
    out = subprocess.run([LDCONFIG, "-v", "-N", "-X", "-r", str(root)], capture_output=True,
                         text=True, check=True).stdout
    return [(d, f, int(n)) for d, f, n in re.findall(r"^(/\S*): \(from (.+):(\d+)\)$", out,
                                                     re.M)]


def test_search_order_is_glibc_ldconfigs(tmp_path: Path) -> None:
    """Every rule of glibc's parser the product follows, against the real ldconfig's own
    listing: comments, blank and `hwcap` lines, `=libc6` types, trailing slashes, relative
    and nested `include`s with several patterns, byte order of the names (uppercase
    first), hidden and non-.conf names left out, directories that do not exist left out,
    and a directory named twice (once through a symlink) kept at its first place."""
    root = tmp_path / "root"
    etc = root / "etc"
    for d in ("usr/local/lib", COMPAT.lstrip("/"), DRIVER_LIBDIR.lstrip("/"), "opt/a",
              "opt/b", "opt/c", "etc/ld.so.conf.d/sub", "etc/ld.so.conf.d/dir.conf"):
        (root / d).mkdir(parents=True)
    os.symlink(COMPAT, root / "opt/compat-link")
    (etc / "ld.so.conf").write_text(
        "# a comment\n\n   /opt/a/ # trailing slash, comment\n"
        "include ld.so.conf.d/*.conf\n/opt/b=libc6\nhwcap 0 nosegneg\n/opt/missing\n")
    conf_d = etc / "ld.so.conf.d"
    (conf_d / "000_cuda.conf").write_text(f"{COMPAT}\n")
    (conf_d / "Zupper.conf").write_text("/opt/c\n")
    (conf_d / "libc.conf").write_text("/usr/local/lib\n")
    (conf_d / "m.conf").write_text("include\tsub/*.conf  /etc/extra.conf\n")
    (conf_d / "sub/1.conf").write_text("/opt/compat-link\n/opt/a\n")
    (etc / "extra.conf").write_text("/opt/c\n")
    (conf_d / ".hidden.conf").write_text("/opt/missing\n")
    (conf_d / "x.conf.dpkg-old").write_text("/opt/missing\n")
    machine = Machine(root=root, config=Config(), arch="x86_64")
    (conf_d / "unbounded-nvidia-setup.conf").write_text(dropin_text(machine))
    ours = [(d.path, d.conf, d.line) for d in searchorder.search_order(machine)]
    assert ours == ldconfig_order(root)
    assert [d for d, _, _ in ours] == ["/opt/a", COMPAT, "/opt/c", "/usr/local/lib",
                                       DRIVER_LIBDIR, "/opt/b"]


def test_an_include_cycle_or_a_fifo_ends(tmp_path: Path) -> None:
    """glibc's ldconfig recurses into a conf file that includes itself until it fails, and
    blocks on a FIFO named *.conf (tests/test_branches.py): the product reads neither
    forever."""
    root = tmp_path / "root"
    conf_d = root / "etc/ld.so.conf.d"
    conf_d.mkdir(parents=True)
    (root / "opt/a").mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (conf_d / "loop.conf").write_text("/opt/a\ninclude /etc/ld.so.conf.d/loop.conf\n")
    os.mkfifo(conf_d / "fifo.conf")
    machine = Machine(root=root, config=Config(), arch="x86_64")
    # The drop-in counts as written (the run is about to write it), the loop once.
    assert [d.path for d in searchorder.search_order(machine)] == ["/opt/a", DRIVER_LIBDIR]


def test_paths_resolve_under_the_root_as_in_ldconfigs_chroot(tmp_path: Path) -> None:
    """An absolute link starts again at the root, `..` stops there, and a dangling link
    or a loop resolves to nothing (ldconfig -r chroots; the tool must not read the
    host's files for the machine's)."""
    root = tmp_path / "root"
    (root / "usr/local/cuda-12.9/compat").mkdir(parents=True)
    os.symlink("/usr/local/cuda-12.9", root / "usr/local/cuda")
    os.symlink("../../../../../etc", root / "usr/local/up")
    os.symlink("loop", root / "usr/loop")
    os.symlink("/nowhere", root / "usr/dangling")
    r = str(root)
    assert (searchorder.resolve_machine_path(r, "/usr/local/cuda/compat")
            == f"{r}/usr/local/cuda-12.9/compat")
    assert searchorder.resolve_machine_path(r, "/usr/local/up") is None  # root/etc does not exist
    (root / "etc").mkdir()
    assert searchorder.resolve_machine_path(r, "/usr/local/up") == f"{r}/etc"
    assert searchorder.resolve_machine_path(r, "/usr/loop") is None
    assert searchorder.resolve_machine_path(r, "/usr/dangling") is None
    assert searchorder.resolve_machine_path(r, "/") == r


# --------------------------------------------------------------------------------------
# The facts the decision rests on, with the real ldconfig


def test_a_conf_file_after_the_drop_in_does_not_shadow(m: simgpu.SimMachine,
                                                       cli: Cli) -> None:
    """Same compat directory, named by a file that sorts after the drop-in: the driver
    root comes first, the run is Ready and check is ok."""
    install_cuda_compat(m, "zz-cuda.conf")
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert cache_first(m, "libcuda.so.1") == f"{DRIVER_LIBDIR}/libcuda.so.1"
    assert check_json(cli, m)["ok"] is True


# --------------------------------------------------------------------------------------
# `check` names the conf file


def copy_of(m: simgpu.SimMachine) -> str:
    """The shadowing copy, which `ldcache-shadowed`'s message names."""
    return str(m.root / COMPAT.lstrip("/") / "libcuda.so.1")


def shadowed(report: dict[str, object]) -> list[dict[str, str]]:
    found = report["problems"]
    assert isinstance(found, list)
    return [p for p in found if p["code"] == "ldcache-shadowed"]


def test_check_names_the_conf_file_on_a_ready_node(m: simgpu.SimMachine, cli: Cli) -> None:
    """The package installed after a good boot, its postinst's ldconfig included: the
    cache now resolves the compat copies (ldcache-stale), and the conf file is why."""
    assert cli(m.root, "run").code == 0
    conf = install_cuda_compat(m)
    report = check_json(cli, m)
    assert codes(report) == {"ldcache-shadowed", "ldcache-stale"}, report["problems"]
    problems = report["problems"]
    assert isinstance(problems, list) and problems[0]["code"] == "ldcache-shadowed"  # cause
    found = shadowed(report)
    assert [p["path"] for p in found] == [str(conf)]
    message = found[0]["message"]
    for part in (copy_of(m), f"{conf} line 1", COMPAT, "libcuda.so.1",
                 "libnvidia-ptxjitcompiler.so.1", DRIVER_LIBDIR):
        assert part in message, message


def test_check_names_the_conf_file_with_no_driver_root(m: simgpu.SimMachine,
                                                       cli: Cli) -> None:
    """What a first boot's rollback leaves (no root, drop-in or spec): the cause is shown
    beside the missing state, for the SONAMEs every root has."""
    conf = install_cuda_compat(m)
    report = check_json(cli, m)
    assert codes(report) == {"root-missing", "ldconf-missing", "ldcache-shadowed",
                             "spec-missing"}, report["problems"]
    found = shadowed(report)
    assert [p["path"] for p in found] == [str(conf)]
    message = found[0]["message"]
    assert copy_of(m) in message and COMPAT in message and "libcuda.so.1" in message


def test_check_names_a_directory_line_of_ld_so_conf_itself(m: simgpu.SimMachine,
                                                           cli: Cli) -> None:
    """Not only ld.so.conf.d: a directory line above the `include` comes first too (no
    file name of ours could outrank it)."""
    assert cli(m.root, "run").code == 0
    install_cuda_compat(m, "zz-cuda.conf")
    assert check_json(cli, m)["ok"] is True
    ld_so_conf = m.root / "etc/ld.so.conf"
    ld_so_conf.write_text(f"{COMPAT}\n{ld_so_conf.read_text()}")
    found = shadowed(check_json(cli, m))
    assert [p["path"] for p in found] == [str(ld_so_conf)]
    assert f"{ld_so_conf} line 1 " in found[0]["message"]


# --------------------------------------------------------------------------------------
# `run` refuses, changing nothing, in one line


def refused(out: Outcome, conf: Path) -> str:
    """The run's one line: the conf file, the directory, the SONAME, what to do."""
    assert out.code == 1, out.stderr
    assert "Ready" not in out.stderr
    assert len(out.errors) == 1, out.lines
    line = out.errors[0]
    for part in (str(conf), COMPAT, "libcuda.so.1", DRIVER_LIBDIR,
                 f"`dpkg -S {COMPAT}/libcuda.so.1`", "left as they were"):
        assert part in line, line
    return line


def test_a_compat_dir_named_first_fails_the_first_boot_changing_nothing(
        m: simgpu.SimMachine, cli: Cli) -> None:
    conf = install_cuda_compat(m)
    assert cache_first(m, "libcuda.so.1") == f"{COMPAT}/libcuda.so.1"
    out = cli(m.root, "run")
    refused(out, conf)
    # Refused before anything was built, swapped, generated or written.
    assert "Building driver root" not in out.stderr
    assert "Generating the CDI spec" not in out.stderr
    assert not os.path.lexists(root_of(m))
    assert not list(root_of(m).parent.glob(".driver.*"))
    assert not spec_of(m).exists() and not (m.root / DROPIN).exists()
    assert "ldcache-shadowed" in codes(check_json(cli, m))
    # The operator removes the file: the unit's next retry succeeds, nothing else needed.
    conf.unlink()
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert cache_first(m, "libcuda.so.1") == f"{DRIVER_LIBDIR}/libcuda.so.1"
    assert check_json(cli, m)["ok"] is True


def test_a_compat_dir_installed_on_a_ready_node_keeps_the_live_state(
        m: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(m.root, "run").code == 0
    before = snapshot(m)
    conf = install_cuda_compat(m)
    refused(cli(m.root, "run"), conf)
    assert snapshot(m) == before
    # The repair on a running node: the file goes (a purge, whose libc-bin trigger runs a
    # plain ldconfig); no restart of kubelet or containerd is needed. Until a run succeeds
    # (the unit's own retry), check also says that the last one failed.
    conf.unlink()
    assert codes(check_json(cli, m)) == {"ldcache-stale", "setup-failed"}
    subprocess.run([LDCONFIG, "-r", str(m.root)], check=True)
    assert codes(check_json(cli, m)) == {"setup-failed"}
    assert cli(m.root, "run").code == 0 and snapshot(m) == before
    assert check_json(cli, m)["ok"] is True


def test_a_directory_line_of_ld_so_conf_itself_fails_the_run(m: simgpu.SimMachine,
                                                             cli: Cli) -> None:
    install_cuda_compat(m, "zz-cuda.conf")
    ld_so_conf = m.root / "etc/ld.so.conf"
    ld_so_conf.write_text(f"{COMPAT}\n{ld_so_conf.read_text()}")
    line = refused(cli(m.root, "run"), ld_so_conf)
    assert f"{ld_so_conf} line 1 " in line
