"""`run`, `check`, `status`, `clean` end to end: the real CLI, real ELF files, real
ldconfig, the nvidia-ctk stand-in, on simulated machines under --root."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from check_schema import check_report
from invariants import assert_secure_root, secure_after  # noqa: F401  (fixture)
from unbounded_nvidia_setup.tree import manifest

import simgpu
from conftest import NVIDIA_CTK, Cli, needs_root, stand_in_only

pytestmark = [needs_root, pytest.mark.usefixtures("secure_after")]
MA = "x86_64-linux-gnu"


def root_of(m: simgpu.SimMachine) -> Path:
    return m.root / "run/nvidia/driver"


def spec_of(m: simgpu.SimMachine) -> Path:
    return m.root / "etc/cdi/nvidia.yaml"


def snapshot(m: simgpu.SimMachine) -> tuple[object, ...]:
    spec = spec_of(m)
    dropin = m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"
    return (manifest(root_of(m)), spec.read_bytes() if spec.exists() else None,
            dropin.read_bytes() if dropin.exists() else None)


def check_json(cli: Cli, m: simgpu.SimMachine) -> dict[str, object]:
    """`check --json`, validated against the schema (tests/check_schema.py)."""
    return check_report(cli(m.root, "check", "--json"))


def codes(report: dict[str, object]) -> set[str]:
    problems = report["problems"]
    assert isinstance(problems, list)
    return {p["code"] for p in problems}


def load_spec(m: simgpu.SimMachine) -> dict[str, object]:
    import yaml

    doc: dict[str, object] = yaml.safe_load(spec_of(m).read_text())
    return doc


def mounts(doc: dict[str, object]) -> list[str]:
    edits = doc["containerEdits"]
    assert isinstance(edits, dict)
    return [mount["hostPath"] for mount in edits.get("mounts", [])]


def plugin_view(m: simgpu.SimMachine, tmp_path: Path) -> set[str]:
    """What nvidia-ctk (as the device plugin runs it) mounts from the driver root alone:
    the staging mounts are moved away, as they are absent in the plugin's pod. Leaves
    them moved away."""
    shutil.move(m.root / "run/host-nvidia", tmp_path / "hidden")
    out_dir = tmp_path / "plugin"
    out_dir.mkdir()
    proc = subprocess.run([str(NVIDIA_CTK), "cdi", "generate", f"--driver-root={root_of(m)}",
                           f"--dev-root={m.root}", "--mode=management",
                           f"--output={out_dir}/spec.json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out_dir / "spec.json").read_text())
    return {os.path.basename(mt["hostPath"]) for mt in spec["containerEdits"]["mounts"]}


def test_first_run_builds_a_self_contained_root_and_spec(m: simgpu.SimMachine, cli: Cli) -> None:
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    root = root_of(m)
    lib = root / "lib" / MA
    assert sorted(p.name for p in lib.iterdir() if not p.is_symlink() and p.is_file()) == sorted(
        n for n in m.expected_libs if "/" not in n)
    for name, soname in m.expected_libs.items():
        path = lib / name
        assert path.is_file() and not path.is_symlink(), name
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        if soname and soname != os.path.basename(name):
            link = path.parent / soname
            assert os.readlink(link) == os.path.basename(name)
    assert os.readlink(lib / "libcuda.so") == "libcuda.so.1"
    assert os.readlink(lib / "libnvidia-ml.so") == "libnvidia-ml.so.1"
    for helper in m.helpers:
        assert stat.S_IMODE((root / "usr/bin" / helper).stat().st_mode) == 0o755
    for fw in m.firmware:
        assert (root / "lib/firmware" / fw).is_file()
    assert_secure_root(root)
    assert not list(root.parent.glob(".driver.*"))

    doc = load_spec(m)
    assert doc["kind"] == "nvidia.com/gpu"
    host_paths = mounts(doc)
    assert str(lib / f"libcuda.so.{m.version}") in host_paths
    assert str(lib / f"libnvidia-ml.so.{m.version}") in host_paths
    assert not [p for p in host_paths if "/run/host-nvidia" in p]
    assert stat.S_IMODE(spec_of(m).stat().st_mode) == 0o644
    assert not [p for p in spec_of(m).parent.iterdir() if p.name != "nvidia.yaml"]

    dropin = m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf"
    assert f"/run/nvidia/driver/lib/{MA}\n" in dropin.read_text()
    cache = subprocess.run(["ldconfig", "-p", "-C", str(m.root / "etc/ld.so.cache")],
                           capture_output=True, text=True, check=True).stdout
    assert f"libcuda.so.1 (libc6,x86-64) => /run/nvidia/driver/lib/{MA}/libcuda.so.1" in cache

    report = check_json(cli, m)
    assert report["ok"] is True and report["gpu"] is True
    assert report["driver_version"] == m.version
    assert {"driver_root", "cdi_spec"} <= set(report)


def test_log_lines_carry_priority_prefixes_for_the_journal(m: simgpu.SimMachine,
                                                           tmp_path: Path) -> None:
    """With stderr on the journal stream (JOURNAL_STREAM names it) every line carries an
    sd-daemon prefix; elsewhere only errors and warnings are labelled."""
    import sys

    log_file = tmp_path / "stderr"
    (m.staging[0] / f"libnvidia-x y.so.{m.version}").write_text("")  # a warning
    with open(log_file, "w") as f:
        st = os.fstat(f.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root", str(m.root),
                        "run"], env=env, stderr=f, check=True)
    lines = log_file.read_text().splitlines()
    assert lines and all(line[:3] in ("<6>", "<5>", "<4>") for line in lines)
    assert any(line.startswith("<4>ignoring") for line in lines)
    proc = subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root",
                           str(m.root), "run"], env=env, capture_output=True, text=True)
    assert not [line for line in proc.stderr.splitlines() if line.startswith("<")]
    assert any(line.startswith("warning: ignoring") for line in proc.stderr.splitlines())


def test_stale_driver_and_unrelated_files_stay_out(m: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(m.root, "run").code == 0
    root = root_of(m)
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
             and not p.is_symlink()}
    assert files == ({f"lib/{MA}/{n}" for n in m.expected_libs}
                     | {f"usr/bin/{h}" for h in m.helpers}
                     | {f"lib/firmware/{f}" for f in m.firmware})
    names = {p.name for p in root.rglob("*")}
    for stale in m.stale_versions:
        assert not [n for n in names if stale in n]
    assert not names & set(m.unrelated)


def test_root_keeps_libcuda_and_nvml_when_staging_is_hidden(m: simgpu.SimMachine,
                                                            cli: Cli, tmp_path: Path) -> None:
    """The device plugin's view: only the driver root, no staging mounts."""
    assert cli(m.root, "run").code == 0
    names = plugin_view(m, tmp_path)
    assert {f"libcuda.so.{m.version}", f"libnvidia-ml.so.{m.version}", "nvidia-smi"} <= names
    report = check_json(cli, m)
    assert "staging-missing" in codes(report)
    assert not [c for c in codes(report) if c.startswith(("root-", "spec-"))]


