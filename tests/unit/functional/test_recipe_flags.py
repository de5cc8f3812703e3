"""Every recipe flag the harness accepts is honoured or refused: the test walks the flag table
(``recipe._FLAGS``) and, per flag, either shows a value that is refused (a named
CPConfigError) or shows that a value changes what runs - read where the run reads it: the
TransformerConfig the trainer builds (``trainer._transformer_config``), the CPConfig the worker
hands to the process-group builders, or a spec field the trainer's code reads. A new flag
without such a proof fails this test.

``--calculate-per-token-loss: false`` was accepted and dropped (the trainer hard-coded
per-token loss); ``--mock-data: false``, ``--mock-*`` without variable-length data,
``--micro-batch-size`` with packed data, dynamic-CP knobs without dynamic CP and
``--num-query-groups`` without ``--group-query-attention`` were accepted and did nothing.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron_hcp.config import CPConfigError
from megatron_hcp.functional import recipe as recipe_module
from megatron_hcp.functional.harness import recipe_dir
from megatron_hcp.functional.recipe import load_recipe
from megatron_hcp.training import trainer

FIXED = "gpt3_mcore_tp1_pp1_cp4_p2p"  # CP4 p2p, fixed-length data, 4 ranks
DYNAMIC = "gpt3_mcore_tp2_pp1_cp4_dcp"  # TP2 x dynamic CP4, packed variable-length data
VARLEN = {"--mock-variable-seq-lengths": True}  # the fixed recipe with packed data
TP2 = {"--tensor-model-parallel-size": 2, "NPROC": 8}
REMOVE = object()


def tc(attr: str):
    """Read from the megatron TransformerConfig the trainer builds for the recipe."""
    return lambda r: getattr(trainer._transformer_config(r.spec), attr)


def cfg(attr: str):
    """Read from the CPConfig the worker passes to initialize_model_parallel /
    create_pg_collection (and the trainer reads through the spec)."""
    return lambda r: getattr(r.config, attr)


def spec(attr: str, *, read_as: str):
    """Read from a spec field; ``read_as`` is how the trainer's code reads it."""
    def probe(r):
        value = r.spec
        for part in attr.split("."):
            value = getattr(value, part)
        return value

    probe.read_as = read_as  # type: ignore[attr-defined]
    return probe


