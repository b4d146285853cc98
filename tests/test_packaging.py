"""The systemd units and the Debian package (docs/packaging.md).

* ``systemd-analyze verify`` of units/ with stand-in containerd/kubelet units: with the
  host's systemd (whatever its version) and with the target's (Debian trixie, systemd 257,
  run in a chroot of the test rootfs).
* ``make deb`` (once per session, into dist/; a second build with ``VERSION=`` override
  into a temp dir): contents, control fields, maintainer scripts, lintian.
* Offline installs into a trixie rootfs (``dpkg --root=DIR -i`` and ``chroot DIR dpkg
  -i``): the unit is enabled, nothing runs, the drop-ins are in place, the console script
  works with Debian's python3 packages; upgrade; purge removes what the package installed
  and nothing of the node's state.
* The nvidia-cdi-refresh units of the NVIDIA Container Toolkit are skipped while the
  package is installed and run again after it is removed: offline with ``systemd-analyze
  condition``, and in one booted machine (systemd-nspawn), where an in-place purge also
  leaves containerd and kubelet running.

Needs root and the tools named in each skip reason (tests/install-deps installs them).
Skips say why; when the environment variable CI is set they fail instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import cdirefresh
import check_schema

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "units"
PACKAGE = "unbounded-nvidia-setup"
SETUP_UNIT = f"{PACKAGE}.service"
DROPIN = "10-unbounded-nvidia-setup.conf"
DROPIN_UNITS = ("containerd.service", "kubelet.service", "nvidia-cdi-refresh.service",
                "nvidia-cdi-refresh.path")
UNIT_DIR = "usr/lib/systemd/system"
SCHEMA = f"usr/share/{PACKAGE}/check.schema.json"  # issue 11: the `check --json` contract
WANTS_LINK = f"etc/systemd/system/multi-user.target.wants/{SETUP_UNIT}"
CHECK_SERVICE = f"{PACKAGE}-check.service"
CHECK_TIMER = f"{PACKAGE}-check.timer"
CHECK_UNITS = (CHECK_SERVICE, CHECK_TIMER)
TIMER_LINK = f"etc/systemd/system/timers.target.wants/{CHECK_TIMER}"
CLEAN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENV = {"PATH": CLEAN_PATH, "LC_ALL": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
# Options systemd learnt after 252 (Debian bookworm): an older host's systemd-analyze
# reports them as unknown; the trixie check below verifies them for real.
NEWER_THAN_252 = {"RestartMode": 254, "RestartSteps": 254, "RestartMaxDelaySec": 254}
# lintian warnings that are accepted; each one is explained in docs/packaging.md.
ACCEPTED_LINTIAN_WARNINGS: frozenset[str] = frozenset()

STAND_IN = """\
[Unit]
Description={name} (test stand-in)

[Service]
ExecStart=/bin/sleep infinity

[Install]
WantedBy=multi-user.target
"""

def need(ok: object, reason: str) -> None:
    """Skip with ``reason`` unless ``ok``; fail instead when $CI is set."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason} [CI is set: packaging tests must run, not skip]",
                    pytrace=False)
    pytest.skip(reason)


def need_tools(*tools: str) -> None:
    need(os.geteuid() == 0, "needs root (dpkg --root, chroot, mount)")
    missing = [t for t in tools if shutil.which(t, path=CLEAN_PATH) is None]
    need(not missing, f"missing {', '.join(missing)} (run tests/install-deps as root)")


def sh(*argv: str | Path, check: bool = True, timeout: float = 180,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, env=env or HOST_ENV, stdin=subprocess.DEVNULL,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"`{' '.join(map(str, argv))}` exited {proc.returncode}:\n"
                             f"{proc.stdout}{proc.stderr}")
    return proc


def pyproject_version() -> str:
    found = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(),
                      re.M)
    assert found, "no version in pyproject.toml"
    return found.group(1)


