"""Every `check` problem code of docs/problems.md has a test that builds its condition and
asserts that exact code (issue 12, point 7).

The first test builds, on a machine after a good run, each condition no other test
built, and asserts the code together with the path the problem names. The second fails
when a code of the table in docs/problems.md is asserted by no test, by this rule
(`asserted_codes`, read from the test files' syntax trees, not by grepping):

  inside a function named test_*, the code is a string constant
  (a) in the condition of an `assert`, or
  (b) in the value of an assignment `name = ...` whose `name` such an assert uses, or
  (c) in the values of a `pytest.mark.parametrize` for an argument such an assert uses;
  where "such an assert" excludes what sits under `not`, `or`, `!=`, `not in` or
  `is not`: `assert not codes & {"x"}` or `assert "x" in a or "y" in b` asserts no
  particular code. A code mentioned in a comment, a docstring, a helper outside a test,
  or computed (f"{prefix}-invalid") does not count.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

import simgpu
from conftest import Cli, needs_root
from test_run import check_json, root_of, spec_of

TESTS = Path(__file__).resolve().parent
PROBLEMS_MD = TESTS.parent / "docs" / "problems.md"
MA = "x86_64-linux-gnu"
# Codes whose tests live in a file this branch does not have yet: the lead's
# tests/test_ldconfig.py (issue 9) asserts these. Allowed only while that file is
# absent; once it exists it is read like every other test file and must assert them.
EXPECTED_IN = {"root-wrong-link": "test_ldconfig.py", "ldcache-stale": "test_ldconfig.py"}


# --------------------------------------------------------------------------------------
# The conditions (each returns the path the problem must name)


def lib_of(m: simgpu.SimMachine) -> Path:
    return root_of(m) / "lib" / MA


def foreign_owner(m: simgpu.SimMachine) -> str:
    path = lib_of(m) / f"libnvidia-cfg.so.{m.version}"
    os.chown(path, 1000, 1000)
    return str(path)


def dangling_link(m: simgpu.SimMachine) -> str:
    link = lib_of(m) / "libnvidia-gone.so.1"
    os.symlink(f"libnvidia-gone.so.{m.version}", link)
    return str(link)


def libcuda_link_missing(m: simgpu.SimMachine) -> str:
    link = lib_of(m) / "libcuda.so.1"
    link.unlink()
    return str(link)


def soname_link_missing(m: simgpu.SimMachine) -> str:
    link = lib_of(m) / "libnvidia-cfg.so.1"  # libnvidia-cfg.so.<ver> carries that SONAME
    link.unlink()
    return str(link)


def nvml_missing(m: simgpu.SimMachine) -> str:
    path = lib_of(m) / f"libnvidia-ml.so.{m.version}"
    path.unlink()
    return str(path)


def two_libcuda_versions(m: simgpu.SimMachine) -> str:
    """Only without a readable module version does check look at the root's versions."""
    (m.root / "proc/driver/nvidia/version").unlink()
    other = lib_of(m) / f"libcuda.so.{m.stale_versions[0]}"
    shutil.copy2(lib_of(m) / f"libcuda.so.{m.version}", other)
    return str(root_of(m))


def other_kernel_module(m: simgpu.SimMachine) -> str:
    version = m.root / "proc/driver/nvidia/version"
    version.write_text(version.read_text().replace(m.version, "570.133.20"))
    return str(root_of(m))


def file_at_the_root_path(m: simgpu.SimMachine) -> str:
    shutil.rmtree(root_of(m))
    root_of(m).write_text("not a driver root\n")
    return str(root_of(m))


def link_at_the_root_path(m: simgpu.SimMachine) -> str:
    """A symlink to a whole driver root is not a directory of its own either."""
    elsewhere = m.root / "run/elsewhere"
    shutil.move(root_of(m), elsewhere)
    os.symlink(elsewhere, root_of(m))
    return str(root_of(m))


def run_nvidia_a_symlink(m: simgpu.SimMachine) -> str:
    parent = root_of(m).parent
    shutil.move(parent, m.root / "run/nvidia-real")
    os.symlink("nvidia-real", parent)
    return str(parent)


