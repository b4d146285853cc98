"""The live state, validated, changing nothing: what `check` and `status` show, and what
a run proves its end state with (reconcile._verify_end_state). Rendering is check.py's."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import devices, discover, driver, gpus, linker, outcome, searchorder, tree
from .config import Machine
from .log import EXIT_TEMPFAIL, Failure
from .plan import ACTIVE_LINKS, LeftOut, Manifest, Plan
from .problems import REBUILT_CODES, SERVING_CODES, WAITING_CODES, Problem
from .spec import KIND, PLUGIN_SPEC_CODES, SPEC_CODES, device_names, spec_problems
from .spec import load as load_spec
from .verify import library_sonames, root_problems, root_version

if TYPE_CHECKING:
    from .unit import Unit

SCHEMA_VERSION = 1  # of `check --json`; docs/problems.md says what may change within one
UNIT = "unbounded-nvidia-setup.service"
# The answer a host agent switches on (docs/host-integration.md).
# Minor versions add keys, codes and verdicts only (docs/problems.md); 1: `degraded`,
# `gpu-lost`, `setup-failed` and the `gpus` section (issue 27); 2: `no-usable-gpu` (a
# verdict and a code), `gpu-unusable`, `spec-imex-channel`, the `gpus` section's
# `unusable`, `excluded` and `node_error`, and `last_reload` (issue 31); 3: the `gpus`
# section's unusable GPUs' `query` and `timeout_seconds`, `served` counted from the
# installed spec on every node, `plugin-spec-unusable-gpu`, and the device plugin spec
# section's `written_at` and `gpus` (issue 35); 4: `pending`, the code `setup-pending`,
# the unit section's `n_restarts`, `result` and `status_text`, the verdict `image` with
# its section and the codes `image-unit-missing` and `image-unit-disabled` (issue 36); 5:
# the codes `spec-unsafe-path` (issue 37) and `consumer-spec-stale`, the section
# `nvidia_specs` (issue 38).
SCHEMA_MINOR = 5
READY, NO_GPU, NOT_READY_YET, BROKEN = "ready", "no-gpu", "not-ready-yet", "broken"
DEGRADED, NO_USABLE_GPU, IMAGE = "degraded", "no-usable-gpu", "image"
VERDICTS = (READY, DEGRADED, NO_USABLE_GPU, NO_GPU, NOT_READY_YET, BROKEN, IMAGE)
# `check`'s exit status for `degraded`: serving, with fewer GPUs. Not 0 (a host agent
# that reads only the status must not take it for healthy) and not 1: the drift check's
# unit takes it for success (SuccessExitStatus=3), since a restart cannot mend it.
EXIT_DEGRADED = 3
# `check`'s exit status for `no-usable-gpu`: the node is up and serves no GPU. Not 1,
# for the same reason: a host agent that restarts the unit on 1 would stop every CPU pod
# and mend nothing, and the drift check's unit takes it for success too.
EXIT_NO_USABLE_GPU = 4


@dataclass
class Report:
    gpu: bool
    driver_version: str | None
    module_version: str | None
    problems: list[Problem] = field(default_factory=list)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Live facts beside the files, set by `check`: a run or clean holds the lock right
    # now; the unit's ActiveState and SubState (None: systemd not reachable or not asked).
    setup_running: bool = False
    unit: Unit | None = None  # unit.py
    # Staged libraries planning leaves out of the root (plan.LeftOut): not a problem (the
    # verdict ignores them), but a host whose driver installation is damaged.
    left_out: tuple[LeftOut, ...] = ()
    # How the last run ended (outcome.py), when check read it.
    last_run: outcome.Outcome | None = None
    # A stopped image (`--root` without a kernel's view): only what it holds is checked.
    image: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        """From the state just read, never from a remembered result. Problems are only
        "broken" when nothing is on its way to fixing them: no run holding the lock, no
        unit start (or retry) pending, staging that is there."""
        if self.image:
            return IMAGE if self.ok else BROKEN
        if self.ok:
            return READY if self.gpu else NO_GPU
        if self.waiting:
            return NOT_READY_YET
        codes = {p.code for p in self.problems}
        if codes <= SERVING_CODES:
            return NO_USABLE_GPU if "no-usable-gpu" in codes else DEGRADED
        return BROKEN

    @property
    def waiting(self) -> bool:
        """A setup is on its way: a run holds the lock, the unit's start or retry is
        pending, or the host has not staged the driver or bound the devices yet."""
        return (self.setup_running or (self.unit is not None and self.unit.pending)
                or any(p.code in WAITING_CODES for p in self.problems))

    def causes(self) -> tuple[list[Problem], list[Problem]]:
        """(the problems to act on, the cause of a wait first; what a pending setup
        rebuilds, which the last boot left). While nothing is pending, every problem is
        a cause. While a start is pending and nothing else names why, the unit does."""
        # A unit systemd shows as neither starting nor retrying, with no run holding the
        # lock, rebuilds nothing by itself (staging unmounted under an active unit).
        idle = self.unit is not None and not self.unit.pending and not self.setup_running
        if not self.waiting or idle:
            return self.problems, []
        pending = [p for p in self.problems if p.code in REBUILT_CODES]
        causes = [p for p in self.problems if p.code not in REBUILT_CODES]
        if pending and not any(p.code in WAITING_CODES | {"setup-failed"} for p in causes):
            unit = f" ({self.unit.describe()})" if self.unit is not None else ""
            if self.setup_running:
                causes.append(Problem(
                    "setup-running", f"a run holds the setup's lock{unit}: it is replacing "
                    "what the last boot left; check again when it ends", UNIT))
            else:
                causes.append(Problem(
                    "setup-pending", f"{UNIT}'s start is pending{unit}: what the last boot "
                    "left is rebuilt when it runs; wait for it", UNIT))
        first = ("staging-missing", "devices-not-bound", "setup-running", "setup-pending")
        causes.sort(key=lambda p: first.index(p.code) if p.code in first else len(first))
        return causes, pending

    def to_json(self) -> dict[str, Any]:
        causes, pending = self.causes()
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION, "schema_minor": SCHEMA_MINOR,
            "verdict": self.verdict, "ok": self.ok,
            "gpu": self.gpu, "driver_version": self.driver_version,
            "module_version": self.module_version, "setup_running": self.setup_running,
            "problems": [asdict(p) for p in causes],
            "pending": [asdict(p) for p in pending],
            "left_out": [left._asdict() for left in self.left_out], **self.sections}
        if self.unit is not None:
            out["unit"] = {"name": UNIT, "active_state": self.unit.active,
                           "sub_state": self.unit.sub, "n_restarts": self.unit.restarts,
                           "result": self.unit.result, "status_text": self.unit.status}
        last = self.last_run
        if last is not None and last.reload_exit_code is not None:
            out["last_reload"] = {"exit_code": last.reload_exit_code,
                                  "finished_at": last.reload_finished_at,
                                  "error": last.reload_error}
        return out


def _check_root(machine: Machine, report: Report,
                want: Manifest | None) -> tuple[str | None, dict[str, str | None] | None]:
    """The root's driver version and the DT_SONAMEs of its library directory (read once,
    for the link check here and the linker-cache check after it; None: no such dir)."""
    live = machine.driver_root
    have = tree.manifest(live)
    section: dict[str, Any] = {"path": str(live), "present": have is not None}
    report.sections["driver_root"] = section
    if os.path.islink(live.parent):
        report.problems.append(Problem("root-parent-symlink", f"{live.parent} is a symlink",
                                       str(live.parent)))
    if have is None:
        code = "root-not-directory" if os.path.lexists(live) else "root-missing"
        report.problems.append(Problem(code, f"driver root {live} is missing or not a "
                                       "directory", str(live)))
        if want is None:  # why: staging not there yet, or refused in the run's words
            _plan_staging(machine, report)
        return None, None
    versions = root_version(live, machine.libdir)
    sizes = [v[1] for v in have.values() if len(v) == 4]
    version = report.module_version or (min(versions) if len(versions) == 1 else None)
    section.update(
        version=version,
        libraries=sorted(k.rsplit("/", 1)[1] for k, v in have.items()
                         if k.startswith(f"{machine.libdir}/") and v[0] == "f"),
        helpers=sorted(k.rsplit("/", 1)[1] for k, v in have.items()
                       if k.startswith("usr/bin/") and v[0] == "f"),
        firmware=sorted(k for k, v in have.items() if k.startswith("lib/firmware/")
                        and v[0] == "f"),
        files=len(sizes),
        bytes=sum(sizes),
    )
    libdir = live / machine.libdir
    sonames = library_sonames(libdir) if libdir.is_dir() and not libdir.is_symlink() else None
    report.problems += root_problems(live, machine.libdir, version,
                                     machine.config.extra_library_prefixes, sonames)
    if report.module_version and versions and versions != {report.module_version}:
        report.problems.append(Problem("root-version-mismatch",
                                       f"driver root holds {', '.join(sorted(versions))} but the "
                                       f"kernel module is {report.module_version}", str(live)))
    if want is not None:  # a run's own end state: what it just built
        difference = tree.describe_difference(want, have)
        if difference != "identical":
            report.problems.append(Problem("root-out-of-date", "driver root differs from "
                                           f"what this run built: {difference}", str(live)))
        return version, sonames
    # What the staging mounts call for now: catches tampering and staging that changed.
    staged = _plan_staging(machine, report)
    if staged is not None:
        difference = tree.describe_difference(staged.manifest(), have)
        if difference != "identical":
            report.problems.append(Problem("root-out-of-date",
                                           f"driver root differs from staging: {difference}",
                                           str(live)))
    return version, sonames


def _plan_staging(machine: Machine, report: Report, *, missing_ok: bool = False) -> Plan | None:
    """The plan the staging mounts make now, as a run would make it, and what it leaves
    out; None when there is none. Planning's refusal is `staging-invalid` with the run's
    own line. Staging not mounted is `staging-missing`, unless `missing_ok` (no root to
    compare: `root-missing` already says what is wrong)."""
    try:
        dirs = discover.staging_dirs(machine)
        if not dirs or not all(discover.is_populated(d) for d in dirs):
            if not missing_ok:
                report.problems.append(Problem(
                    "staging-missing", f"driver staging is not mounted at "
                    f"{machine.at(machine.config.staging_glob)}: the setup waits for the "
                    "host agent to mount it, and builds the driver root from it then",
                    machine.staging_parent))
            return None
        staged = driver.plan_from_staging(machine, dirs, report.module_version, say=False)
    except Failure as e:
        report.problems.append(Problem("staging-invalid", e.message, machine.staging_parent))
        return None
    report.left_out = staged.left_out
    return staged


# A spec as it was read (document, or why not), by path: what `check` read once for its
# own checks, the survey of every NVIDIA spec (consumers.py) does not read again.
Loaded = dict[Path, tuple[Any, str | None]]


def _check_spec(machine: Machine, report: Report, version: str | None,
                found: gpus.NodeGpus, loaded: Loaded) -> None:
    path = machine.cdi_spec
    section: dict[str, Any] = {"path": str(path), "present": path.exists()}
    report.sections["cdi_spec"] = section
    if not section["present"]:
        if found.serves:  # else no spec is the run's own decision (degrade.py)
            report.problems.append(Problem("spec-missing", f"{path} does not exist", str(path)))
        _check_gpus(machine, report, None, found)
        return
    doc, why = loaded[path] = load_spec(path)
    if why:
        report.problems.append(Problem("spec-invalid", f"{path}: {why}", str(path)))
        return
    kind = doc.get("kind") if isinstance(doc, dict) else None
    section.update(kind=kind if isinstance(kind, str) else None,  # a string or null: schema
                   devices=device_names(doc))
    helpers = ("nvidia-smi",) if (machine.driver_root / "usr/bin/nvidia-smi").exists() else ()
    report.problems += spec_problems(doc, machine, codes=SPEC_CODES, where=str(path), kind=KIND,
                                     version=version, helpers=helpers)
    _check_gpus(machine, report, doc, found)
    shadow = machine.at("/var/run/cdi") / path.name
    if shadow.exists() and shadow.resolve() != path.resolve():
        report.problems.append(Problem("spec-shadowed", f"{shadow} outranks {path} for the same "
                                       "devices (nvidia-cdi-refresh?)", str(shadow)))


def _check_gpus(machine: Machine, report: Report, doc: Any, found: gpus.NodeGpus) -> None:
    """What the installed spec serves of the GPUs the kernel lists, on every node; where
    the last run found GPUs NVML cannot use, those it leaves out (gpus.problems)."""
    report.sections["gpus"], problems = gpus.report(machine, doc, found, str(machine.cdi_spec))
    report.problems += problems


def _check_last_run(machine: Machine, report: Report) -> None:
    """A run that failed kept the previous root and spec live, which pass every check of
    the files: that is not `ready` (containerd and kubelet are down while the unit
    retries). Its own line says why (outcome.py)."""
    last = outcome.read(machine)
    report.last_run = last
    # A failed reload (last.reload_exit_code) is not a failed setup: it changed nothing,
    # and what is live is the run's on record, which the files are checked against.
    if last is None or not last.failed:
        return
    live = ("what is live is what the run before it left"
            if machine.driver_root.is_dir() or machine.cdi_spec.exists()
            else "no driver root or spec is live")
    # Exit 75 is a wait that ran out (staging, devices, the lock), which systemd retries.
    ended = ("gave up waiting" if last.exit_code == EXIT_TEMPFAIL else "failed")
    report.problems.append(Problem(
        "setup-failed", f"the last `{last.command}` {ended} at {outcome.when(last)} (exit "
        f"{last.exit_code}): {last.error or 'no error line recorded'}; {live}",
        str(machine.last_run)))


def _check_plugin_spec(machine: Machine, report: Report, version: str | None,
                       loaded: Loaded) -> None:
    """The device plugin's own spec, as it wrote it and when: what it lists is what pods
    get through it. A GPU it lists that the last run found unusable is a problem of its
    own (gpus.plugin_problems): the plugin started before, and only an Xid tells it."""
    path = machine.plugin_spec
    try:
        written = path.stat().st_mtime
    except OSError:
        return
    section: dict[str, Any] = {"path": str(path), "present": True, "written_at": written}
    report.sections["device_plugin_spec"] = section
    doc, why = loaded[path] = load_spec(path)
    if why:
        report.problems.append(Problem("plugin-spec-invalid", f"{path}: {why}", str(path)))
        return
    section["devices"] = device_names(doc)
    section["gpus"] = sorted(f"/dev/nvidia{n}" for n in gpus.served_minors(doc))
    report.problems += spec_problems(doc, machine, codes=PLUGIN_SPEC_CODES, where=str(path),
                                     kind=None, version=version)
    if report.last_run is not None and report.last_run.gpus.degraded:
        when = outcome.when_at(written)
        report.problems += gpus.plugin_problems(report.last_run.gpus, doc, str(path), when)


def _check_ldcache(machine: Machine, report: Report, sonames: dict[str, str | None] | None,
                   leftovers: list[Path]) -> None:
    """The search order first: a directory ahead of the driver root's is why the cache
    resolves a SONAME elsewhere, and it is found without a root too (after a first
    boot's rollback), for the SONAMEs every root has (libcuda.so.1, libnvidia-ml.so.1)."""
    present = ACTIVE_LINKS if sonames is None else {s for s in sonames.values() if s}
    report.problems += searchorder.problems(machine, present, leftovers)
    if sonames is not None:
        report.problems += linker.cache_problems(machine, sonames)


def collect(machine: Machine, want: Manifest | None = None,
            left_out: tuple[LeftOut, ...] = (),
            found: gpus.NodeGpus | None = None) -> Report:
    """Everything `check` reports. With `want` (a run verifying its own end state), the
    root is compared with what the run built instead of resolving staging again (and
    `left_out` is what its plan left out, `found` what it found NVML cannot use), and
    the device plugin's spec, which the plugin rewrites after kubelet starts, is left
    out. Without, the GPUs are those of the last run's record."""
    if want is None and not machine.is_live:
        from . import image

        if image.is_image(machine):
            report = Report(gpu=False, driver_version=None, module_version=None, image=True)
            report.sections["image"], report.problems = image.report(machine)
            return report
    gpu = discover.has_gpu(machine)
    report = Report(gpu=gpu, driver_version=None, module_version=discover.module_version(machine),
                    left_out=left_out)
    if not gpu:
        try:
            unbound = devices.staged_without_nodes(machine)
        except Failure as e:
            unbound = None
            report.problems.append(Problem("staging-invalid", e.message,
                                           machine.staging_parent))
        if unbound is not None:  # its state is kept, not stale
            report.problems.append(unbound)
            return report
        for path in (machine.driver_root, machine.cdi_spec, machine.ldconf_dropin):
            if os.path.lexists(path):
                report.problems.append(Problem("stale-state", f"no NVIDIA GPU, but {path} "
                                               "exists", str(path)))
        return report
    report.problems += devices.problems(machine)
    version, sonames = _check_root(machine, report, want)
    report.driver_version = version
    dropin = linker.dropin_text(machine)
    try:
        have = machine.ldconf_dropin.read_text()
    except OSError:
        have = None
    if have != dropin:
        report.problems.append(Problem("ldconf-missing", f"{machine.ldconf_dropin} is missing "
                                       "or does not name the driver root",
                                       str(machine.ldconf_dropin)))
    leftovers = linker.legacy_links(machine)
    for link in leftovers:
        report.problems.append(Problem("legacy-link", f"{link} leads into the staging mounts "
                                       "(an older agent's link)", str(link)))
    _check_ldcache(machine, report, sonames, leftovers)
    if want is None:
        _check_last_run(machine, report)
        found = report.last_run.gpus if report.last_run is not None else None
    loaded: Loaded = {}
    _check_spec(machine, report, version, found or gpus.NodeGpus(), loaded)
    if want is None:
        _check_plugin_spec(machine, report, version, loaded)
        # Not in a run's end-state proof: pods that predate the run keep the generation it
        # replaced until their owners restart them, as the device plugin's spec is
        # rewritten after kubelet starts. The run never kills pods; check names them.
        _check_holders(machine, report)
        _check_consumer_specs(machine, report, loaded)
    return report


def _check_consumer_specs(machine: Machine, report: Report, loaded: Loaded) -> None:
    """Every NVIDIA spec on the node, for `check` and `status` only (consumers.py)."""
    from . import consumers

    specs = consumers.read(machine, loaded)
    report.sections["nvidia_specs"] = {
        "directories": [str(machine.at(d)) for d in consumers.SPEC_DIRS],
        "specs": [s.to_json(report.driver_version) for s in specs]}
    report.problems += consumers.problems(specs)


def _check_holders(machine: Machine, report: Report) -> None:
    # Imported here: only `check` and `status` need it, never a run, which it would cost
    # about 4.4M instructions on every boot (1% of a cold run's own; callgrind).
    from . import holders

    for h in holders.stale_holders(machine):
        where = f", container {h.container[:12]}" if h.container else ""
        report.problems.append(Problem(
            "pod-on-old-root", f"pid {h.pid} ({h.comm}{where}) sees {h.mount_point} from a "
            f"replaced driver root generation ({h.source}): it has the previous driver, or "
            "none; restart it", str(machine.at(f"/proc/{h.pid}"))))


def collect_beside(machine: Machine, busy: bool) -> Report:
    """`check`'s report. `busy`: a run or clean holds the lock and `check` reads without it
    (lock.shared_or_busy). Each file it reads is whole (replaced by rename), but a walk of
    the root can meet a generation the run is deleting after its swap, or a name the swap
    has just moved: then the report says that a setup is changing the state, nothing
    more, and the verdict is "not ready yet"."""
    if not busy:
        return collect(machine)
    # The root is read more than once (its walk, then its libraries' links and SONAMEs): a
    # swap or clean in between leaves no error, only a root that seems to lack files. Its
    # identity before and after tells the two apart.
    before = _identity(machine.driver_root)
    changed: str | None = None
    try:
        report = collect(machine)
        if _identity(machine.driver_root) != before:
            changed = str(machine.driver_root)
    except OSError as e:
        changed = e.filename or str(machine.driver_root)
    if changed is not None:
        report = Report(gpu=discover.has_gpu(machine), driver_version=None,
                        module_version=discover.module_version(machine))
        report.problems.append(Problem(
            "setup-running", f"{changed} changed while check read it: a run holding "
            f"{machine.lock_file} is replacing the state; check again when it ends",
            str(machine.lock_file)))
    report.setup_running = True
    return report


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
