"""The module size rule of docs/architecture.md ("Conventions"): no module in guest/ or
bench/ over 500 lines, and no test helper (a module of tests/ that is not a test_*.py
file: conftest.py, tests/fakes/ and tests/boot/ included) over 600. Lines are counted as
``wc -l`` counts them. Modules are found on disk, not through git, so a new file counts
before it is committed."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRODUCT_LIMIT = 500  # guest/ and bench/
HELPER_LIMIT = 600  # tests/, except test_*.py


def modules(top: str) -> list[Path]:
    """The Python modules under ``top`` (relative to the repository), hidden and
    ``__pycache__`` directories left out."""
    found = []
    for path in sorted((REPO / top).rglob("*.py")):
        rel = path.relative_to(REPO)
        if not any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            found.append(path)
    return found


def limit_of(path: Path) -> int | None:
    """The most lines ``path`` may have; None for a test module (no limit)."""
    top = path.relative_to(REPO).parts[0]
    if top in ("guest", "bench"):
        return PRODUCT_LIMIT
    if path.name.startswith("test_"):
        return None
    return HELPER_LIMIT


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def test_the_walk_finds_the_modules_the_rule_is_about() -> None:
    found = {str(p.relative_to(REPO)) for top in ("guest", "bench", "tests") for p in modules(top)}
    for known in ("guest/unbounded_nvidia_setup/cli.py", "tests/simgpu.py", "tests/conftest.py",
                  "tests/test_layout.py"):
        assert known in found, known
    for directory in ("bench/", "tests/fakes/", "tests/boot/"):
        assert any(name.startswith(directory) for name in found), directory
    assert limit_of(REPO / "tests" / "test_layout.py") is None
    assert limit_of(REPO / "tests" / "fakes" / "nvidia_ctk.py") == HELPER_LIMIT


def test_no_module_is_over_its_size_limit() -> None:
    offenders = []
    for top in ("guest", "bench", "tests"):
        for path in modules(top):
            limit = limit_of(path)
            count = lines(path)
            if limit is not None and count > limit:
                offenders.append(f"{path.relative_to(REPO)}: {count} lines (limit {limit})")
    assert not offenders, (
        "split by concern (docs/architecture.md, Conventions):\n  " + "\n  ".join(offenders)
    )
