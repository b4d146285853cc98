"""The machine's linker after a run (issue 9): glibc's real ldconfig may not change what the
run verified, and a run whose end state is wrong is not Ready.

glibc's ldconfig trusts an aux cache keyed by (inode, ctime in seconds, size, device); a new
tmpfs hands out the same keys again, so equal-size libraries created in another order within
one second get each other's SONAMEs, and a plain ldconfig rewrites SONAME links to the wrong
files (FACTS.md). The clash test writes such an aux cache itself, in glibc's format, on the
exact keys of the root's files, so that it does not depend on two runs meeting within one
second; the runs and every ldconfig in these tests are the real ones."""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from invariants import secure_after  # noqa: F401  (fixture)
from unbounded_nvidia_setup.elf import read_elf
from unbounded_nvidia_setup.tree import manifest

import elfbuild
import simgpu
from conftest import Cli, needs_root
from test_failures import mount_tmpfs, new_driver
from test_run import check_json, codes, root_of, snapshot, spec_of

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"
LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"
# A file's aux-cache key as glibc builds it from stat: inode, ctime seconds, size, device.
Key = tuple[int, int, int, int]
# Aux-cache key of a file -> the SONAME it really carries.
Keys = dict[Key, str | None]

# glibc's aux cache as ldconfig reads it (elf/cache.c, load_aux_cache; 2.36 here): a
# 24-byte magic ("glibc-ld.so.auxcache-2.0"), the number of entries and the size of the
# string table; per entry the key (four 64-bit fields, in Key's order), the flags, the
# SONAME's offset in the string table (0: none), the required OS version and a 32-bit field
# kept as read; then the string table, which starts with an empty string. ldconfig ignores
# a file whose size is not exactly that, so a layout read wrongly cannot pass unnoticed: the
# writer below must give back glibc's own file byte for byte.
AUX_CACHE = Path("var/cache/ldconfig/aux-cache")
AUX_HEAD = struct.Struct("<24sII")
AUX_ENTRY = struct.Struct("<QQQQiIIi")


@dataclasses.dataclass(frozen=True)
class AuxEntry:
    key: Key
    flags: int
    soname: str | None
    osversion: int
    last: int


def read_aux_cache(m: simgpu.SimMachine) -> tuple[bytes, list[AuxEntry]]:
    data = (m.root / AUX_CACHE).read_bytes()
    magic, count, strings_size = AUX_HEAD.unpack_from(data)
    assert magic.startswith(b"glibc-ld.so.auxcache-"), magic
    table = AUX_HEAD.size + count * AUX_ENTRY.size
    assert len(data) == table + strings_size, "not an aux cache this ldconfig reads"
    strings = data[table:]
    entries = []
    for i in range(count):
        ino, ctime, size, dev, flags, offset, osversion, last = AUX_ENTRY.unpack_from(
            data, AUX_HEAD.size + i * AUX_ENTRY.size)
        soname = strings[offset:strings.index(b"\0", offset)].decode() if offset else None
        entries.append(AuxEntry((ino, ctime, size, dev), flags, soname, osversion, last))
    assert aux_cache_bytes(magic, entries) == data
    return magic, entries


def aux_cache_bytes(magic: bytes, entries: list[AuxEntry]) -> bytes:
    """The aux cache file as glibc's save_aux_cache writes these entries."""
    strings = bytearray(b"\0")
    table = bytearray()
    for entry in entries:
        offset = 0
        if entry.soname is not None:
            offset = len(strings)
            strings += entry.soname.encode() + b"\0"
        table += AUX_ENTRY.pack(*entry.key, entry.flags, offset, entry.osversion, entry.last)
    return AUX_HEAD.pack(magic, len(entries), len(strings)) + bytes(table) + bytes(strings)


def claimed(m: simgpu.SimMachine) -> dict[Key, str | None]:
    """What the machine's aux cache says each key's SONAME is."""
    return {entry.key: entry.soname for entry in read_aux_cache(m)[1]}


def equal_size_machine(root: Path) -> simgpu.SimMachine:
    """A simulated machine whose driver libraries all have one size, so that only inode,
    ctime and device tell them apart in ldconfig's aux cache."""
    m = simgpu.make_machine(root, stale_versions=(), unrelated=4, helpers=False,
                            firmware=False)
    libs = [p for p in m.staging[0].rglob("lib*.so*")
            if p.is_file() and not p.is_symlink() and p.name.endswith(f".so.{m.version}")]
    size = max(p.stat().st_size for p in libs) + 4096
    for lib in libs:
        data = lib.read_bytes()
        elfbuild.write_file(lib, data, size=size)
    assert len({p.stat().st_size for p in libs}) == 1 and len(libs) > 10
    (m.root / "var/cache/ldconfig").mkdir(parents=True, exist_ok=True)
    m.write_config()
    return m


def key_of(path: Path) -> Key:
    """The aux-cache key of the file at `path` (a link: of the file it leads to)."""
    st = path.stat()
    return st.st_ino, int(st.st_ctime), st.st_size, st.st_dev


