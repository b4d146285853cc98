"""The staging fuzz (tests/stagingfuzz.py, issue 16) in the suite: a fixed seed picks
CASES of its mutated ELF headers, DT_SONAMEs and file names over a simulated machine
with a live root, and runs the real `run` on each, with the nvidia-ctk stand-in in
nvidia-ctk's default mode (NVML, the machine's GPUs answering), so that every input
planning accepts goes through the build, the spec and the end-state proof.

Each case ends one of two ways: refused by planning (exit 1, one line naming the file,
nothing built, nothing live changed), or accepted (built, verified, its spec generated,
installed and proven, exit 0). Never "this is a bug" (the new root failed verification),
a failed end-state proof, a failure after the build that was rolled back (nvidia-ctk or
the spec's validation refusing the root), a traceback, or a refusal that changed the live
root, spec or drop-in (stagingfuzz.classify tells them apart by the run's messages). The
whole fuzz, over the real Debian driver too, is `python3 tests/stagingfuzz.py --all
[--real]` (docs/reliability.md, "Staging fuzz").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from invariants import secure_after  # noqa: F401  (fixture)

import stagingfuzz
from conftest import needs_root

SEED = 16
CASES = 36


@needs_root
def test_no_staged_input_is_built_wrong_or_reaches_this_is_a_bug(tmp_path: Path) -> None:
    bench = stagingfuzz.Bench(tmp_path, real=False)
    assert bench.m.nvidia_ctk_args() == [] or not bench.m.nvml_answers
    chosen = stagingfuzz.sample(bench.cases(), CASES, SEED)
    outcomes = [bench.run(case, check=False) for case in chosen]
    wrong = [o for o in outcomes if o.kind not in stagingfuzz.FINE]
    assert wrong == [], "\n".join(f"{o.kind}: {o.case}: {o.error}" for o in wrong)
    # The sample reaches both ends: inputs planning refuses, and inputs that are built,
    # proven and left live.
    kinds = Counter(o.kind for o in outcomes)
    assert kinds["ok"] and kinds["refused"], [(o.kind, o.case, o.error) for o in outcomes]
