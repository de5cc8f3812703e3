"""Write the gpu_nccl golden values of one-rank recipe forms (run on a GPU node).

``python -m tests.gpu.record_one_rank FAMILY ...`` runs each family's one-rank form under
``--platform gpu_nccl`` and writes ``tests/gpu/golden/<family>@1rank_gpu_nccl.json`` (megatron's
golden-value format; a diverged or short run is refused and nothing is written), printing what
changed. ``./scripts/gpu_check.sh --record-golden`` calls it for the families whose check passed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from megatron_hcp.functional.golden import replace_golden
from megatron_hcp.functional.harness import run_recipe
from megatron_hcp.functional.launch import Launch
from megatron_hcp.functional.recipe import load_recipe
from tests.gpu._recipes import GOLDEN_DIR, one_rank_families, one_rank_golden, one_rank_recipe


def record(family: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="megatron-hcp-1rank-") as tmp:
        recipe = load_recipe(one_rank_recipe(Path(tmp) / family, family))
        metrics = run_recipe(recipe, echo=None, launch=Launch(platform="gpu_nccl"))
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    return replace_golden(one_rank_golden(family), metrics, recipe.steps, f"{family}@1rank")


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    unknown = [n for n in names if n not in one_rank_families()]
    if unknown:
        print(f"record_one_rank: {unknown[0]!r} is no recipe family; use one of "
              f"{', '.join(sorted(one_rank_families()))}", file=sys.stderr)
        return 2
    for family in names:
        for line in record(family):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
