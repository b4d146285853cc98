"""`make demo`: the main job on a simulated GPU machine.

Builds a machine in a temporary directory (staging dirs with real ELF driver libraries,
a stale older driver, unrelated libraries and hostile entries; mknod device nodes; a
kernel module version; the nvidia-ctk stand-in), then runs the real tool against it with
--root: run, check, status, a second run, tampering and repair, and the device plugin's
view with the staging mounts hidden. It ends with a GPU pod: on a machine staged with the
real NVIDIA userspace from Debian non-free, podman + runc start a container from the spec
`run` installed, beside the incident's spec that lacks libcuda and NVML.

NVIDIA's own tools are used when they are beside the checkout (../shared, as .ci/run
finds them): its nvidia-ctk and nvidia-cdi-hook in place of the stand-ins, `run` then
generating in NVML mode against the simulated NVML of the staging, and its device plugin.
UNB_TEST_NVIDIA_CTK (tests/toolkit.py) chooses instead when it is set: a real nvidia-ctk
it names, or the stand-ins when it is set empty. A fresh clone has no ../shared and runs
the stand-ins; the demo says which nvidia-ctk it runs, and why.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pod
import realdriver
import simgpu
import toolkit
from realmachine import real_machine

TOOL = [sys.executable, "-m", "unbounded_nvidia_setup"]


CHECKOUT = Path(__file__).resolve().parent.parent
# NVIDIA's real binaries beside the checkout, as .ci/run finds them. A fresh clone has
# none: the demo then runs the stand-ins, saying so.
SHARED = CHECKOUT.parent / "shared"
# NVIDIA's real device plugin, when it is beside the checkout (or UNB_TEST_DEVICE_PLUGIN
# names it): without it the demo imitates it, saying so.
SHARED_PLUGIN = SHARED / "k8s-device-plugin" / "bin" / "nvidia-device-plugin"
# NVIDIA's real nvidia-ctk, with its nvidia-cdi-hook in the same directory.
SHARED_NVIDIA_CTK = SHARED / "nvidia-container-toolkit" / "bin" / "nvidia-ctk"


def executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def choose_nvidia_ctk() -> str:
    """Choose the nvidia-ctk the demo runs, for tests/toolkit.py and for every program the
    demo starts (they inherit UNB_TEST_NVIDIA_CTK): the one UNB_TEST_NVIDIA_CTK names
    when it is set (set empty: the stand-in), else NVIDIA's beside the checkout when it
    is there with its nvidia-cdi-hook, else the stand-in. Returns where the choice came
    from, in words for the step line."""
    if toolkit.ENV in os.environ:
        return (f"named by {toolkit.ENV}" if os.environ[toolkit.ENV] else
                f"{toolkit.ENV} is set empty")
    if not (executable(SHARED_NVIDIA_CTK)
            and executable(SHARED_NVIDIA_CTK.with_name("nvidia-cdi-hook"))):
        return "NVIDIA's nvidia-ctk is not beside the checkout"
    os.environ[toolkit.ENV] = str(SHARED_NVIDIA_CTK)
    # toolkit chose at import from the environment: choose again (the modules that use
    # it read toolkit.NVIDIA_CTK, NVIDIA_CDI_HOOK, REAL when they run).
    importlib.reload(toolkit)
    return "beside the checkout"


def nvidia_ctk_step(why: str) -> None:
    """One step line: which nvidia-ctk `run` uses, and why."""
    if not toolkit.REAL:
        stand_in = toolkit.STAND_IN_NVIDIA_CTK.relative_to(CHECKOUT)
        step(f"nvidia-ctk: the stand-in ({stand_in}): {why}")
        return
    proc = subprocess.run([str(toolkit.NVIDIA_CTK), "--version"], text=True,
                          capture_output=True)
    lines = proc.stdout.splitlines()
    version = lines[0] if proc.returncode == 0 and lines else (
        f"--version failed: exit {proc.returncode}")
    step(f"nvidia-ctk: NVIDIA's own, {why}: {toolkit.NVIDIA_CTK} ({version})")


def plugin_binary() -> Path | None:
    named = os.environ.get(toolkit.PLUGIN_ENV)
    path = Path(named) if named else SHARED_PLUGIN
    return path if path.is_file() and os.access(path, os.X_OK) else None


def plugin_view(m: simgpu.SimMachine, root: Path, work: Path) -> None:
    """What the device plugin writes from the driver root alone (its pod sees no staging):
    NVIDIA's plugin itself when it is here, else nvidia-ctk's discovery, which the
    plugin vendors, with the staging hidden."""
    binary = plugin_binary()
    if binary is None:
        step("The device plugin's view, IMITATED (NVIDIA's plugin is not beside the "
             "checkout): nvidia-ctk's discovery, which the plugin vendors, with the staging "
             "mounts hidden")
        shutil.move(root / "run/host-nvidia", work / "hidden")
        out = work / "plugin.json"
        subprocess.run([str(toolkit.NVIDIA_CTK), "cdi", "generate",
                        f"--driver-root={m.driver_root}", f"--dev-root={root}",
                        "--mode=management", f"--output={out}"], check=True,
                       capture_output=True)
        mounts = json.loads(out.read_text())["containerEdits"]["mounts"]
        shutil.move(work / "hidden", root / "run/host-nvidia")
    else:
        import nvplugin

        step(f"The device plugin's view: NVIDIA's device plugin ({binary}), staging mounts "
             "hidden, only the driver root")
        log = work / "plugin.log"
        with nvplugin.running(binary, root, work / "device-plugins", log=log,
                              hide=(root / "run/host-nvidia",),
                              extra=("--kubelet-socket=",)) as plugin:
            spec = nvplugin.spec_path(root)
            if not nvplugin.wait_for(spec, 30.0):
                raise SystemExit(f"demo: NVIDIA's device plugin wrote no spec:\n"
                                 f"{plugin.output()[-2000:]}")
            doc = json.loads(spec.read_text())
        mounts = [x for e in [doc.get("containerEdits", {})]
                  + [d.get("containerEdits", {}) for d in doc.get("devices", [])]
                  for x in e.get("mounts", [])]
        print(f"  {spec}: kind {doc['kind']}, devices "
              f"{[d['name'] for d in doc.get('devices', [])]}")
    names = sorted(os.path.basename(x["hostPath"]) for x in mounts)
    print(f"  {len(names)} mounts, including "
          f"{[n for n in names if n.startswith(('libcuda.so.', 'libnvidia-ml.so.'))]}")
    tool(root, "check")


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def tool(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [*TOOL, "--root", str(root), *args]
    print(f"$ unbounded-nvidia-setup --root {root} {' '.join(args)}", flush=True)
    proc = subprocess.run(argv, text=True, capture_output=True)
    for line in (proc.stderr + proc.stdout).splitlines():
        print(f"  {line}")
    print(f"  (exit {proc.returncode})")
    if check and proc.returncode not in (0,):
        raise SystemExit(f"demo: unexpected exit {proc.returncode}")
    return proc


def show_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if p.is_symlink():
            print(f"  {rel} -> {os.readlink(p)}")
        elif p.is_file():
            print(f"  {rel}  ({p.stat().st_size} bytes, {oct(p.stat().st_mode & 0o7777)})")


def show_pod(title: str, result: pod.Pod) -> dict[str, Any]:
    print(f"  {title}")
    report = result.report()
    print(f"    devices: {' '.join('/dev/' + d for d in report['devices'])}")
    print("    ldconfig -p:" + ("" if report["ldconfig_p"] else " nothing for libcuda or NVML"))
    for line in report["ldconfig_p"]:
        print(f"      {line}")
    print(f"    nvmlInit_v2() = {report['nvmlInit_v2']}")
    print(f"    cuInit(0) = {report['cuInit']}")
    smi = report["nvidia_smi"][1].replace("\n", "\n                ")
    print(f"    nvidia-smi: {smi}")
    return report


def gpu_pod(work: Path) -> None:
    """The moment the project exists for: a GPU pod gets libcuda and NVML."""
    step("A GPU pod: podman + runc start a container from the installed spec")
    why = pod.unavailable()
    if why is not None:
        raise SystemExit(f"demo: cannot start a pod: {why}")
    print("  the real NVIDIA userspace from Debian non-free (downloaded once, then cached)")
    drv = realdriver.fetch_real_driver()
    m = real_machine(work / "pod", drv)
    print(f"  a machine staged with NVIDIA {drv.version}; {toolkit.NAME}")
    tool(m.root, "run")
    print("  the container image: a Debian trixie tree (tests/rootfs.py, built once)")
    staging = [m.root / "run/host-nvidia"]
    good = show_pod("with the spec run installed (staging hidden, as a pod's runtime sees it):",
                    pod.probe(etc_cdi=m.cdi_spec.parent, hide=staging))
    incident = pod.spec_without(m.cdi_spec, work / "incident-spec", mounts=(
        f"libcuda.so.{drv.version}", f"libnvidia-ml.so.{drv.version}"))
    bad = show_pod("with the incident's spec (no libcuda and NVML mounts):",
                   pod.probe(etc_cdi=incident, hide=staging))
    print("  (no GPU here: NVML's 9 is NVML_ERROR_DRIVER_NOT_LOADED and cuInit's 100 "
          "CUDA_ERROR_NO_DEVICE,\n   answers of a loaded libcuda and NVML; the incident's "
          "pod cannot load them at all)")
    gaps = pod.missing(good, drv.version)
    if gaps or pod.SMI_NO_NVML not in bad["nvidia_smi"][1]:
        raise SystemExit(f"demo: the pod did not get {', '.join(gaps) or 'the incident'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="keep the machine directory")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("demo: needs root (it creates device nodes with mknod)", file=sys.stderr)
        return 2
    why = choose_nvidia_ctk()
    os.environ["PATH"] = toolkit.path_with_hook()
    work = Path(tempfile.mkdtemp(prefix="unbounded-nvidia-demo."))
    try:
        step("A simulated GPU machine (real ELF objects, stale driver, hostile entries)")
        m = simgpu.make_machine(work / "machine", hostile=True)
        m.write_config()
        root = m.root
        print(f"  root: {root}")
        print(f"  staging: {', '.join(str(s.relative_to(root)) for s in m.staging)}")
        print(f"  {len(list(m.lib_dir.iterdir()))} entries in the host lib dir; driver "
              f"{m.version}, stale {', '.join(m.stale_versions)}, "
              f"{len(m.hostile)} hostile entries")

        nvidia_ctk_step(why)
        if not m.nvml_answers or m.nvidia_ctk_args():
            raise SystemExit("demo: the simulated NVML does not answer on this machine")
        config = [x for x in m.config_path.read_text().splitlines() if not x.startswith("#")]
        print(f"  {m.config_path.relative_to(root)}: {', '.join(config)} (no --mode: "
              "nvidia-ctk's auto, NVML mode on a GPU node, as shipped)")
        print(f"  NVML: the staging's {(m.lib_dir / f'libnvidia-ml.so.{m.version}').name} is "
              f"the simulated NVML (tests/simnvml.c), listing {len(m.nvml_gpus)} GPUs")

        step("run: build the driver root and the CDI spec")
        tool(root, "run")

        step("The driver root: regular files, relative links, nothing else")
        show_tree(m.driver_root)

        step("The CDI spec")
        import yaml

        spec = yaml.safe_load(m.cdi_spec.read_text())
        edits = spec["containerEdits"]
        devices = [d["name"] for d in spec["devices"]]
        print(f"  kind {spec['kind']}, devices {devices}, {len(edits.get('mounts', []))} "
              f"mounts, hooks {[h['args'][1] for h in edits.get('hooks', [])]}")
        for mount in edits.get("mounts", [])[:4]:
            print(f"  {mount['hostPath']} -> {mount['containerPath']}")
        # Management mode names only "all": a device per index and per UUID is NVML's.
        nvml_named = [str(i) for i in range(len(m.nvml_gpus))] + m.nvml_gpus
        if not set(nvml_named) <= set(devices):
            raise SystemExit(f"demo: the spec does not name the simulated NVML's GPUs "
                             f"{nvml_named}: nvidia-ctk did not run in NVML mode")
        print(f"  NVML mode: the spec names the {len(m.nvml_gpus)} GPUs the simulated NVML "
              "lists by index and UUID (management mode names only 'all')")

        step("check and status")
        tool(root, "check")
        tool(root, "status")

        step("A second run (every boot): nothing changed, nothing swapped")
        tool(root, "run")

        step("Tampering: libcuda replaced by an absolute link into staging (the incident)")
        cuda = m.driver_lib_dir / f"libcuda.so.{m.version}"
        cuda.unlink()
        cuda.symlink_to(m.lib_dir / cuda.name)
        tool(root, "check", check=False)
        tool(root, "run")
        tool(root, "check")

        plugin_view(m, root, work)

        step("The devices do not arrive (the host's module did not load): run keeps "
             "everything and says so (exit 75, systemd retries)")
        for node in (root / "dev").glob("nvidia*"):
            node.unlink()
        if tool(root, "run", check=False).returncode != 75:
            raise SystemExit("demo: expected exit 75 for staging without devices")
        tool(root, "check", check=False)

        step("The GPU goes away, and its staging with it: run removes what it made, "
             "and succeeds")
        shutil.rmtree(root / "run/host-nvidia")
        tool(root, "run")
        tool(root, "check")

        gpu_pod(work)
        print("\ndemo: all steps behaved as expected")
    finally:
        if args.keep:
            print(f"demo: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