def staging_incomplete(m: simgpu.SimMachine) -> str:
    for path in m.staging[0].glob("libnvidia-ml.so*"):
        path.unlink()
    return "/run/host-nvidia"  # the staging parent, as the machine names it


def device_node_a_file(m: simgpu.SimMachine) -> str:
    node = m.root / "dev/nvidia-uvm"
    node.unlink()
    node.write_text("")
    return str(node)


def spec_without_nvidia_smi(m: simgpu.SimMachine) -> str:
    import yaml

    doc = yaml.safe_load(spec_of(m).read_text())
    mounts = doc["containerEdits"]["mounts"]
    doc["containerEdits"]["mounts"] = [x for x in mounts
                                       if not x["hostPath"].endswith("/nvidia-smi")]
    assert len(doc["containerEdits"]["mounts"]) == len(mounts) - 1
    spec_of(m).write_text(yaml.safe_dump(doc))
    return str(spec_of(m))


def edit_spec(m: simgpu.SimMachine, change: Callable[[dict[str, Any]], None]) -> str:
    import yaml

    doc = yaml.safe_load(spec_of(m).read_text())
    change(doc)
    spec_of(m).write_text(yaml.safe_dump(doc))
    return str(spec_of(m))


def spec_of_another_kind(m: simgpu.SimMachine) -> str:
    return edit_spec(m, lambda doc: doc.update(kind="example.com/gpu"))


def spec_without_devices(m: simgpu.SimMachine) -> str:
    return edit_spec(m, lambda doc: doc.update(devices=[]))


def spec_without_nvml(m: simgpu.SimMachine) -> str:
    def drop(doc: dict[str, Any]) -> None:
        edits = doc["containerEdits"]
        edits["mounts"] = [x for x in edits["mounts"] if "/libnvidia-ml.so." not in x["hostPath"]]

    return edit_spec(m, drop)


def mount(host: str) -> dict[str, Any]:
    return {"hostPath": host, "containerPath": f"/lib/{MA}/{os.path.basename(host)}",
            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}


def spec_naming_a_vanished_file(m: simgpu.SimMachine) -> str:
    """The incident's stale spec: a file of an older root that is not there."""
    gone = str(lib_of(m) / f"libEGL_nvidia.so.{m.stale_versions[0]}")
    edit_spec(m, lambda doc: doc["containerEdits"]["mounts"].append(mount(gone)))
    return gone


def spec_naming_staging(m: simgpu.SimMachine) -> str:
    staged = str(m.staging[0] / f"libcuda.so.{m.version}")
    edit_spec(m, lambda doc: doc["containerEdits"]["mounts"].append(mount(staged)))
    return staged


PLUGIN_SPEC = "var/run/cdi/k8s.device-plugin.nvidia.com-gpu.json"


