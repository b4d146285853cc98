"""The staging fuzz (tests/stagingfuzz.py, issue 16) in the suite: a fixed seed picks
CASES of its mutated ELF headers, DT_SONAMEs and file names over a simulated machine
with a live root, and runs the real `run` on each. None may end in "this is a bug", a
traceback, a failed end-state proof, or a refusal that changed the live root, spec or
drop-in. The whole fuzz, over the real Debian driver too, is `python3
tests/stagingfuzz.py --all [--real]` (docs/reliability.md, "Staging fuzz").

nvidia-ctk is /bin/false here, so a case that passes planning and verification fails
fast at the spec, after its root was swapped in, and is rolled back: the case still
shows that the root was planned and verified, and that the rollback left the live state
as it was.
"""

from __future__ import annotations

from pathlib import Path

from invariants import secure_after  # noqa: F401  (fixture)

import stagingfuzz
from conftest import needs_root

SEED = 16
CASES = 36


@needs_root
def test_no_staged_input_reaches_this_is_a_bug(tmp_path: Path) -> None:
    bench = stagingfuzz.Bench(tmp_path, real=False, nvidia_ctk="/bin/false")
    chosen = stagingfuzz.sample(bench.cases(), CASES, SEED)
    outcomes = [bench.run(case, check=False) for case in chosen]
    wrong = [o for o in outcomes if o.kind not in ("ok", "refused", "n/a")]
    assert wrong == [], "\n".join(f"{o.kind}: {o.case}: {o.error}" for o in wrong)
    # The sample reaches both ends: inputs planning refuses, and inputs that are built,
    # verified and swapped in (then rolled back when /bin/false fails the spec).
    built = [o for o in outcomes if o.kind == "refused" and "/bin/false" in o.error]
    assert built and len(built) < len(outcomes), [(o.case, o.error) for o in outcomes]