def test_old_style_root_of_absolute_links_is_detected_and_replaced(
        m: simgpu.SimMachine, cli: Cli) -> None:
    """The incident: a root of absolute links into /run/host-nvidia/0."""
    lib = root_of(m) / "lib" / MA
    lib.mkdir(parents=True)
    staging = m.staging[0]
    for name in (f"libcuda.so.{m.version}", f"libnvidia-ml.so.{m.version}"):
        os.symlink(staging / name, lib / name)
    report = check_json(cli, m)
    assert {"root-absolute-link", "root-library-not-regular", "spec-missing"} <= codes(report)
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True
    assert_secure_root(root_of(m))


def test_second_run_changes_nothing(m: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(m.root, "run").code == 0
    before = snapshot(m)
    ino = os.stat(root_of(m)).st_ino
    spec_ino = os.stat(spec_of(m)).st_ino
    out = cli(m.root, "run")
    assert out.code == 0
    assert "not rebuilt" in out.stderr
    assert os.stat(root_of(m)).st_ino == ino
    assert os.stat(spec_of(m)).st_ino == spec_ino
    assert snapshot(m) == before


def test_new_driver_version_swaps_in_a_new_generation(m: simgpu.SimMachine, cli: Cli,
                                                      tmp_path: Path) -> None:
    assert cli(m.root, "run").code == 0
    ino = os.stat(root_of(m)).st_ino
    new = simgpu.make_machine(tmp_path / "new", version="570.133.20",
                              stale_versions=(m.version,))
    shutil.rmtree(m.root / "run/host-nvidia")
    shutil.copytree(new.root / "run/host-nvidia", m.root / "run/host-nvidia", symlinks=True)
    shutil.copy(new.root / "proc/driver/nvidia/version", m.root / "proc/driver/nvidia/version")
    assert cli(m.root, "run").code == 0
    assert os.stat(root_of(m)).st_ino != ino
    assert (root_of(m) / "lib" / MA / "libcuda.so.570.133.20").is_file()
    assert not (root_of(m) / "lib" / MA / f"libcuda.so.{m.version}").exists()
    assert not list(root_of(m).parent.glob(".driver.*"))
    report = check_json(cli, m)
    assert report["ok"] is True and report["driver_version"] == "570.133.20"


@pytest.mark.parametrize("tamper,code", [
    ("delete-lib", "root-out-of-date"),
    ("chmod", "root-bad-mode"),
    ("setuid", "root-bad-mode"),
    ("foreign", "root-foreign-file"),
    ("absolute-link", "root-absolute-link"),
    ("escaping-link", "root-escaping-link"),
    ("truncate", "root-out-of-date"),
    ("spec-deleted", "spec-missing"),
    ("spec-garbage", "spec-invalid"),
    ("dropin-deleted", "ldconf-missing"),
    ("legacy-link", "legacy-link"),
    ("shadow-spec", "spec-shadowed"),
])
def test_tampering_is_detected_and_repaired(m: simgpu.SimMachine, cli: Cli, tamper: str,
                                            code: str) -> None:
    assert cli(m.root, "run").code == 0
    lib = root_of(m) / "lib" / MA
    cuda = lib / f"libcuda.so.{m.version}"
    if tamper == "delete-lib":
        (lib / f"libnvidia-ptxjitcompiler.so.{m.version}").unlink()
    elif tamper == "chmod":
        cuda.chmod(0o666)
    elif tamper == "setuid":
        cuda.chmod(0o4755)
    elif tamper == "foreign":
        (root_of(m) / "usr/bin/sh").write_text("#!/bin/sh\n")
    elif tamper == "absolute-link":
        (lib / "libcuda.so.1").unlink()
        os.symlink(m.staging[0] / f"libcuda.so.{m.version}", lib / "libcuda.so.1")
    elif tamper == "escaping-link":
        os.symlink("../../../../../etc/passwd", lib / "libnvidia-x.so.1")
    elif tamper == "truncate":
        os.truncate(cuda, 10)
    elif tamper == "spec-deleted":
        spec_of(m).unlink()
    elif tamper == "spec-garbage":
        spec_of(m).write_text("{{{ not yaml")
    elif tamper == "dropin-deleted":
        (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").unlink()
    elif tamper == "shadow-spec":
        (m.root / "var/run/cdi").mkdir(parents=True)
        shutil.copy(spec_of(m), m.root / "var/run/cdi/nvidia.yaml")
    elif tamper == "legacy-link":
        (m.root / "usr/lib" / MA).mkdir(parents=True, exist_ok=True)
        os.symlink(f"/run/host-nvidia/0/libcuda.so.{m.version}",
                   m.root / "usr/lib" / MA / "libcuda.so.1")
    report = check_json(cli, m)
    assert report["ok"] is False and code in codes(report), report["problems"]
    text = cli(m.root, "check")
    assert text.code == 1 and code in text.stdout
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True
    # lexists: the link dangles on this host (the staging is under the root).
    assert not os.path.lexists(m.root / "usr/lib" / MA / "libcuda.so.1")
    assert not (m.root / "var/run/cdi/nvidia.yaml").exists()


def test_device_plugin_spec_missing_libcuda_is_reported(m: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(m.root, "run").code == 0
    plugin = m.root / "var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"
    plugin.parent.mkdir(parents=True)
    good = {"cdiVersion": "0.5.0", "kind": "k8s.device-plugin.nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [
                {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]}}],
            "containerEdits": {"mounts": [
                {"hostPath": f"/run/nvidia/driver/lib/{MA}/{n}.so.{m.version}",
                 "containerPath": f"/lib/{MA}/{n}.so.{m.version}"}
                for n in ("libcuda", "libnvidia-ml")]}}
    plugin.write_text(json.dumps(good))
    report = check_json(cli, m)
    assert report["ok"] is True and "device_plugin_spec" in report
    # The incident's spec: no libcuda or NVML, and a mount of a file that is not there
    # ("failed to fulfil mount request ... no such file or directory").
    bad = json.loads(json.dumps(good))
    bad["containerEdits"]["mounts"] = [
        {"hostPath": f"/run/nvidia/driver/lib/{MA}/libEGL_nvidia.so.535.183.01",
         "containerPath": f"/lib/{MA}/libEGL_nvidia.so.535.183.01"}]
    plugin.write_text(json.dumps(bad))
    report = check_json(cli, m)
    assert {"plugin-spec-missing-library", "plugin-spec-missing-host-path"} <= codes(report)


