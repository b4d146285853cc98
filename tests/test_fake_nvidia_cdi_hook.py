"""Fidelity tests for the nvidia-cdi-hook stand-in (tests/fakes/nvidia-cdi-hook).

Each test builds an OCI bundle in tmp_path (config.json + a root with a minimal /etc) and
runs the hook as a container runtime would: the container state as JSON on stdin. The
libraries are real ELF files compiled with gcc (conftest's so_cache), so the host's ldconfig
reads their DT_SONAMEs. The root is bind-mounted onto itself, as runc does, because the real
update-ldcache pivot_roots into it.

UNB_TEST_NVIDIA_CTK=/path/to/real/nvidia-ctk runs every test a second time ([real]) against
the real nvidia-cdi-hook beside it (and that nvidia-ctk where a spec is generated). Where the
stand-in knowingly differs the test is for the stand-in only and says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import toolkit
from conftest import needs_root

ARCH = os.uname().machine
MULTIARCH = f"/lib/{ARCH}-linux-gnu"
VER = "535.309.01"
LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
DEBIAN_DIRS = [MULTIARCH, f"/usr/lib/{ARCH}-linux-gnu", "/lib", "/usr/lib"]
NON_DEBIAN_DIRS = ["/lib", "/usr/lib", "/lib64", "/usr/lib64",
                   *(["/libx32", "/usr/libx32"] if ARCH == "x86_64" else [])]
LOG_LINE = re.compile(r'^time="[^"]+" level=(\w+) msg=(".*")$')
GO_FATAL = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d Error updating ldcache: (.*)$")

pytestmark = [pytest.mark.root, needs_root]


@dataclass(frozen=True)
class Impl:
    name: str
    hook: Path
    ctk: Path


IMPLS = [pytest.param(Impl("stand-in", toolkit.STAND_IN_NVIDIA_CDI_HOOK,
                          toolkit.STAND_IN_NVIDIA_CTK), id="stand-in")]
if toolkit.REAL:
    real = Impl("real", toolkit.NVIDIA_CDI_HOOK, toolkit.NVIDIA_CTK)
    IMPLS.append(pytest.param(real, id="real"))


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Impl:
    chosen: Impl = request.param
    assert os.access(chosen.hook, os.X_OK), chosen.hook
    return chosen


def stand_in_only(impl: Impl, why: str) -> None:
    if impl.name != "stand-in":
        pytest.skip(f"stand-in only: {why}")


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def logged(self, level: str) -> list[str]:
        found = [LOG_LINE.match(line) for line in self.stderr.splitlines()]
        return [json.loads(m[2]) for m in found if m and m[1] == level]

    @property
    def error(self) -> str:
        errors = self.logged("error")
        assert len(errors) == 1, self.stderr
        return errors[0]

    @property
    def fatal(self) -> str:
        """update-ldcache's child failure: Go's log line, then 'exit status 1'."""
        assert self.code == 1 and self.stderr.splitlines()[-1] == "exit status 1", self.stderr
        messages = [m[1] for m in map(GO_FATAL.match, self.stderr.splitlines()) if m]
        assert len(messages) == 1, self.stderr
        return messages[0]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NVIDIA_CTK_", "NVIDIA_CDI_", "FAKE_NVIDIA"))}
    return {**env, **extra}


def run(hook: Path, *args: str, stdin: str = "", env: dict[str, str] | None = None,
        argv0: str = "nvidia-cdi-hook") -> Result:
    proc = subprocess.run([argv0, *args], executable=hook, input=stdin, capture_output=True,
                          text=True, env=clean_env() if env is None else env, timeout=60,
                          check=False, cwd="/")  # a relative bundle or spec is taken from /
    assert "Traceback" not in proc.stderr, proc.stderr
    return Result(proc.returncode, proc.stdout, proc.stderr)


@dataclass
class Container:
    """An OCI bundle: config.json naming the root, and the container's state as JSON."""

    bundle: Path
    root: Path
    so: Callable[[str], Path]

    @property
    def state(self) -> str:
        return json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating",
                           "pid": os.getpid(), "bundle": str(self.bundle)})

    def hook(self, impl: Impl, *args: str, env: dict[str, str] | None = None) -> Result:
        return run(impl.hook, *args, stdin=self.state, env=env)

    def libs(self, directory: str) -> None:
        """libcuda and libnvidia-ml as a CDI spec mounts them: versioned files, no links."""
        (self.root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for soname in LIBS:
            target = self.root / directory.lstrip("/") / soname.replace(".so.1", f".so.{VER}")
            shutil.copyfile(self.so(soname), target)

    def cache(self) -> dict[str, str]:
        """SONAME -> path of the root's own /etc/ld.so.cache (ldconfig -p -C)."""
        out = subprocess.run(["ldconfig", "-p", "-C", str(self.root / "etc/ld.so.cache")],
                             capture_output=True, text=True, check=True).stdout
        pairs = (line.strip().split(" => ") for line in out.splitlines()[1:] if "=>" in line)
        return {left.split()[0]: right for left, right in pairs}

    def dropins(self) -> dict[str, str]:
        """'00-nvcr' / 'zz-nvcr' -> content, one file each (checked), mode 0644."""
        found: dict[str, str] = {}
        for path in sorted((self.root / "etc/ld.so.conf.d").glob("*")):
            assert re.fullmatch(r"(00|zz)-nvcr-\d+\.conf", path.name), path.name
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
            assert path.name[:7] not in found, f"two {path.name[:7]} files"
            found[path.name[:7]] = path.read_text()
        return found


def tree(top: Path, skip: Path | None = None) -> dict[str, str]:
    """Every name under top (but skip) -> its type or link target: what changed outside."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        if skip is not None and Path(dirpath) == skip.parent and skip.name in dirnames:
            dirnames.remove(skip.name)
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            kind = os.readlink(path) if os.path.islink(path) else "dir" if name in dirnames else "f"
            out[os.path.relpath(path, top)] = kind
    return out


@pytest.fixture
def container(tmp_path: Path, mounts: list[Path], so_cache: Callable[[str], Path]
              ) -> Iterator[Callable[..., Container]]:
    def make(debian: bool = True, mounted: bool = True, config: object = None,
             name: str = "c") -> Container:
        bundle = tmp_path / name / "bundle"
        root = bundle / "rootfs"
        (root / "etc").mkdir(parents=True)
        if debian:
            (root / "etc/debian_version").write_text("12.11\n")
        config = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}} if config is None else config
        (bundle / "config.json").write_text(json.dumps(config))
        if mounted:  # runc bind-mounts the root onto itself (private: nothing propagates)
            subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
            mounts.append(root)
            subprocess.run(["mount", "--make-private", str(root)], check=True)
        return Container(bundle, root, so_cache)

    yield make


# --------------------------------------------------------------------------- command line


def test_no_hook_or_an_unknown_hook_warns_and_succeeds(impl: Impl) -> None:
    """A spec naming a hook this version lacks must not fail the container."""
    for args, warning in [((), "No CDI hook specified"),
                          (("future-hook", "--its-flag"), "Unsupported CDI hook: future-hook"),
                          (("--bogus", "create-symlinks"), "No CDI hook specified")]:
        result = run(impl.hook, *args)
        assert (result.code, result.logged("warning")) == (0, [warning]), result.stderr
    assert run(impl.hook, "-d", "noop", "x").code == 0
    version = run(impl.hook, "--version")
    assert version.stdout.splitlines()[0] == "NVIDIA CDI Hook version 1.20.0"


def test_a_bad_flag_of_a_known_hook_fails(impl: Impl) -> None:
    for args, message in [(("create-symlinks", "--bogus"), "flag provided but not defined: -bogus"),
                          (("update-ldcache", "--folder"), "flag needs an argument: --folder"),
                          (("create-symlinks", "-debug=maybe"),
                           'invalid value "maybe" for flag -debug: parse error')]:
        result = run(impl.hook, *args)
        assert result.code == 1, result.stderr
        assert result.stderr.startswith(f"Incorrect Usage: {message}\n"), result.stderr
        assert result.error == message
        assert "NAME:" in result.stdout
    empty = run(impl.hook, "update-ldcache", "--ldconfig-path=")
    assert (empty.code, empty.error) == (1, "ldconfig-path must be specified")


def test_debug_comes_from_the_environment_the_spec_sets(
        impl: Impl, container: Callable[..., Container]) -> None:
    c = container(mounted=False)
    quiet = c.hook(impl, "create-symlinks", "--link", "a::/x", "--link", "a::/x",
                   env=clean_env(NVIDIA_CTK_DEBUG="false"))
    assert quiet.code == 0 and quiet.logged("debug") == [], quiet.stderr
    loud = c.hook(impl, "create-symlinks", "--link", "a::/x", env=clean_env(NVIDIA_CDI_DEBUG="1"))
    assert loud.logged("debug") == [f"Link {c.root}/x already exists"]
    bad = c.hook(impl, "create-symlinks", env=clean_env(NVIDIA_CTK_DEBUG="yes"))
    assert (bad.code, bad.error) == (1, 'could not parse "yes" as bool value from environment '
                                        'variable "NVIDIA_CTK_DEBUG" for flag debug: parse error')


@pytest.mark.parametrize("name", ["chmod", "disable-device-node-modification",
                                  "update-application-profile"])
def test_other_hooks_fail_as_not_simulated(impl: Impl, name: str) -> None:
    stand_in_only(impl, "the real hook runs these")
    result = run(impl.hook, name)
    assert result.code == 1 and "not simulated" in result.error


# --------------------------------------------------------------------------- container root


def test_the_root_is_found_from_the_bundles_config(impl: Impl, tmp_path: Path,
                                                   container: Callable[..., Container]) -> None:
    relative = container(mounted=False)
    assert relative.hook(impl, "create-symlinks", "--link", "t::/l").code == 0
    assert os.readlink(relative.root / "l") == "t"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    absolute = container(mounted=False, config={"root": {"path": str(elsewhere)}}, name="abs")
    assert absolute.hook(impl, "create-symlinks", "--link", "t::/l").code == 0
    assert os.readlink(elsewhere / "l") == "t" and not (absolute.root / "l").exists()
    no_root = container(mounted=False, config={}, name="none")  # the bundle is the root
    assert no_root.hook(impl, "create-symlinks", "--link", "t::/l").code == 0
    assert os.readlink(no_root.bundle / "l") == "t"
    # --container-spec FILE wins over stdin; JSON keys match case-insensitively
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"Bundle": str(relative.bundle)}) + " trailing")
    from_file = run(impl.hook, "create-symlinks", "--container-spec", str(state), "--link",
                    "u::/m", stdin="garbage")
    assert from_file.code == 0 and os.readlink(relative.root / "m") == "u"


STATE = '{"bundle": BUNDLE}'


@pytest.mark.parametrize(("state", "config", "message"), [
    ("", None, "failed to load container state: failed to decode container state: EOF"),
    ('{"bundle": "', None,
     "failed to load container state: failed to decode container state: unexpected EOF"),
    ("x", None, "failed to load container state: failed to decode container state: "
                "invalid character 'x' looking for beginning of value"),
    ('{"bundle": 5}', None, "failed to load container state: failed to decode container state: "
                            "json: cannot unmarshal number into Go struct field State.bundle of "
                            "type string"),
    ("[1]", None, "failed to load container state: failed to decode container state: "
                  "json: cannot unmarshal array into Go value of type oci.State"),
    ("{}", None, "failed to determined container root: failed to open OCI spec file: open "
                 "config.json: no such file or directory"),
    (STATE, "absent", "failed to determined container root: failed to open OCI spec file: "
                         "open BUNDLE/config.json: no such file or directory"),
    (STATE, {"root": 5}, "failed to determined container root: failed to load minimal OCI "
                            "spec: json: cannot unmarshal number into Go struct field "
                            "minimalSpec.root of type specs.Root"),
    (STATE, {"root": {"path": ["x"]}}, "failed to determined container root: failed to load "
                                          "minimal OCI spec: json: cannot unmarshal array into "
                                          "Go struct field Root.root.path of type string"),
], ids=["empty", "truncated", "garbage", "bundle-number", "array", "no-bundle", "no-config",
        "root-number", "root-path-array"])
def test_a_bad_container_state_fails(impl: Impl, container: Callable[..., Container],
                                     state: str, config: object, message: str) -> None:
    c = container(mounted=False)
    if config == "absent":
        (c.bundle / "config.json").unlink()
    elif config is not None:
        (c.bundle / "config.json").write_text(json.dumps(config))
    for hook in ("create-symlinks", "update-ldcache"):
        result = run(impl.hook, hook, stdin=state.replace("BUNDLE", json.dumps(str(c.bundle))))
        assert (result.code, result.error) == (1, message.replace("BUNDLE", str(c.bundle)))
    assert sorted(os.listdir(c.root)) == ["etc"]


def test_update_ldcache_refuses_the_host_root(impl: Impl, container: Callable[..., Container]
                                              ) -> None:
    c = container(mounted=False, config={"root": {"path": "/"}})
    result = c.hook(impl, "update-ldcache")
    assert (result.code, result.error) == (1, "failed to determined container root: <nil>")


def test_create_symlinks_refuses_the_host_root(impl: Impl, container: Callable[..., Container]
                                               ) -> None:
    stand_in_only(impl, "the real create-symlinks makes the link in the host's / (not run)")
    link = Path(f"/unb-hook-test-{uuid.uuid4().hex[:8]}")
    c = container(mounted=False, config={"root": {"path": "/tmp/.."}})
    try:
        result = c.hook(impl, "create-symlinks", "--link", f"t::{link}")
        assert result.code == 1 and "refused by this nvidia-cdi-hook test stand-in" in result.error
        assert not os.path.lexists(link)
    finally:
        if os.path.islink(link):
            link.unlink()


# --------------------------------------------------------------------------- create-symlinks


def test_links_are_made_in_the_root_with_their_targets_verbatim(
        impl: Impl, tmp_path: Path, container: Callable[..., Container]) -> None:
    c = container(mounted=False)
    outside = tree(tmp_path, skip=c.root)
    result = c.hook(impl, "create-symlinks",
                    "--link", f"libcuda.so.1::{MULTIARCH}/libcuda.so",
                    "--link", "/etc/shadow::/abs-target",
                    "--link", "../x::/new/deep/link,y::z")
    assert result.code == 0, result.stderr
    assert os.readlink(c.root / MULTIARCH.lstrip("/") / "libcuda.so") == "libcuda.so.1"
    assert os.readlink(c.root / "abs-target") == "/etc/shadow"
    assert os.readlink(c.root / "new/deep/link") == "../x" and os.readlink(c.root / "z") == "y"
    for made in ("lib", MULTIARCH.lstrip("/"), "new", "new/deep"):
        assert stat.S_IMODE((c.root / made).stat().st_mode) == 0o755
    assert result.logged("info") == [
        f"Symlinking {c.root}{MULTIARCH}/libcuda.so to libcuda.so.1",
        f"Symlinking {c.root}/abs-target to /etc/shadow",
        f"Symlinking {c.root}/new/deep/link to ../x", f"Symlinking {c.root}/z to y"]
    assert tree(tmp_path, skip=c.root) == outside


def test_links_never_leave_the_root(impl: Impl, tmp_path: Path,
                                    container: Callable[..., Container]) -> None:
    c = container(mounted=False)
    (c.root / "usr/lib").mkdir(parents=True)
    (c.root / "lib").symlink_to("/usr/lib")  # absolute: the host's /usr/lib outside the root
    (c.root / "up").symlink_to("../../../..")
    tag = f"unb-hook-test-{uuid.uuid4().hex[:8]}"
    outside = tree(tmp_path, skip=c.root)
    result = c.hook(impl, "create-symlinks",
                    "--link", f"t::../../../../../../{tag}-dotdot",
                    "--link", f"t::/lib/{tag}/libzz.so",
                    "--link", f"t::/up/{tag}-up",
                    "--link", f"t::/lib/../../../{tag}-mixed")
    assert result.code == 0, result.stderr
    for inside in (f"{tag}-dotdot", f"usr/lib/{tag}/libzz.so", f"{tag}-up", f"{tag}-mixed"):
        assert os.readlink(c.root / inside) == "t"
    assert not Path(f"/usr/lib/{tag}").exists() and not Path(f"/{tag}-dotdot").exists()
    assert tree(tmp_path, skip=c.root) == outside


def test_an_existing_link_is_kept_or_replaced(impl: Impl, container: Callable[..., Container]
                                             ) -> None:
    c = container(mounted=False)
    (c.root / "same").symlink_to("t")
    (c.root / "other").symlink_to("old")
    (c.root / "file").write_text("data")
    (c.root / "dir").mkdir()
    same_inode = os.lstat(c.root / "same").st_ino
    result = c.hook(impl, "-d", "create-symlinks", "--link", "t::/same", "--link", "t::/other",
                    "--link", "t::/file", "--link", "t::/same")
    assert result.code == 0, result.stderr
    assert os.lstat(c.root / "same").st_ino == same_inode
    assert os.readlink(c.root / "other") == "t" and os.readlink(c.root / "file") == "t"
    assert result.logged("debug") == [f"Link {c.root}/same already exists",
                                      "Link t::/same already processed"]
    onto_dir = c.hook(impl, "create-symlinks", "--link", "t::/dir")
    assert (onto_dir.code, onto_dir.error) == (
        1, "failed to create link [t /dir]: failed to create symlink: is a directory")
    assert sorted(os.listdir(c.root)) == ["dir", "etc", "file", "other", "same"]  # no temp left


def test_the_existence_check_is_on_the_lexical_host_path(
        impl: Impl, container: Callable[..., Container]) -> None:
    """LINK '../x' is created as <root>/x, but checked at <bundle>/x: if that is already a
    link to TARGET, nothing is made in the root (create-symlinks.go linkExists)."""
    c = container(mounted=False)
    (c.bundle / "x").symlink_to("t")
    skipped = c.hook(impl, "create-symlinks", "--link", "t::../x")
    assert skipped.code == 0 and not os.path.lexists(c.root / "x")
    made = c.hook(impl, "create-symlinks", "--link", "u::../x")
    assert made.code == 0 and os.readlink(c.root / "x") == "u"
    assert os.readlink(c.bundle / "x") == "t"


def test_links_are_made_in_order_until_one_is_invalid(
        impl: Impl, container: Callable[..., Container]) -> None:
    c = container(mounted=False)
    result = c.hook(impl, "create-symlinks", "--link", "a::/one", "--link", "a::/two::x",
                    "--link", "b::/three")
    assert (result.code, result.error) == (1, "invalid symlink specification a::/two::x")
    assert os.readlink(c.root / "one") == "a" and not os.path.lexists(c.root / "three")
    last_wins = c.hook(impl, "create-symlinks", "--link", "a::/four", "--link", "b::/four")
    assert last_wins.code == 0 and os.readlink(c.root / "four") == "b"


def test_a_dangling_directory_link_fails(impl: Impl, container: Callable[..., Container]) -> None:
    c = container(mounted=False)
    (c.root / "dangling").symlink_to("/nonexistent-dir")
    result = c.hook(impl, "create-symlinks", "--link", "t::/dangling/x")
    assert (result.code, result.error) == (
        1, f"failed to create link [t /dangling/x]: failed to create parent dir of link in root: "
           f"openat2 {c.root}/dangling: not a directory")
    assert not (c.root / "nonexistent-dir").exists()


# --------------------------------------------------------------------------- update-ldcache


def test_enable_cuda_compat_without_compat_libraries_does_nothing(
        impl: Impl, tmp_path: Path, container: Callable[..., Container]) -> None:
    """nvidia-ctk 1.20 puts this hook in every spec it writes by default (the device
    plugin's among them): a container without CUDA forward-compat libraries is left as it
    was, with or without the host's driver version."""
    c = container()
    before = tree(tmp_path)
    for args in ((), ("--host-driver-version", VER)):
        result = c.hook(impl, "enable-cuda-compat", *args)
        assert (result.code, result.logged("error")) == (0, []), result.stderr
    assert tree(tmp_path) == before
    (c.root / "usr/local/cuda/compat").mkdir(parents=True)
    before = tree(tmp_path)
    result = c.hook(impl, "enable-cuda-compat", "--host-driver-version", VER)
    assert (result.code, result.logged("error")) == (0, []), result.stderr
    assert tree(tmp_path) == before
    result = run(impl.hook, "enable-cuda-compat", "--host-driver-version", VER,
                 stdin='{"bundle": "/nonexistent"}')
    assert result.code == 1 and result.error.startswith("failed to determined container root")


def test_enable_cuda_compat_with_compat_libraries_is_not_simulated(
        impl: Impl, container: Callable[..., Container]) -> None:
    stand_in_only(impl, "the real hook reads the compat library's ELF header")
    c = container()
    compat = c.root / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.575.57.08").write_bytes(b"\x7fELF")
    result = c.hook(impl, "enable-cuda-compat", "--host-driver-version", VER)
    assert result.code == 1 and "not simulated" in result.error


def assert_scratch_left(c: Container) -> None:
    """The real hook's /proc mount point and scratch dir stay behind in the root."""
    assert (c.root / "proc").is_dir()
    scratch = os.listdir(c.root / "run/nvidia-ctk-hook")
    assert len(scratch) == 1 and re.fullmatch(r"[0-9a-f-]{36}", scratch[0]), scratch
    assert os.listdir(c.root / "run/nvidia-ctk-hook" / scratch[0]) == []


def test_update_ldcache_builds_the_containers_own_cache(
        impl: Impl, tmp_path: Path, container: Callable[..., Container]) -> None:
    c = container()
    c.libs(MULTIARCH)
    outside = tree(tmp_path, skip=c.root)
    result = c.hook(impl, "update-ldcache", "--folder", MULTIARCH)
    assert (result.code, result.stderr) == (0, "")
    assert (c.root / "etc/ld.so.conf").read_text() == "include /etc/ld.so.conf.d/*.conf\n"
    # a Debian root: the multiarch dir is a system dir already, so no 00-nvcr file
    assert c.dropins() == {"zz-nvcr": "".join(f"{d}\n" for d in DEBIAN_DIRS)}
    lib = f"{c.root}{MULTIARCH}"
    assert {s: c.cache()[s] for s in LIBS} == {s: f"{MULTIARCH}/{s}" for s in LIBS}
    assert os.readlink(f"{lib}/libcuda.so.1") == f"libcuda.so.{VER}"  # ldconfig's own link
    assert not any((c.root / d).exists() for d in ("sbin", "usr/sbin"))  # no ldconfig inside
    assert_scratch_left(c)
    assert tree(tmp_path, skip=c.root) == outside


def test_update_ldcache_adds_folders_not_yet_configured(
        impl: Impl, container: Callable[..., Container]) -> None:
    c = container(debian=False)
    c.libs("/usr/local/nvidia/lib")
    args = ["--folder", "/usr/local/nvidia/lib", "--folder", "/usr/lib,/usr/local/nvidia/lib"]
    assert c.hook(impl, "update-ldcache", *args).code == 0
    system = "".join(f"{d}\n" for d in NON_DEBIAN_DIRS)
    assert c.dropins() == {"00-nvcr": "/usr/local/nvidia/lib\n", "zz-nvcr": system}
    assert c.cache()["libcuda.so.1"] == "/usr/local/nvidia/lib/libcuda.so.1"
    again = c.hook(impl, "update-ldcache", *args)  # listed now: no second 00-nvcr file
    assert again.code == 0
    names = sorted(p.name[:7] for p in (c.root / "etc/ld.so.conf.d").iterdir())
    assert names == ["00-nvcr", "zz-nvcr", "zz-nvcr"]


def test_update_ldcache_keeps_an_existing_ld_so_conf(
        impl: Impl, container: Callable[..., Container]) -> None:
    """Folders listed by ld.so.conf or a file it includes are not written again; a relative
    include glob is taken from / (ldconfig itself takes it from /etc: /drv-a stays out)."""
    c = container()
    conf = "# ours\ninclude etc/extra/*.conf\n/already\n"
    (c.root / "etc/ld.so.conf").write_text(conf)
    (c.root / "etc/extra").mkdir()
    (c.root / "etc/extra/a.conf").write_text("/drv-a\n")
    c.libs("/drv-a")
    result = c.hook(impl, "update-ldcache", "--folder", "/drv-a", "--folder", "/already",
                    "--folder", "/new")
    assert result.code == 0, result.stderr
    assert (c.root / "etc/ld.so.conf").read_text() == conf
    assert c.dropins()["00-nvcr"] == "/new\n"
    assert "libcuda.so.1" not in c.cache()


def test_update_ldcache_runs_the_hosts_ldconfig(impl: Impl, tmp_path: Path,
                                               container: Callable[..., Container]) -> None:
    c = container()
    c.libs(MULTIARCH)
    (tmp_path / "ldconfig").write_bytes(b"")  # <path>.real is preferred when it exists
    shutil.copy2("/sbin/ldconfig", tmp_path / "ldconfig.real")
    result = c.hook(impl, "update-ldcache", "--ldconfig-path", str(tmp_path / "ldconfig"),
                    "--folder", MULTIARCH)
    assert result.code == 0, result.stderr
    assert "libcuda.so.1" in c.cache()
    missing = container(name="missing")
    gone = missing.hook(impl, "update-ldcache", "--ldconfig-path", "/nonexistent/ldconfig")
    assert gone.fatal == ("error mounting host ldconfig: error reading host ldconfig: stat "
                          "/nonexistent/ldconfig: no such file or directory")
    assert sorted(os.listdir(missing.root)) == ["etc", "proc"]


def test_update_ldcache_needs_the_root_mounted(impl: Impl, container: Callable[..., Container]
                                              ) -> None:
    c = container(mounted=False)
    result = c.hook(impl, "update-ldcache", "--folder", MULTIARCH)
    assert result.fatal in ("error running pivot_root: pivot_root .: device or resource busy",
                            "error running pivot_root: pivot_root .: invalid argument")
    assert sorted(os.listdir(c.root / "etc")) == ["debian_version"]
    assert_scratch_left(c)


@pytest.mark.parametrize(("breakage", "message"), [
    ("no-etc", "failed to ensure ld.so.conf file: failed to create top-level ld.so.conf file: "
               "open /etc/ld.so.conf: no such file or directory"),
    ("conf.d-file", "failed to write zz-nvcr-*.conf drop-in: failed to create ld.so.conf.d: "
                    "mkdir /etc/ld.so.conf.d: not a directory"),
    ("cache-dir", None),
])
def test_update_ldcache_failures(impl: Impl, container: Callable[..., Container],
                                 breakage: str, message: str | None) -> None:
    c = container()
    if breakage == "no-etc":
        shutil.rmtree(c.root / "etc")
    elif breakage == "conf.d-file":
        (c.root / "etc/ld.so.conf.d").write_text("")
    else:
        (c.root / "etc/ld.so.cache").mkdir()
    result = c.hook(impl, "update-ldcache")
    if message is not None:
        assert result.fatal == message
        return
    # ldconfig itself fails: its own message, its status; the drop-in was written before
    assert result.code == 1 and result.stderr.splitlines()[-1] == "exit status 1", result.stderr
    assert "ld.so.cache" in result.stderr.splitlines()[0]
    assert list(c.dropins()) == ["zz-nvcr"]


def test_update_ldcache_writes_musls_path_file_on_alpine(
        impl: Impl, container: Callable[..., Container]) -> None:
    c = container(debian=False)
    (c.root / "etc/alpine-release").write_text("3.20.0\n")
    assert c.hook(impl, "update-ldcache", "--folder", "/drv").code == 0
    expected = "".join(f"{d}\n" for d in ["/drv", *NON_DEBIAN_DIRS])
    assert (c.root / f"etc/ld-musl-{ARCH}.path").read_text() == expected


# --------------------------------------------------------------------------- with nvidia-ctk


@pytest.fixture
def driver(tmp_path: Path, so_cache: Callable[[str], Path]) -> Path:
    """A driver root with libcuda and libnvidia-ml and relative SONAME links, and its
    device nodes (the spec generators run in management mode)."""
    root = tmp_path / "driver"
    lib = root / MULTIARCH.lstrip("/")
    lib.mkdir(parents=True)
    for soname in LIBS:
        versioned = soname.replace(".so.1", f".so.{VER}")
        shutil.copyfile(so_cache(soname), lib / versioned)
        (lib / soname).symlink_to(versioned)
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    (root / "dev").mkdir()
    for name, minor in (("nvidia0", 0), ("nvidiactl", 255)):
        os.mknod(root / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(195, minor))
    return root


def generate(impl: Impl, driver: Path, out: Path, path: str, *extra: str) -> dict[str, Any]:
    result = run(impl.ctk, "cdi", "generate", f"--driver-root={driver}", f"--dev-root={driver}",
                 "--mode=management", "--format=yaml", f"--output={out}", "--disable-hook",
                 "all", "--enable-hook", "create-symlinks", "--enable-hook", "update-ldcache",
                 *extra, env=clean_env(PATH=path), argv0="nvidia-ctk")
    assert result.code == 0, result.stderr
    spec = yaml.safe_load(out.read_text())
    assert isinstance(spec, dict)
    return spec


def hooks(spec: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = spec["containerEdits"]["hooks"]
    assert found
    return found


def test_the_spec_names_the_hook_found_like_nvidia_ctk_does(
        impl: Impl, tmp_path: Path, driver: Path) -> None:
    """ResolveNVIDIACDIHookPath: the first executable nvidia-cdi-hook in $PATH (not a
    directory, not without x bits; a symlink is named, not resolved), else
    /usr/bin/nvidia-cdi-hook; 'nvidia-ctk' likewise; an absolute path as given."""
    for name in ("noexec", "isdir/nvidia-cdi-hook", "found"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "noexec/nvidia-cdi-hook").write_text("")
    (tmp_path / "found/nvidia-cdi-hook").symlink_to(impl.hook)
    dirs = f"{tmp_path}/noexec:{tmp_path}/isdir:{tmp_path}/found:/usr/bin:/bin"
    out = tmp_path / "spec.yaml"
    for path, extra, expected in [
            (dirs, (), (f"{tmp_path}/found/nvidia-cdi-hook", "nvidia-cdi-hook")),
            (f"{tmp_path}/noexec:/usr/bin:/bin", (),
             ("/usr/bin/nvidia-cdi-hook", "nvidia-cdi-hook")),
            (f"{impl.ctk.parent}:/usr/bin", ("--nvidia-cdi-hook-path=nvidia-ctk",),
             (f"{impl.ctk.parent}/nvidia-ctk", "nvidia-ctk")),
            (dirs, ("--nvidia-cdi-hook-path=/opt/x/hook",), ("/opt/x/hook", "hook"))]:
        for hook in hooks(generate(impl, driver, out, path, *extra)):
            assert (hook["path"], hook["args"][0]) == expected
            assert (hook["args"][1] == "hook") == (expected[1] == "nvidia-ctk")


def test_the_specs_hooks_give_the_container_its_libraries(
        impl: Impl, tmp_path: Path, driver: Path, mounts: list[Path],
        container: Callable[..., Container]) -> None:
    """End to end, as runc would: the spec's mounts bound read-only into the root, then its
    createContainer hooks run (argv, env from the spec, the state on stdin)."""
    spec = generate(impl, driver, tmp_path / "spec.yaml", f"{impl.hook.parent}:/usr/bin:/bin")
    c = container()
    for mount in spec["containerEdits"]["mounts"]:
        target = c.root / mount["containerPath"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        subprocess.run(["mount", "--bind", "-o", "ro", mount["hostPath"], str(target)], check=True)
        mounts.append(target)
    ran = []
    for hook in hooks(spec):
        assert hook["hookName"] == "createContainer" and hook["path"] == str(impl.hook)
        args = hook["args"]
        result = run(Path(hook["path"]), *args[1:], stdin=c.state, argv0=args[0],
                     env=dict(e.split("=", 1) for e in hook.get("env", [])))
        assert result.code == 0, result.stderr
        ran.append(args[1])
    assert ran == ["create-symlinks", "update-ldcache"]
    assert os.readlink(c.root / MULTIARCH.lstrip("/") / "libcuda.so") == "libcuda.so.1"
    assert {s: c.cache()[s] for s in LIBS} == {s: f"{MULTIARCH}/{s}" for s in LIBS}
    for soname in LIBS:  # each resolves, inside the root, to the mounted driver file
        resolved = os.path.realpath(c.root / MULTIARCH.lstrip("/") / soname)
        assert resolved == f"{c.root}{MULTIARCH}/{soname.replace('.so.1', f'.so.{VER}')}"
