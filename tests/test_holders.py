"""Pods left on a replaced driver root (issue 23, point 3): real processes in private mount
namespaces that bind-mount the driver root as the device plugin does, or its parent, then
a run that swaps in a new generation. `check` names each process that still sees the
replaced one (`pod-on-old-root`), from the kernel's own /proc/<pid>/mountinfo; the
simulated machine's /proc/<pid> is the real one, bound in."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from invariants import product_argv, product_env
from unbounded_nvidia_setup import holders

import simgpu
from conftest import Cli, needs_root
from test_run import check_json, codes, root_of

pytestmark = [needs_root]


class Pods:
    """Processes that bind-mount a path in their own mount namespace and sleep."""

    def __init__(self, m: simgpu.SimMachine, tmp_path: Path) -> None:
        self.m, self.tmp = m, tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.binds: list[Path] = []

    def start(self, source: Path, name: str) -> int:
        target = self.tmp / name
        if source.is_dir():
            target.mkdir()
        else:
            target.touch()
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount --bind "{source}" "{target}" && echo up && exec sleep 600'],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        # The machine's /proc/<pid> is the real one (its mountinfo, comm, cgroup, ns).
        seen = self.m.root / "proc" / str(proc.pid)
        seen.mkdir(parents=True)
        subprocess.run(["mount", "--bind", f"/proc/{proc.pid}", str(seen)], check=True)
        self.binds.append(seen)
        return proc.pid

    def stop(self) -> None:
        for seen in self.binds:
            subprocess.run(["umount", "-l", str(seen)], check=False)
            seen.rmdir()
        self.binds.clear()
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()


@pytest.fixture
def pods(m: simgpu.SimMachine, tmp_path: Path) -> Iterator[Pods]:
    running = Pods(m, tmp_path)
    yield running
    running.stop()


def new_generation(m: simgpu.SimMachine, cli: Cli) -> None:
    """The host's driver files changed: the next run builds and swaps a new root."""
    lib = m.lib_dir / f"libnvidia-cfg.so.{m.version}"
    os.utime(lib, (1_700_000_000, 1_700_000_000))
    out = cli(m.root, "run", "--force")  # the sleeping pods are not containerd
    assert out.code == 0 and "now holds driver" in out.stderr, out.stderr


def test_a_pod_on_the_replaced_root_is_named(m: simgpu.SimMachine, cli: Cli,
                                             pods: Pods) -> None:
    assert cli(m.root, "run").code == 0
    plugin = pods.start(root_of(m), "driver-root")  # the device plugin's mount
    follower = pods.start(root_of(m).parent, "run-nvidia")  # its parent: follows swaps
    # A CDI consumer binds single files of the root.
    (pods.tmp / "libcuda").mkdir()
    cdi = pods.start(root_of(m) / "lib" / simgpu.MULTIARCH / f"libcuda.so.{m.version}",
                     "libcuda/libcuda.so.1")
    assert check_json(cli, m)["ok"] is True  # the live generation: nothing to say
    new_generation(m, cli)
    report = check_json(cli, m)
    problems = report["problems"]
    assert isinstance(problems, list)
    found = [p for p in problems if p["code"] == "pod-on-old-root"]
    assert sorted(p["path"] for p in found) == sorted(
        str(m.root / "proc" / str(pid)) for pid in (plugin, cdi)), found
    found = [p for p in found if p["path"].endswith(f"/{plugin}")]
    message = found[0]["message"]
    assert f"pid {plugin} (sleep)" in message and "/driver-root" in message, message
    assert "/.driver." in message and "//deleted" in message, message
    assert str(follower) not in message
    assert report["verdict"] == "broken"
    # What each sees now, through its own mount namespace (/proc/<pid>/root):
    # the plugin's mount is the deleted old generation, empty; the parent's follows.
    old_view = Path(f"/proc/{plugin}/root") / str(pods.tmp / "driver-root").lstrip("/")
    assert not os.path.exists(old_view / "lib") and os.listdir(old_view) == []
    new_view = (Path(f"/proc/{follower}/root") / str(pods.tmp / "run-nvidia").lstrip("/")
                / "driver/lib" / simgpu.MULTIARCH / f"libcuda.so.{m.version}")
    assert new_view.is_file()
    pods.stop()
    assert check_json(cli, m)["ok"] is True


def test_the_run_itself_does_not_fail_for_old_pods(m: simgpu.SimMachine, cli: Cli,
                                                   pods: Pods) -> None:
    """A restart with pods running (containerd's KillMode=process keeps them) must still
    make the node Ready: the pods are their owners' to restart, not a rollback's cause."""
    assert cli(m.root, "run").code == 0
    pods.start(root_of(m), "driver-root")
    new_generation(m, cli)
    assert codes(check_json(cli, m)) == {"pod-on-old-root"}


def test_a_check_without_capabilities_names_them_too(m: simgpu.SimMachine, cli: Cli,
                                                     pods: Pods) -> None:
    """The drift check's unit runs `check` with no capabilities (CapabilityBoundingSet=
    empty). A pod's /proc/<pid>/ns/mnt then cannot be read (it needs ptrace access), and
    `check` used to skip every such process: the unit said `ready` while full root named
    the pod (issue 37, point 2). mountinfo is readable by anyone, and is enough."""
    assert cli(m.root, "run").code == 0
    plugin = pods.start(root_of(m), "driver-root")
    new_generation(m, cli)
    out = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all",
                          *product_argv(m.root, "check", "--json")], capture_output=True,
                         text=True, env=product_env(None), timeout=60, stdin=subprocess.DEVNULL)
    denied = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "readlink",
                             "-e", f"/proc/{plugin}/ns/mnt"], capture_output=True, text=True)
    assert denied.returncode != 0, "the sandbox this test stands for can read a pod's namespace"
    report = json.loads(out.stdout)
    found = [p["path"] for p in report["problems"] if p["code"] == "pod-on-old-root"]
    assert found == [str(m.root / "proc" / str(plugin))], (report, out.stderr)


def test_mountinfo_and_cgroup_as_the_kernel_writes_them() -> None:
    line = ("1234 1180 0:27 /nvidia/.driver.k2j4h8//deleted /driver\\040root ro,nosuid "
            "master:5 - tmpfs tmpfs rw,size=65536k")
    assert holders.parse_mountinfo(line) == [
        ("0:27", "/nvidia/.driver.k2j4h8//deleted", "/driver root")]
    cid = "0f" * 32
    cgroup = f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{cid}.scope\n"
    assert holders.container_of(cgroup) == cid
    assert holders.container_of("0::/system.slice/containerd.service\n") is None
