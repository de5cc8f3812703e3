"""A Megatron-Bridge configuration as megatron-hcp's :class:`~megatron_hcp.config.CPConfig`.

:func:`cp_config_from_bridge` reads the CP-relevant fields of Bridge's model config (a
``GPTModelProvider`` or any megatron ``TransformerConfig``) with the strict parser: a field that
is not what megatron means by it (``context_parallel_size=0``, ``4.9``, ``"2"``, ``True`` as a
size) is a :class:`~megatron_hcp.config.CPConfigError` naming ``model.<field>``, never a
coerced value. Dynamic CP is read under both its names: megatron-core 0.19's
``hybrid_context_parallel`` and the development branch's ``dynamic_context_parallel`` /
``min_dynamic_context_parallel_size`` (an attribute set on the provider where megatron-core has
no such field). The Megatron-Bridge hook (``_create_pg_collection``, ``load_megatron_model``) and
Bridge's training loop (``bridge-cp-setup``) read configs with it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..config import FIELD_KINDS, CPConfig, CPConfigError, Violation, fields_read_by, parse_value

__all__ = ["MODEL_FIELDS", "cp_config_from_bridge", "read_window", "window_override",
           "world_size_before_init"]

# CPConfig fields a Bridge model config may carry, by the same name (the one field table,
# config.values.FIELDS)
MODEL_FIELDS = fields_read_by("bridge")


def world_size_before_init() -> int:
    """The world size, also before ``torch.distributed`` is initialized (torchrun's
    ``WORLD_SIZE``), as Bridge reads it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return parse_value(os.environ.get("WORLD_SIZE", "1"), "size", "WORLD_SIZE")


def _te_version() -> str | None:
    from ..attention.te import have_te, installed_te_version

    return installed_te_version() if have_te() else None


# kinds whose values may be text in a Python config (every other value must be the Python type
# megatron means: "2" is not a size, 4.9 is not 4, True is not 1)
_TEXT_KINDS = frozenset({"str", "strs", "version"})


def _read_field(name: str, raw: Any) -> Any:
    kind = FIELD_KINDS[name]
    base = kind.lstrip("?")
    if base == "window":
        return read_window(raw, f"model.{name}")
    want = {"sizes": "a list of integers", "bool": "a boolean"}.get(base, "an integer")
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    if base not in _TEXT_KINDS and any(isinstance(x, (str, bytes)) for x in items):
        raise CPConfigError([Violation(
            f"model.{name}", raw, f"must be {want}, not text (a Python config holds the value "
            "itself)", f"set model.{name} to {want}")])
    if base == "sizes" and not isinstance(raw, (list, tuple)):
        raise CPConfigError([Violation(f"model.{name}", raw, f"must be {want}",
                                       f"set e.g. model.{name}=[2, 2]")])
    return parse_value(raw, kind, f"model.{name}")


_WINDOW_FORMS = ("an integer token count W >= 1 (Bridge's form, e.g. Gemma 3's window_size=512: "
                 "megatron's (W-1, 0)), a pair of integers (left, right) >= -1 (megatron's "
                 "form; -1 = unbounded) or None")


def window_override(raw: str) -> str:
    """A Bridge override's ``model.window_size`` text in megatron's form: a plain integer ``W``
    (Bridge's scalar window, as a provider holds it: :func:`read_window`) becomes
    ``[W-1,0]``; anything else is left to the strict reader (``[16]`` stays refused)."""
    text = raw.strip()
    if text.isascii() and text.lstrip("+-").isdecimal():  # not "¹": digits int() reads
        left, right = read_window(int(text))  # type: ignore[misc]
        return f"[{left},{right}]"
    return raw


def read_window(raw: Any, name: str = "model.window_size") -> list[int] | None:
    """megatron's ``(left, right)`` of a model config's ``window_size``, in every form megatron
    and Bridge give it: ``None`` (no window), a tuple or list of two integers >= -1 (megatron's
    ``TransformerConfig.window_size``; -1 = unbounded), or one integer ``W >= 1``: a causal
    window of ``W`` tokens, the current one included - Bridge's scalar form (Gemma 3's provider,
    ``window_size=512``, which its attention turns into ``(W-1, 0)`` on its sliding-window
    layers; Bridge's ``mcore_to_hf_window_size`` is the inverse) - read as ``[W-1, 0]``.
    Anything else (text, a bool, a float, ``W <= 0``, a pair of other length) is a
    :class:`CPConfigError` naming ``name``."""
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1:
            raise CPConfigError([Violation(
                name, raw, f"an integer window is a token count and must be >= 1 (forms: "
                f"{_WINDOW_FORMS})", f"set {name}=None for no window, or e.g. {name}=512")])
        return [raw - 1, 0]
    pair = isinstance(raw, Sequence) and not isinstance(raw, (str, bytes))  # a list, tuple, ...
    items = list(raw) if pair else [raw]
    if pair and len(items) == 2 and not any(isinstance(x, (str, bytes)) for x in items):
        return parse_value(items, "window", name)
    if any(isinstance(x, (str, bytes)) for x in items):
        what = "text"
    elif pair:
        what = f"{len(raw)} values"
    else:
        what = f"a {type(raw).__name__}"
    raise CPConfigError([Violation(
        name, raw, f"must be {_WINDOW_FORMS}, not {what}",
        f"set e.g. {name}=[127, 0] or {name}=128 (a Python config holds the value itself)")])


def cp_config_from_bridge(model_config: Any, world_size: int | None = None, *,
                          use_megatron_fsdp: bool = False,
                          te_version: str | None = ...) -> CPConfig:
    """The :class:`CPConfig` of Bridge's ``model_config`` on ``world_size`` ranks (default: one
    data-parallel replica, ``tp*cp*pp``), every field read strictly: the Python value megatron
    means (an integer size >= 1, never a float, a string or a bool; a list of them), ``None``
    being megatron's default. Raises :class:`CPConfigError` naming every bad field.

    ``te_version`` defaults to the installed Transformer Engine's where it imports (TE is then
    the attention backend, as megatron's default spec); ``use_megatron_fsdp`` is Bridge's
    ``dist.use_megatron_fsdp``.
    """
    values: dict[str, Any] = {}
    problems: list[Violation] = []
    for name in MODEL_FIELDS:
        raw = getattr(model_config, name, None)
        if raw is None:
            continue  # absent or megatron's default
        try:
            values[name] = _read_field(name, raw)
        except CPConfigError as err:
            problems.extend(err.violations)
    tp = values.get("tensor_model_parallel_size", 1)
    pp = values.get("pipeline_model_parallel_size", 1)
    cp = values.get("context_parallel_size", 1)
    try:
        world = (tp * cp * pp if world_size is None
                 else parse_value(world_size, "size", "world_size"))
        use_fsdp = parse_value(use_megatron_fsdp, "bool", "dist.use_megatron_fsdp")
    except CPConfigError as err:
        problems.extend(err.violations)
        world, use_fsdp = tp * cp * pp, False
    if not problems and world % (tp * cp * pp):
        problems.append(Violation(
            "model.context_parallel_size", cp,
            f"tensor*context*pipeline_model_parallel_size = {tp}*{cp}*{pp} = {tp * cp * pp} "
            f"must divide the world size {world}",
            "change the parallel sizes or the number of ranks"))
    if problems:
        raise CPConfigError(problems)
    return CPConfig(data_parallel_size=world // (tp * cp * pp), use_megatron_fsdp=use_fsdp,
                    te_version=_te_version() if te_version is ... else te_version, **values)