def make_deb(version: str | None = None, dist: Path | None = None) -> Path:
    """``make deb [VERSION=] [DIST=]``; the .deb it wrote."""
    need_tools("make", "dpkg-buildpackage", "flock", "tar")
    version = version or pyproject_version()
    dist = dist or REPO / "dist"
    argv = ["make", "-C", str(REPO), "--no-print-directory", "deb", f"DIST={dist}"]
    if version != pyproject_version():
        argv.append(f"VERSION={version}")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    proc = sh(*argv, check=False, timeout=900, env=env)
    deb = dist / f"{PACKAGE}_{version}_all.deb"
    assert proc.returncode == 0 and deb.is_file(), (
        f"make deb failed ({proc.returncode}), no {deb}:\n"
        + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    return deb


@pytest.fixture(scope="session")
def deb() -> Path:
    return make_deb()


# -- rootfs helpers -----------------------------------------------------------------------


def new_rootfs(dest: Path) -> Path:
    """A fresh trixie rootfs (tests/rootfs.py: systemd 257, python3 and the four deps,
    stand-in containerd/kubelet) plus test copies of NVIDIA's nvidia-cdi-refresh units
    (tests/cdirefresh.py), enabled as the toolkit's preset does, that would run there."""
    need_tools("debootstrap", "tar", "chroot", "unshare", "dpkg")
    need((REPO / "tests/rootfs.py").is_file(), "no tests/rootfs.py (the trixie rootfs)")
    import rootfs

    try:
        root = rootfs.fresh_rootfs(dest)
    except Exception as e:  # network, debootstrap: say why rather than error out
        need(False, f"no trixie rootfs (tests/rootfs.py): {e}")
        raise
    cdirefresh.install(root)
    return root


@pytest.fixture
def trixie(tmp_path: Path) -> Iterator[Path]:
    root = new_rootfs(tmp_path / "root")
    try:
        yield root
    finally:
        import rootfs

        rootfs.remove_rootfs(root)


def in_root(root: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``argv`` chrooted into ``root`` with its own /proc (systemd tools want one), in a
    private mount namespace so nothing stays mounted."""
    script = 'mount -t proc proc "$1/proc" && exec chroot "$@"'
    return sh("unshare", "--mount", "--fork", "sh", "-c", script, "sh", root, *argv,
              check=check)


def dpkg_status(root: Path) -> str:
    res = sh("dpkg-query", f"--root={root}", "-W", "-f=${Status}", PACKAGE, check=False)
    return res.stdout.strip() if res.returncode == 0 else "not-installed"


def assert_installed_offline(root: Path) -> None:
    assert dpkg_status(root) == "install ok installed"
    unit = root / UNIT_DIR / SETUP_UNIT
    assert unit.read_bytes() == (UNITS / SETUP_UNIT).read_bytes()
    for name in DROPIN_UNITS:
        dropin = root / UNIT_DIR / f"{name}.d" / DROPIN
        assert dropin.read_bytes() == (UNITS / f"{name}.d" / DROPIN).read_bytes(), name
    link = root / WANTS_LINK
    assert link.is_symlink(), "unit not enabled (no multi-user.target.wants link)"
    assert os.readlink(link) in (f"/{UNIT_DIR}/{SETUP_UNIT}", f"/lib/systemd/system/{SETUP_UNIT}")
    for name in CHECK_UNITS:
        assert (root / UNIT_DIR / name).read_bytes() == (UNITS / name).read_bytes(), name
    timer = root / TIMER_LINK
    assert timer.is_symlink(), "drift-check timer not enabled (no timers.target.wants link)"
    assert os.readlink(timer) in (f"/{UNIT_DIR}/{CHECK_TIMER}",
                                  f"/lib/systemd/system/{CHECK_TIMER}")
    # The check service runs from its timer only: nothing else wants it.
    assert not list((root / "etc/systemd/system").rglob(CHECK_SERVICE))
    # Offline: no running systemd in the rootfs, so the maintainer scripts started
    # nothing, and the tool itself did not run (it would have left its state).
    assert not (root / "run/systemd/system").exists()
    for state in ("run/nvidia", "etc/cdi/nvidia.yaml", "run/unbounded-nvidia-setup",
                  "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"):
        assert not (root / state).exists(), f"{state} exists after an offline install"
    # The stand-ins' own enablement is untouched.
    assert (root / "etc/systemd/system/multi-user.target.wants/containerd.service").is_symlink()


def assert_purged(root: Path) -> None:
    assert dpkg_status(root) in ("not-installed", "unknown ok not-installed")
    assert not (root / WANTS_LINK).is_symlink(), "enable link left after purge"
    assert not (root / TIMER_LINK).is_symlink(), "timer's enable link left after purge"
    assert not (root / UNIT_DIR / SETUP_UNIT).exists()
    assert not any((root / UNIT_DIR / name).exists() for name in CHECK_UNITS)
    for name in DROPIN_UNITS:
        assert not (root / UNIT_DIR / f"{name}.d").exists(), f"{name}.d left after purge"
    assert not (root / "usr/bin/unbounded-nvidia-setup").exists()
    assert not list((root / "var/lib/systemd/deb-systemd-helper-enabled").rglob(
        f"*{PACKAGE}*")), "deb-systemd-helper state left after purge"
    assert (root / "etc/systemd/system/multi-user.target.wants/containerd.service").is_symlink()
    assert (root / UNIT_DIR / "containerd.service").is_file()


def fake_node_state(root: Path) -> list[Path]:
    """What `run` leaves on a node (driver root, spec, ld.so.conf drop-in, lock)."""
    paths = [root / "run/nvidia/driver/lib/x86_64-linux-gnu/libcuda.so.550.127.05",
             root / "etc/cdi/nvidia.yaml",
             root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf",
             root / "run/unbounded-nvidia-setup.lock"]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("state\n")
    return paths


# -- units --------------------------------------------------------------------------------


def _stand_in_unit_dir(base: Path) -> Path:
    unit_dir = base / "units"
    shutil.copytree(UNITS, unit_dir)
    for name in ("containerd.service", "kubelet.service"):
        (unit_dir / name).write_text(STAND_IN.format(name=name))
    return unit_dir


def test_units_verify_host_systemd(tmp_path: Path) -> None:
    """The host's systemd-analyze (any version) finds nothing wrong beyond options newer
    than itself and the program that only the package installs."""
    need(shutil.which("systemd-analyze"), "no systemd-analyze (apt-get install systemd)")
    version = int(re.findall(r"\d+", sh("systemd-analyze", "--version").stdout)[0])
    unit_dir = _stand_in_unit_dir(tmp_path)
    env = {**HOST_ENV, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_LOG_COLOR": "0"}
    res = sh("systemd-analyze", "verify", "--man=no", SETUP_UNIT, "containerd.service",
             "kubelet.service", check=False, env=env)
    unexpected = []
    for line in (res.stdout + res.stderr).splitlines():
        key = re.search(r"Unknown key( name)? '(\w+)'", line)
        if key and NEWER_THAN_252.get(key.group(2), 0) > version:
            continue
        if "/usr/bin/unbounded-nvidia-setup is not executable" in line and not Path(
                "/usr/bin/unbounded-nvidia-setup").exists():
            continue
        if line.strip():
            unexpected.append(line)
    assert not unexpected, "\n".join(unexpected)


def test_units_verify_trixie(trixie: Path, deb: Path) -> None:
    """systemd 257 (the machines' systemd) verifies the installed units with no message at
    all, drop-ins included."""
    sh("dpkg", f"--root={trixie}", "-i", deb)
    units = [SETUP_UNIT, *CHECK_UNITS, "containerd.service", "kubelet.service",
             "nvidia-cdi-refresh.service", "nvidia-cdi-refresh.path"]
    res = in_root(trixie, "systemd-analyze", "verify", "--man=no", *units, check=False)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), (
        res.stdout + res.stderr)
    delta = in_root(trixie, "systemd-delta", "--no-pager", "--type=extended").stdout
    for name in DROPIN_UNITS:
        assert f"/{UNIT_DIR}/{name}.d/{DROPIN}" in delta, delta
    # The settings the design depends on (systemctl show needs a running PID 1; the
    # booted test below sees them live).
    text = (trixie / UNIT_DIR / SETUP_UNIT).read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert settings["Type"] == "oneshot"
    assert settings["RemainAfterExit"] == "yes"
    assert settings["Restart"] == "on-failure"
    assert settings["RestartMode"] == "direct"
    assert settings["NotifyAccess"] == "exec"  # ExecReload's STATUS= counts too
    assert settings["StartLimitIntervalSec"] == "0"
    assert settings["ExecStart"] == "/usr/bin/unbounded-nvidia-setup run"
    assert settings["ExecReload"] == "/usr/bin/unbounded-nvidia-setup run --spec-only"
    assert "ProtectSystem" not in settings and "PrivateDevices" not in settings
    assert "DeviceAllow" not in settings and "ProtectClock" not in settings
    # Least privilege (issue 37): no capability at all, a system call filter that answers
    # EPERM, and the ratings systemd 257 gives: setup 2.5 or lower, the check 2.1 or lower.
    assert settings["CapabilityBoundingSet"] == "" and settings["AmbientCapabilities"] == ""
    assert settings["SystemCallFilter"] == "@system-service"
    assert settings["SystemCallErrorNumber"] == "EPERM"
    for unit, most in ((SETUP_UNIT, 25), (CHECK_SERVICE, 21)):
        rated = in_root(trixie, "systemd-analyze", "security", "--offline=true",
                        f"--threshold={most}", f"/{UNIT_DIR}/{unit}", check=False)
        assert rated.returncode == 0, f"{unit} is rated above {most / 10}:\n{rated.stdout}"

    # The drift check: read-only, never retried, on no boot path.
    check = dict(re.findall(r"^(\w+)=(.*)$", (trixie / UNIT_DIR / CHECK_SERVICE).read_text(),
                            re.M))
    assert check["Type"] == "oneshot"
    assert check["ExecStart"] == ("/usr/bin/unbounded-nvidia-setup check --metrics "
                                  "--reload-if-degraded")
    assert check["ProtectSystem"] == "strict"
    assert check["ReadWritePaths"] == "-/var/lib/prometheus/node-exporter"
    assert "Restart" not in check and "WantedBy" not in check and "Before" not in check
    # Not ordered after the setup: that start job runs for as long as the setup retries
    # (RestartMode=direct), and the check must run meanwhile (tests/boot, issue 21).
    assert "After" not in check and "Requires" not in check and "Wants" not in check
    timer = dict(re.findall(r"^(\w+)=(.*)$", (trixie / UNIT_DIR / CHECK_TIMER).read_text(),
                            re.M))
    assert (timer["OnBootSec"], timer["OnUnitActiveSec"]) == ("5min", "5min")
    assert timer["RandomizedDelaySec"] and timer["WantedBy"] == "timers.target"

    # Exposure as systemd 257 scores it (docs/packaging.md states both figures).
    def exposure(unit: str) -> float:
        out = in_root(trixie, "systemd-analyze", "security", "--offline=true", "--no-pager",
                      unit, check=False).stdout
        return float(re.findall(r"Overall exposure level for \S+: ([\d.]+)", out)[0])

    assert exposure(SETUP_UNIT) <= 4.6
    assert exposure(CHECK_SERVICE) <= 1.9
    # The toolkit's unit as our drop-in leaves it: it only runs systemctl.
    assert exposure("nvidia-cdi-refresh.service") <= 1.9


# -- the package --------------------------------------------------------------------------


def test_deb_contents(deb: Path) -> None:
    listing = sh("dpkg-deb", "-c", deb).stdout
    files = {line.split()[-1].removeprefix(".") for line in listing.splitlines()
             if line.startswith("-")}
    expected = {
        f"/{UNIT_DIR}/{SETUP_UNIT}",
        *(f"/{UNIT_DIR}/{name}.d/{DROPIN}" for name in DROPIN_UNITS),
        "/usr/bin/unbounded-nvidia-setup",
        "/usr/lib/python3/dist-packages/unbounded_nvidia_setup/__init__.py",
        "/usr/lib/python3/dist-packages/unbounded_nvidia_setup/__main__.py",
        "/usr/share/doc/unbounded-nvidia-setup/copyright",
        "/usr/share/doc/unbounded-nvidia-setup/README.md",
        "/usr/share/doc/unbounded-nvidia-setup/packaging.md",
        "/usr/share/doc/unbounded-nvidia-setup/alerts.yml",
        "/usr/share/man/man8/unbounded-nvidia-setup.8.gz",
        f"/{SCHEMA}",
    }
    assert expected <= files, sorted(expected - files)
    # Nothing outside /usr: no conffiles to merge, no /lib (merged /usr), no /etc.
    assert all(f.startswith("/usr/") for f in files), sorted(f for f in files
                                                            if not f.startswith("/usr/"))
    extracted = Path(sh("mktemp", "-d").stdout.strip())
    try:
        sh("dpkg-deb", "-x", deb, extracted)
        for rel in [SETUP_UNIT, *CHECK_UNITS, *(f"{n}.d/{DROPIN}" for n in DROPIN_UNITS)]:
            shipped = (extracted / UNIT_DIR / rel).read_bytes()
            assert shipped == (UNITS / rel).read_bytes(), f"{rel} differs from units/"
        assert (extracted / SCHEMA).read_bytes() == check_schema.SCHEMA_FILE.read_bytes()
        script = (extracted / "usr/bin/unbounded-nvidia-setup").read_text()
        assert script.startswith("#!/usr/bin/python3\n"), script.splitlines()[0]
        assert (extracted / "usr/bin/unbounded-nvidia-setup").stat().st_mode & 0o111
    finally:
        shutil.rmtree(extracted)


def test_deb_control(deb: Path) -> None:
    def field(name: str) -> str:
        return sh("dpkg-deb", "--field", deb, name).stdout.strip()

    assert field("Package") == PACKAGE
    assert field("Version") == pyproject_version()
    assert field("Architecture") == "all"
    depends = {d.strip().split()[0] for d in field("Depends").split(",")}
    assert {"python3-yaml", "python3-sdnotify"} <= depends, depends
    assert not depends & {"python3-click", "python3-pyelftools"}, depends
    assert depends & {"python3", "python3:any"}, depends
    # RestartMode=direct and RestartSteps= need systemd 254: an older one ignores them,
    # and the first failed attempt would fail containerd and kubelet for good.
    relations = [d.strip() for d in field("Depends").split(",")]
    assert "systemd (>= 254)" in relations, relations
    info = sh("dpkg-deb", "-I", deb).stdout
    assert "preinst" not in info, "a preinst would stop the unit before upgrades"
    scripts = {}
    for name in ("postinst", "prerm", "postrm"):
        text = sh("dpkg-deb", "--info", deb, name).stdout
        scripts[name] = "\n".join(line for line in text.splitlines()
                                  if not line.lstrip().startswith("#"))
    everything = "\n".join(scripts.values())
    # Never start, stop or restart anything: no deb-systemd-invoke, no systemctl verb
    # other than daemon-reload.
    assert "deb-systemd-invoke" not in everything
    verbs = set(re.findall(r"systemctl\s+(?:--system\s+)?([a-z-]+)", everything))
    assert verbs <= {"daemon-reload"}, verbs
    assert "deb-systemd-helper enable 'unbounded-nvidia-setup.service'" in scripts["postinst"]
    assert "deb-systemd-helper purge 'unbounded-nvidia-setup.service'" in scripts["postrm"]
    assert "deb-systemd-helper enable 'unbounded-nvidia-setup-check.timer'" in scripts["postinst"]
    assert "deb-systemd-helper purge 'unbounded-nvidia-setup-check.timer'" in scripts["postrm"]
    # Each daemon-reload is guarded: only where systemd runs (never in an offline rootfs).
    for name, text in scripts.items():
        for block in text.split("\nif ")[1:]:
            if "daemon-reload" in block:
                assert "/run/systemd/system" in block.splitlines()[0], (name, block)


def test_lintian(deb: Path) -> None:
    need_tools("lintian")
    res = sh("lintian", "--pedantic", "--display-experimental", "--info", deb, check=False,
             timeout=300)
    tags = [line for line in res.stdout.splitlines() if re.match(r"^[EWIPX]: ", line)]
    errors = [t for t in tags if t.startswith("E: ")]
    assert not errors, "\n".join(errors)
    warnings = [t for t in tags if t.startswith("W: ")
                and t.split()[2] not in ACCEPTED_LINTIAN_WARNINGS]
    assert not warnings, ("lintian warnings: fix them or explain them in docs/packaging.md "
                          "and ACCEPTED_LINTIAN_WARNINGS:\n" + "\n".join(warnings))


# -- offline installs ---------------------------------------------------------------------


def test_install_dpkg_root_and_purge(trixie: Path, deb: Path) -> None:
    res = sh("dpkg", f"--root={trixie}", "-i", deb)
    assert "Setting up unbounded-nvidia-setup" in res.stdout
    assert_installed_offline(trixie)
    # Debian's python3 packages satisfy the program (imports happen in the rootfs).
    in_root(trixie, "python3", "-c", "import sdnotify, yaml, unbounded_nvidia_setup.cli, "
            "unbounded_nvidia_setup.reconcile, unbounded_nvidia_setup.check, "
            "unbounded_nvidia_setup.state")
    assert in_root(trixie, PACKAGE, "--version").stdout.strip()
    # No NVIDIA device in the chroot: `check` is healthy (no GPU, no state), and its JSON
    # matches the schema the package installed.
    assert in_root(trixie, PACKAGE, "check", check=False).returncode == 0
    out = in_root(trixie, PACKAGE, "check", "--json", check=False)
    report = check_schema.parse_check(out.stdout, out.returncode, trixie / SCHEMA)
    assert report["verdict"] == "no-gpu", report

    state = fake_node_state(trixie)
    sh("dpkg", f"--root={trixie}", "--remove", PACKAGE)
    assert not (trixie / UNIT_DIR / SETUP_UNIT).exists()
    sh("dpkg", f"--root={trixie}", "--purge", PACKAGE)
    assert_purged(trixie)
    # Removal never touches the node's state (a running node keeps working; /run goes
    # at the next boot; `unbounded-nvidia-setup clean` removes it, see the docs).
    assert all(p.exists() for p in state)


def test_install_in_chroot_upgrade_and_purge(trixie: Path, deb: Path, tmp_path: Path) -> None:
    (trixie / "root" / deb.name).write_bytes(deb.read_bytes())
    in_root(trixie, "dpkg", "-i", f"/root/{deb.name}")
    assert_installed_offline(trixie)

    # An upgrade to a newer build (`make deb VERSION=...`) keeps the unit enabled.
    newer_version = f"{pyproject_version()}+pkgtest1"
    newer = make_deb(newer_version, tmp_path / "dist")
    assert sh("dpkg-deb", "--field", newer, "Version").stdout.strip() == newer_version
    (trixie / "root" / newer.name).write_bytes(newer.read_bytes())
    in_root(trixie, "dpkg", "-i", f"/root/{newer.name}")
    assert_installed_offline(trixie)
    assert sh("dpkg-query", f"--root={trixie}", "-W", "-f=${Version}",
              PACKAGE).stdout == newer_version

    in_root(trixie, "dpkg", "--purge", PACKAGE)
    assert_purged(trixie)


def test_nvidia_cdi_refresh_skipped_while_installed(trixie: Path, deb: Path) -> None:
    """Our drop-ins make both toolkit units' conditions fail; removal reverts that."""
    units = ("nvidia-cdi-refresh.service", "nvidia-cdi-refresh.path")
    for unit in units:  # before: they would run
        in_root(trixie, "systemd-analyze", "condition", f"--unit={unit}")
    sh("dpkg", f"--root={trixie}", "-i", deb)
    # The path unit: never set up while we are installed. The service: our drop-in
    # replaces the toolkit's conditions with "an NVIDIA device here" (none in a chroot).
    expected = {"nvidia-cdi-refresh.path":
                ("ConditionPathExists=!/usr/bin/unbounded-nvidia-setup failed",),
                "nvidia-cdi-refresh.service":
                ("ConditionPathExists=|/dev/nvidiactl failed",
                 "ConditionPathExistsGlob=|/dev/nvidia[0-9]* failed")}
    for unit in units:
        res = in_root(trixie, "systemd-analyze", "condition", f"--unit={unit}", check=False)
        assert res.returncode != 0
        for line in expected[unit]:
            assert line in res.stdout + res.stderr, (unit, res.stdout + res.stderr)
        assert "nvidia-smi" not in res.stdout + res.stderr  # the toolkit's are reset
    sh("dpkg", f"--root={trixie}", "--remove", PACKAGE)
    for unit in units:
        in_root(trixie, "systemd-analyze", "condition", f"--unit={unit}")


# -- a build on trixie ----------------------------------------------------------------------


def test_build_on_trixie_and_install(deb: Path, tmp_path: Path) -> None:
    """The package builds on trixie (debhelper 13.24, which puts units in usr/lib itself) as
    on the bookworm host, with the same files and relations, and that .deb installs into a
    trixie machine rootfs. The build tree (rootfs + Build-Depends) is cached
    (tests/buildroot.py): about 40 s after the first run, which downloads the packages."""
    need_tools("debootstrap", "tar", "chroot", "unshare", "dpkg")
    import buildroot
    import rootfs

    try:
        tree = buildroot.fresh_tree(tmp_path / "build-tree")
    except Exception as e:  # no mirror, no network, apt: say why rather than error out
        need(False, f"no trixie build tree (tests/buildroot.py): {e}")
        raise
    try:
        built, output = buildroot.build_deb(tree, REPO, pyproject_version())
        assert "dh_installsystemd" in output
        ours = shutil.copy2(built, tmp_path / built.name)
    finally:
        rootfs.remove_rootfs(tree)
    trixie_deb = Path(ours)

    # The installer's bookkeeping in the .dist-info differs between the two pybuilds
    # (bookworm's keeps RECORD, trixie's INSTALLER); nothing reads either.
    bookkeeping = {"INSTALLER", "RECORD", "REQUESTED", "direct_url.json"}

    def files(package: Path) -> set[str]:
        listing = sh("dpkg-deb", "-c", package).stdout
        paths = {ln.split()[5].removeprefix(".") for ln in listing.splitlines()}
        return {p for p in paths if not (".dist-info/" in p
                                         and p.rsplit("/", 1)[-1] in bookkeeping)}

    assert files(trixie_deb) == files(deb), (sorted(files(trixie_deb) ^ files(deb)))
    for name in ("Depends", "Version", "Architecture"):
        got = sh("dpkg-deb", "--field", trixie_deb, name).stdout.strip()
        want = sh("dpkg-deb", "--field", deb, name).stdout.strip()
        assert got == want, (name, got, want)

    root = new_rootfs(tmp_path / "machine")
    try:
        sh("dpkg", f"--root={root}", "-i", trixie_deb)
        assert_installed_offline(root)
        assert in_root(root, PACKAGE, "--version").stdout.strip()
    finally:
        rootfs.remove_rootfs(root)


# -- one booted machine -------------------------------------------------------------------


def test_booted_machine_refresh_skipped_and_purge_leaves_node_alone(
        trixie: Path, deb: Path, tmp_path: Path) -> None:
    """Booted (no GPU): the toolkit's refresh units are skipped and write no spec; then
    `dpkg --purge` inside the running machine stops and restarts nothing, and the
    refresh service runs again (the mechanism reverts with the package)."""
    need_tools("systemd-nspawn", "nsenter")
    need((REPO / "tests/boot/nspawn.py").is_file(), "no tests/boot/nspawn.py")
    from boot.nspawn import Machine

    sh("dpkg", f"--root={trixie}", "-i", deb)
    (trixie / "root" / deb.name).write_bytes(deb.read_bytes())
    with Machine(trixie, log_dir=tmp_path) as m:
        def up() -> bool | None:
            return m.is_active("kubelet.service") or None

        m.wait_until(up, timeout=90, what="kubelet active",
                     units=(SETUP_UNIT, "containerd.service", "kubelet.service"))
        assert m.is_active(SETUP_UNIT)
        for unit in ("nvidia-cdi-refresh.service", "nvidia-cdi-refresh.path"):
            props = m.show(unit, "ActiveState", "ConditionResult", "UnitFileState")
            assert props == {"ActiveState": "inactive", "ConditionResult": "no",
                             "UnitFileState": "enabled"}, (unit, props)
        assert not m.exists("/var/run/cdi/nvidia.yaml")
        # Someone (nvidia-mig-manager, an operator) restarts it by hand: still skipped on
        # a machine without a GPU (tests/boot has the GPU case: it reloads our unit).
        m.systemctl("restart", "nvidia-cdi-refresh.service", check=True)
        assert not m.exists("/var/run/cdi/nvidia.yaml")

        before = {u: m.show(u, "MainPID", "ActiveEnterTimestampMonotonic", "NRestarts")
                  for u in ("containerd.service", "kubelet.service")}
        setup_before = m.show(SETUP_UNIT, "ActiveEnterTimestampMonotonic")
        m.exec("dpkg", "--purge", PACKAGE)
        after = {u: m.show(u, "MainPID", "ActiveEnterTimestampMonotonic", "NRestarts")
                 for u in ("containerd.service", "kubelet.service")}
        assert after == before, "purge restarted containerd or kubelet"
        assert m.show(SETUP_UNIT, "ActiveEnterTimestampMonotonic") == setup_before
        assert m.show(SETUP_UNIT, "LoadState", "ActiveState") == {
            "LoadState": "not-found", "ActiveState": "active"}  # gone, but never stopped
        assert m.is_active("containerd.service") and m.is_active("kubelet.service")
        requires = m.prop("containerd.service", "Requires")
        assert SETUP_UNIT not in requires.split(), requires  # daemon-reload happened
        m.systemctl("restart", "nvidia-cdi-refresh.service", check=True)
        assert m.read_text("/var/run/cdi/nvidia.yaml") == "stand-in\n"
