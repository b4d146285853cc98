"""`run` and `clean`: the reconcile of DESIGN.md, one step after the other."""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import cdi, devices, discover, driver, linker, log, outcome, searchorder, tree
from .config import Machine
from .lock import locked
from .log import EXIT_FAILED, EXIT_TEMPFAIL, Failure, die
from .metrics import RunRecord
from .plan import LeftOut, Manifest, Plan
from .problems import SERVING_CODES
from .run import find_program
from .state import collect
from .tree import write_atomically
from .verify import changed_copies, root_problems

# Programs that hold the driver root open in pods: swapping under them is refused. They
# are their systemd units, never a name a process gives itself: any process, a pod's
# included (a Docker-in-Docker pod runs a real containerd), sets its own comm (issue 37).
CONSUMERS = {"containerd": "containerd.service", "kubelet": "kubelet.service"}
_POLL = 1.0
_SAY_AFTER = 10.0  # seconds of a wait before the journal hears of it again, then doubling


def running_consumers(machine: Machine) -> list[str]:
    """containerd and kubelet, when their units run: asked of systemd on the running
    system, else read from each process's cgroup (a unit's processes are in
    /system.slice/<unit>; a pod's are in its own, kubepods, slice)."""
    if machine.is_live and os.path.isdir("/run/systemd/system"):
        running = _active_units(list(CONSUMERS.values()))
        if running is not None:
            return sorted(name for name, unit in CONSUMERS.items() if unit in running)
    found = set()
    proc = machine.at("/proc")
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []
    units = {f"/system.slice/{unit}": name for name, unit in CONSUMERS.items()}
    for pid in pids:
        try:
            with open(proc / pid / "cgroup", "rb") as f:
                lines = f.read(1 << 16).decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            name = units.get(line.rpartition(":")[2])
            if name is not None:
                found.add(name)
    return sorted(found)


def _active_units(units: list[str]) -> set[str] | None:
    """The units systemd has active (or activating, reloading, deactivating: their
    processes run); None when systemctl cannot answer."""
    import shutil

    from .budget import Limit
    from .run import run

    systemctl = shutil.which("systemctl", path="/usr/bin:/bin")  # never the caller's PATH
    if systemctl is None:
        return None
    try:
        result = run([systemctl, "show", "--property=Id,ActiveState", *units],
                     limit=Limit(10), quiet=True)
    except Failure:
        return None
    if not result.ok:
        return None
    running, unit = set(), None
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key == "Id":
            unit = value
        elif key == "ActiveState" and unit is not None and value not in ("inactive", "failed"):
            running.add(unit)
    return running


def wait_for_staging(machine: Machine) -> list[Path]:
    """All staging dirs, once every one of them is populated (an empty one is a bind mount
    the host has not made yet); exit 75 when they are not within the configured wait, or
    within what is left of the run's budget when that ends first."""
    limit = machine.limit(machine.config.staging_wait_seconds)
    wait = limit.seconds or 0.0
    start = time.monotonic()
    pattern = machine.at(machine.config.staging_glob)
    said, next_said = "", _SAY_AFTER
    while True:
        dirs = discover.staging_dirs(machine)
        empty = [d for d in dirs if not discover.is_populated(d)]
        if dirs and not empty:
            if said:
                log.info(f"driver staging arrived after {time.monotonic() - start:.0f} s")
            return dirs
        waited = time.monotonic() - start
        what = f"{', '.join(map(str, empty))} empty" if empty else f"nothing at {pattern}"
        if waited >= wait:
            die(f"NVIDIA devices present but driver staging is not ready after "
                f"{limit.text()} ({what}){limit.because()}",
                hint="the host agent must bind-mount its driver library directories; "
                     "systemd retries", code=EXIT_TEMPFAIL)
        # STATUS= every poll (`systemctl status` shows how long); the journal when the
        # wait starts, when what it waits for changes, and at doubling intervals.
        say = what != said or waited >= next_said
        if waited >= next_said:
            next_said *= 2
        log.status(f"Waiting for driver staging ({what}, {waited:.0f} s of {limit.text()})",
                   journal=say)
        said = what
        time.sleep(min(_POLL, max(0.0, wait - waited)))


