"""Planner inputs: the model, the global batch (fixed length or a length distribution), options.

Every input error is a :class:`PlanInputError` with one line saying what is wrong and how to fix
it (the CLI prints it and exits 2).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

import numpy as np

from ..config import (
    MAX_SEQ_LENGTH,
    MAX_SEQUENCES,
    CPConfigError,
    parse_float,
    parse_int,
    parse_value,
)
from ..dynamic_cp.workload import GPTWorkload
from ..files.bounded_read import InputFileError, loads_yaml, read_text

__all__ = ["PLAN_MAX_GPUS", "PLAN_MAX_SEQUENCES", "PLAN_MAX_VARLEN_GPUS",
           "PLAN_MAX_VARLEN_SEQUENCES", "Batch", "ModelSpec", "Options",
           "PlanInputError", "load_model_file", "lognormal", "lognormal_spec"]

PLAN_MAX_GPUS = 16384
"""GPUs the planner estimates layouts for with a fixed-length batch (every layout is estimated;
``benchmarks/input_limits.py``: 16384 GPUs take 48-60 s on the 2-core CI VM)."""
PLAN_MAX_SEQUENCES = MAX_SEQUENCES
"""Sequences in the planner's fixed-length global batch (``--global-batch``)."""
PLAN_MAX_VARLEN_GPUS = 4096
PLAN_MAX_VARLEN_SEQUENCES = 512
"""A batch of variable lengths (``--lengths``, ``--lognormal``) is scheduled and packed for
every layout: its cost grows with layouts x sequences (measured: 4096 GPUs x 512 sequences
49 s; 512 GPUs x 2048 sequences 79 s; 16384 GPUs x 256 sequences 114 s), so it is bounded at
:data:`PLAN_MAX_VARLEN_GPUS` GPUs and :data:`PLAN_MAX_VARLEN_SEQUENCES` sequences."""


