"""The published measurements (``published.yaml``): loading, checking, tokens/s per GPU.

A run that publishes TFLOP/s per GPU is converted to tokens/s per GPU with the FLOPs convention
its publisher used (``flops`` field, :func:`flops_per_token`), so that every comparison is in
tokens/s per GPU, which does not depend on how anyone counts FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ...config import CPConfigError
from ..estimate import Layout
from ..gpus import GPUS, PRECISIONS
from ..inputs import ModelSpec, Options, PlanInputError

__all__ = ["CONVENTIONS", "DEFAULT_PATH", "PublishedRun", "flops_per_token", "load_published",
           "load_yaml"]

DEFAULT_PATH = Path(__file__).with_name("published.yaml")
CONVENTIONS = ("full-attention", "causal-attention", "palm-mfu")
#: reported recompute -> the planner's mode. Not reported (null): selective, i.e. no full
#: recompute - the run fitted, and the memory tricks recipes use instead (CPU offloading,
#: recompute of a few layers) are not modelled; whether the memory model agrees that it fits
#: is reported separately
RECOMPUTE = {None: "selective", "none": "selective", "selective": "selective", "full": "full"}


def flops_per_token(model: ModelSpec, seq_length: int, convention: str) -> float:
    """Model FLOPs per token (forward + backward) under a publisher's convention.

    ``full-attention``: 6 x linear-layer parameters + 6 h V + 12 L q s (the score matrix counted
    whole, Megatron-LM / NeMo before 2025); ``causal-attention``: the attention term halved
    (Megatron-Bridge 25.09+); ``palm-mfu``: 6 N + 12 L q s with N all parameters (Chowdhery et
    al. 2023, App. B; the Llama 3 paper's MFU).
    """
    w = model.workload()
    full_attention = 12.0 * model.num_layers * w.query_width * seq_length
    if convention == "palm-mfu":
        return 6.0 * model.params() + full_attention
    dense = w.linear_flops_per_token() + w.logits_flops_per_token(model.vocab_size)
    if convention == "full-attention":
        return dense + full_attention
    if convention == "causal-attention":
        return dense + full_attention / 2
    raise PlanInputError(f"flops convention {convention!r}: use one of {', '.join(CONVENTIONS)}")


@dataclass(frozen=True)
class PublishedRun:
    """One measured run (see the header of ``published.yaml`` for the fields)."""

    id: str
    source: str
    quote: str
    model_key: str
    model: ModelSpec
    seq_length: int
    global_batch: int
    gpu: str
    gpus: int
    gpus_per_node: int
    gpu_memory_gb: float | None
    precision: str
    layout: Layout | None  # None: not published (the planner's best layout stands in)
    data_parallel: str
    recompute: str | None  # as reported: none | selective | full | None (not reported)
    published_value: float
    published_unit: str  # tflops_per_gpu | tokens_per_second_per_gpu
    flops: str | None
    pair: str | None
    fit: bool
    micro_batch: int | None = None
    notes: str = ""
    in_summary: bool = True  # False: the source's hardware is not a preset (see its caveat)
    tp_comm_overlap: bool = False
    grad_reduce_in_bf16: bool = False

    @property
    def recompute_mode(self) -> str:
        """The planner's mode for the published layout (:data:`RECOMPUTE`)."""
        return RECOMPUTE[self.recompute]

    @property
    def measured(self) -> float:
        """Tokens per second per GPU: as published, or TFLOP/s / FLOPs per token."""
        if self.published_unit == "tokens_per_second_per_gpu":
            return self.published_value
        assert self.flops is not None
        return self.published_value * 1e12 / flops_per_token(self.model, self.seq_length,
                                                              self.flops)

    @property
    def derivation(self) -> str:
        if self.published_unit == "tokens_per_second_per_gpu":
            return f"{self.published_value:g} tokens/s/GPU as published"
        per_token = flops_per_token(self.model, self.seq_length, str(self.flops))
        return (f"{self.published_value:g} TFLOP/s/GPU / {per_token:.4g} FLOPs per token "
                f"({self.flops})")


def _fail(where: str, field: str, value: object, rule: str, fix: str) -> PlanInputError:
    return PlanInputError(f"{where}: {field}={value!r} {rule}; {fix}")


def _posint(where: str, row: dict, field: str, required: bool = True) -> int | None:
    value = row.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(where, field, value, "must be a positive integer", f"give {field}")
    return value


def _model(key: str, spec: dict) -> ModelSpec:
    return ModelSpec(num_layers=spec["layers"], hidden_size=spec["hidden"],
                     num_attention_heads=spec["heads"], num_query_groups=spec["kv_heads"],
                     ffn_hidden_size=spec["ffn"], gated_mlp=spec.get("gated_mlp", True),
                     vocab_size=spec["vocab"], untie_embeddings=not spec.get("tied", False))


def _layout(where: str, row: dict, gpus: int, model: ModelSpec) -> Layout | None:
    lay = row.get("layout")
    if lay is None:
        return None
    if not isinstance(lay, dict):
        raise _fail(where, "layout", lay, "must be a mapping or null", "give tp, pp, cp, dp")
    sizes = {k: _posint(where, lay, k) for k in ("tp", "pp", "cp", "dp")}
    vp = _posint(where, lay, "vp", required=False) or 1
    product = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"]
    if product != gpus:
        raise _fail(where, "layout", lay, f"multiplies to {product}, not gpus={gpus}",
                    "make TP x PP x CP x DP equal the GPU count")
    kind = lay.get("cp_comm_type")
    if sizes["cp"] > 1 and kind not in ("p2p", "all_gather", "a2a"):
        raise _fail(where, "layout.cp_comm_type", kind, "must be p2p, all_gather or a2a when "
                    "cp > 1", "give the CP communication type")
    try:  # the published setup as a candidate: its CPConfig resolved on the run's GPUs
        return Layout.of(model, Options(), world=gpus, vp=vp, tp=sizes["tp"], cp=sizes["cp"],
                         pp=sizes["pp"], dp=sizes["dp"],
                         cp_comm_type=kind if sizes["cp"] > 1 else None,
                         seq_length=row["seq_length"])
    except CPConfigError as err:
        refused = "; ".join(map(str, err.violations))
        raise _fail(where, "layout", lay, f"is refused by CPConfig ({refused})",
                    "give a layout megatron accepts") from None


def _run(row: dict, models: dict[str, ModelSpec], sources: dict) -> PublishedRun:
    where = f"published run {row.get('id', '?')!r}"
    for field in ("id", "source", "quote", "model", "gpu", "precision", "published"):
        if row.get(field) in (None, ""):
            raise _fail(where, field, row.get(field), "is missing", f"give {field}")
    if row["source"] not in sources:
        raise _fail(where, "source", row["source"], "is not in sources", "add the source")
    if row["model"] not in models:
        raise _fail(where, "model", row["model"], "is not in models", "add the model")
    if row["gpu"] not in GPUS:
        raise _fail(where, "gpu", row["gpu"], f"is not one of {', '.join(GPUS)}",
                    "use a preset")
    if row["precision"] not in PRECISIONS:
        raise _fail(where, "precision", row["precision"], "must be bf16 or fp8",
                    "give the run's precision")
    seq = _posint(where, row, "seq_length")
    batch = _posint(where, row, "global_batch")
    gpus = _posint(where, row, "gpus")
    assert seq is not None and batch is not None and gpus is not None
    published = row["published"]
    if not isinstance(published, dict) or len(published) != 1:
        raise _fail(where, "published", published, "must hold exactly one of tflops_per_gpu, "
                    "tokens_per_second_per_gpu", "give the number as printed")
    (unit, value), = published.items()
    if unit not in ("tflops_per_gpu", "tokens_per_second_per_gpu") or not (
            isinstance(value, (int, float)) and value > 0):
        raise _fail(where, "published", published, "must be a positive tflops_per_gpu or "
                    "tokens_per_second_per_gpu", "give the number as printed")
    flops = row.get("flops")
    if unit == "tflops_per_gpu" and flops not in CONVENTIONS:
        raise _fail(where, "flops", flops, f"must be one of {', '.join(CONVENTIONS)} for a "
                    "TFLOP/s figure", "name the publisher's FLOPs convention")
    if row.get("recompute") not in RECOMPUTE:
        raise _fail(where, "recompute", row.get("recompute"), "must be none, selective, full "
                    "or null", "give the reported recompute or null")
    if row.get("data_parallel", "megatron") not in ("megatron", "fsdp"):
        raise _fail(where, "data_parallel", row.get("data_parallel"), "must be megatron or "
                    "fsdp", "say how the run shards its optimizer")
    preset = GPUS[row["gpu"]]
    gpn = _posint(where, row, "gpus_per_node", required=False) or min(gpus, preset.gpus_per_node)
    if gpus % gpn:
        raise _fail(where, "gpus_per_node", gpn, f"does not divide gpus={gpus}",
                    "give the GPUs per NVLink domain")
    return PublishedRun(
        id=row["id"], source=row["source"], quote=row["quote"], model_key=row["model"],
        model=models[row["model"]], seq_length=seq, global_batch=batch, gpu=row["gpu"],
        gpus=gpus, gpus_per_node=gpn, gpu_memory_gb=row.get("gpu_memory_gb"),
        precision=row["precision"], layout=_layout(where, row, gpus, models[row["model"]]),
        data_parallel=row.get("data_parallel", "megatron"), recompute=row.get("recompute"),
        published_value=float(value), published_unit=unit,
        flops=flops, pair=row.get("pair"), fit=bool(row.get("fit", False)),
        micro_batch=row.get("micro_batch"), notes=str(row.get("notes", "")),
        in_summary=bool(sources[row["source"]].get("in_summary", True)),
        tp_comm_overlap=bool(row.get("tp_comm_overlap", False)),
        grad_reduce_in_bf16=bool(row.get("grad_reduce_in_bf16", False)))


def load_yaml(path: Path | str | None = None) -> dict:
    """The raw document (``yaml.safe_load``)."""
    path = Path(path) if path else DEFAULT_PATH
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise PlanInputError(f"published measurements {path}: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise PlanInputError(f"published measurements {path}: no 'runs' list")
    return data


def load_published(path: Path | str | None = None) -> list[PublishedRun]:
    """Every run of ``published.yaml`` (or ``path``), checked; ids unique."""
    data = load_yaml(path)
    models = {k: _model(k, v) for k, v in (data.get("models") or {}).items()}
    sources = data.get("sources") or {}
    runs = [_run(row, models, sources) for row in data["runs"]]
    seen: set[str] = set()
    for r in runs:
        if r.id in seen:
            raise PlanInputError(f"published run {r.id!r}: id appears twice; make ids unique")
        seen.add(r.id)
    return runs