def remove_state(machine: Machine) -> list[Path]:
    """Remove the driver root, spec and ld.so.conf drop-in; the root goes in one rename
    so nobody sees it half deleted."""
    removed = []
    live = machine.driver_root
    if os.path.lexists(live):
        tree.unswap(live, None)
        removed.append(live)
    tree.remove_leftovers(live.parent)
    for path in (machine.cdi_spec, machine.ldconf_dropin):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    if machine.ldconf_dropin in removed:
        linker.run_ldconfig(machine)
    for path in removed:
        log.info(f"removed {path}")
    return removed


def refuse_if_consumers(machine: Machine, what: str, force: bool) -> None:
    busy = running_consumers(machine)
    if busy and not force:
        die(f"{' and '.join(busy)} running: {what} would change the driver under running pods",
            hint="run `systemctl restart unbounded-nvidia-setup` (it stops kubelet and "
                 "containerd first), or pass --force")


def clean(machine: Machine, *, force: bool = False) -> None:
    with locked(machine):
        if os.path.lexists(machine.driver_root):
            refuse_if_consumers(machine, f"removing {machine.driver_root}", force)
        try:
            removed = remove_state(machine)
            outcome.remove(machine)  # nothing left that a run's outcome could describe
        except OSError as e:
            die(f"cannot remove {e.filename}: {e.strerror}", hint="remove it by hand")
    log.status(f"Removed {len(removed)} items" if removed else "Nothing to remove")


def reconcile(machine: Machine, *, force: bool = False,
              record: RunRecord | None = None) -> None:
    """`record`, when given, learns what the run did (metrics.RunRecord)."""
    record = record or RunRecord()
    with locked(machine):
        record.held_lock = True
        _reconcile(machine, force, record)


def _reconcile(machine: Machine, force: bool, record: RunRecord) -> None:
    log.status("Looking for NVIDIA devices")
    if not discover.has_gpu(machine):
        _refuse_if_staged_without_devices(machine, record)
        try:
            removed = remove_state(machine)
        except OSError as e:
            die(f"cannot remove stale driver state {e.filename}: {e.strerror}",
                hint="remove it by hand")
        # The end state is known without checking: no GPU, and nothing of ours left.
        record.no_gpu, record.checked_at = True, time.time()
        log.status("No NVIDIA GPU in this machine: nothing to set up"
                   + (f" (removed {len(removed)} stale items)" if removed else ""))
        return

    _refuse_unless_devices(machine, record)
    # nvidia-ctk and ldconfig are found before anything live changes.
    with cdi.Generator(machine) as generator:
        find_program(machine.config.ldconfig, "ldconfig")
        plan, want, new = _resolve_and_build(machine, force, record)
        live = machine.driver_root
        undo = Undo(machine, previous_spec=_read_or_none(machine.cdi_spec))
        if new is not None:
            _refuse_if_out_of_time(machine, new)
        # Every refusal is behind us: from here the run changes the live state.
        linker.remove_legacy_links(machine)
        if new is not None:
            generator.discard_early()
            undo.swapped, undo.old = True, tree.swap(new, live)

        # The spec is made for the new root before the old one is deleted: when
        # nvidia-ctk fails, the previous root and spec stay live together. ldconfig,
        # which leaves the root's links alone (-X), runs meanwhile.
        log.status("Generating the CDI spec")
        helpers = ("nvidia-smi",) if "usr/bin/nvidia-smi" in want else ()
        try:
            # Known before writing: a drop-in whose directory fsync fails after its rename
            # is already there.
            undo.new_dropin = not machine.ldconf_dropin.exists()
            linker.install_dropin(machine)
            with linker.start_ldconfig(machine) as ldconfig:
                spec = generator.spec(plan.version, helpers)
                linker.check_ldconfig(ldconfig.wait())
            record.gpus = generator.gpus or record.gpus
            _install_and_prove(machine, undo, spec, want, record, plan.left_out,
                               generator.kept)
        except BaseException:
            undo.rollback()
            raise
    if undo.old is not None:
        tree.remove_tree(undo.old)
    if undo.swapped:
        record.swapped = True
        log.info(f"driver root {live} now holds driver {plan.version}")
    log.status(f"{serving(record)}: driver {plan.version}, {len(plan.files)} files "
               f"in {live}, spec {machine.cdi_spec}")