REFUSED = "refused"
# flag -> [(base recipe, base edits, edits under test, probe or REFUSED)]
CASES: dict[str, list[tuple[str, dict, dict, Any]]] = {
    "--num-layers": [(FIXED, {}, {"--num-layers": 8}, tc("num_layers"))],
    "--num-attention-heads": [(FIXED, {}, {"--num-attention-heads": 8},
                               tc("num_attention_heads"))],
    "--num-query-groups": [(FIXED, {}, {"--num-query-groups": 4}, tc("num_query_groups")),
                           (FIXED, {"--group-query-attention": REMOVE,
                                    "--num-query-groups": REMOVE},
                            {"--num-query-groups": 4}, REFUSED)],
    "--seq-length": [(FIXED, {}, {"--seq-length": 128},
                      spec("config.seq_length", read_as="spec.config.seq_length"))],
    "--tensor-model-parallel-size": [(FIXED, {"NPROC": 8}, {"--tensor-model-parallel-size": 2},
                                      tc("tensor_model_parallel_size"))],
    "--pipeline-model-parallel-size": [(FIXED, {"NPROC": 8},
                                        {"--pipeline-model-parallel-size": 2},
                                        tc("pipeline_model_parallel_size"))],
    "--context-parallel-size": [(FIXED, {}, {"--context-parallel-size": 2},
                                 tc("context_parallel_size"))],
    "--cp-comm-type": [(FIXED, {}, {"--cp-comm-type": "a2a"}, tc("cp_comm_type"))],
    "--cp-partition-mode": [(FIXED, {}, {"--cp-partition-mode": "contiguous"},
                             tc("cp_partition_mode")),
                            (FIXED, {}, {"--cp-partition-mode": "diagonal"}, REFUSED)],
    "--window-size": [(FIXED, {}, {"--window-size": [16, 0]}, tc("window_size")),
                      (FIXED, {}, {"--window-size": [16]}, REFUSED)],
    "--hierarchical-context-parallel-sizes": [
        (FIXED, {"--cp-comm-type": "a2a+p2p", "--hierarchical-context-parallel-sizes": [2, 2]},
         {"--hierarchical-context-parallel-sizes": [1, 4]},
         tc("hierarchical_context_parallel_sizes"))],
    "--dynamic-context-parallel": [
        (DYNAMIC, {}, {"--dynamic-context-parallel": REMOVE,
                       "--min-dynamic-context-parallel-size": REMOVE,
                       "--max-seqlen-per-dp-cp-rank": REMOVE}, cfg("dynamic")),
        (DYNAMIC, {}, {"--dynamic-context-parallel": False}, REFUSED)],
    "--hybrid-context-parallel": [
        (DYNAMIC, {"--dynamic-context-parallel": REMOVE,
                   "--min-dynamic-context-parallel-size": REMOVE,
                   "--max-seqlen-per-dp-cp-rank": REMOVE},
         {"--hybrid-context-parallel": True, "--max-seqlen-per-dp-cp-rank": 128},
         cfg("dynamic"))],
    "--min-dynamic-context-parallel-size": [
        (DYNAMIC, {}, {"--min-dynamic-context-parallel-size": 2},
         spec("topology.dynamic_min_size", read_as="spec.topology.dynamic_min_size")),
        (FIXED, {}, {"--min-dynamic-context-parallel-size": 2}, REFUSED)],
    "--max-seqlen-per-dp-cp-rank": [
        (DYNAMIC, {}, {"--max-seqlen-per-dp-cp-rank": 64}, tc("max_seqlen_per_dp_cp_rank")),
        (FIXED, {}, {"--max-seqlen-per-dp-cp-rank": 64}, REFUSED)],
    "--calculate-per-token-loss": [
        (FIXED, {}, {"--calculate-per-token-loss": False}, tc("calculate_per_token_loss")),
        (DYNAMIC, {}, {"--calculate-per-token-loss": False}, REFUSED)],
    "--hidden-size": [(FIXED, {}, {"--hidden-size": 128}, tc("hidden_size"))],
    "--micro-batch-size": [
        (FIXED, {}, {"--micro-batch-size": 2},
         spec("micro_batch_size", read_as="spec.micro_batch_size")),
        (DYNAMIC, {}, {"--micro-batch-size": 2}, REFUSED)],
    "--global-batch-size": [(FIXED, {}, {"--global-batch-size": 16},
                             spec("global_batch_size", read_as="spec.global_batch_size"))],
    "--train-iters": [(FIXED, {}, {"--train-iters": 3}, spec("steps", read_as="spec.steps"))],
    "--lr": [(FIXED, {}, {"--lr": 0.01}, spec("lr", read_as="spec.lr"))],
    "--seed": [(FIXED, {}, {"--seed": 7}, spec("seed", read_as="spec.seed"))],
    "--vocab-size": [(FIXED, {}, {"--vocab-size": 256},
                      spec("vocab_size", read_as="spec.vocab_size"))],
    "--virtual-pipeline-model-parallel-size": [
        (FIXED, {"NPROC": 8, "--pipeline-model-parallel-size": 2},
         {"--virtual-pipeline-model-parallel-size": 2},
         tc("virtual_pipeline_model_parallel_size"))],
    "--sequence-parallel": [(FIXED, TP2, {"--sequence-parallel": True},
                             tc("sequence_parallel"))],
    "--group-query-attention": [(FIXED, {}, {"--group-query-attention": False}, REFUSED)],
    "--max-position-embeddings": [
        (FIXED, {}, {"--max-position-embeddings": 512},
         spec("max_position_embeddings", read_as="spec.max_position_embeddings")),
        (FIXED, {}, {"--max-position-embeddings": 32}, REFUSED)],
    "--tokenizer-type": [(FIXED, {}, {"--tokenizer-type": "GPT2BPETokenizer"}, REFUSED)],
    "--untie-embeddings-and-output-weights": [
        (FIXED, {}, {"--untie-embeddings-and-output-weights": False},
         spec("share_embeddings_and_output_weights",
              read_as="spec.share_embeddings_and_output_weights"))],
    "--position-embedding-type": [(FIXED, {}, {"--position-embedding-type": "learned_absolute"},
                                   REFUSED)],
    "--mock-data": [(FIXED, {}, {"--mock-data": False}, REFUSED)],
    "--use-decentralized-pg": [(FIXED, {}, {"--use-decentralized-pg": True},
                                lambda r: r.decentralized)],
    "--mock-variable-seq-lengths": [(FIXED, {}, VARLEN,
                                     spec("varlen", read_as="spec.varlen"))],
    "--mock-min-seqlen": [(FIXED, VARLEN, {"--mock-min-seqlen": 8},
                           spec("varlen.min_len", read_as="min_len=v.min_len")),
                          (FIXED, {}, {"--mock-min-seqlen": 8}, REFUSED)],
    "--mock-max-seqlen": [(FIXED, VARLEN, {"--mock-max-seqlen": 128},
                           spec("varlen.max_len", read_as="max_len=v.max_len")),
                          (FIXED, {}, {"--mock-max-seqlen": 128}, REFUSED)],
    "--mock-mean-seqlen": [(FIXED, VARLEN, {"--mock-mean-seqlen": 32.0},
                            spec("varlen.mean", read_as="mean=v.mean")),
                           (FIXED, {}, {"--mock-mean-seqlen": 32.0}, REFUSED)],
    "--mock-seqlen-sigma": [(FIXED, VARLEN, {"--mock-seqlen-sigma": 0.5},
                             spec("varlen.sigma", read_as="sigma=v.sigma")),
                            (FIXED, {}, {"--mock-seqlen-sigma": 0.5}, REFUSED)],
    "--mock-samples-per-micro-batch": [
        (FIXED, VARLEN, {"--mock-samples-per-micro-batch": 2},
         spec("varlen.samples_per_micro_batch", read_as="v.samples_per_micro_batch")),
        (FIXED, {}, {"--mock-samples-per-micro-batch": 2}, REFUSED)],
    "--mock-corpus": [(FIXED, VARLEN, {"--mock-corpus": "markov"},
                       spec("varlen.corpus", read_as="v.corpus")),
                      (FIXED, {}, {"--mock-corpus": "markov"}, REFUSED)],
}


