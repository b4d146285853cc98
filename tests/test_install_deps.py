"""`make deb` installs the build dependencies and nothing else (issue 36, point 7).

Fast, no root: ``tests/install-deps --list SET`` prints a set without installing it,
``make -n deb`` prints what ``make deb`` would run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL_DEPS = REPO / "tests" / "install-deps"
CONTROL = REPO / "packaging" / "debian" / "control"
# What packaging/build-deb (and the dpkg-buildpackage it runs) need beyond Build-Depends:
# dpkg-checkbuilddeps requires build-essential implicitly; dpkg-buildpackage is dpkg-dev's.
BUILD_TOOLS = {"build-essential", "dpkg-dev"}
# What only `make test` or `make demo` use: never needed to build the package.
TEST_ONLY = {"podman", "runc", "qemu-user-static", "prometheus", "prometheus-node-exporter",
             "strace", "systemd-container", "lintian", "debootstrap", "python3-jsonschema"}
# The commands packaging/build-deb runs itself (git is optional: `|| date -R`).
SCRIPT_COMMANDS = ("dpkg-buildpackage", "flock", "tar", "find", "sed", "cp", "mv", "mkdir",
                   "head", "env", "date", "printf", "rm")


def listed(*args: str) -> list[str]:
    proc = subprocess.run([str(INSTALL_DEPS), "--list", *args], capture_output=True,
                          text=True, timeout=30, check=True, cwd="/")
    return proc.stdout.split()


def build_depends() -> set[str]:
    """Package names in Build-Depends(-Indep/-Arch), parsed here independently of the
    script: deb822 fields with continuation lines, no versions, arches or profiles."""
    fields: dict[str, str] = {}
    name = ""
    for line in CONTROL.read_text().splitlines():
        if line[:1] in (" ", "\t") and name:
            fields[name] += " " + line.strip()
        elif ":" in line:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    names = set()
    for field in ("Build-Depends", "Build-Depends-Indep", "Build-Depends-Arch"):
        for dep in fields.get(field, "").split(","):
            first = dep.split("|")[0].strip()
            if first:
                pkg = re.match(r"[a-z0-9][a-z0-9+.-]*", first)
                assert pkg, first
                names.add(pkg.group(0))
    # A virtual package that debhelper provides; dpkg-query knows only the real one.
    return {"debhelper" if n == "debhelper-compat" else n for n in names}


def test_build_set_is_build_depends_plus_the_script_tools() -> None:
    build = listed("build")
    assert len(build) == len(set(build)), build
    assert "debhelper" in build_depends() and "go-md2man" in build_depends()
    assert set(build) == build_depends() | BUILD_TOOLS
    assert not set(build) & TEST_ONLY


def test_make_test_installs_every_set() -> None:
    everything = set(listed())
    assert set(listed("build")) <= everything
    assert set(listed("demo")) <= everything
    assert set(listed("rehearsal")) <= everything
    assert everything >= TEST_ONLY


def test_make_deb_installs_only_the_build_set() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "-C", str(REPO), "--no-print-directory", "-n", "deb"],
                          capture_output=True, text=True, timeout=30, check=True, env=env)
    lines = proc.stdout.splitlines()
    installs = [ln for ln in lines if "install-deps" in ln]
    assert installs == ["tests/install-deps build"], lines
    assert lines[-1].startswith("packaging/build-deb "), lines


def _package_of(command: str) -> str | None:
    """The Debian package that ships ``command`` (usrmerge: /usr/bin or /bin)."""
    found = shutil.which(command, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        return None
    for path in {found, os.path.realpath(found), "/bin/" + command, "/usr/bin/" + command}:
        proc = subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True,
                              timeout=30, check=False)
        if proc.returncode == 0:
            return proc.stdout.split(":")[0].strip()
    return None


def test_the_script_commands_come_from_the_build_set_or_essential() -> None:
    if shutil.which("dpkg-query") is None:
        pytest.skip("no dpkg-query here")
    build = set(listed("build"))
    text = (REPO / "packaging" / "build-deb").read_text()
    unchecked = []
    for command in SCRIPT_COMMANDS:
        assert re.search(rf"(^|[\s(|]){re.escape(command)}\s", text, re.M), command
        package = _package_of(command)
        if package is None:
            unchecked.append(command)
            continue
        if package in build:
            continue
        essential = subprocess.run(["dpkg-query", "-W", "-f=${Essential}", package],
                                   capture_output=True, text=True, timeout=30, check=False)
        assert essential.stdout.strip() == "yes", (command, package)
    # dpkg-buildpackage is the one that is no Essential package's: it must be installed
    # wherever `make deb` has run (here, or skipped).
    if "dpkg-buildpackage" in unchecked:
        pytest.skip("dpkg-buildpackage is not installed here: run `make deb` as root first")