class PlanInputError(ValueError):
    """An input the planner cannot use (one line: what and how to fix it)."""


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder with megatron's names (``num_query_groups`` = KV heads)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    gated_mlp: bool = False
    kv_channels: int | None = None
    vocab_size: int = 32000
    untie_embeddings: bool = True
    #: a causal sliding window of this many tokens back (megatron's window_size[0]); None: none
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanInputError(f"model {name}={value!r} must be a positive integer")
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels", "window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PlanInputError(f"model {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.kv_heads:
            raise PlanInputError(
                f"num_query_groups={self.kv_heads} must divide num_attention_heads="
                f"{self.num_attention_heads}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise PlanInputError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; give the head dimension (--head-dim)")

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def workload(self) -> GPTWorkload:
        return GPTWorkload(num_layers=self.num_layers, hidden_size=self.hidden_size,
                           ffn_hidden_size=self.ffn, num_attention_heads=self.num_attention_heads,
                           num_query_groups=self.num_query_groups, gated_mlp=self.gated_mlp,
                           kv_channels=self.kv_channels, window=self.window)

    def params_per_layer(self) -> int:
        """QKV + output projection + MLP + two norms (biases ignored)."""
        w = self.workload()
        h, q, kv = self.hidden_size, w.query_width, self.kv_heads * w.head_dim
        return h * (q + 2 * kv) + q * h + (3 if self.gated_mlp else 2) * h * self.ffn + 2 * h

    def params(self) -> int:
        return (self.num_layers * self.params_per_layer()
                + (2 if self.untie_embeddings else 1) * self.vocab_size * self.hidden_size)


@dataclass(frozen=True)
class Batch:
    """The sequences of one global batch (``fixed``: every one ``lengths[0]`` tokens)."""

    lengths: tuple[int, ...]
    fixed: bool

    def __post_init__(self) -> None:
        if not self.lengths:
            raise PlanInputError("the global batch is empty; give --global-batch >= 1")
        if min(self.lengths) < 1:
            raise PlanInputError("sequence lengths must be >= 1")

    @classmethod
    def fixed_length(cls, seq_length: int, global_batch: int) -> Batch:
        if seq_length < 2:
            raise PlanInputError(f"--seq-length {seq_length} must be >= 2")
        if global_batch < 1:
            raise PlanInputError(f"--global-batch {global_batch} must be >= 1")
        return cls(tuple([int(seq_length)] * int(global_batch)), True)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def lognormal(count: int, median: float, sigma: float, min_len: int, max_len: int,
              seed: int = 0) -> Batch:
    """``count`` lengths from a lognormal of median ``median`` and shape ``sigma``, clipped to
    ``[min_len, max_len]`` (the variable-length mock data of the recipes), seeded."""
    if count < 1 or not 1 <= min_len <= max_len or median <= 0 or sigma < 0:
        raise PlanInputError(
            "--lognormal needs MEDIAN,SIGMA,MIN,MAX with MEDIAN > 0, SIGMA >= 0, "
            f"1 <= MIN <= MAX and --global-batch >= 1 (got {median},{sigma},{min_len},{max_len}"
            f", batch {count})")
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    return Batch(tuple(int(x) for x in np.clip(np.rint(draws), min_len, max_len)), False)


def lognormal_spec(text: str) -> tuple[float, float, int, int]:
    """``MEDIAN,SIGMA,MIN,MAX`` of ``--lognormal``: two numbers and two integer lengths (never
    truncated: ``2.7`` is not a length), each within its bounds."""
    parts = text.split(",")
    if len(parts) != 4:
        raise PlanInputError(f"--lognormal {text!r}: needs MEDIAN,SIGMA,MIN,MAX (four values, "
                             "e.g. 8192,1.2,128,131072)")
    try:
        median = parse_float(parts[0], "--lognormal MEDIAN", above=0.0,
                             maximum=float(MAX_SEQ_LENGTH))
        sigma = parse_float(parts[1], "--lognormal SIGMA", minimum=0.0, maximum=10.0)
        low = parse_int(parts[2], "--lognormal MIN", minimum=1, maximum=MAX_SEQ_LENGTH)
        high = parse_int(parts[3], "--lognormal MAX", minimum=1, maximum=MAX_SEQ_LENGTH)
    except CPConfigError as err:
        raise PlanInputError(str(err.violations[0])) from None
    if low > high:
        raise PlanInputError(f"--lognormal {text!r}: MIN={low} > MAX={high}; give MIN <= MAX")
    return median, sigma, low, high


def lengths_file(path: str) -> Batch:
    """A global batch's lengths from the one lengths reader (:func:`~megatron_hcp.command_line.
    read_lengths`: 1..``MAX_SEQUENCES`` integers, each at most ``MAX_SEQ_LENGTH``)."""
    from ..command_line import UsageError, read_lengths

    try:
        return Batch(tuple(read_lengths(path)), False)
    except UsageError as err:
        raise PlanInputError(str(err)) from None


@dataclass(frozen=True)
class Options:
    """Training choices the estimate depends on (defaults: what Bridge's recipes use)."""

    recompute: str = "auto"  # selective | full | auto (selective when it fits, else full)
    precision: str = "bf16"  # bf16 | fp8 (Transformer Engine FP8 linear layers)
    distributed_optimizer: bool = True
    fsdp: bool = False  # Megatron-FSDP (optim_grads_params): weights and grads sharded too
    grad_reduce_in_bf16: bool = False  # bf16 main grads (megatron: fp32 with --bf16)
    tp_comm_overlap: bool = False
    te_version: str = "2.8"
    #: the CP attention backend: Transformer Engine (zigzag layout only) or megatron-hcp's
    #: reference backend (both CP partition layouts)
    attention_backend: str = "te"
    tie_tolerance: float = 0.02
    max_tp: int | None = None  # default: GPUs per node (TP stays inside a node)
    min_dynamic_sizes: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self) -> None:
        if self.recompute not in ("auto", "selective", "full"):
            raise PlanInputError(f"--recompute {self.recompute!r}: use auto, selective or full")
        if self.precision not in ("bf16", "fp8"):
            raise PlanInputError(f"--precision {self.precision!r}: use bf16 or fp8")
        if self.fsdp and not self.distributed_optimizer:
            raise PlanInputError("--fsdp shards the optimizer itself; drop "
                                 "--no-distributed-optimizer")
        if self.attention_backend not in ("te", "reference"):
            raise PlanInputError(f"--attention-backend {self.attention_backend!r}: use te or "
                                 "reference")
        if not 0 <= self.tie_tolerance < 1:
            raise PlanInputError(f"--tie-tolerance {self.tie_tolerance} must be in [0, 1)")


