"""The CP rules: :class:`CPConfig`, one validated description of a context-parallel setup.

:class:`CPConfig` uses megatron's field names; :meth:`CPConfig.validate` checks every rule at once
and raises one :class:`~.errors.CPConfigError` listing each violated rule with its parameter,
value, rule and fix. Validation is pure (no collectives), so every rank raises the same error
before any process group exists.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .errors import CPConfigError, Violation
from .flags import check_pairs, read_flags
from .topology import Topology, describe_levels, dynamic_levels, is_power_of_two
from .values import _VERSION_TEXT, FIELD_KINDS, LIMITS, MAX_RANKS, parse_version, version_tuple

__all__ = [
    "CP_COMM_TYPES",
    "CP_PARTITION_MODES",
    "CPConfig",
    "DEFAULT_CP_COMM_TYPE",
    "MIN_TE_VERSION_A2A_P2P",
    "MIN_TE_VERSION_A2A_P2P_THD",
    "SOFTMAX_TYPES",
    "Backend",
    "Topology",
    "comm_type_or_default",
    "describe_levels",
    "dynamic_levels",
    "is_power_of_two",
]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
DEFAULT_CP_COMM_TYPE = "p2p"  # megatron's default; the one place it is decided here
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")  # megatron's TransformerConfig.softmax_type
# the token layouts of megatron_hcp.sharding (which config may not import; a test keeps the two
# equal): zigzag = chunks r and 2cp-1-r of every sequence, contiguous = its r-th slice
CP_PARTITION_MODES = ("zigzag", "contiguous")


def comm_type_or_default(cp_comm_type: str | None) -> str:
    """``cp_comm_type`` as megatron reads it: None means :data:`DEFAULT_CP_COMM_TYPE`."""
    return cp_comm_type or DEFAULT_CP_COMM_TYPE


MIN_TE_VERSION_A2A_P2P = (1, 12)
# Transformer Engine refused a2a+p2p with packed THD input (an assertion in
# attn_forward_func_with_cp) up to its 2.18 release; its main branch dropped the gate in
# commit 8ff60f8 (2026-08-04, "Enable THD with hierarchical context parallelism", 2.20.0.dev0).
# Dynamic CP always packs THD, so dynamic HCP on TE needs the first release with that commit.
MIN_TE_VERSION_A2A_P2P_THD = (2, 20)
Backend = Literal["auto", "te", "reference"]


def _plain_ints(value: object) -> object:
    """``value`` with integral numbers (numpy, torch) as Python ints, in lists too."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, list):
        return [_plain_ints(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_ints(v) for v in value)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# a field kind of FIELD_KINDS -> (the Python values it takes, what to write instead)
_TYPES: dict[str, tuple[object, str]] = {
    "int": (_is_int, "an integer"),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "version": (lambda v: isinstance(v, str), "a version string such as '2.20.0'"),
    "strs": (lambda v: isinstance(v, str) or isinstance(v, (list, tuple)) and bool(v) and all(
        isinstance(x, str) for x in v), "a string or a list of strings"),
    "sizes": (lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
              "a list of integers, e.g. [2, 2]"),
    "window": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(
        _is_int(x) for x in v), "two integers (left, right), e.g. [128, 0]"),
}


def _type_violations(config: CPConfig) -> list[Violation]:
    """Every field whose Python type its kind does not take (FIELD_KINDS; ``?``: None too)."""
    out = []
    for name, kind in FIELD_KINDS.items():
        value = getattr(config, name)
        optional, base = kind.startswith("?"), kind.lstrip("?")
        if value is None and optional:
            continue
        accepts, wanted = _TYPES["int" if base in LIMITS else base]
        if value is None or not accepts(value):
            hint = (f"; {name}={int(value)} if you meant the number" if isinstance(value, str)
                    and value.strip().lstrip("+-").isdecimal() and value.isascii()
                    and len(value) < 30 else "")
            out.append(Violation(name, value, f"must be {wanted}"
                                 + (" (or None)" if optional else "")
                                 + f", not {type(value).__name__}",
                                 f"pass {wanted}{hint}"))
    return out


