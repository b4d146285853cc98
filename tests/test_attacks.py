"""Nothing inside the machine can stop, fool or hijack the setup (issue 37): the attacks
this change answers, each tried against the product as a non-root process, a pod or a
hostile staged file would, and each seen to work on the product before it.
"""

from __future__ import annotations

import fcntl
import os
import re
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import invariants

import elfmutate
import simgpu
from conftest import Cli, needs_root, needs_tool
from test_lost_gpu import check_json

pytestmark = needs_root

GIB = 1 << 30


def run_limited(root: Path, *args: str, address_space: int) -> subprocess.CompletedProcess[str]:
    """The CLI with RLIMIT_AS set, as a unit's MemoryMax= would bound it."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root", str(root),
                           *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit, stdin=subprocess.DEVNULL)


def test_a_sparse_library_claiming_a_huge_dynamic_segment_is_refused(
        m: simgpu.SimMachine) -> None:
    """A staged libnvidia-*.so.<ver> of 8 GiB apparent size (a few KiB on disk) whose
    PT_DYNAMIC claims 4 GiB: before, `run` and `check` read it whole and, under a 2 GiB
    address-space limit, ended in a MemoryError traceback. Now it is refused in one
    line naming the file."""
    victim, = [p for top in m.staging for p in top.glob(f"libnvidia-glcore.so.{m.version}")]
    data = victim.read_bytes()
    mutated = elfmutate.dynamic_field(32, 4 * GIB)(data)
    assert mutated is not None
    victim.write_bytes(mutated)
    os.truncate(victim, 8 * GIB)
    assert victim.stat().st_blocks * 512 < 1 << 24  # sparse: nothing of it on disk
    out = run_limited(m.root, "run", address_space=2 * GIB)
    assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr, out.stderr
    assert out.returncode == 1, out.stderr
    error, = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert str(victim) in error and "dynamic segment of 4294967296 bytes" in error, error
    out = run_limited(m.root, "check", address_space=2 * GIB)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1 and "staging-invalid" in out.stdout, out.stdout


def test_status_and_check_escape_what_they_print(m: simgpu.SimMachine, cli: Cli) -> None:
    """A staged name or a process name is the machine's, printed to root's terminal:
    before, `status` printed a staged name's escape sequences raw (a terminal obeys
    them). Every control character now reaches the terminal escaped."""
    assert cli(m.root, "run").code == 0
    hostile = m.staging[0] / "libnvidia-\x1b]0;pwned\x07\x1b[2J.so.1"
    hostile.write_bytes(b"not an ELF file")
    for command in ("status", "check"):
        out = cli(m.root, command)
        assert "\x1b" not in out.stdout and "\x07" not in out.stdout, repr(out.stdout)
        assert "\x1b" not in out.stderr and "\x07" not in out.stderr, repr(out.stderr)
    status = cli(m.root, "status").stdout
    assert "\\x1b]0;pwned\\x07" in status, status  # said, escaped (Left out:)
    report = check_json(cli, m)
    assert any("\x1b" in left["path"] for left in report["left_out"]), report["left_out"]


def test_a_pods_process_named_containerd_keeps_no_node_dark(m: simgpu.SimMachine,
                                                            cli: Cli) -> None:
    """A pod's processes may call themselves containerd and kubelet (a Docker-in-Docker
    pod runs a real containerd). Before, a run that had to replace the driver root
    refused on every retry ("would change the driver under running pods"): the node
    stayed dark. Their cgroup is the pod's, not containerd.service's or kubelet.service's
    (on the running system the tool asks systemd instead): no refusal."""
    assert cli(m.root, "run").code == 0
    for pid, comm in (("4242", "containerd"), ("4243", "kubelet")):
        proc = m.root / "proc" / pid
        proc.mkdir(parents=True)
        (proc / "comm").write_text(f"{comm}\n")
        (proc / "cgroup").write_text(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/"
            f"cri-containerd-{pid}.scope\n")
    os.utime(m.lib_dir / f"libcuda.so.{m.version}", (1, 1))  # a driver change: a new root
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    assert "driver root" in out.stderr and "now holds driver" in out.stderr, out.stderr
    # containerd's own process, in its unit's cgroup, is one.
    (m.root / "proc/4242/cgroup").write_text("0::/system.slice/containerd.service\n")
    os.utime(m.lib_dir / f"libcuda.so.{m.version}", (2, 2))
    out = cli(m.root, "run")
    assert out.code == 1 and "containerd running" in out.errors[0], out.stderr


def test_a_config_others_can_write_is_refused(m: simgpu.SimMachine, cli: Cli) -> None:
    """The config names the programs root runs. Before, its owner and mode were never
    looked at, and `ldconfig:` could be a relative path, run from wherever the admin
    stood. Now it must be root's (or the caller's) and writable by nobody else, and
    program keys are names (on PATH, as DESIGN says) or absolute paths."""
    config = m.root / "etc/unbounded/nvidia-setup.yaml"
    config.chmod(0o666)
    out = cli(m.root, "run")
    assert out.code == 2 and "mode 0666" in out.errors[0] and "chmod go-w" in out.errors[0]
    config.chmod(0o644)
    os.chown(config, 65534, 65534)
    out = cli(m.root, "check")
    assert out.code == 2 and "owned by uid 65534" in out.errors[0], out.stderr
    os.chown(config, 0, 0)
    m.write_config(ldconfig="bin/ldconfig")
    out = cli(m.root, "run")
    assert out.code == 2 and "'ldconfig' must be a program name or an absolute path" in \
        out.errors[0], out.stderr


def test_the_lock_is_out_of_a_strangers_reach(m: simgpu.SimMachine, cli: Cli) -> None:
    """The lock was /run/lock/unbounded-nvidia-setup.lock, in a world-writable directory:
    any process that created it first and held an flock on it made every run exit 75, and
    a FIFO under its name made `check`'s open block for ever. Now it is
    /run/unbounded-nvidia-setup.lock: /run is root's alone, and the file is root's 0600,
    so no other user can create, open or flock it. A holder of the old name stops nothing."""
    assert Path("/run").stat().st_uid == 0 and not Path("/run").stat().st_mode & 0o022
    old = m.root / "run/lock/unbounded-nvidia-setup.lock"
    old.parent.mkdir(parents=True, exist_ok=True)
    old.parent.chmod(0o1777)
    old.touch()
    with old.open() as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = cli(m.root, "run", timeout=120)
    assert out.code == 0, out.stderr
    lock = m.root / "run/unbounded-nvidia-setup.lock"
    st = lock.stat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    # A FIFO there (root put it, by mistake) still does not hang `check`.
    lock.unlink()
    os.mkfifo(lock)
    out = cli(m.root, "check", timeout=30)
    assert out.code == 0 and "verdict: ready" in out.stdout, out.stdout


def test_a_flock_on_the_metrics_directory_stops_no_metrics(m: simgpu.SimMachine,
                                                          cli: Cli) -> None:
    """node_exporter's textfile directory is world-readable: any process can open it and
    hold an flock on it. Writers used to serialize on exactly that flock, so a stranger
    holding it stopped every run's and every check's metrics. Now they lock a file of
    root's, mode 0600, that no other user can open."""
    directory = m.root / "var/lib/prometheus/node-exporter"
    directory.mkdir(parents=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        out = cli(m.root, "run")
        assert out.code == 0 and "metrics not written" not in out.stderr, out.stderr
        out = cli(m.root, "check", "--metrics")
        assert out.code == 0 and "metrics not written" not in out.stderr, out.stderr
    finally:
        os.close(fd)
    assert "unbounded_nvidia_setup_check_ok 1" in \
        (directory / "unbounded_nvidia_setup.prom").read_text()
    st = (directory / ".unbounded_nvidia_setup.prom.lock").stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600


@needs_tool("strace")
def test_legacy_links_are_removed_relative_to_their_directory(m: simgpu.SimMachine) -> None:
    """An older agent's links in /usr/lib/<multiarch> are judged from a scandir and then
    removed. By path, a directory on that path changed in between (a link swapped in)
    would take the unlink elsewhere; relative to the directory's descriptor, the unlink
    reaches the directory that was judged. Seen in strace: unlinkat(<dir fd>, name)."""
    usr = m.root / "usr/lib/x86_64-linux-gnu"
    usr.mkdir(parents=True, exist_ok=True)
    os.symlink(f"/run/host-nvidia/0/libcuda.so.{m.version}", usr / "libcuda.so.1")
    run = invariants.traced(m.root, "run")
    assert run.outcome.code == 0, run.outcome.stderr
    assert not os.path.lexists(usr / "libcuda.so.1")
    unlinks = [c for c in run.calls if c.name in ("unlink", "unlinkat")
               and c.args and "libcuda.so.1" in c.args[-2 if c.name == "unlinkat" else 0]]
    assert unlinks and all(c.name == "unlinkat" and re.fullmatch(rf"\d+<{re.escape(str(usr))}>",
                                                                 c.args[0])
                           and c.args[1] == '"libcuda.so.1"' for c in unlinks), unlinks


@needs_tool("strace")
@pytest.mark.parametrize("refused", ["flock", "renameat2", "openat:when=200", "fsync",
                                     "mkdir", "ioctl"])
def test_a_call_the_sandbox_refuses_ends_the_run_in_its_own_words(
        m: simgpu.SimMachine, cli: Cli, refused: str) -> None:
    """The unit's SystemCallFilter= answers a call it blocks with EPERM
    (SystemCallErrorNumber=), as does a drop-in that narrows it: the run must end in one
    line, exit 1 (the unit retries), never a traceback or a hang, with the live root and
    spec as they were. strace's error injection returns what seccomp would."""
    assert cli(m.root, "run").code == 0
    spec = (m.root / "etc/cdi/nvidia.yaml").read_bytes()
    (m.lib_dir / f"libnvidia-cfg.so.{m.version}").touch()  # a new generation to swap in
    name, _, when = refused.partition(":")
    run = invariants.traced(m.root, "run", "--force", timeout=120,
                            inject=f"{name}:error=EPERM" + (f":{when}" if when else ""))
    out = run.outcome
    refused_calls = [c for c in run.calls if c.name == name and "EPERM" in c.result]
    if out.code == 0:  # a call whose failure the product rightly takes in its stride
        assert refused_calls, f"{refused}: never made"
        return
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.code == 1 and len(errors) == 1, out.stderr
    assert "not permitted" in errors[0].lower(), errors[0]
    assert (m.root / "etc/cdi/nvidia.yaml").read_bytes() == spec
    assert cli(m.root, "run").code == 0


def test_a_metrics_lock_file_others_could_hold_is_not_used(m: simgpu.SimMachine,
                                                           cli: Cli) -> None:
    """The lock file is trusted only as root's, 0600: one another user owns (a directory
    others may write), or one others may open, could be held by them for ever. Such a
    file stops the metrics with one warning naming it, never the run."""
    directory = m.root / "var/lib/prometheus/node-exporter"
    directory.mkdir(parents=True)
    lock = directory / ".unbounded_nvidia_setup.prom.lock"
    for owner, mode in ((65534, 0o600), (0, 0o644)):
        lock.touch()
        os.chown(lock, owner, owner)
        lock.chmod(mode)
        out = cli(m.root, "run")
        warned = [line for line in out.stderr.splitlines() if "metrics not written" in line]
        assert out.code == 0 and len(warned) == 1, out.stderr
        assert str(lock) in warned[0] and "remove it" in warned[0], warned
        assert not (directory / "unbounded_nvidia_setup.prom").exists()
        lock.unlink()


def test_code_planted_in_the_working_directory_is_not_run(tmp_path: Path) -> None:
    """The NVML child (a degraded node's run starts it) was `python3 -m
    unbounded_nvidia_setup.nvml` without -I: a package of that name in the directory an
    admin typed `run` in was imported and ran as root. It now runs isolated (-I)."""
    import simnvml

    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    simnvml.lose_gpu(m, 1)
    planted = tmp_path / "cwd" / "unbounded_nvidia_setup"
    planted.mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (planted / "nvml.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    # As the admin types it: the installed command (its own directory first on sys.path,
    # never the working directory), standing in the directory with the planted package.
    command = Path(__file__).resolve().parent.parent / "guest/scripts/unbounded-nvidia-setup"
    proc = subprocess.run([sys.executable, str(command), "--root", str(m.root), "run"],
                          cwd=planted.parent, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "running: " in proc.stderr and "-I -m unbounded_nvidia_setup.nvml" in proc.stderr
    assert not marker.exists()


def test_the_device_plugins_spec_is_read_bounded(m: simgpu.SimMachine, cli: Cli) -> None:
    """/var/run/cdi is the plugin's to write. Before, `check` read its spec with
    read_text(): through a symlink, waiting for ever on a FIFO, whatever its size. Now a
    regular file only, never through a link, at most 4 MiB: anything else is
    plugin-spec-invalid, named."""
    assert cli(m.root, "run").code == 0
    spec = m.root / "var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(spec)
    out = cli(m.root, "check", "--json", timeout=30)
    assert '"plugin-spec-invalid"' in out.stdout and "not a regular file" in out.stdout
    spec.unlink()
    spec.symlink_to(m.cdi_spec)
    out = cli(m.root, "check", "--json", timeout=30)
    assert '"plugin-spec-invalid"' in out.stdout and "a symlink" in out.stdout, out.stdout
    spec.unlink()
    spec.write_text('{"kind": "k8s.device-plugin.nvidia.com/gpu", "pad": "'
                    + "x" * (5 << 20) + '"}')
    out = cli(m.root, "check", "--json", timeout=30)
    assert '"plugin-spec-invalid"' in out.stdout and "larger than 4194304 bytes" in out.stdout


def test_an_unsafe_name_behind_a_safe_link_stays_out_of_root_and_spec(
        m: simgpu.SimMachine, cli: Cli) -> None:
    """A staged link with a plain name, libnvidia-ok.so.1, to a real library named
    `libnvidia-ok.so x<newline>::evil.so.<ver>`. Before, the link's name passed the
    plain-name rule and its file was copied into the root under the file's own name:
    nvidia-ctk put that name in every pod's mounts and create-symlinks --link, which
    NVIDIA's hook fails on, so every GPU pod failed. Now a file enters the root only under
    a plain name: the link and its file are left out, said in one line, and the root's
    SONAME link is not made either (nothing dangles)."""
    import elfbuild

    hostile = f"libnvidia-ok.so x\n::evil.so.{m.version}"
    elfbuild.compile_so(m.lib_dir / hostile, "libnvidia-ok.so.1")
    (m.lib_dir / "libnvidia-ok.so.1").symlink_to(hostile)
    out = cli(m.root, "run")
    assert out.code == 0, out.stderr
    in_root = [str(p) for p in m.driver_root.rglob("*") if "ok.so" in p.name]
    assert in_root == [], in_root
    spec = m.cdi_spec.read_text()
    assert "evil" not in spec and "libnvidia-ok" not in spec, spec
    said = [line for line in out.warnings if "libnvidia-ok.so.1: links to" in line]
    assert len(said) == 1 and "the link and its file are left out" in said[0], out.stderr
    report = check_json(cli, m)
    assert report["ok"] is True, report["problems"]
    assert str(m.lib_dir / "libnvidia-ok.so.1") in [left["path"] for left in report["left_out"]]


def hostile_spec_ctk(directory: Path, doc: object) -> Path:
    """A stand-in nvidia-ctk (config key `nvidia_ctk`) whose `cdi generate` writes `doc`
    as the spec; `--version` answers 1.20.0."""
    import yaml

    directory.mkdir(exist_ok=True)
    spec = directory / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))
    script = directory / "nvidia-ctk"
    script.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then
    printf 'NVIDIA Container Toolkit CLI version 1.20.0\\ncommit: 0\\n'; exit 0
fi
for arg; do case "$arg" in --output=*) cp {spec} "${{arg#--output=}}";; esac; done
""")
    script.chmod(0o755)
    return script


def test_a_spec_naming_paths_outside_the_root_is_not_installed(
        m: simgpu.SimMachine, cli: Cli, tmp_path: Path) -> None:
    """nvidia-ctk's spec was checked for staging paths and missing files only: one that
    mounted a file of the machine's (its config), or whose hooks named a `..` path, a
    newline or a second `::`, was installed and handed to every GPU pod. Now each mount
    must be a plain path of the driver root (or a device node), each hook path argument
    plain: such a spec is refused in one line, the previous spec kept; `check` reports a
    spec changed so afterwards as spec-unsafe-path."""
    import copy
    from typing import Any

    import yaml

    assert cli(m.root, "run").code == 0
    good = m.cdi_spec.read_bytes()
    doc = yaml.safe_load(good)
    outside = str(m.config_path)

    def args_of(d: dict[str, Any], hook: str) -> list[str]:
        found: list[str]
        found, = [h["args"] for h in d["containerEdits"]["hooks"] if hook in h["args"]]
        return found  # the hook's own list: changing it changes `d`

    def mount_outside(d: dict[str, Any]) -> None:
        d["containerEdits"]["mounts"].append({"hostPath": outside, "containerPath": "/x.so",
                                              "options": ["ro", "nosuid", "nodev", "rbind"]})

    def folder_escaping(d: dict[str, Any]) -> None:
        args_of(d, "update-ldcache").extend(["--folder", "/lib/../../etc"])

    def link_with_newline(d: dict[str, Any]) -> None:
        args_of(d, "create-symlinks").extend(
            ["--link", "libcuda.so.1::/lib/x86_64-linux-gnu/libcuda.so\n::evil"])

    def target_escaping(d: dict[str, Any]) -> None:
        args_of(d, "create-symlinks").extend(
            ["--link", "../../../../etc/shadow::/lib/x86_64-linux-gnu/libx.so"])

    for change, words in ((mount_outside, f"mounts {outside}, which is outside"),
                          (folder_escaping, "'--folder /lib/../../etc', which has a '..'"),
                          (link_with_newline, "which has a control character"),
                          (target_escaping, "climbs above the container's root")):
        hostile = copy.deepcopy(doc)
        change(hostile)
        m.write_config(nvidia_ctk=str(hostile_spec_ctk(tmp_path / change.__name__, hostile)))
        out = cli(m.root, "run")
        assert out.code == 1, (change.__name__, out.stderr)
        error, = out.errors
        assert words in error and "it was not installed" in error, error
        assert "the previous driver root and spec were kept" in error, error
        assert m.cdi_spec.read_bytes() == good
        m.cdi_spec.write_text(yaml.safe_dump(hostile))
        report = check_json(cli, m)
        assert "spec-unsafe-path" in [p["code"] for p in report["problems"]], report
        m.cdi_spec.write_bytes(good)


def test_the_hook_arguments_nvidia_ctk_writes_pass_and_hostile_ones_do_not() -> None:
    """spec.hook_problem on argument lists as NVIDIA's nvidia-ctk writes them (relative
    targets that climb, as the DRM by-path and GBM links do; bus ids with single colons;
    `@` host paths; `--flag=value`), and on hostile ones."""
    from unbounded_nvidia_setup.spec import hook_problem

    lib = "/usr/lib/x86_64-linux-gnu"
    fine = [
        ["nvidia-cdi-hook", "create-symlinks", "--link", f"libcuda.so.1::{lib}/libcuda.so",
         "--link", f"../libnvidia-allocator.so.1::{lib}/gbm/nvidia-drm_gbm.so",
         "--link", "../card1::/dev/dri/by-path/pci-0000:17:00.0-card"],
        ["nvidia-cdi-hook", "update-ldcache", "--ldconfig-path=@/sbin/ldconfig.real",
         "--folder", lib, f"--folder={lib}/vdpau"],
        ["nvidia-ctk", "hook", "enable-cuda-compat", "--host-driver-version=550.127.05"],
        ["nvidia-cdi-hook", "chmod", "--mode", "755", "--path", "/dev/dri"],
    ]
    assert [hook_problem(args) for args in fine] == [None] * len(fine)
    hostile = [
        (["--link", f"libnvidia-ok.so x\n::evil.so.1::{lib}/libnvidia-ok.so.1"],
         "has a control character"),
        (["--link", f"a.so::b::{lib}/a.so.1"], "has a '::'"),
        (["--link", f"../../../../etc/shadow::{lib}/x.so"],
         "has a target that climbs above the container's root"),
        (["--link", f"x.so::{lib}/../../../etc/x.so"], "has a '..'"),
        ([f"--link={lib}/x.so"], "has no '::'"),
        (["--folder", "lib"], "is not absolute"),
        (["--ldconfig-path", "@/sbin/../tmp/ldconfig"], "has a '..'"),
        (["--host-driver-version=550\n"], "has a control character"),
    ]
    assert [(why := hook_problem(args)) and why[1] for args, _ in hostile] == \
        [want for _, want in hostile]