def test_status_summarizes(m: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(m.root, "run").code == 0
    out = cli(m.root, "status")
    assert out.code == 0
    assert f"Driver version: {m.version}" in out.stdout and "Problems:       none" in out.stdout
    shutil.rmtree(root_of(m))
    out = cli(m.root, "status")
    assert out.code == 0 and "root-missing" in out.stdout


def test_clean_removes_what_the_tool_made(m: simgpu.SimMachine, cli: Cli) -> None:
    assert cli(m.root, "run").code == 0
    assert cli(m.root, "clean").code == 0
    assert not os.path.lexists(root_of(m)) and not spec_of(m).exists()
    assert not (m.root / "etc/ld.so.conf.d/unbounded-nvidia-setup.conf").exists()
    assert cli(m.root, "clean").code == 0


def test_no_gpu_removes_stale_state_and_succeeds(m: simgpu.SimMachine, cli: Cli) -> None:
    """Hardware can disappear: the GPU goes, and with it the host's staging."""
    assert cli(m.root, "run").code == 0
    for node in (m.root / "dev").glob("nvidia*"):
        node.unlink()
    shutil.rmtree(m.root / "run/host-nvidia")
    report = check_json(cli, m)
    assert report["gpu"] is False and codes(report) == {"stale-state"}
    out = cli(m.root, "run")
    assert out.code == 0 and "No NVIDIA GPU" in out.stderr
    assert not os.path.lexists(root_of(m)) and not spec_of(m).exists()
    assert check_json(cli, m)["ok"] is True


def test_no_gpu_from_the_start_is_a_no_op(tmp_path: Path, cli: Cli) -> None:
    machine = simgpu.make_machine(tmp_path / "root", gpu=False)
    machine.write_config()
    assert cli(machine.root, "run").code == 0
    assert not (machine.root / "run/nvidia").exists()
    assert not (machine.root / "etc/cdi").exists()


def test_fake_device_files_that_are_not_char_devices_mean_no_gpu(tmp_path: Path,
                                                                 cli: Cli) -> None:
    machine = simgpu.make_machine(tmp_path / "root", gpu=False)
    machine.write_config()
    (machine.root / "dev/nvidia0").write_text("")
    assert cli(machine.root, "run").code == 0
    assert not (machine.root / "run/nvidia").exists()


def test_legacy_links_into_staging_are_removed(m: simgpu.SimMachine, cli: Cli) -> None:
    usr = m.root / "usr/lib" / MA
    usr.mkdir(parents=True, exist_ok=True)
    os.symlink(f"/run/host-nvidia/0/libcuda.so.{m.version}", usr / "libcuda.so.1")
    os.symlink("libc.so.6", usr / "libc-keep.so")
    assert cli(m.root, "run").code == 0
    assert not os.path.lexists(usr / "libcuda.so.1")
    assert os.path.lexists(usr / "libc-keep.so")


def test_refuses_to_swap_under_running_containerd(m: simgpu.SimMachine, cli: Cli) -> None:
    proc = m.root / "proc/4242"
    proc.mkdir(parents=True)
    (proc / "comm").write_text("containerd\n")
    (proc / "cgroup").write_text("0::/system.slice/containerd.service\n")
    out = cli(m.root, "run")
    assert out.code == 1 and len(out.errors) == 1
    assert "systemctl restart unbounded-nvidia-setup" in out.errors[0]
    assert not os.path.lexists(root_of(m))
    assert cli(m.root, "run", "--force").code == 0
    # Nothing to swap: no refusal.
    assert cli(m.root, "run").code == 0
    out = cli(m.root, "clean")
    assert out.code == 1 and "removing" in out.errors[0] and os.path.lexists(root_of(m))
    assert cli(m.root, "clean", "--force").code == 0
    assert not os.path.lexists(root_of(m))


@stand_in_only("log its arguments and impersonate 1.17")
def test_hook_flags_follow_the_nvidia_ctk_version(m: simgpu.SimMachine, cli: Cli,
                                                  tmp_path: Path) -> None:
    log_file = tmp_path / "ctk.log"
    m.write_config(nvidia_ctk_args=["--mode=management", "--device-name-strategy=uuid"])
    env = {"FAKE_NVIDIA_CTK_LOG": str(log_file)}
    assert cli(m.root, "run", env=env).code == 0
    calls = [json.loads(line) for line in log_file.read_text().splitlines()]
    generate = [c for c in calls if "generate" in c][-1]
    assert f"--driver-root={root_of(m)}" in generate
    assert f"--dev-root={m.root}" in generate
    assert "--format=yaml" in generate
    assert generate[-2:] == ["--mode=management", "--device-name-strategy=uuid"]
    assert "--disable-hook" in generate
    spec_of(m).unlink()
    log_file.unlink()
    env["FAKE_NVIDIA_CTK_VERSION"] = "1.17.8"
    assert cli(m.root, "run", env=env).code == 0
    calls = [json.loads(line) for line in log_file.read_text().splitlines()]
    generate = [c for c in calls if "generate" in c][-1]
    assert "--disable-hook" not in generate and "--enable-hook" not in generate


def test_status_reaches_systemd(m: simgpu.SimMachine, tmp_path: Path) -> None:
    import sys

    sock_path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.1)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path)}
    proc = subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root",
                           str(m.root), "run"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    messages = []
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except TimeoutError:
        pass
    sock.close()
    assert any(msg.startswith("STATUS=Ready: driver") for msg in messages), messages


