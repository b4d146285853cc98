"""`make demo`: the main job on a simulated GPU machine.

Builds a machine in a temporary directory (staging dirs with real ELF driver libraries,
a stale older driver, unrelated libraries and hostile entries; mknod device nodes; a
kernel module version; the nvidia-ctk stand-in), then runs the real tool against it with
--root: run, check, status, a second run, tampering and repair, and the device plugin's
view with the staging mounts hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import simgpu

TOOL = [sys.executable, "-m", "unbounded_nvidia_setup"]


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="keep the machine directory")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("demo: needs root (it creates device nodes with mknod)", file=sys.stderr)
        return 2
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

        step("The device plugin's view: staging mounts hidden, only the driver root")
        shutil.move(root / "run/host-nvidia", work / "hidden")
        out = work / "plugin.json"
        subprocess.run([str(simgpu.FAKE_NVIDIA_CTK), "cdi", "generate",
                        f"--driver-root={m.driver_root}", f"--dev-root={root}",
                        "--mode=management", f"--output={out}"], check=True,
                       capture_output=True)
        mounts = json.loads(out.read_text())["containerEdits"]["mounts"]
        names = sorted(os.path.basename(x["hostPath"]) for x in mounts)
        print(f"  nvidia-ctk sees {len(names)} mounts, including "
              f"{[n for n in names if n.startswith(('libcuda.so.', 'libnvidia-ml.so.'))]}")
        shutil.move(work / "hidden", root / "run/host-nvidia")

        step("The GPU goes away: run removes what it made, and succeeds")
        for node in (root / "dev").glob("nvidia*"):
            node.unlink()
        tool(root, "run")
        tool(root, "check")
        print("\ndemo: all steps behaved as expected")
    finally:
        if args.keep:
            print(f"demo: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
