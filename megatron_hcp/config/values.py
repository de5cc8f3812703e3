"""The one strict value parser and the bounds of every count a user gives.

:func:`parse_value` reads text (or a YAML/JSON value) as a kind - booleans only from
true/false/1/0, integers only from integers (``2.7``, ``true``, ``"200"`` are refused), versions
only from versions - within :data:`LIMITS`; :func:`argument_type` is its argparse form. Every
error is a :class:`~.errors.CPConfigError` naming the parameter, the value, the rule and the fix.
Below the CP rules: it imports only :mod:`.errors`.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from .errors import CPConfigError, Violation

__all__ = [
    "FIELDS",
    "FIELD_KINDS",
    "LIMITS",
    "MAX_INT",
    "MAX_RANKS",
    "MAX_SEQUENCES",
    "MAX_SEQ_LENGTH",
    "MAX_STEPS",
    "argument_type",
    "fields_read_by",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_value",
    "parse_version",
    "version_tuple",
]

MAX_RANKS = 1 << 17
"""Upper bound of every size and world size (131072 ranks): beyond it rank lists exhaust
memory before anything useful happens."""
MAX_SEQ_LENGTH = 1 << 26
"""Tokens in one sequence or on one rank (64 Mi)."""
MAX_SEQUENCES = 1 << 16
"""Sequences in one global batch or one schedule input (65536; measured: the scheduler plans
10000 sequences in ~1 s and 100000 in ~25 s on this 2-core VM)."""
MAX_STEPS = 100_000
"""Training steps of one run, and the steps a golden-values file may cover."""
MAX_INT = (1 << 63) - 1
"""Every other integer is an int64 (larger ones overflow floats and tensors)."""
# parse_value kinds with their bounds (1..limit): every count a user gives is bounded
LIMITS: dict[str, int] = {
    "size": MAX_RANKS,
    "seqlen": MAX_SEQ_LENGTH,
    "layers": 1 << 12,
    "heads": 1 << 14,
    "width": 1 << 20,  # hidden, FFN and head sizes
    "vocab": 1 << 24,
    "steps": MAX_STEPS,
    "sequences": MAX_SEQUENCES,
    "posint": MAX_INT,
}

_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_VERSION_TEXT = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc|\.post|\.dev)[0-9]+)*(\+[A-Za-z0-9.]+)?")
_BOOL_TEXT = {"true": True, "false": False, "1": True, "0": False}
_NONE_TEXT = ("none", "null")

# The one field table: CPConfig field -> (kind for parse_value, "?" prefix: None allowed; who
# else reads the field by the same name: "r" a recipe's MODEL_ARGS flag, "b" Megatron-Bridge's
# model config, "t" megatron's TransformerConfig, set by the trainer from the config)
FIELDS: dict[str, tuple[str, str]] = {
    "context_parallel_size": ("size", "rbt"),
    "cp_comm_type": ("?strs", "rbt"),
    "hierarchical_context_parallel_sizes": ("?sizes", "rbt"),
    "tensor_model_parallel_size": ("size", "rbt"),
    "pipeline_model_parallel_size": ("size", "rbt"),
    "data_parallel_size": ("size", ""),
    "num_attention_heads": ("?heads", "rbt"),
    "num_query_groups": ("?heads", "rbt"),
    "num_layers": ("?layers", "rbt"),
    "seq_length": ("?seqlen", "rb"),
    "dynamic_context_parallel": ("bool", "rb"),
    "min_dynamic_context_parallel_size": ("size", "rb"),
    "max_seqlen_per_dp_cp_rank": ("?seqlen", "rbt"),
    "hybrid_context_parallel": ("bool", "rb"),
    "calculate_per_token_loss": ("?bool", "rbt"),
    "cuda_graph_impl": ("str", "b"),
    "enable_cuda_graph": ("bool", "b"),
    "use_megatron_fsdp": ("bool", ""),
    "te_version": ("?version", ""),
    "cp_attention_backend": ("str", ""),
    "window_size": ("?window", "rb"),
    "softmax_type": ("str", "b"),
    "cp_partition_mode": ("str", "rb"),
}
# CPConfig field -> kind for parse_value (the table's first column)
FIELD_KINDS: dict[str, str] = {name: kind for name, (kind, _) in FIELDS.items()}
_READERS = {"recipe": "r", "bridge": "b", "transformer": "t"}


def fields_read_by(reader: str) -> tuple[str, ...]:
    """The CPConfig fields ``reader`` (``"recipe"``, ``"bridge"`` or ``"transformer"``) reads by
    the same name, in the table's order."""
    code = _READERS[reader]
    return tuple(name for name, (_, readers) in FIELDS.items() if code in readers)


