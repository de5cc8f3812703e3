"""How long the commands take at the largest inputs their bounds accept (issue 35: every bound a
command accepts must be one it finishes within about a minute on the 2-core CI machine).

``python benchmarks/input_limits.py [--budget SECONDS] [--quick]`` runs each case as a fresh
``megatron-hcp`` process and prints wall time, peak memory (RSS of the process) and the ratio to
the budget (default 60 s); ``met`` / ``MISSED`` per case, not asserted. The cases are the bounds
of ``schedule`` (sequences of one input, ranks of the DPxCP group, tokens per rank) and ``plan``
(GPUs, sequences of a global batch), each at its limit with the shapes that cost most.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_hcp.cli import SCHEDULE_MAX_DP_CP  # noqa: E402
from megatron_hcp.config import MAX_SEQUENCES  # noqa: E402
from megatron_hcp.planner.inputs import (  # noqa: E402
    PLAN_MAX_GPUS,
    PLAN_MAX_SEQUENCES,
    PLAN_MAX_VARLEN_GPUS,
    PLAN_MAX_VARLEN_SEQUENCES,
)


def _lengths(path: Path, count: int, longest: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    path.write_text(json.dumps([min(longest, max(1, int(rng.lognormvariate(7.0, 1.2))))
                                for _ in range(count)]))
    return str(path)


def cases(tmp: Path, quick: bool) -> dict[str, list[str]]:
    n = 1024 if quick else MAX_SEQUENCES
    lengths = _lengths(tmp / "lengths.json", n, 65536)
    plan_n = 64 if quick else PLAN_MAX_VARLEN_SEQUENCES
    gpus = 64 if quick else PLAN_MAX_GPUS
    varlen_gpus = 64 if quick else PLAN_MAX_VARLEN_GPUS
    model = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8"]
    return {
        f"schedule {n} sequences, DPxCP {SCHEDULE_MAX_DP_CP}": [
            "schedule", "--dp-cp", str(SCHEDULE_MAX_DP_CP), "--max-seqlen-per-rank", "65536",
            "--lengths", lengths],
        f"schedule {n} sequences, DPxCP 64 (many micro-batches)": [
            "schedule", "--dp-cp", "64", "--max-seqlen-per-rank", "65536", "--lengths",
            lengths],
        f"schedule {n} sequences, DPxCP 1024, cap 4096 (large groups)": [
            "schedule", "--dp-cp", "1024", "--max-seqlen-per-rank", "4096", "--lengths",
            lengths],
        f"plan {gpus} GPUs, {PLAN_MAX_SEQUENCES} sequences of 131072": [
            "plan", *model, "--nodes", str(gpus // 8), "--seq-length", "131072",
            "--global-batch", str(PLAN_MAX_SEQUENCES)],
        f"plan {varlen_gpus} GPUs, {plan_n} lognormal lengths": [
            "plan", *model, "--nodes", str(varlen_gpus // 8), "--lognormal",
            "4096,1.2,128,131072", "--global-batch", str(plan_n)],
    }


def run(argv: list[str], budget: float) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in GiB, exit code) of one command in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_hcp.cli", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=budget * 5, check=False)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = -1
    wall = time.perf_counter() - started
    peak = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before) / (1 << 20)
    return wall, peak, code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="small inputs (a smoke run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'case':<62} {'wall s':>7} {'peak GiB':>9} {'exit':>4}  vs {args.budget:.0f} s")
        for name, argv in cases(Path(tmp), args.quick).items():
            wall, peak, code = run(argv, args.budget)
            verdict = "met" if wall <= args.budget and code in (0, 2) else "MISSED"
            print(f"{name:<62} {wall:7.1f} {peak:9.2f} {code:4d}  {wall / args.budget:.2f}x "
                  f"{verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