def serving(record: RunRecord) -> str:
    """STATUS='s first words: what the proved end state serves (gpus.status_word)."""
    from .gpus import status_word

    counted = record.report.sections.get("gpus", {}) if record.report is not None else {}
    return status_word(record.gpus, counted.get("served", 0), counted.get("listed", 0))


def _refuse_if_staged_without_devices(machine: Machine, record: RunRecord) -> None:
    """Staging without a device node is a GPU node whose devices did not arrive: refuse,
    removing nothing (devices.staged_without_nodes)."""
    unbound = devices.staged_without_nodes(machine)
    if unbound is None:
        return
    record.report, record.checked_at = collect(machine), time.time()
    die(unbound.message, hint=devices.NOT_BOUND, code=EXIT_TEMPFAIL)


def _refuse_unless_devices(machine: Machine, record: RunRecord, *,
                           code: int = EXIT_TEMPFAIL) -> None:
    """A GPU node without the nodes CUDA needs, or with nodes of a module that is no
    longer loaded, would be Ready with every CUDA pod failing: refuse, changing nothing."""
    found = devices.findings(machine)
    if not found:
        return
    record.report, record.checked_at = collect(machine), time.time()
    (first, todo), more = found[0], len(found) - 1
    die(first.message + (f" (and {more} more)" if more else ""), hint=todo, code=code)


RESTART_HINT = ("run `systemctl restart unbounded-nvidia-setup` instead (it stops kubelet and "
                "containerd, rebuilds the root, then starts them again)")


def refresh_spec(machine: Machine, *, record: RunRecord | None = None) -> None:
    """`run --spec-only` (`systemctl reload`): regenerate, validate and install the CDI spec
    against the live driver root, for a device change (MIG, a GPU added) with pods
    running. The root is neither copied nor swapped, so a root that no longer matches
    the staging mounts cannot be fixed here: that fails, changing nothing."""
    record = record or RunRecord()
    with locked(machine):
        record.held_lock = True
        _refresh_spec(machine, record)


def _refresh_spec(machine: Machine, record: RunRecord) -> None:
    live = machine.driver_root
    if not discover.has_gpu(machine):
        die("no NVIDIA GPU in this machine: there is no spec to refresh", hint=RESTART_HINT)
    _refuse_unless_devices(machine, record, code=EXIT_FAILED)
    module = discover.module_version(machine)
    dirs = discover.staging_dirs(machine)
    if not dirs or not all(discover.is_populated(d) for d in dirs):
        die(f"driver staging is not mounted at {machine.at(machine.config.staging_glob)}: "
            f"cannot tell whether {live} is still right", hint=RESTART_HINT)
    with cdi.Generator(machine) as generator:
        log.status(f"Comparing {live} with the staging mounts")
        plan = driver.plan_from_staging(machine, dirs, module)
        want = plan.manifest()
        difference = tree.describe_difference(want, tree.manifest(live))
        if difference != "identical":
            die(f"the driver root {live} no longer matches the driver staging ({difference}): "
                "a spec-only refresh changed nothing", hint=RESTART_HINT)
        log.status("Generating the CDI spec for the live driver root")
        helpers = ("nvidia-smi",) if "usr/bin/nvidia-smi" in want else ()
        spec = generator.spec(plan.version, helpers)
        record.gpus = generator.gpus or record.gpus
        undo = Undo(machine, previous_spec=_read_or_none(machine.cdi_spec))
        try:
            changed = _install_and_prove(machine, undo, spec, want, record, plan.left_out,
                                         generator.kept)
        except BaseException:
            undo.rollback()
            raise
    # STATUS= as a run's, "Ready" first: the unit's status shows the reload's outcome.
    log.status(f"{serving(record)}: spec refreshed for driver {plan.version}, "
               f"{machine.cdi_spec} " + ("updated" if changed else "unchanged"))


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _install_and_prove(machine: Machine, undo: Undo, spec: bytes | None, want: Manifest,
                       record: RunRecord, left_out: tuple[LeftOut, ...], kept: str) -> bool:
    """Install the validated spec and prove the end state (the last steps of `run` and of
    `run --spec-only`); True when the spec changed. The caller rolls back on failure.
    No spec (NVML can use no GPU): the previous one goes, as it serves GPUs that are
    unusable now; a pod asking for one fails to start, naming the device."""
    # Set first: an install that fails after its rename (fsync of /etc/cdi) has already
    # replaced the spec.
    undo.spec_written = True
    changed = (cdi.install(machine, spec, kept) if spec is not None
               else cdi.uninstall(machine, kept))
    cdi.remove_shadow(machine)
    _verify_end_state(machine, want, record, left_out, undo.put_back())
    return changed


