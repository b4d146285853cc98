"""The selection rules of plan.py, over made-up discovery results (no filesystem)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbounded_nvidia_setup import plan
from unbounded_nvidia_setup.discover import Inspected, Link, Staged
from unbounded_nvidia_setup.elf import ElfInfo
from unbounded_nvidia_setup.log import Failure

V = "550.127.05"
OLD = "535.183.01"
LIBDIR = "lib/x86_64-linux-gnu"


def staged(name: str, index: int = 0, subdir: str = "") -> Staged:
    base = Path(f"/s/{index}") / subdir
    return Staged(index, base / name, subdir)


def lib(name: str, soname: str | None, *, index: int = 0, machine: str = "x86_64",
        bits: int = 64, kind: str = "ET_DYN", subdir: str = "") -> Inspected:
    return Inspected(staged(name, index, subdir), ElfInfo(bits, machine, kind, soname),
                     size=100, mtime_ns=1, dev=1, ino=hash(name) & 0xFFFF)


def link(name: str, target: str, index: int = 0) -> Link:
    return Link(index, name, "", Path(f"/s/{index}/{target}"))


def test_version_prefers_the_kernel_module() -> None:
    libs = [staged(f"libcuda.so.{OLD}")]
    assert plan.driver_version(V, libs, []) == V


def test_version_from_the_libcuda_so_1_link() -> None:
    libs = [staged(f"libcuda.so.{V}"), staged(f"libcuda.so.{OLD}")]
    assert plan.driver_version(None, libs, [link("libcuda.so.1", f"libcuda.so.{V}")]) == V


def test_version_from_the_nvml_link_when_libcuda_link_is_gone() -> None:
    """The current libcuda went missing: the stale one must not be taken for the driver."""
    libs = [staged(f"libcuda.so.{OLD}"), staged(f"libnvidia-ml.so.{V}")]
    links = [link("libnvidia-ml.so.1", f"libnvidia-ml.so.{V}")]
    assert plan.driver_version(None, libs, links) == V


def test_links_that_disagree_are_an_error() -> None:
    links = [link("libcuda.so.1", f"libcuda.so.{OLD}"),
             link("libnvidia-ml.so.1", f"libnvidia-ml.so.{V}")]
    with pytest.raises(Failure, match="links point at"):
        plan.driver_version(None, [], links)


def test_version_from_the_only_libcuda() -> None:
    assert plan.driver_version(None, [staged(f"libcuda.so.{V}")], []) == V


def test_two_versions_without_module_or_link_is_an_error() -> None:
    libs = [staged(f"libcuda.so.{V}"), staged(f"libcuda.so.{OLD}")]
    with pytest.raises(Failure, match="cannot tell the driver version"):
        plan.driver_version(None, libs, [])


def test_no_libcuda_at_all_is_an_error() -> None:
    with pytest.raises(Failure, match="no libcuda"):
        plan.driver_version(None, [staged(f"libnvidia-ml.so.{V}")], [])


def test_stale_versions_come_from_libcuda_and_nvml_names_only() -> None:
    libs = [staged(f"libcuda.so.{V}"), staged(f"libnvidia-ml.so.{OLD}"),
            staged("libnvidia-egl-wayland.so.1.1.13")]
    assert plan.stale_versions(V, libs) == {OLD}


def test_stale_files_are_dropped_by_name_even_without_a_current_counterpart() -> None:
    libs = [staged(f"libcuda.so.{V}"), staged(f"libnvidia-fbc.so.{OLD}"),
            staged("libnvidia-egl-wayland.so.1.1.13")]
    kept = [s.name for s in plan.drop_stale(libs, {OLD})]
    assert kept == [f"libcuda.so.{V}", "libnvidia-egl-wayland.so.1.1.13"]


def test_exact_version_wins_within_a_soname() -> None:
    items = [lib("libnvidia-foo.so.1.0", "libnvidia-foo.so.1"),
             lib(f"libnvidia-foo.so.{V}", "libnvidia-foo.so.1")]
    chosen = plan.select_libraries(items, [], V, "x86_64").chosen
    assert [c.name for c in chosen] == [f"libnvidia-foo.so.{V}"]


def test_soname_link_decides_when_no_name_has_the_version() -> None:
    items = [lib("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1"),
             lib("libnvidia-egl-wayland.so.1.1.9", "libnvidia-egl-wayland.so.1")]
    links = [link("libnvidia-egl-wayland.so.1", "libnvidia-egl-wayland.so.1.1.13")]
    chosen = plan.select_libraries(items, links, V, "x86_64").chosen
    assert [c.name for c in chosen] == ["libnvidia-egl-wayland.so.1.1.13"]


def test_open_choice_is_ambiguous() -> None:
    items = [lib("libnvidia-egl-wayland.so.1.1.13", "libnvidia-egl-wayland.so.1"),
             lib("libnvidia-egl-wayland.so.1.1.9", "libnvidia-egl-wayland.so.1")]
    with pytest.raises(Failure, match=r"ambiguous driver files for libnvidia-egl-wayland\.so\.1"):
        plan.select_libraries(items, [], V, "x86_64")


def test_same_file_in_two_staging_dirs_takes_the_first() -> None:
    items = [lib(f"libcuda.so.{V}", "libcuda.so.1", index=1),
             lib(f"libcuda.so.{V}", "libcuda.so.1", index=0)]
    chosen = plan.select_libraries(items, [], V, "x86_64").chosen
    assert [c.staged.index for c in chosen] == [0]


@pytest.mark.parametrize("machine,bits,kind", [("aarch64", 64, "ET_DYN"),
                                               ("x86_64", 32, "ET_DYN"),
                                               ("EM_386", 32, "ET_DYN"),
                                               ("x86_64", 64, "ET_EXEC")])
def test_foreign_arch_32_bit_and_non_libraries_are_skipped(machine: str, bits: int,
                                                           kind: str) -> None:
    items = [lib(f"libnvidia-foo.so.{V}", "libnvidia-foo.so.1", machine=machine, bits=bits,
                 kind=kind)]
    assert plan.select_libraries(items, [], V, "x86_64").chosen == []


def test_aarch64_selects_aarch64() -> None:
    items = [lib(f"libcuda.so.{V}", "libcuda.so.1", machine="aarch64"),
             lib(f"libcuda.so.{V}", "libcuda.so.1", machine="x86_64", index=1)]
    chosen = plan.select_libraries(items, [], V, "aarch64").chosen
    assert [c.elf.machine for c in chosen if c.elf] == ["aarch64"]


def full_set() -> list[Inspected]:
    return [lib(f"libcuda.so.{V}", "libcuda.so.1"),
            lib(f"libnvidia-ml.so.{V}", "libnvidia-ml.so.1"),
            lib(f"libnvidia-eglcore.so.{V}", f"libnvidia-eglcore.so.{V}"),
            lib(f"libvdpau_nvidia.so.{V}", "libvdpau_nvidia.so.1", subdir="vdpau")]


def test_plan_layout_links_and_modes() -> None:
    helper = Inspected(staged("nvidia-smi", 1), ElfInfo(64, "x86_64", "ET_EXEC", None),
                       10, 1, 1, 99)
    fw = Inspected(staged("gsp_ga10x.bin", 2), None, 10, 1, 1, 98)
    p = plan.make_plan(full_set(), [helper], [(V, fw), (OLD, fw)], V, "x86_64", LIBDIR)
    m = p.manifest()
    assert m[f"{LIBDIR}/libcuda.so.{V}"] == ("f", 100, 1, 0o644)
    assert m[f"{LIBDIR}/libcuda.so.1"] == ("l", f"libcuda.so.{V}")
    assert m[f"{LIBDIR}/libcuda.so"] == ("l", "libcuda.so.1")
    assert m[f"{LIBDIR}/libnvidia-ml.so"] == ("l", "libnvidia-ml.so.1")
    assert m[f"{LIBDIR}/vdpau/libvdpau_nvidia.so.1"] == ("l", f"libvdpau_nvidia.so.{V}")
    assert m["usr/bin/nvidia-smi"] == ("f", 10, 1, 0o755)
    assert m[f"lib/firmware/nvidia/{V}/gsp_ga10x.bin"] == ("f", 10, 1, 0o644)
    assert f"lib/firmware/nvidia/{OLD}/gsp_ga10x.bin" not in m
    # A library whose SONAME is its own name gets no link to itself.
    assert m[f"{LIBDIR}/libnvidia-eglcore.so.{V}"][0] == "f"
    assert all(not t.startswith("/") and "/" not in t for _, t in p.links)


@pytest.mark.parametrize("missing", ["libcuda.so", "libnvidia-ml.so"])
def test_required_libraries(missing: str) -> None:
    items = [i for i in full_set() if not i.name.startswith(f"{missing}.")]
    with pytest.raises(Failure, match=f"incomplete driver state: {missing}.{V}"):
        plan.make_plan(items, [], [], V, "x86_64", LIBDIR)


def test_helper_of_wrong_arch_is_left_out() -> None:
    helper = Inspected(staged("nvidia-smi", 1), ElfInfo(64, "aarch64", "ET_EXEC", None),
                       10, 1, 1, 99)
    p = plan.make_plan(full_set(), [helper], [], V, "x86_64", LIBDIR)
    assert "usr/bin/nvidia-smi" not in p.manifest()
