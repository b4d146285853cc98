#!/usr/bin/env python3
"""Entry point of `make bench` and `--profile`: arguments, checks, signals, where results go.

`make bench`: how fast `unbounded-nvidia-setup run` is on a realistic GPU machine,
measured side by side with what a user would otherwise write (issue 5).

Everything happens on a tmpfs this script mounts itself, in a private mount namespace
(`unshare --mount`), so the mount disappears even if the benchmark is killed; it is
also unmounted explicitly on every exit path. Needs root (mount, mknod).

Writes bench/results.json and bench/results.md; prints one summary line and PASS/FAIL
per target, and exits 0 whatever the figures are (it is a measurement). Exit 1 means
the benchmark itself broke (a run failed, the tool built the wrong tree, ...), exit 2
a usage problem (not root, no venv).

What is measured and how: bench/phases.py; the machines: bench/machine.py; `--profile`:
bench/profiler.py; every module: bench/__init__.py. Lint: `make lint`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the script's own sys.path[0] is bench/, not its parent

from bench.machine import SMALL_STAGING  # noqa: E402
from bench.phases import benchmark  # noqa: E402
from bench.proc import TOOL, BenchError, enter_private_namespace  # noqa: E402
from bench.profiler import profile  # noqa: E402
from bench.report import render_table, write  # noqa: E402

RESULTS_JSON = REPO / "bench" / "results.json"
RESULTS_MD = REPO / "bench" / "results.md"
HARD_LIMIT = 1500  # seconds: SIGALRM ends a benchmark that hangs anyway (cleanup runs)


class Interrupted(BaseException):
    """SIGTERM, SIGHUP or SIGALRM: unwind so every mount and process is cleaned up."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1] if __doc__ else "",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=31,
                        help="alternating rounds at scale 1.0 (default 31)")
    parser.add_argument("--pairs-xfs", type=int, default=11,
                        help="alternating rounds of same-fs and cross-fs cold runs and the "
                             "cross-fs baseline (default 11)")
    parser.add_argument("--pairs-metrics", type=int, default=21,
                        help="alternating rounds of cold and warm runs with metrics off and "
                             "on (default 21)")
    parser.add_argument("--pairs-x2", type=int, default=11,
                        help="alternating rounds of payload x1 and x2 (default 11)")
    parser.add_argument("--version-rounds", type=int, default=60,
                        help="alternating rounds of --version vs python -c pass (default 60)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one cold run instead (timeline, importtime, cProfile, "
                             "parts timed alone); writes no results")
    parser.add_argument("--top", type=int, default=20, help="rows per --profile table")
    parser.add_argument("--entries", type=int, default=SMALL_STAGING,
                        help=f"staging entries of the --profile machine (default {SMALL_STAGING})")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="payload scale of the --profile machine (default 1.0; at most 2)")
    parser.add_argument("--no-write", action="store_true",
                        help="print only; do not write bench/results.{json,md}")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (it mounts a tmpfs and creates device nodes)", file=sys.stderr)
        return 2
    if not TOOL.exists():
        print(f"bench: {TOOL} missing; run `make venv`", file=sys.stderr)
        return 2
    if min(args.pairs, args.pairs_x2, args.version_rounds, args.pairs_xfs,
           args.pairs_metrics) < 1:
        print("bench: rounds must be at least 1", file=sys.stderr)
        return 2
    if not (0 < args.scale <= 2 and 0 < args.entries <= 100_000):
        print("bench: --scale must be in (0, 2], --entries in (0, 100000]", file=sys.stderr)
        return 2
    enter_private_namespace(Path(__file__).resolve(), argv)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, _on_signal)
    signal.alarm(HARD_LIMIT)
    try:
        if args.profile:
            profile(args.top, 3, args.entries, args.scale)
            return 0
        result = benchmark(args.pairs, args.pairs_x2, args.version_rounds, args.pairs_xfs,
                           args.pairs_metrics)
    except BenchError as e:
        print(f"bench: FAILED: {e}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"bench: interrupted ({e or 'SIGINT'}); mounts and processes cleaned up",
              file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    print(result["summary"])
    print("\n".join(render_table(result)))
    if not args.no_write:
        write(result, RESULTS_JSON, RESULTS_MD)
        print(f"wrote {RESULTS_JSON.relative_to(REPO)} and {RESULTS_MD.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