@dataclass
class CPConfig:
    """Context-parallel setup, with megatron-core's field names.

    ``cp_comm_type`` is one of :data:`CP_COMM_TYPES` or a per-layer list of them (``None`` means
    megatron's default, ``"p2p"``). ``num_query_groups=None`` means MHA (as many KV heads as
    heads). ``cp_attention_backend`` says which attention kernel runs CP: ``"te"`` (Transformer
    Engine), ``"reference"`` (this project's pure-PyTorch backend) or ``"auto"`` (TE when
    ``te_version`` is set). ``cp_partition_mode`` (upstream megatron's name) is the token layout
    of a CP rank: ``"zigzag"`` (chunks r and 2cp-1-r) or ``"contiguous"`` (slice r).
    """

    context_parallel_size: int = 1
    cp_comm_type: str | list[str] | None = None
    hierarchical_context_parallel_sizes: list[int] | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    num_layers: int | None = None
    seq_length: int | None = None
    dynamic_context_parallel: bool = False
    min_dynamic_context_parallel_size: int = 1
    max_seqlen_per_dp_cp_rank: int | None = None
    hybrid_context_parallel: bool = False
    calculate_per_token_loss: bool | None = None
    cuda_graph_impl: str = "none"
    enable_cuda_graph: bool = False
    use_megatron_fsdp: bool = False
    te_version: str | None = None
    cp_attention_backend: Backend = "auto"
    window_size: list[int] | tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    cp_partition_mode: str = "zigzag"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # numpy / torch integers are integers
            setattr(self, f.name, _plain_ints(getattr(self, f.name)))
        if self.hybrid_context_parallel is True:  # deprecated alias (advice in validate())
            self.dynamic_context_parallel = True

    # ------------------------------------------------------------------ derived values
    @property
    def comm_types(self) -> list[str]:
        """The comm type of every layer (a single entry when not given per layer)."""
        if self.cp_comm_type is None:
            return [DEFAULT_CP_COMM_TYPE]
        if isinstance(self.cp_comm_type, str):
            return [self.cp_comm_type]
        return list(self.cp_comm_type)

    @property
    def comm_type(self) -> str | list[str]:
        """``cp_comm_type`` with the default applied (a string, or the per-layer list)."""
        types = self.comm_types
        return types[0] if not isinstance(self.cp_comm_type, list) else types

    @property
    def uses_hierarchical(self) -> bool:
        return "a2a+p2p" in self.comm_types

    @property
    def backend(self) -> Literal["te", "reference"]:
        if self.cp_attention_backend == "auto":
            return "te" if self.te_version else "reference"
        return self.cp_attention_backend

    @property
    def a2a_size(self) -> int:
        """Size of the a2a level (the inner group of a2a+p2p)."""
        sizes = self.hierarchical_context_parallel_sizes
        return int(sizes[0]) if sizes else 1

    @property
    def p2p_size(self) -> int:
        sizes = self.hierarchical_context_parallel_sizes
        return int(sizes[1]) if sizes and len(sizes) > 1 else 1

    @property
    def dp_cp_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    @property
    def world_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.data_parallel_size
        )

    # ------------------------------------------------------------------ validation
    def validate(self) -> list[str]:
        """Check every rule; raise :class:`CPConfigError` listing all violations.

        Every field's type is checked first, strictly (``"4"`` is not 4, ``None`` is no size);
        the rules then run with each mistyped field at its default, and a rule that involves a
        mistyped field is not reported (its type error is). Returns advice (strings) for a
        valid configuration: choices that work but are usually not what the user wants.
        """
        violations = _type_violations(self)
        mistyped = {v.parameter for v in violations}
        config = self if not mistyped else dataclasses.replace(self, **{
            f.name: f.default for f in dataclasses.fields(self) if f.name in mistyped})
        rules, advice = config._rule_violations()
        violations += [v for v in rules if not any(
            name in v.parameter or name in v.rule or name in v.fix for name in mistyped)]
        if violations:
            raise CPConfigError(violations)
        return advice

    def _rule_violations(self) -> tuple[list[Violation], list[str]]:
        violations: list[Violation] = []
        advice: list[str] = []
        for check in (
            self._check_sizes,
            self._check_comm_types,
            self._check_hierarchical,
            self._check_seq_length,
            self._check_heads,
            self._check_te,
            self._check_attention_features,
            self._check_dynamic,
        ):
            check(violations, advice)
        return violations, advice

    def _check_sizes(self, out: list[Violation], advice: list[str]) -> None:
        for name in (
            "context_parallel_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "data_parallel_size",
            "min_dynamic_context_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(Violation(name, value, "must be an integer >= 1", f"set {name} >= 1"))
            elif value > MAX_RANKS:
                out.append(Violation(name, value, f"must be <= {MAX_RANKS} (ranks)",
                                     f"set {name} <= {MAX_RANKS}"))
        for name in ("dynamic_context_parallel", "hybrid_context_parallel", "enable_cuda_graph",
                     "use_megatron_fsdp", "calculate_per_token_loss"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (
                    value is None and name == "calculate_per_token_loss"):
                out.append(Violation(name, value, "must be a boolean (True or False)",
                                     f"set {name}=True or {name}=False"))
        if self.te_version is not None:
            try:
                parse_version(self.te_version, "te_version")
            except CPConfigError as err:
                out.extend(err.violations)
        for name in ("num_attention_heads", "num_query_groups", "num_layers", "seq_length",
                     "max_seqlen_per_dp_cp_rank"):
            value = getattr(self, name)
            limit = LIMITS[FIELD_KINDS[name].lstrip("?")]
            if value is None or name == "max_seqlen_per_dp_cp_rank" and not self.dynamic:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                if name != "max_seqlen_per_dp_cp_rank":  # _check_dynamic says it for the cap
                    out.append(Violation(name, value, "must be a positive integer",
                                         f"set {name} >= 1"))
            elif value > limit:
                out.append(Violation(name, value, f"must be <= {limit}",
                                     f"set {name} <= {limit}"))
        if self.cp_attention_backend not in ("auto", "te", "reference"):
            out.append(
                Violation(
                    "cp_attention_backend",
                    self.cp_attention_backend,
                    "must be one of auto, te, reference",
                    "pick one of those",
                )
            )

    def _check_comm_types(self, out: list[Violation], advice: list[str]) -> None:
        ct = self.cp_comm_type
        if ct is not None and not isinstance(ct, (str, list, tuple)):
            out.append(
                Violation(
                    "cp_comm_type",
                    ct,
                    "must be a string or a per-layer list of strings",
                    f"use one of {', '.join(CP_COMM_TYPES)}",
                )
            )
            return
        bad = [t for t in self.comm_types if t not in CP_COMM_TYPES]
        if bad:
            out.append(
                Violation(
                    "cp_comm_type",
                    ct,
                    f"unknown comm type(s) {bad}",
                    f"use one of {', '.join(CP_COMM_TYPES)}",
                )
            )
        if isinstance(ct, (list, tuple)):
            if self.num_layers is None:
                out.append(
                    Violation(
                        "cp_comm_type",
                        ct,
                        "a per-layer list needs num_layers to check its length",
                        "set num_layers",
                    )
                )
            elif len(ct) != self.num_layers:
                out.append(
                    Violation(
                        "cp_comm_type",
                        ct,
                        f"a per-layer list must have num_layers={self.num_layers} entries, "
                        f"it has {len(ct)}",
                        f"give exactly {self.num_layers} entries or a single string",
                    )
                )

    def _check_hierarchical(self, out: list[Violation], advice: list[str]) -> None:
        sizes = self.hierarchical_context_parallel_sizes
        name = "hierarchical_context_parallel_sizes"
        if sizes is None:
            if self.uses_hierarchical:
                out.append(
                    Violation(
                        name,
                        None,
                        "cp_comm_type a2a+p2p needs the sizes of its two levels "
                        "(without them older stacks silently ran with CP off)",
                        f"set {name}=[a2a, p2p] with a2a*p2p == context_parallel_size",
                    )
                )
            return
        if not isinstance(sizes, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sizes
        ):
            out.append(Violation(name, sizes, "must be a list of integers", "e.g. [2, 2]"))
            return
        if any(s < 1 for s in sizes):
            out.append(Violation(name, sizes, "every level must be >= 1", "use sizes >= 1"))
            return
        cp = self.context_parallel_size
        if math.prod(sizes) != cp:
            out.append(
                Violation(
                    name,
                    sizes,
                    f"the product of the levels ({math.prod(sizes)}) must equal "
                    f"context_parallel_size={cp}",
                    "choose levels whose product is the CP size, or change "
                    "context_parallel_size",
                )
            )
        if not self.uses_hierarchical:
            # An error, not a warning: the groups would be built but never used, so a user who
            # believes HCP is active would silently train with flat CP (docs/configuration.md).
            out.append(
                Violation(
                    name,
                    sizes,
                    "hierarchical sizes only take effect with cp_comm_type a2a+p2p; with "
                    f"{self.comm_types} they would be created and never used",
                    "set cp_comm_type=a2a+p2p, or remove hierarchical_context_parallel_sizes",
                )
            )
        elif len(sizes) != 2:
            out.append(
                Violation(
                    name,
                    sizes,
                    f"a2a+p2p has exactly two levels [a2a, p2p], got {len(sizes)}",
                    "give two sizes, the a2a (inner) size first",
                )
            )
        elif 1 in sizes and cp > 1:
            kind = "p2p" if sizes[0] == 1 else "a2a"
            advice.append(
                f"hierarchical_context_parallel_sizes={list(sizes)} has a level of size 1: "
                f"a2a+p2p then behaves as pure {kind}; cp_comm_type={kind} is simpler"
            )

    def _check_seq_length(self, out: list[Violation], advice: list[str]) -> None:
        cp = self.context_parallel_size
        if self.seq_length is None or cp <= 1 or not isinstance(self.seq_length, int):
            return
        if self.cp_partition_mode == "contiguous":
            unit, why = cp, ("context_parallel_size", "the contiguous layout cuts every sequence "
                             "into CP slices")
        else:
            unit, why = 2 * cp, ("2*context_parallel_size", "load-balanced (zigzag) causal CP "
                                 "splits every sequence into 2*CP chunks")
        if self.seq_length % unit != 0:
            out.append(
                Violation(
                    "seq_length",
                    self.seq_length,
                    f"must be divisible by {why[0]}={unit} ({why[1]})",
                    f"use a multiple of {unit}, "
                    f"e.g. {(self.seq_length // unit + 1) * unit}",
                )
            )

    def _check_heads(self, out: list[Violation], advice: list[str]) -> None:
        heads, groups, tp = self.num_attention_heads, self.num_query_groups, (
            self.tensor_model_parallel_size
        )
        if heads is None or not isinstance(heads, int) or not isinstance(tp, int) or tp < 1:
            return
        groups = heads if groups is None else groups
        if not isinstance(groups, int) or groups < 1:
            return
        ok = True
        if heads % tp:
            ok = False
            out.append(
                Violation(
                    "num_attention_heads",
                    heads,
                    f"must be divisible by tensor_model_parallel_size={tp}",
                    "change the TP size or the head count",
                )
            )
        if groups % tp:
            ok = False
            out.append(
                Violation(
                    "num_query_groups",
                    groups,
                    f"must be divisible by tensor_model_parallel_size={tp}",
                    "change the TP size or the number of query groups",
                )
            )
        if heads % groups:
            ok = False
            out.append(
                Violation(
                    "num_query_groups",
                    groups,
                    f"must divide num_attention_heads={heads}",
                    "use a divisor of the head count",
                )
            )
        if not ok:
            return
        q_local, kv_local = heads // tp, groups // tp
        cp = self.context_parallel_size
        checks = []
        if "a2a" in self.comm_types:
            checks.append(("a2a", "context_parallel_size", cp))
        if self.uses_hierarchical and self.hierarchical_context_parallel_sizes:
            checks.append(
                ("a2a+p2p", "hierarchical_context_parallel_sizes[0] (a2a level)", self.a2a_size)
            )
        for kind, size_name, size in checks:
            if size <= 1:
                continue
            if q_local % size:
                out.append(
                    Violation(
                        "num_attention_heads",
                        heads,
                        f"{kind} splits the {q_local} local query heads (per TP rank) over "
                        f"{size_name}={size}, which must divide them",
                        "use an a2a size that divides the local head count, or more TP",
                    )
                )
            if kv_local % size == 0:
                continue
            if self.backend == "reference" and size % kv_local == 0:
                continue  # KV heads are replicated size/kv_local times (reference backend only)
            rule = (
                f"{kind} splits the {kv_local} local KV heads over {size_name}={size}; they "
                "must be divisible by it"
            )
            if self.backend == "reference":
                rule += " (or divide it, so the reference backend can replicate them)"
            out.append(
                Violation(
                    "num_query_groups",
                    groups,
                    rule,
                    "use a smaller a2a size (a2a+p2p with a larger p2p level) or more KV heads",
                )
            )
        if self.uses_hierarchical and cp > 1 and cp <= kv_local and q_local % cp == 0:
            advice.append(
                f"context_parallel_size={cp} <= local KV heads ({kv_local}): pure a2a "
                "(cp_comm_type=a2a) fits and is usually simpler with the same throughput"
            )

    def _check_te(self, out: list[Violation], advice: list[str]) -> None:
        if self.backend != "te" or not self.uses_hierarchical:
            return
        if self.dynamic and isinstance(self.te_version, str) and _VERSION_TEXT.fullmatch(
                self.te_version.strip()) and (
                version_tuple(self.te_version) < MIN_TE_VERSION_A2A_P2P_THD):
            need = ".".join(map(str, MIN_TE_VERSION_A2A_P2P_THD))
            out.append(Violation(
                "te_version", self.te_version,
                f"dynamic CP packs THD micro-batches, and Transformer Engine runs a2a+p2p with "
                f"THD only from {need} (backend te)",
                f"upgrade transformer-engine to >= {need}, or use cp_attention_backend=reference"))
        if self.te_version is None:
            out.append(
                Violation(
                    "te_version",
                    None,
                    "the te backend for a2a+p2p needs Transformer Engine >= 1.12",
                    "install transformer-engine>=1.12 or use cp_attention_backend=reference",
                )
            )
        elif isinstance(self.te_version, str) and _VERSION_TEXT.fullmatch(
                self.te_version.strip()) and (
                version_tuple(self.te_version) < MIN_TE_VERSION_A2A_P2P):
            out.append(
                Violation(
                    "te_version",
                    self.te_version,
                    "a2a+p2p needs Transformer Engine >= 1.12",
                    "upgrade transformer-engine to >= 1.12",
                )
            )

    def _check_attention_features(self, out: list[Violation], advice: list[str]) -> None:
        """Sliding windows and softmax offsets: what each backend runs with CP."""
        w = self.window_size
        windowed = w is not None and tuple(w) != (-1, -1)
        if w is not None and not (
                isinstance(w, (list, tuple)) and len(w) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in w)):
            out.append(Violation("window_size", w, "must be (left, right) with ints >= -1",
                                 "e.g. window_size=[128, 0]; -1 = unbounded"))
            windowed = False
        ring = sorted({t for t in self.comm_types if t in ("p2p", "a2a+p2p")})
        if windowed and self.backend == "te" and self.context_parallel_size > 1 and ring:
            out.append(Violation(
                "window_size", w,
                f"Transformer Engine runs sliding-window CP attention only with a2a or "
                f"all_gather, not {', '.join(ring)} (backend te)",
                "use cp_comm_type=a2a or all_gather, or cp_attention_backend=reference (its "
                "ring skips the blocks outside the window)"))
        self._check_partition_mode(out, advice, windowed)
        if self.softmax_type not in SOFTMAX_TYPES:
            out.append(Violation("softmax_type", self.softmax_type,
                                 f"must be one of {', '.join(SOFTMAX_TYPES)}", "pick one of those"))
        elif self.softmax_type != "vanilla" and self.context_parallel_size > 1:
            # the reference backend runs softmax offsets with every comm type
            if self.backend == "te" and any(t != "a2a" for t in self.comm_types):
                out.append(Violation(
                    "softmax_type", self.softmax_type,
                    "Transformer Engine runs softmax offsets (sinks) with CP only with a2a "
                    f"(backend te, cp_comm_type={self.comm_type})", "use cp_comm_type=a2a"))

    def _check_partition_mode(self, out: list[Violation], advice: list[str],
                              windowed: bool) -> None:
        mode, cp = self.cp_partition_mode, self.context_parallel_size
        if mode not in CP_PARTITION_MODES:
            out.append(Violation(
                "cp_partition_mode", mode, f"must be one of {', '.join(CP_PARTITION_MODES)}",
                "zigzag (chunks r and 2cp-1-r of every sequence: balanced causal work) or "
                "contiguous (slice r of every sequence)"))
            return
        if mode != "contiguous" or (cp <= 1 and not self.dynamic):
            return
        if self.backend == "te":
            out.append(Violation(
                "cp_partition_mode", mode,
                "Transformer Engine's CP attention cuts every sequence zigzag (chunks r and "
                "2cp-1-r); no TE release attends over per-sequence contiguous slices (its "
                "NO_LOAD_BALANCE strategy slices the whole packed buffer, all_gather with THD "
                "only) (backend te)",
                "use cp_attention_backend=reference, or cp_partition_mode=zigzag"))
        elif not windowed and cp > 1:
            advice.append(
                f"cp_partition_mode=contiguous with causal attention and no sliding window: "
                f"the last of {cp} CP ranks does {2 * cp - 1}/{cp} = {(2 * cp - 1) / cp:.2f}x "
                "the mean attention work (zigzag balances it); contiguous pays off with a "
                "sliding window, where a rank needs K/V only from its neighbours")

    def dynamic_levels(self, size: int) -> tuple[int, int]:
        """(a2a, p2p) level sizes of a dynamic CP group of ``size`` ranks (:func:`dynamic_levels`:
        a flat ring ``(1, size)`` without hierarchical CP)."""
        hierarchical = self.uses_hierarchical and self.hierarchical_context_parallel_sizes
        return dynamic_levels(size, self.a2a_size if hierarchical else None)

    def _check_dynamic_hierarchical(self, n: int, out: list[Violation],
                                    advice: list[str]) -> None:
        """Dynamic hierarchical CP: every dynamic group splits into an a2a level of at most
        ``a`` contiguous ranks and a p2p ring across them."""
        if len(self.comm_types) > 1:
            out.append(Violation(
                "cp_comm_type", self.cp_comm_type,
                "dynamic CP switches every layer's group per micro-batch; a per-layer comm type "
                "list has no per-micro-batch meaning", "give one cp_comm_type"))
            return
        a = self.a2a_size
        if a == 1:
            out.append(Violation(
                "hierarchical_context_parallel_sizes[0]", a,
                "an a2a level of 1 makes every dynamic group a plain ring",
                "use cp_comm_type=p2p with dynamic CP (or an a2a size >= 2)"))
        elif not is_power_of_two(a):
            out.append(Violation(
                "hierarchical_context_parallel_sizes[0]", a,
                "with dynamic CP the a2a level size must be a power of two (dynamic groups are "
                "aligned power-of-two blocks that the a2a level must tile)",
                "use an a2a size of 1, 2, 4, 8, ..."))
        elif n >= 2 and is_power_of_two(n) and a > n:
            out.append(Violation(
                "hierarchical_context_parallel_sizes[0]", a,
                f"the a2a level cannot exceed DPxCP={n}", f"use an a2a size <= {n}"))
        if not out:
            sizes = []
            c = max(1, self.min_dynamic_context_parallel_size)
            while c <= n:
                sizes.append(f"{c}: {describe_levels(c, self.a2a_size)}")
                c *= 2
            advice.append("dynamic hierarchical CP, levels per dynamic group size: "
                          + "; ".join(sizes))

    @property
    def dynamic(self) -> bool:
        """Dynamic CP on (``hybrid_context_parallel`` is megatron-core 0.16's name for it)."""
        return bool(self.dynamic_context_parallel or self.hybrid_context_parallel)

    def _per_token_violations(self) -> list[Violation]:
        """The modes that need per-token loss, when it is turned off."""
        if self.calculate_per_token_loss is False and self.dynamic:
            return [Violation(
                "calculate_per_token_loss", False,
                "dynamic CP needs per-token loss: micro-batches hold different token counts, so "
                "averaging per micro-batch would weight tokens unequally",
                "set calculate_per_token_loss=True (the default with dynamic CP)")]
        return []

    def per_token_loss(self) -> bool:
        """True: the loss is averaged over the tokens of the global batch
        (``calculate_per_token_loss`` True, or unset: this project's default); False: per
        micro-batch, over its tokens on the whole CP group (megatron's
        ``calculate_per_token_loss=False``). Raises :class:`CPConfigError` where a mode needs
        per-token loss (dynamic CP)."""
        problems = self._per_token_violations()
        if problems:
            raise CPConfigError(problems)
        return self.calculate_per_token_loss is not False

    def _check_dynamic(self, out: list[Violation], advice: list[str]) -> None:
        if self.hybrid_context_parallel:
            advice.append(
                "hybrid_context_parallel is megatron-core 0.16's name for dynamic CP and is "
                "deprecated here: set dynamic_context_parallel=True instead"
            )
        if not self.dynamic:
            return
        out.extend(self._per_token_violations())
        if self.enable_cuda_graph or self.cuda_graph_impl not in ("none", None):
            out.append(Violation(
                "cuda_graph_impl", self.cuda_graph_impl if self.cuda_graph_impl != "none"
                else "enable_cuda_graph=True",
                "dynamic CP changes tensor shapes and CP groups per micro-batch; CUDA graphs "
                "capture fixed ones", "disable CUDA graphs (cuda_graph_impl=none)"))
        if self.use_megatron_fsdp:
            out.append(Violation(
                "use_megatron_fsdp", True,
                "dynamic CP is not supported with Megatron FSDP (upstream rule)",
                "use DDP or the distributed optimizer"))
        n = self.dp_cp_size
        if self.uses_hierarchical:
            self._check_dynamic_hierarchical(n, out, advice)
        m = self.min_dynamic_context_parallel_size
        if isinstance(m, int) and not is_power_of_two(m):
            out.append(
                Violation(
                    "min_dynamic_context_parallel_size",
                    m,
                    "must be a power of two (dynamic CP groups are power-of-two blocks)",
                    "use 1, 2, 4, ...",
                )
            )
        if isinstance(m, int) and m > n:
            out.append(
                Violation(
                    "min_dynamic_context_parallel_size",
                    m,
                    f"must be <= data_parallel_size*context_parallel_size={n}",
                    f"use at most {n}",
                )
            )
        if n < 2 or not is_power_of_two(n):
            out.append(
                Violation(
                    "data_parallel_size",
                    self.data_parallel_size,
                    f"dynamic CP needs DPxCP = data_parallel_size*context_parallel_size to be a "
                    f"power of two >= 2 (its groups are aligned power-of-two blocks), got {n}",
                    "choose data_parallel_size and context_parallel_size so that their product "
                    "is 2, 4, 8, ...",
                )
            )
        cap = self.max_seqlen_per_dp_cp_rank
        if cap is None or not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
            out.append(
                Violation(
                    "max_seqlen_per_dp_cp_rank",
                    cap,
                    "dynamic CP needs a positive token cap per rank",
                    "set max_seqlen_per_dp_cp_rank to the tokens one rank may hold",
                )
            )

    # ------------------------------------------------------------------ resolution
    def resolve(self, world_size: int | None = None, *, expert_model_parallel_size: int = 1,
                expert_tensor_parallel_size: int | None = None, order: str = "tp-cp-ep-dp-pp",
                rank_offset: int = 0) -> Topology:
        """Validate, then derive every fact of this setup on ``world_size`` ranks (default:
        ``tp*pp*cp*dp``) starting at ``rank_offset``: the one :class:`~.topology.Topology` the
        process groups, the planner and the clients read. Pure; raises :class:`CPConfigError`
        (every rule, and ``tp*pp*cp*dp`` against ``world_size``) before anything is built."""
        self.validate()
        world = self.world_size if world_size is None else world_size
        if self.world_size != world:
            model = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                     * self.context_parallel_size)
            raise CPConfigError([Violation(
                "data_parallel_size", self.data_parallel_size,
                f"tp*pp*cp*dp={self.world_size} must equal the world size {world}",
                f"set data_parallel_size = world_size / (tp * pp * cp) = {world / model:g}")])
        hcp = self.hierarchical_context_parallel_sizes if self.uses_hierarchical else None
        return Topology(
            world_size=world, tp=self.tensor_model_parallel_size,
            cp=self.context_parallel_size, pp=self.pipeline_model_parallel_size,
            ep=expert_model_parallel_size,
            etp=expert_tensor_parallel_size or self.tensor_model_parallel_size, order=order,
            hierarchical_sizes=tuple(hcp) if hcp else None, rank_offset=rank_offset,
            dynamic_min_size=self.min_dynamic_context_parallel_size if self.dynamic else None,
            dynamic_a2a_size=self.a2a_size if self.dynamic and hcp else None, config=self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_pairs(cls, pairs: Sequence[str]) -> CPConfig:
        """Build from ``key=value`` strings (megatron field names; lists as ``[2,2]``): the
        thin alias of :meth:`from_args` (``key=value`` is ``--key value``)."""
        check_pairs(pairs)
        return cls.from_args(pairs)

    @classmethod
    def from_args(cls, args: Sequence[str]) -> CPConfig:
        """Build from megatron's command-line flags, the one dialect of a CP setup (recipes'
        ``MODEL_ARGS``, the CLI): ``--context-parallel-size 4 --cp-comm-type a2a+p2p
        --hierarchical-context-parallel-sizes 2 2 --dynamic-context-parallel``. A bare flag of a
        boolean field is true; list fields take several values (or ``[2,2]``, ``2,2``);
        ``key=value`` / ``--key=value`` are thin aliases. Every value is read by
        :func:`~.values.parse_value` with its field's kind (:func:`~.flags.read_flags`); every
        bad argument is reported at once.
        """
        return cls(**read_flags(args, cls.field_names()))