def aux_keys(m: simgpu.SimMachine) -> Keys:
    keys: Keys = {}
    for path in (root_of(m) / "lib" / MA).iterdir():
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                info = read_elf(f)
            keys[key_of(path)] = info.soname if info else None
    return keys


def stale_aux_cache(m: simgpu.SimMachine, live: Keys) -> bytes:
    """The aux cache the run's ldconfig wrote, with every driver library's entry given the
    SONAME of the library of the same size at the next inode number (the last one that of
    the first): what the previous boot's libraries leave when a new tmpfs hands their keys
    out again one inode later (issue 9), on every library instead of on those a race hit."""
    magic, entries = read_aux_cache(m)
    # `ldconfig -i` read every library of the root and keyed it as stat does here.
    assert {e.key: e.soname for e in entries if e.key in live} == live
    groups: dict[int, list[AuxEntry]] = {}
    for entry in sorted((e for e in entries if e.key in live), key=lambda e: e.key):
        groups.setdefault(entry.key[2], []).append(entry)
    moved = {}
    for group in groups.values():
        assert len(group) > 1, group
        for entry, other in zip(group, group[1:] + group[:1], strict=True):
            moved[entry.key] = dataclasses.replace(entry, soname=other.soname)
    return aux_cache_bytes(magic, [moved.get(e.key, e) for e in entries])


def problems(report: dict[str, object], code: str) -> list[dict[str, str]]:
    found = report["problems"]
    assert isinstance(found, list)
    return [p for p in found if p["code"] == code]


def links_right(m: simgpu.SimMachine) -> None:
    lib = root_of(m) / "lib" / MA
    for name, target in m.expected_links.items():
        assert os.path.realpath(lib / name) == str(lib / target), (name, os.readlink(lib / name))


def test_stale_aux_cache_after_a_tmpfs_remount_changes_nothing(tmp_path: Path, cli: Cli,
                                                               mounts: list[Path]) -> None:
    """The issue's clash against the real run. The machine's aux cache holds, on the exact
    key of every driver library in the root, another library's SONAME, as after a tmpfs
    remount that handed the previous boot's keys out again; the run (its `ldconfig -i -X`)
    meets it. Then a plain ldconfig, as dpkg's libc-bin trigger runs after a package
    install. `check` passes after each. The same stale entries with no run in between make
    that plain ldconfig re-point the links: they are entries this ldconfig trusts.

    The entries are written, not waited for: the root's files keep their keys while the
    root stays (a restart's run), so the run meets them every time, where two runs on new
    mounts within one second and on one device number met only by chance."""
    m = equal_size_machine(tmp_path / "root")
    run_nvidia = m.root / "run/nvidia"
    mount_tmpfs(run_nvidia, "size=64m")  # /run on a boot
    mounts.append(run_nvidia)
    assert cli(m.root, "run").code == 0
    live = aux_keys(m)
    sonames = set(live.values())
    stale = stale_aux_cache(m, live)
    aux = m.root / AUX_CACHE
    aux.write_bytes(stale)
    stale_said = claimed(m)
    for key, soname in live.items():
        assert stale_said.get(key) in sonames - {soname}, (key, soname, stale_said.get(key))

    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert aux_keys(m) == live  # the files kept their keys: its ldconfig met every entry
    links_right(m)
    assert check_json(cli, m)["ok"] is True
    # `-i`: the aux cache is written again from the files, every key with its own SONAME.
    said = claimed(m)
    assert {key: said.get(key) for key in live} == live

    subprocess.run([LDCONFIG, "-r", str(m.root)], check=True)  # a package install
    links_right(m)
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]

    # Without the run in between, the same plain ldconfig believes every stale entry: each
    # SONAME link of the root now leads to the library whose key claimed that SONAME.
    assert aux_keys(m) == live
    aux.write_bytes(stale)
    subprocess.run([LDCONFIG, "-r", str(m.root)], check=True)
    lib = root_of(m) / "lib" / MA
    claimant = {soname: key for key, soname in stale_said.items() if key in live}
    links = {name for name in m.expected_links if name in sonames}
    assert {"libcuda.so.1", "libnvidia-ml.so.1"} <= links
    for name in links:
        assert key_of(lib / name) == claimant[name], name
        assert live[claimant[name]] != name
    report = check_json(cli, m)
    assert {"root-wrong-link", "ldcache-stale"} <= codes(report)
    flagged = problems(report, "root-wrong-link") + problems(report, "root-missing-link")
    assert {str(lib / name) for name in links} <= {p["path"] for p in flagged}


def test_plain_ldconfig_after_a_good_run_keeps_check_ok(tmp_path: Path, cli: Cli) -> None:
    m = equal_size_machine(tmp_path / "root")
    assert cli(m.root, "run").code == 0
    before = manifest(root_of(m))
    subprocess.run([LDCONFIG, "-r", str(m.root)], check=True)
    assert manifest(root_of(m)) == before
    assert check_json(cli, m)["ok"] is True


