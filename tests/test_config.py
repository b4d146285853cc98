"""Config file handling: defaults, validation, and one-line errors with exit 2."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from check_schema import parse_check
from unbounded_nvidia_setup.config import Config, load_config, parse_config
from unbounded_nvidia_setup.log import EXIT_USAGE, Failure

from conftest import Cli


def test_defaults_match_the_design() -> None:
    c = Config()
    assert (c.driver_root, c.staging_glob, c.cdi_spec) == (
        "/run/nvidia/driver", "/run/host-nvidia/*", "/etc/cdi/nvidia.yaml")
    assert (c.nvidia_ctk, c.nvidia_ctk_args, c.ldconfig, c.arch) == ("nvidia-ctk", (),
                                                                     "ldconfig", "auto")
    # lock_timeout_seconds was 300 (DESIGN.md), the unit's whole TimeoutStartSec; it is 60
    # since every run has its own budget, run_timeout_seconds (issue 16, config.py).
    assert (c.staging_wait_seconds, c.lock_timeout_seconds) == (60, 60)
    assert (c.nvidia_ctk_timeout_seconds, c.ldconfig_timeout_seconds) == (120, 120)
    assert c.run_timeout_seconds == 240
    assert c.extra_library_prefixes == ()


def test_missing_default_file_means_defaults(tmp_path: Path) -> None:
    config, path = load_config(tmp_path, None)
    assert config == Config()
    assert path == tmp_path / "etc/unbounded/nvidia-setup.yaml"


def test_full_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("driver_root: /run/x/driver\nnvidia_ctk_args: [--mode=management]\n"
                 "staging_wait_seconds: 5\narch: aarch64\nextra_library_prefixes: [libfoo]\n")
    config, _ = load_config(tmp_path, f)
    assert config.driver_root == "/run/x/driver"
    assert config.nvidia_ctk_args == ("--mode=management",)
    assert config.staging_wait_seconds == 5.0
    assert config.extra_library_prefixes == ("libfoo",)


@pytest.mark.parametrize("data,key", [
    ({"driver_rot": "/x"}, "driver_rot"),
    ({"staging_wait_seconds": "60"}, "staging_wait_seconds"),
    ({"staging_wait_seconds": True}, "staging_wait_seconds"),
    ({"lock_timeout_seconds": -1}, "lock_timeout_seconds"),
    ({"ldconfig_timeout_seconds": "2m"}, "ldconfig_timeout_seconds"),
    ({"run_timeout_seconds": "4m"}, "run_timeout_seconds"),
    ({"run_timeout_seconds": 0}, "run_timeout_seconds"),  # "no limit" is what it prevents
    ({"run_timeout_seconds": 0.5}, "run_timeout_seconds"),
    ({"run_timeout_seconds": math.inf}, "run_timeout_seconds"),
    ({"nvidia_ctk_args": "--mode=nvml"}, "nvidia_ctk_args"),
    ({"driver_root": "run/nvidia"}, "driver_root"),
    ({"driver_root": "/"}, "driver_root"),
    ({"cdi_spec": "/etc/cdi/nvidia.conf"}, "cdi_spec"),
    ({"arch": "riscv64"}, "arch"),
    ({"nvidia_ctk": "bin/nvidia-ctk"}, "nvidia_ctk"),
])
def test_bad_keys_name_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(Failure) as e:
        parse_config(data, Path("/c.yaml"))
    assert e.value.code == EXIT_USAGE
    assert f"'{key}'" in e.value.message


def test_waits_longer_than_the_run_budget_are_accepted() -> None:
    """A config copied from the old documentation (`lock_timeout_seconds: 300`, the old
    default) keeps working: the run's budget ends such a wait first and says so (issue 16,
    docs/architecture.md "The time budget"), instead of the node failing on a config
    error after an upgrade."""
    config = parse_config({"lock_timeout_seconds": 300, "nvidia_ctk_timeout_seconds": 600,
                           "run_timeout_seconds": 60}, Path("/c.yaml"))
    assert (config.lock_timeout_seconds, config.run_timeout_seconds) == (300, 60)


@pytest.mark.parametrize("text,expect", [
    ("driver_root: [unclosed\n", "is not valid YAML at line"),
    ("- a\n- b\n", "expected a mapping"),
    ("bogus_key: 1\n", "'bogus_key' is unknown"),
])
def test_cli_exits_2_with_one_line(tmp_path: Path, cli: Cli, text: str, expect: str) -> None:
    (tmp_path / "etc/unbounded").mkdir(parents=True)
    (tmp_path / "etc/unbounded/nvidia-setup.yaml").write_text(text)
    for command in ("run", "check", "clean"):
        out = cli(tmp_path, command)
        assert out.code == 2, out
        assert len(out.lines) == 1 and expect in out.lines[0], out.lines
    # `status` exits 0 whatever it finds (README): the error is a line of its summary.
    out = cli(tmp_path, "status")
    assert out.code == 0 and expect in out.stdout.splitlines()[0], out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["etc"]  # nothing changed


def test_explicit_missing_config_is_a_usage_error(tmp_path: Path, cli: Cli) -> None:
    out = cli(tmp_path, "--config", str(tmp_path / "nope.yaml"), "check")
    assert out.code == 2 and "does not exist" in out.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    ((), "required: COMMAND"),
    (("run", "--frobnicate"), "unrecognized arguments: --frobnicate"),
])
def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, cli: Cli, args: tuple[str, ...],
                                              needle: str) -> None:
    out = cli(tmp_path, *args)
    assert out.code == 2 and out.lines == out.errors and len(out.errors) == 1, out
    assert needle in out.errors[0] and "--help" in out.errors[0], out


def test_root_must_be_a_directory(tmp_path: Path, cli: Cli) -> None:
    out = cli(tmp_path / "missing", "status")
    assert out.code == 2 and len(out.errors) == 1 and "does not exist" in out.errors[0], out


def test_version(cli: Cli) -> None:
    out = cli(None, "--version")
    assert out.code == 0 and out.stdout.startswith("unbounded-nvidia-setup ")


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("--root", "{root}", "--version"),
                                  ("--root", "{root}", "status"),
                                  ("--root", "{root}", "check", "--json")])
def test_output_into_a_closed_pipe_is_not_an_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    """`unbounded-nvidia-setup status | head -c0`: the reader is gone before the output is
    written (at once, or from the buffer at exit). That fails the command with 1, without a
    traceback or an "Exception ignored" note; buffered or not."""
    read, write = os.pipe()
    os.close(read)
    argv = [a.format(root=tmp_path) for a in args]
    try:
        for unbuffered in ("", "1"):
            env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
            proc = subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", *argv],
                                  stdout=write, stderr=subprocess.PIPE, text=True, env=env,
                                  timeout=60, check=False)
            assert proc.returncode == 1, proc.stderr
            assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    finally:
        os.close(write)


def test_output_is_complete_through_a_pipe(tmp_path: Path) -> None:
    """The process ends without the interpreter's teardown: buffered output must still
    arrive whole."""
    (tmp_path / "proc").mkdir()  # a running machine's kernel, no NVIDIA driver in it
    (tmp_path / "proc/devices").write_text("Character devices:\n  1 mem\n")
    proc = subprocess.run([sys.executable, "-m", "unbounded_nvidia_setup", "--root",
                           str(tmp_path), "check", "--json"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert parse_check(proc.stdout, proc.returncode)["verdict"] == "no-gpu"
