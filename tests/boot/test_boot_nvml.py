"""A GPU boot in nvidia-ctk's default mode: the unit's config passes no ``--mode``, so
nvidia-ctk runs ``auto``, which is NVML mode on a GPU node, and the spec has a device per
GPU (index and uuid) beside ``all`` (issue 22). The other boot tests run management mode;
this one is the boot of the shipped default. The simulated host's kernel module lists its
two GPUs in /proc/driver/nvidia/gpus (bound into the machine with the module's version
file), where the simulated libnvidia-ml (tests/simnvml.c, loaded from the machine's
/run/nvidia/driver: it reads the machine's own /) finds them, for the nvidia-ctk
stand-in and, in real-tool mode, NVIDIA's nvidia-ctk alike."""

from __future__ import annotations

import yaml

from .harness import NodeFactory
from .test_boot import SPEC, assert_gpu_node_ready


def test_gpu_boot_in_nvml_mode(make_node: NodeFactory) -> None:
    node = make_node(nvml=True)
    with node.machine() as m:
        assert "nvidia_ctk_args: []" in m.read_text("/etc/unbounded/nvidia-setup.yaml")
        assert_gpu_node_ready(m, node)
        spec = yaml.safe_load(m.read_text(SPEC))
        gpus = node.sim.nvml_gpus
        assert len(gpus) == 2
        devices = {d["name"]: [n["path"] for n in d["containerEdits"].get("deviceNodes", [])]
                   for d in spec["devices"]}
        assert devices == {"0": ["/dev/nvidia0"], gpus[0]: ["/dev/nvidia0"],
                           "1": ["/dev/nvidia1"], gpus[1]: ["/dev/nvidia1"],
                           "all": ["/dev/nvidia0", "/dev/nvidia1"]}, devices