def version_tuple(version: str) -> tuple[int, ...]:
    """Numeric release parts of a version text: ``"2.20.0.dev0+abc"`` -> ``(2, 20, 0)``,
    ``"2.20rc1"`` -> ``(2, 20)``; a pre-release compares like its release."""
    parts = []
    for piece in version.split("+")[0].split("."):
        match = re.match(r"[0-9]+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)



def _bad(name: str, value: Any, rule: str, fix: str) -> CPConfigError:
    return CPConfigError([Violation(name, value, rule, fix)])


def parse_int(value: Any, name: str, *, minimum: int | None = None,
              maximum: int | None = None, text: bool = True) -> int:
    """An integer from an int (never a bool or a float) or, with ``text``, integer digits."""
    if isinstance(value, str) and text and _INT_TEXT.fullmatch(value.strip()):
        digits = value.strip().lstrip("+-").lstrip("0")
        if len(digits) > len(str(MAX_INT)):  # before int(): Python refuses > 4300 digits
            raise _bad(name, value, f"must be within +-{MAX_INT} (int64); it has "
                       f"{len(digits)} digits", "use a smaller number")
        value = int(value.strip())
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # numpy and torch integers are integers
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, value, "must be an integer", f"give {name} an integer, e.g. 4")
    if minimum is not None and value < minimum:
        raise _bad(name, value, f"must be >= {minimum}", f"use a value >= {minimum}")
    if maximum is not None and value > maximum:
        raise _bad(name, value, f"must be <= {maximum}", f"use a value <= {maximum}")
    if abs(value) > MAX_INT:
        raise _bad(name, _short(value), f"must be within +-{MAX_INT} (int64)",
                   "use a smaller number")
    return value


def _short(value: int) -> str:
    """An integer too long to show whole (Python refuses to print more than 4300 digits)."""
    digits = len(str(abs(value))) if value.bit_length() < 14000 else None
    return f"an integer of {digits or 'over 4000'} digits"


def parse_float(value: Any, name: str, *, minimum: float | None = None,
                above: float | None = None, maximum: float | None = None) -> float:
    """A finite number from an int, a float or its text (never a bool); ``minimum`` and
    ``maximum`` inclusive, ``above`` exclusive."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            value = math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value):
        raise _bad(name, value, "must be a finite number", f"give {name} a number, e.g. 1.5")
    if minimum is not None and value < minimum:
        raise _bad(name, value, f"must be >= {minimum}", f"use a value >= {minimum}")
    if above is not None and value <= above:
        raise _bad(name, value, f"must be > {above}", f"use a value > {above}")
    if maximum is not None and value > maximum:
        raise _bad(name, value, f"must be <= {maximum:g}", f"use a value <= {maximum:g}")
    return float(value)


def parse_bool(value: Any, name: str, *, text: bool = True) -> bool:
    """A boolean from a bool or, with ``text``, one of the spellings true/false/1/0 (any
    case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1) and text:
        return bool(value)
    if isinstance(value, str) and text and value.strip().lower() in _BOOL_TEXT:
        return _BOOL_TEXT[value.strip().lower()]
    raise _bad(name, value, "must be a boolean (true, false, 1 or 0)",
               f"write {name}=true or {name}=false")


def parse_version(value: Any, name: str) -> str:
    """A release version such as ``1.12``, ``2.3.0.dev0`` or ``1.13.0+cu12``."""
    text = value.strip() if isinstance(value, str) else None
    if text is None or not _VERSION_TEXT.fullmatch(text):
        raise _bad(name, value, "must be a version number", f"write e.g. {name}=1.12.0")
    return text