def test_the_walk_covers_every_flag_the_harness_accepts():
    assert sorted(CASES) == sorted(recipe_module._FLAGS)


def write(tmp_path: Path, base: str, *edits: dict) -> Path:
    doc = yaml.safe_load((recipe_dir(base) / "model_config.yaml").read_text())
    for edit in edits:
        for key, value in edit.items():
            target = doc if key.isupper() else doc["MODEL_ARGS"]
            if value is REMOVE:
                target.pop(key, None)
            else:
                target[key] = value
    folder = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "model_config.yaml").write_text(yaml.safe_dump(doc))
    return folder


TRAINER_SOURCE = inspect.getsource(trainer)


@pytest.mark.parametrize("flag", sorted(CASES))
def test_each_flag_changes_what_runs_or_is_refused(tmp_path, flag):
    for base, base_edits, edits, probe in CASES[flag]:
        before = load_recipe(write(tmp_path, base, base_edits))
        if probe == REFUSED:
            with pytest.raises(CPConfigError) as info:
                load_recipe(write(tmp_path, base, base_edits, edits))
            named = {v.parameter.lstrip("-").replace("-", "_")
                     for v in info.value.violations}
            assert named & {e.lstrip("-").replace("-", "_") for e in edits} or (
                flag in str(info.value)), (flag, info.value)
            continue
        after = load_recipe(write(tmp_path, base, base_edits, edits))
        assert probe(after) != probe(before), (flag, probe(after))
        read_as = getattr(probe, "read_as", None)
        if read_as is not None:  # a spec field: the trainer's code reads it
            assert read_as in TRAINER_SOURCE, (flag, read_as)
