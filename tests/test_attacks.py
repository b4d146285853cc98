"""Nothing inside the machine can stop, fool or hijack the setup (issue 37): the attacks
this change answers, each tried against the product as a non-root process, a pod or a
hostile staged file would, and each seen to work on the product before it.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import elfmutate
import simgpu
from conftest import Cli, needs_root
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


def test_a_fifo_in_place_of_the_lock_does_not_hang_check(m: simgpu.SimMachine,
                                                         cli: Cli) -> None:
    """The lock's directory, /run/lock, is world-writable. Before, a FIFO created there
    under the lock's name made `check`'s open block for ever (and the drift check's
    unit has no TimeoutStartSec=). Now `check` opens it without blocking and takes only
    a regular file of root's for a lock."""
    assert cli(m.root, "run").code == 0
    lock = m.root / "run/lock/unbounded-nvidia-setup.lock"
    lock.unlink()
    os.mkfifo(lock)
    out = cli(m.root, "check", timeout=30)
    assert out.code == 0 and "verdict: ready" in out.stdout, out.stdout


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