def _verify_end_state(machine: Machine, want: Manifest, record: RunRecord,
                      left_out: tuple[LeftOut, ...], put_back: str) -> None:
    """Ready means `check` passes now: the live root, drop-in, linker cache and installed
    spec are checked with check's own invariants, after everything this run started
    (ldconfig, nvidia-ctk) has finished, so nothing can change them unseen."""
    log.status("Verifying the live driver root, linker cache and CDI spec")
    report = collect(machine, want, left_out, record.gpus)
    # A GPU left out of the spec is the run's own decision (a GPU NVML cannot use,
    # cdi.Generator): the node is up, degraded or serving none, and the report says so.
    wrong = [p for p in report.problems if p.code not in SERVING_CODES]
    if wrong:  # not recorded: the rollback undoes the state it describes
        first, more = wrong[0], len(wrong) - 1
        die(f"the live state is wrong after setup: [{first.code}] {first.message}"
            + (f" (and {more} more)" if more else ""),
            hint=f"{put_back}; systemd retries; `unbounded-nvidia-setup check` lists every "
                 "problem")
    record.report, record.checked_at = report, time.time()


class Undo:
    """What a run changed in the live state, and how to put it back when it fails."""

    def __init__(self, machine: Machine, previous_spec: bytes | None) -> None:
        self.machine = machine
        self.previous_spec = previous_spec
        self.swapped = False
        self.old: Path | None = None  # the previous generation, while it is kept
        self.new_dropin = False
        self.spec_written = False

    def put_back(self) -> str:
        """What the rollback will leave live, for the failure's line."""
        if self.swapped and self.old is None:
            return "what this run made was removed: there was no driver root before it"
        return ("the previous driver root and spec were put back" if self.previous_spec
                is not None else "the previous driver root was put back (there was no spec)")

    def rollback(self) -> None:
        machine = self.machine
        if self.spec_written:
            try:
                if self.previous_spec is None:
                    machine.cdi_spec.unlink(missing_ok=True)
                else:
                    write_atomically(machine.cdi_spec, self.previous_spec)
            except OSError as e:
                log.warn(f"after failing: cannot put back {machine.cdi_spec}: {e.strerror}")
        if self.swapped:
            tree.unswap(machine.driver_root, self.old)
            if self.new_dropin and self.old is None:
                machine.ldconf_dropin.unlink(missing_ok=True)
            _best_effort_ldconfig(machine)


def _resolve_and_build(machine: Machine, force: bool,
                       record: RunRecord) -> tuple[Plan, Manifest, Path | None]:
    """The plan, its manifest, and a verified new generation when the live root differs."""
    module = discover.module_version(machine)
    log.info(f"kernel module version: {module or 'not readable'}")
    dirs = wait_for_staging(machine)
    log.status(f"Resolving driver files in {', '.join(map(str, dirs))}")
    try:
        plan = driver.plan_from_staging(machine, dirs, module)
    except Failure:
        # Nothing changed: the metrics carry check's view, staging-invalid with this very
        # line, while systemd retries (a first boot has no drift check yet).
        record.report, record.checked_at = collect(machine), time.time()
        raise
    # An older agent's links into the staging are never ours to keep, and in a directory
    # searched before the drop-in (Debian's aarch64-linux-gnu.conf) they are no package's
    # copies of the driver: the search order is judged without them. They are removed
    # only once every refusal has been decided (_reconcile): a refused run changes
    # nothing (docs/architecture.md, "The older agent's leftovers").
    _refuse_if_shadowed(machine, plan, record, linker.legacy_links(machine))
    live = machine.driver_root
    tree.ensure_parent(machine.root, live.parent)
    tree.remove_leftovers(live.parent)
    want = plan.manifest()
    if tree.manifest(live) == want:
        log.info(f"driver root {live} already holds driver {plan.version}: not rebuilt")
        return plan, want, None
    return plan, want, _build(machine, plan, want, force)