def corrupting_ldconfig(m: simgpu.SimMachine, tmp_path: Path, version: str) -> Path:
    """The real ldconfig, which on its first call that builds the cache then points the
    driver root's libnvidia-cfg.so.1 at another library: what a stale aux cache did.
    (Not libnvidia-ml.so.1: ldconfig runs beside nvidia-ctk, which loads that one, so
    whether nvidia-ctk or the end-state check failed the run would be a race.)"""
    armed = tmp_path / "armed"
    armed.touch()
    lib = root_of(m) / "lib" / MA
    script = tmp_path / "ldconfig"
    script.write_text(
        "#!/bin/sh\n"
        f'"{LDCONFIG}" "$@" || exit $?\n'
        '[ "$1" = -p ] && exit 0\n'
        f'rm "{armed}" 2>/dev/null || exit 0\n'
        f'ln -sfn libnvidia-tls.so.{version} "{lib}/libnvidia-cfg.so.1"\n')
    script.chmod(0o755)
    m.write_config(ldconfig=str(script))
    return armed


def fails_with_wrong_end_state(cli: Cli, m: simgpu.SimMachine) -> str:
    out = cli(m.root, "run")
    assert out.code == 1, out.stderr
    assert "Ready" not in out.stderr
    assert len(out.errors) == 1, out.lines
    assert "the live state is wrong after setup" in out.errors[0]
    assert "[root-wrong-link]" in out.errors[0] and "libnvidia-cfg.so.1" in out.errors[0]
    return out.errors[0]


def test_ldconfig_corrupting_a_link_on_first_boot_leaves_nothing(tmp_path: Path,
                                                                 cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    armed = corrupting_ldconfig(m, tmp_path, m.version)
    fails_with_wrong_end_state(cli, m)
    assert not armed.exists()  # the corruption happened
    assert not os.path.lexists(root_of(m))
    assert not spec_of(m).exists()
    assert not (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").exists()
    assert not list(root_of(m).parent.glob(".driver.*"))


def test_ldconfig_corrupting_a_link_after_a_swap_puts_the_old_state_back(tmp_path: Path,
                                                                        cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert cli(m.root, "run").code == 0
    before = snapshot(m)
    new_driver(m, tmp_path)
    armed = corrupting_ldconfig(m, tmp_path, "570.133.20")
    fails_with_wrong_end_state(cli, m)
    assert not armed.exists()
    assert snapshot(m) == before
    assert not list(root_of(m).parent.glob(".driver.*"))
    # The old generation is whole and the linker cache names it again; check finds it out
    # of date for the newer driver (and its kernel module), nothing else.
    report = check_json(cli, m)
    assert "root-out-of-date" in codes(report)
    assert not codes(report) & {"root-missing-link", "root-wrong-link", "root-dangling-link",
                                "ldcache-stale", "spec-missing-host-path"}, report["problems"]
    links_right(m)
    # The next try (systemd's restart) builds the new driver.
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert check_json(cli, m)["ok"] is True


def test_ldconfig_corrupting_the_unchanged_root_is_not_ready_and_repaired_next_run(
        tmp_path: Path, cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert cli(m.root, "run").code == 0
    spec = spec_of(m).read_bytes()
    corrupting_ldconfig(m, tmp_path, m.version)
    fails_with_wrong_end_state(cli, m)
    assert spec_of(m).read_bytes() == spec
    assert "root-wrong-link" in codes(check_json(cli, m)) or "root-missing-link" in codes(
        check_json(cli, m))
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert check_json(cli, m)["ok"] is True
    links_right(m)


def test_check_reports_a_link_to_a_library_of_another_soname(tmp_path: Path,
                                                             cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert cli(m.root, "run").code == 0
    link = root_of(m) / "lib" / MA / "libnvidia-cfg.so.1"
    os.unlink(link)
    os.symlink(f"libnvidia-tls.so.{m.version}", link)
    report = check_json(cli, m)
    wrong = problems(report, "root-wrong-link")
    assert [p["path"] for p in wrong] == [str(link)], report["problems"]
    assert f"libnvidia-tls.so.{m.version}, not libnvidia-cfg.so.1" in wrong[0]["message"]


def test_check_reports_a_linker_cache_that_misses_the_driver_root(tmp_path: Path,
                                                                  cli: Cli) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert cli(m.root, "run").code == 0
    # A cache built without the drop-in, as an ldconfig run before ours would leave it.
    dropin = m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"
    saved = dropin.read_bytes()
    dropin.unlink()
    subprocess.run([LDCONFIG, "-r", str(m.root)], check=True)
    dropin.write_bytes(saved)
    report = check_json(cli, m)
    stale = " ".join(p["message"] for p in problems(report, "ldcache-stale"))
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        assert f"does not list {soname}," in stale, report["problems"]
    assert codes(report) == {"ldcache-stale"}
    # A cache that cannot be read at all.
    (m.root / "etc/ld.so.cache").unlink()
    assert codes(check_json(cli, m)) == {"ldcache-stale"}
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True