# megatron flag -> ModelSpec field (and the batch flags the planner also reads)
_MODEL_FLAGS = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size",
    "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_query_groups",
    "--ffn-hidden-size": "ffn_hidden_size", "--kv-channels": "kv_channels",
    "--vocab-size": "vocab_size", "--padded-vocab-size": "vocab_size",
}
_BOOL_FLAGS = {"--swiglu": "gated_mlp", "--untie-embeddings-and-output-weights":
               "untie_embeddings"}
_BATCH_FLAGS = {"--seq-length": "seq_length", "--global-batch-size": "global_batch"}


def _flags_from_file(path: str) -> tuple[dict[str, object], bool]:
    """The flags of a model file, and whether their values are typed (YAML) or text."""
    try:
        text = read_text(path, "--model", max_bytes=1 << 20)
    except InputFileError as err:
        raise PlanInputError(str(err)) from None
    try:
        data = loads_yaml(text, "--model", path)
    except InputFileError as err:
        if not err.rule.startswith("is not plain YAML"):
            raise PlanInputError(str(err)) from None
        data = None  # not YAML: a megatron command line
    if isinstance(data, dict):
        args = data.get("MODEL_ARGS", data)
        if not isinstance(args, dict):
            raise PlanInputError(f"--model {path}: MODEL_ARGS must be a mapping of flags")
        return {str(k) if str(k).startswith("--") else "--" + str(k).replace("_", "-"): v
                for k, v in args.items()}, True
    flags: dict[str, object] = {}
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as err:
        raise PlanInputError(f"--model {path}: {err}") from None
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                flags[tok] = tokens[i + 1]
                i += 2
                continue
            flags[tok] = True
        i += 1
    return flags, False


# flag -> parse_value kind (bounded counts, config.LIMITS)
_KINDS = {"--num-layers": "layers", "--hidden-size": "width", "--num-attention-heads": "heads",
          "--num-query-groups": "heads", "--ffn-hidden-size": "width", "--kv-channels": "width",
          "--vocab-size": "vocab", "--padded-vocab-size": "vocab", "--seq-length": "seqlen",
          "--global-batch-size": "sequences"}


def load_model_file(path: str) -> tuple[ModelSpec, dict[str, int]]:
    """A recipe ``model_config.yaml`` (``MODEL_ARGS``), a YAML mapping of megatron flags, or a
    text file of megatron flags -> the model, plus ``seq_length`` / ``global_batch`` if given.
    Flags the planner does not need are ignored (they do not change the estimate); the ones
    it reads are parsed strictly, within the bounds of ``config.LIMITS`` (a YAML value is
    typed: a quoted ``"32"`` is no number, ``maybe`` no boolean)."""
    flags, typed = _flags_from_file(path)
    kwargs: dict[str, object] = {}
    batch: dict[str, int] = {}
    for flag, value in flags.items():
        target = _MODEL_FLAGS.get(flag) or _BATCH_FLAGS.get(flag)
        if target is not None:
            try:
                number = parse_value(value, _KINDS[flag], f"--model {path}: {flag}",
                                     text=not typed)
            except CPConfigError as err:
                raise PlanInputError(str(err.violations[0])) from None
            if flag == "--global-batch-size" and number > PLAN_MAX_SEQUENCES:
                raise PlanInputError(f"--model {path}: {flag} {number} is over the planner's "
                                     f"limit of {PLAN_MAX_SEQUENCES} sequences")
            (batch if flag in _BATCH_FLAGS else kwargs)[target] = number
        elif flag in _BOOL_FLAGS:
            try:
                kwargs[_BOOL_FLAGS[flag]] = True if value in (None, "") else parse_value(
                    value, "bool", f"--model {path}: {flag}", text=not typed)
            except CPConfigError as err:
                raise PlanInputError(str(err.violations[0])) from None
    if "untie_embeddings" not in kwargs:
        kwargs["untie_embeddings"] = False  # megatron ties them unless told otherwise
    missing = [f for f in ("--num-layers", "--hidden-size", "--num-attention-heads")
               if _MODEL_FLAGS[f] not in kwargs]
    if missing:
        raise PlanInputError(f"--model {path}: missing {', '.join(missing)}")
    return ModelSpec(**kwargs), batch
