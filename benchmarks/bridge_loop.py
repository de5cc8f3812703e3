"""What Megatron-Bridge's own loop costs on the CPU next to the project's trainer (same run).

Both train the same parallel layout and model size on 4 local gloo ranks with torchrun, 6 steps:
hierarchical CP a2a+p2p [2, 2] on the decentralized process-group path (CP 4), 4 layers,
hidden 64, 4 heads / 2 KV heads, sequences of 64 tokens, global batch 8, micro-batch 1.

* Bridge: the functional recipe ``bridge_llama_tp1_pp1_cp4_a2a_p2p_decentralized_pg`` (Bridge's
  ``pretrain``, its config container, mock GPT data, checkpoint-free run, Llama-style model:
  RMSNorm, SwiGLU FFN 128, no biases);
* trainer (the baseline): the same layout as a ``MODEL_ARGS`` recipe written to a temporary
  directory (the project's tiny GPT: LayerNorm, GELU FFN 4 x hidden, biases).

Printed per run: the launch's wall time (process start, imports, set-up, training), the first
step and the median of the others; the ratio Bridge / trainer. Run from the repository root:

    .venv-py312/bin/python benchmarks/bridge_loop.py   (Megatron-Bridge needs the py312 stack)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_hcp.functional.harness import recipe_dir, run_recipe  # noqa: E402
from megatron_hcp.functional.recipe import load_recipe  # noqa: E402

BRIDGE = "bridge_llama_tp1_pp1_cp4_a2a_p2p_decentralized_pg"
TRAINER_RECIPE = """\
ENV_VARS: {}
NPROC: 4
TEST_TYPE: regular
MODEL_ARGS:
  --num-layers: 4
  --hidden-size: 64
  --num-attention-heads: 4
  --group-query-attention: true
  --num-query-groups: 2
  --seq-length: 64
  --max-position-embeddings: 64
  --position-embedding-type: rope
  --untie-embeddings-and-output-weights: true
  --tokenizer-type: NullTokenizer
  --vocab-size: 256
  --mock-data: true
  --micro-batch-size: 1
  --global-batch-size: 8
  --train-iters: 6
  --lr: 0.001
  --seed: 1234
  --context-parallel-size: 4
  --cp-comm-type: a2a+p2p
  --hierarchical-context-parallel-sizes: [2, 2]
  --use-decentralized-pg: true
"""


def _measure(recipe) -> dict[str, float]:
    started = time.perf_counter()
    metrics = run_recipe(recipe, echo=None)
    wall = time.perf_counter() - started
    steps = [metrics["iteration-time"][s] for s in sorted(metrics["iteration-time"])]
    return {"wall": wall, "first": steps[0], "median": statistics.median(steps[1:]),
            "loss": metrics["lm loss"][max(metrics["lm loss"])]}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        path = Path(tmp) / "trainer_tp1_pp1_cp4_a2a_p2p_decentralized_pg"
        path.mkdir()
        (path / "model_config.yaml").write_text(TRAINER_RECIPE, encoding="utf-8")
        trainer = _measure(load_recipe(path))
    bridge = _measure(load_recipe(recipe_dir(BRIDGE)))
    print("CP4 a2a+p2p [2,2], decentralized groups, 4 gloo ranks, 6 steps (same run)")
    print(f"{'run':<10} {'launch wall s':>14} {'step 1 s':>9} {'median step s':>14}")
    for name, m in (("trainer", trainer), ("bridge", bridge)):
        print(f"{name:<10} {m['wall']:>14.1f} {m['first']:>9.2f} {m['median']:>14.3f}")
    print(f"{'ratio':<10} {bridge['wall'] / trainer['wall']:>14.2f} "
          f"{bridge['first'] / trainer['first']:>9.2f} "
          f"{bridge['median'] / trainer['median']:>14.2f}   (bridge / trainer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