def _items(value: Any, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if not isinstance(value, str):
        raise _bad(name, value, "must be a list", f"write e.g. {name}=[2,2]")
    text = value.strip()
    if text.startswith("[") != text.endswith("]"):
        raise _bad(name, value, "unbalanced brackets", f"write e.g. {name}=[2,2]")
    text = text.strip("[]").strip()
    return [p.strip() for p in text.split(",")] if text else []


def parse_value(raw: Any, kind: str = "literal", name: str = "value", *,
                text: bool = True) -> Any:
    """The one strict value parser: ``raw`` (text, or a YAML/JSON value) as ``kind``.

    Kinds: ``int`` (int64), the bounded counts of :data:`LIMITS` (``posint``, ``size``
    (1..:data:`MAX_RANKS`), ``seqlen``, ``layers``, ``heads``, ``width``, ...), ``float``, ``bool``,
    ``version``, ``str``, ``sizes``/``strs`` (lists, ``[2,2]`` or ``2,2``); a ``?`` prefix also
    accepts ``none``/``null``. ``literal`` (untyped settings): true/false, integers, ``none``,
    lists, else the text. ``text=False`` reads a typed value (YAML, JSON, Python): a number or a
    boolean must be one, not its spelling (a quoted ``"32"`` is text). Raises
    :class:`CPConfigError` naming ``name``, the value, the rule and the fix.
    """
    if not text and isinstance(raw, str) and kind.lstrip("?") in (
            "int", "float", "bool", "sizes", "window", *LIMITS):
        want = "a boolean" if kind.lstrip("?") == "bool" else "a number"
        raise _bad(name, raw, f"must be {want}, not text (a quoted value is a string)",
                   f"write {name}: {raw.strip()}" if len(raw) < 40 else f"write {want}")
    if kind.startswith("?"):
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE_TEXT):
            return None
        kind = kind[1:]
    if kind == "int":
        return parse_int(raw, name)
    if kind in LIMITS:
        return parse_int(raw, name, minimum=1, maximum=LIMITS[kind])
    if kind == "float":
        return parse_float(raw, name)
    if kind == "bool":
        return parse_bool(raw, name, text=text)
    if kind == "version":
        return parse_version(raw, name)
    if kind == "str":
        if not isinstance(raw, str) or not raw.strip():
            raise _bad(name, raw, "must be a non-empty string", f"give {name} a value")
        return raw.strip()
    if kind == "sizes":
        return [parse_int(p, f"{name}[{i}]", minimum=1, maximum=MAX_RANKS)
                for i, p in enumerate(_items(raw, name))]
    if kind == "window":
        window = [parse_int(p, f"{name}[{i}]", minimum=-1) for i, p in enumerate(_items(raw, name))]
        if len(window) != 2:
            raise _bad(name, raw, "must be two integers (left, right)", "e.g. 128,0")
        return window
    if kind == "strs":
        if isinstance(raw, str) and not raw.strip().startswith("["):
            return parse_value(raw, "str", name)
        return [parse_value(p, "str", f"{name}[{i}]") for i, p in enumerate(_items(raw, name))]
    if kind == "literal":
        if not isinstance(raw, str):
            return raw
        text = raw.strip()
        if text.lower() in _NONE_TEXT:
            return None
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        if _INT_TEXT.fullmatch(text):
            return int(text)
        if text.startswith("["):
            return [parse_value(p, "literal", name) for p in _items(text, name)]
        return text
    raise ValueError(f"parse_value: unknown kind {kind!r}")


def argument_type(kind: str, name: str = "the value", **bounds: Any) -> Any:
    """An argparse ``type`` reading a command-line value with the one strict parser: ``int``
    and ``float`` take ``minimum`` / ``maximum`` (and ``above`` for floats), other kinds are
    :func:`parse_value`'s. A bad value is argparse's one-line error naming the rule and fix."""
    import argparse

    def convert(text: str) -> Any:
        try:
            if kind == "int":
                return parse_int(text, name, **bounds)
            if kind == "float":
                return parse_float(text, name, **bounds)
            return parse_value(text, kind, name)
        except CPConfigError as err:
            v = err.violations[0]
            raise argparse.ArgumentTypeError(f"{v.parameter}={v.value!r} {v.rule}; {v.fix}"
                                             ) from None

    convert.__name__ = kind  # argparse names the type in its message
    return convert