def _refuse_if_shadowed(machine: Machine, plan: Plan, record: RunRecord,
                        leftovers: list[Path]) -> None:
    """A directory searched before the driver root's that holds one of its SONAMEs makes
    the machine's linker load that copy, so the end state could never be proven: refuse
    before building or changing anything, naming the conf file (docs/architecture.md,
    "The linker's search order"). Having changed nothing, the run records what `check`
    sees now, so its metrics name the cause while systemd retries."""
    shadows = searchorder.shadows(machine, plan.sonames(machine.libdir), leftovers)
    if not shadows:
        return
    record.report, record.checked_at = collect(machine), time.time()
    more = len(shadows) - 1
    die(searchorder.describe(machine, shadows[0]) + (f" (and {more} more)" if more else ""),
        hint=searchorder.todo(shadows[0]) + "; the driver root and spec were left as they "
             "were, and the unit's next retry succeeds once it is gone")


def _refuse_if_out_of_time(machine: Machine, new: Path) -> None:
    """A swap now would have no time left to generate the spec and would only be rolled
    back: when the budget is spent (a slow copy), stop while nothing live has changed."""
    if machine.budget is not None and machine.budget.exhausted():
        tree.remove_tree(new)
        die(f"the run's time budget (run_timeout_seconds: {machine.budget.total:g}) ran out "
            "while building the new driver root; nothing was changed",
            hint="systemd retries; if copying the driver is this slow, raise "
                 "run_timeout_seconds together with the unit's TimeoutStartSec",
            code=EXIT_TEMPFAIL)


def _best_effort_ldconfig(machine: Machine) -> None:
    """After a rollback the linker cache should name the old generation's files again;
    the run is failing already, so a second failure here only gets logged. It runs within
    its slice of the time kept back for the rollback (budget.py): an ldconfig that hung
    forward mostly hangs again, and the run must still end in its own words."""
    try:
        linker.run_ldconfig(machine, rollback=True)
    except Failure as e:
        log.warn(f"after rolling back: {e.message}")


def _build(machine: Machine, plan: Plan, want: Manifest, force: bool) -> Path:
    """Build and verify a new generation next to the live root."""
    live = machine.driver_root
    refuse_if_consumers(machine, f"swapping {live} now", force)
    log.status(f"Building driver root for driver {plan.version} ({len(plan.files)} files)")
    new = tree.build(plan, live.parent)
    difference = tree.describe_difference(want, tree.manifest(new))
    problems = root_problems(new, machine.libdir, plan.version,
                             machine.config.extra_library_prefixes)
    if difference != "identical" or problems:
        changed = changed_copies(plan, new)
        tree.remove_tree(new)
        if changed:
            die(f"staged file {changed[0]} changed during setup: its copy's ELF headers "
                "differ from what was read when the run planned the root",
                hint="the host is updating its driver; the unit retries")
        # No staged input leads here (issue 16). Planning admits only what makes a root
        # that passes these checks and refuses the rest, naming the file: every name a
        # driver library name (discover.scan); every SONAME link a plain driver library
        # name of that same library, at most NAME_MAX long, not a linker name
        # (plan.soname_problem), and not a file that carries another SONAME
        # (plan.make_plan); libcuda and libnvidia-ml 64-bit shared objects of this
        # machine whose SONAMEs are libcuda.so.1 and libnvidia-ml.so.1
        # (plan.check_required); no regular file where the root makes its own links
        # (plan._reserved); one file per destination (plan.make_plan); no damaged ELF
        # header (elf.read_elf). The copies are those files: same inode, size and mtime
        # (tree._copy) and, checked just above, same ELF headers. What is left is a bug
        # in this tool. tests/test_staging_fuzz.py keeps it so for mutated ELF headers,
        # SONAMEs and names.
        what = problems[0].message if problems else difference
        die(f"the new driver root failed verification ({what})",
            hint="this is a bug; the live root was left as it was")
    return new
