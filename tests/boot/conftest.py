"""Fixtures of the boot tests (helpers in harness.py, machines in nspawn.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from .harness import (
    Node,
    NodeFactory,
    build_deb,
    destroy_node,
    new_node,
    pyproject_version,
    require_boot_support,
    timing_lines,
)
from realdriver import RealDriver


@pytest.fixture(autouse=True)
def _boot_support() -> None:
    require_boot_support()


@pytest.fixture(scope="session")
def product_deb() -> Path:
    """``make deb``: dist/unbounded-nvidia-setup_<pyproject version>_all.deb."""
    require_boot_support()
    return build_deb()


@pytest.fixture(scope="session")
def upgrade_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A newer build of the same sources: Debian version ``<version>+boottest1``."""
    require_boot_support()
    return build_deb(f"{pyproject_version()}+boottest1", tmp_path_factory.mktemp("deb-new"))


@pytest.fixture
def make_node(tmp_path: Path, product_deb: Path) -> Iterator[NodeFactory]:
    """``make_node(gpu=True, driver=None, nvml=False, gpus=2, lost=(), **config)`` ->
    :class:`Node` (see ``harness.new_node``; ``nvml``: nvidia-ctk's default mode, NVML,
    where the host's GPUs answer the simulated libnvidia-ml, for the stand-in and the
    real nvidia-ctk; ``lost``: the minors of GPUs lost before the boot).
    Every machine booted on it is stopped and its rootfs unmounted and removed after the
    test, pass or fail."""
    nodes: list[Node] = []

    def factory(gpu: bool = True, driver: RealDriver | None = None, nvml: bool = False,
                gpus: int = 2, lost: Sequence[int] = (), **config: object) -> Node:
        node = new_node(tmp_path / f"node{len(nodes)}", product_deb, gpu=gpu, driver=driver,
                        nvml=nvml, gpus=gpus, lost=lost, **config)
        nodes.append(node)
        return node

    try:
        yield factory
    finally:
        errors = [e for node in nodes for e in destroy_node(node)]
        assert not errors, "teardown failed: " + "; ".join(errors)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = timing_lines()
    if lines:
        terminalreporter.write_line("")
        terminalreporter.write_line("boot timings (tests/boot):")
        for line in lines:
            terminalreporter.write_line("  " + line)
