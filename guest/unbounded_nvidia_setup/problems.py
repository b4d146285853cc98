"""The unit of every verdict, and every code it can carry: what docs/problems.md documents.

Every checker (devices, verify, spec, linker, searchorder, holders, state) makes its
findings as `Problem`s; `check`, the metrics and the schema name exactly these codes
(tests/test_contract.py and tests/test_metrics.py keep the four in step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the live state. `code` is stable (docs/problems.md)."""

    code: str
    message: str
    path: str | None = None


# Every problem code `check` can report (docs/problems.md; tests keep them in step).
# Each has a series, 0 when absent, so an alert tells "no problem" from "no data".
PROBLEM_CODES = (
    "stale-state", "staging-missing", "staging-invalid", "setup-running", "setup-pending",
    "setup-failed",
    "device-missing", "device-stale", "devices-not-bound", "pod-on-old-root", "gpu-lost",
    "gpu-unusable", "no-usable-gpu",
    "root-missing", "root-not-directory", "root-parent-symlink", "root-out-of-date",
    "root-missing-library", "root-library-not-regular", "root-missing-link",
    "root-wrong-link", "root-absolute-link", "root-escaping-link", "root-dangling-link",
    "root-foreign-file", "root-bad-owner", "root-bad-mode", "root-mixed-versions",
    "root-version-mismatch",
    "ldconf-missing", "ldcache-stale", "ldcache-shadowed", "legacy-link",
    "spec-missing", "spec-invalid", "spec-wrong-kind", "spec-no-devices",
    "spec-missing-host-path", "spec-staging-path", "spec-bad-device-node",
    "spec-missing-library", "spec-missing-helper", "spec-imex-channel", "spec-shadowed",
    "spec-unsafe-path",
    "plugin-spec-invalid", "plugin-spec-missing-host-path", "plugin-spec-missing-library",
    "plugin-spec-staging-path", "plugin-spec-no-devices", "plugin-spec-bad-device-node",
    "plugin-spec-unusable-gpu", "consumer-spec-stale", "image-unit-missing",
    "image-unit-disabled",
)

# Problems that mean "the host has not staged the driver, or bound its devices, yet", or
# "a setup is on its way", not "something broke": the verdict is `not-ready-yet`.
WAITING_CODES = frozenset({"staging-missing", "devices-not-bound", "setup-running",
                           "setup-pending"})

# What a pending setup rebuilds from the staging: while a start is pending, problems of
# these codes are what the last boot left (the root lived in /run and is gone, the spec
# in /etc names it), the consequence of the wait, not a cause to act on. `check` lists
# them apart (`pending`), after the cause (state.Report.causes).
REBUILT_CODES = frozenset({
    "stale-state", "root-missing", "root-not-directory", "root-out-of-date",
    "root-missing-library", "root-library-not-regular", "root-missing-link",
    "root-wrong-link", "root-absolute-link", "root-escaping-link", "root-dangling-link",
    "root-foreign-file", "root-bad-owner", "root-bad-mode", "root-mixed-versions",
    "root-version-mismatch", "ldconf-missing", "ldcache-stale", "legacy-link",
    "spec-missing", "spec-invalid", "spec-wrong-kind", "spec-no-devices",
    "spec-missing-host-path", "spec-staging-path", "spec-bad-device-node",
    "spec-missing-library", "spec-missing-helper", "spec-imex-channel", "spec-shadowed",
    "spec-unsafe-path"})

# Problems that leave the node serving, with less: the verdict is `degraded` when they are
# all there is (a GPU NVML cannot use, and the device plugin's spec that still lists one;
# docs/host-integration.md says what the host agent does).
DEGRADED_CODES = frozenset({"gpu-lost", "gpu-unusable", "plugin-spec-unusable-gpu"})
# With `no-usable-gpu` (NVML can use no GPU of the node): the node is up and serves none,
# the verdict `no-usable-gpu` when they are all there is. A run ends with these by its
# own decision, never as a failure (reconcile._verify_end_state).
SERVING_CODES = DEGRADED_CODES | {"no-usable-gpu"}