def plugin_spec(m: simgpu.SimMachine, change: Callable[[dict[str, Any]], None]) -> Path:
    """The device plugin's spec (JSON, paths as the machine names them), changed."""
    doc: dict[str, Any] = {
        "cdiVersion": "0.5.0", "kind": "k8s.device-plugin.nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [
            {"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]}}],
        "containerEdits": {"mounts": [
            mount(f"/run/nvidia/driver/lib/{MA}/{n}.so.{m.version}")
            for n in ("libcuda", "libnvidia-ml")]}}
    change(doc)
    path = m.root / PLUGIN_SPEC
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def plugin_spec_naming_staging(m: simgpu.SimMachine) -> str:
    staged = "/run/host-nvidia/0/libnvidia-ml.so.1"
    plugin_spec(m, lambda doc: doc["containerEdits"]["mounts"].append(mount(staged)))
    return staged


def plugin_spec_without_devices(m: simgpu.SimMachine) -> str:
    return str(plugin_spec(m, lambda doc: doc.update(devices=[])))


def plugin_spec_naming_a_gone_gpu(m: simgpu.SimMachine) -> str:
    def gpu7(doc: dict[str, Any]) -> None:
        doc["devices"][0]["containerEdits"]["deviceNodes"] = [
            {"path": "/dev/nvidia7", "hostPath": "/dev/nvidia7"}]

    plugin_spec(m, gpu7)
    return "/dev/nvidia7"


def plugin_spec_garbage(m: simgpu.SimMachine) -> str:
    plugin = m.root / PLUGIN_SPEC
    plugin.parent.mkdir(parents=True)
    plugin.write_text('{"cdiVersion": "0.5.0", "kind": ')  # cut short while written
    return str(plugin)


Condition = Callable[[simgpu.SimMachine], str]


# Without the secure_after fixture: these conditions break the root's invariants on purpose.
@needs_root
@pytest.mark.parametrize("code,condition", [
    ("root-bad-owner", foreign_owner),
    ("root-dangling-link", dangling_link),
    ("root-missing-link", libcuda_link_missing),
    ("root-missing-link", soname_link_missing),
    ("root-missing-library", nvml_missing),
    ("root-mixed-versions", two_libcuda_versions),
    ("root-version-mismatch", other_kernel_module),
    ("root-not-directory", file_at_the_root_path),
    ("root-not-directory", link_at_the_root_path),
    ("root-parent-symlink", run_nvidia_a_symlink),
    ("staging-invalid", staging_incomplete),
    ("spec-bad-device-node", device_node_a_file),
    ("spec-missing-helper", spec_without_nvidia_smi),
    ("plugin-spec-invalid", plugin_spec_garbage),
    # Not among issue 12's twelve, but asserted by no test either (the rule below found
    # them): the run validates what nvidia-ctk writes, and tests assert that refusal by
    # its message; check's codes for a spec changed afterwards were never asserted.
    ("spec-wrong-kind", spec_of_another_kind),
    ("spec-no-devices", spec_without_devices),
    ("spec-missing-host-path", spec_naming_a_vanished_file),
    ("spec-staging-path", spec_naming_staging),
    ("spec-missing-library", spec_without_nvml),
    ("plugin-spec-staging-path", plugin_spec_naming_staging),
    ("plugin-spec-no-devices", plugin_spec_without_devices),
    ("plugin-spec-bad-device-node", plugin_spec_naming_a_gone_gpu),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_check_reports_the_condition_with_its_code(tmp_path: Path, cli: Cli, code: str,
                                                   condition: Condition) -> None:
    m = simgpu.make_machine(tmp_path / "root")
    m.write_config()
    assert cli(m.root, "run").code == 0
    assert check_json(cli, m)["ok"] is True
    path = condition(m)
    report = check_json(cli, m)
    problems = report["problems"]
    assert isinstance(problems, list)
    assert report["ok"] is False
    assert path in [p["path"] for p in problems if p["code"] == code], problems
    text = cli(m.root, "check")
    assert text.code == 1 and f"{code}: " in text.stdout
    status = cli(m.root, "status")
    assert status.code == 0 and f"[{code}]" in status.stdout


# --------------------------------------------------------------------------------------
# Every documented code has such a test


def documented_codes() -> list[str]:
    """The codes of the table in docs/problems.md, in its order."""
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", PROBLEMS_MD.read_text(), re.M)
    assert len(rows) >= 30, f"the code table of {PROBLEMS_MD} was not found"
    return rows


_NEGATING = (ast.NotIn, ast.NotEq, ast.IsNot)


def _positive(node: ast.AST) -> Iterable[ast.AST]:
    """The nodes of an assert's condition that assert something is there: whatever is
    not under `not`, `or`, or a `!=` / `not in` / `is not` comparison."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        return
    if isinstance(node, ast.Compare) and any(isinstance(op, _NEGATING) for op in node.ops):
        return
    if isinstance(node, ast.JoinedStr):  # the pieces of an f-string are no code
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _positive(child)


def _strings(node: ast.AST) -> set[str]:
    """String constants in `node`, f-strings left out."""
    if isinstance(node, ast.JoinedStr):
        return set()
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else set()
    return {s for child in ast.iter_child_nodes(node) for s in _strings(child)}


def _parametrized(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, set[str]]:
    """argument name -> the string constants pytest.mark.parametrize gives it."""
    values: dict[str, set[str]] = {}
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr == "parametrize" and len(decorator.args) >= 2):
            continue
        names_node, cases = decorator.args[0], decorator.args[1]
        if isinstance(names_node, ast.Constant) and isinstance(names_node.value, str):
            names = [n.strip() for n in names_node.value.split(",")]
        elif isinstance(names_node, ast.List | ast.Tuple):
            names = [n.value for n in names_node.elts
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        else:
            continue
        if not isinstance(cases, ast.List | ast.Tuple):
            continue
        for case in cases.elts:
            if (isinstance(case, ast.Call) and isinstance(case.func, ast.Attribute)
                    and case.func.attr == "param"):
                items = list(case.args)
            elif isinstance(case, ast.Tuple) and len(names) > 1:
                items = list(case.elts)
            else:
                items = [case]
            for name, item in zip(names, items, strict=False):
                values.setdefault(name, set()).update(_strings(item))
    return values


def _function_codes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    positive = [n for a in ast.walk(function) if isinstance(a, ast.Assert)
                for n in _positive(a.test)]
    found = {n.value for n in positive
             if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    used = {n.id for n in positive if isinstance(n, ast.Name)}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in used for t in targets):
                found |= _strings(node.value)
    for name, strings in _parametrized(function).items():
        if name in used:
            found |= strings
    return found


def asserted_codes(source: str, codes: Iterable[str]) -> set[str]:
    """The `codes` a test function of `source` asserts, by the rule of this module's
    docstring."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name.startswith("test_")):
            found |= _function_codes(node)
    return found & set(codes)


def test_every_documented_code_is_asserted_by_a_test() -> None:
    codes = documented_codes()
    asserted: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for code in asserted_codes(path.read_text(), codes):
            asserted.setdefault(code, []).append(path.name)
    missing = [c for c in codes if c not in asserted]
    pending = [c for c in missing if c in EXPECTED_IN and not (TESTS / EXPECTED_IN[c]).exists()]
    untested = [c for c in missing if c not in pending]
    assert not untested, f"codes in {PROBLEMS_MD.name} that no test asserts: {untested}"
    for code in pending:  # shown with -s: these rest on another branch's file
        print(f"{code}: expected in tests/{EXPECTED_IN[code]}, not on this branch yet")


# Made-up codes only: a documented one here would count as asserted by this test.
@pytest.mark.parametrize("source,expected", [
    ('def test_a():\n    assert "root-x" in codes(r)\n', {"root-x"}),
    ('def test_a():\n    assert codes(r) == {"root-x", "spec-y"}\n', {"root-x", "spec-y"}),
    ('def test_a():\n    assert r["ok"] is False and "root-x" in c\n', {"root-x"}),
    ('def test_a():\n    assert not c & {"root-x"}\n', set()),
    ('def test_a():\n    assert "root-x" not in c\n', set()),
    ('def test_a():\n    assert c != {"root-x"}\n', set()),
    ('def test_a():\n    assert "root-x" in a or "root-y" in b\n', set()),
    ('def test_a():\n    w = problems(r, "root-x")\n    assert w\n', {"root-x"}),
    ('def test_a():\n    w = problems(r, "root-x")\n    assert not w\n', set()),
    ('def test_a():\n    w = problems(r, "root-x")\n    assert r\n', set()),
    ('def helper():\n    assert "root-x" in c\n', set()),
    ('def test_a():\n    """root-x"""\n    # "root-y"\n    assert c\n', set()),
    ('def test_a():\n    assert f"{p}-invalid" in c\n', set()),
    ('def test_a():\n    w = f"{p}-invalid"\n    assert w in c\n', set()),
    ('@pytest.mark.parametrize("t,code", [("a", "root-x"), pytest.param("b", "root-y")])\n'
     'def test_a(t, code):\n    assert code in c\n', {"root-x", "root-y"}),
    ('@pytest.mark.parametrize("t,code", [("a", "root-x")])\n'
     'def test_a(t, code):\n    assert c\n', set()),
    ('@pytest.mark.parametrize("code", ["root-x"])\n'
     'def test_a(code):\n    assert code not in c\n', set()),
])
def test_the_rule_for_an_asserted_code(source: str, expected: set[str]) -> None:
    """The detector itself: what counts as asserting a code, and what does not."""
    assert asserted_codes(source, ["root-x", "spec-y", "root-y", "-invalid"]) == expected