@pytest.mark.parametrize("refusal", ["run-nvidia-symlink", "consumers", "shadowed"])
def test_a_refused_run_keeps_the_older_agents_links(m: simgpu.SimMachine, cli: Cli,
                                                    refusal: str) -> None:
    """A run that refuses changes nothing, the older agent's links included: they go with
    the change the run commits to, after every refusal was decided (issue 27), and check
    still names them as legacy links."""
    usr = m.root / "usr/lib" / MA
    usr.mkdir(parents=True, exist_ok=True)
    legacy = usr / f"libcuda.so.{m.version}"
    os.symlink(f"/run/host-nvidia/0/libcuda.so.{m.version}", legacy)
    if refusal == "run-nvidia-symlink":
        (m.root / "elsewhere").mkdir()
        os.symlink("../elsewhere", m.root / "run/nvidia")
    elif refusal == "consumers":
        assert cli(m.root, "run").code == 0
        os.symlink(f"/run/host-nvidia/0/libcuda.so.{m.version}", legacy)
        (m.root / f"run/host-nvidia/0/libnvidia-extra.so.{m.version}").write_bytes(
            (m.lib_dir / f"libnvidia-ml.so.{m.version}").read_bytes())
        os.utime(m.lib_dir / f"libcuda.so.{m.version}", (1, 1))
        proc = m.root / "proc/4242"
        proc.mkdir(parents=True)
        (proc / "comm").write_text("kubelet\n")
        (proc / "cgroup").write_text("0::/system.slice/kubelet.service\n")
    else:
        shutil.copy(m.lib_dir / f"libcuda.so.{m.version}", m.root / "usr/lib/libcuda.so.1")
        conf = m.root / "etc/ld.so.conf.d/000-first.conf"
        conf.write_text("/usr/lib\n")
    before = snapshot(m)
    out = cli(m.root, "run")
    assert out.code != 0 and len(out.errors) == 1, out.stderr
    assert os.path.islink(legacy), f"a refused run removed {legacy}: {out.stderr}"
    assert snapshot(m) == before
    problems = check_json(cli, m)["problems"]
    assert isinstance(problems, list)
    assert str(legacy) in {p["path"] for p in problems if p["code"] == "legacy-link"}
    if refusal == "run-nvidia-symlink":
        (m.root / "run/nvidia").unlink()
    elif refusal == "shadowed":
        (m.root / "usr/lib/libcuda.so.1").unlink()
    assert cli(m.root, "run", "--force").code == 0
    assert not os.path.lexists(legacy)


def test_a_failed_restart_keeps_check_truthful(m: simgpu.SimMachine, cli: Cli) -> None:
    """After a failed run on a live node the previous root and spec stay live and pass
    every check of the files, but containerd and kubelet are down: check must not say a
    plain `ready`. The run's failure and its cause are in check and status (issue 27)."""
    assert cli(m.root, "run").code == 0
    before = snapshot(m)
    m.write_config(nvidia_ctk_args=["--mode=no-such-mode"])
    failed = cli(m.root, "run")
    assert failed.code == 1 and len(failed.errors) == 1, failed.stderr
    assert snapshot(m) == before
    report = check_json(cli, m)
    assert report["verdict"] == "broken" and codes(report) == {"setup-failed"}, report
    problems = report["problems"]
    assert isinstance(problems, list)
    problem, = problems
    assert "nvidia-ctk cdi generate failed" in problem["message"], problem
    assert problem["path"] == str(m.root / "run/unbounded-nvidia-setup.last-run")
    status = cli(m.root, "status").stdout
    assert "Last run:       `run` failed at " in status and "nvidia-ctk" in status, status
    m.write_config()
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["verdict"] == "ready"
    assert "Last run:       `run` succeeded at " in cli(m.root, "status").stdout
