"""The one reader of the JSON and YAML files the project reads, with bounds checked first.

Every file (recipes, golden values, checkpoint manifests, schedule and planner inputs, patch
journals) is read by :func:`read_json` / :func:`read_yaml` (or :func:`read_text`), which refuse,
before any parsing that could recurse or allocate without bound:

* anything but a regular file (a directory, a FIFO, a device such as ``/dev/zero``, a symlink
  loop), by its type, without blocking on it;
* more than ``max_bytes`` bytes (default :data:`MAX_FILE_BYTES`);
* nesting deeper than :data:`MAX_DEPTH` (measured on the text: a 100000-deep list is refused,
  not a ``RecursionError``);
* integers outside +-(2**63 - 1) and (by default) non-finite numbers (``NaN``, ``Infinity``,
  ``1e400``): they overflow or compare wrongly later; a key repeated in one JSON object or
  YAML mapping (the last would win silently);
* YAML tags of Python objects (``yaml.safe_load``), more than :data:`MAX_YAML_ALIASES`
  aliases, and documents whose aliases expand to more than :data:`MAX_YAML_NODES` nodes (an
  alias counts the whole node it names: a "billion laughs" document is refused from its event
  stream, before anything is built).

Each refusal is an :class:`InputFileError` naming the input, the file, the rule (with its
limit) and the fix, in one line.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_INT", "MAX_YAML_ALIASES", "MAX_YAML_BYTES",
           "MAX_YAML_NODES",
           "InputFileError",
           "check_depth", "loads_json", "loads_yaml", "read_json", "read_text", "read_yaml"]

MAX_FILE_BYTES = 16 << 20
"""Largest file read (16 MiB): a million sequence lengths fit; anything larger is a mistake."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings (the project's files nest at most 4 deep)."""
MAX_INT = (1 << 63) - 1
"""Largest integer magnitude in a file (int64): larger ones overflow floats and tensors."""
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 100_000
"""Most nodes of a YAML document with its aliases expanded (recipes have about a hundred)."""
MAX_YAML_BYTES = 1 << 20
"""Largest YAML file read (1 MiB; YAML parses slowly, and recipes are a few hundred bytes)."""


class InputFileError(ValueError):
    """A file that breaks a bound or is not the format it should be (one line)."""

    def __init__(self, name: str, path: str | os.PathLike, rule: str, fix: str):
        self.name, self.path, self.rule, self.fix = name, str(path), rule, fix
        shown = repr(str(path))
        shown = shown if len(shown) <= 120 else f"{shown[:100]}... ({len(shown)} characters)"
        super().__init__(f"{name} {shown}: {rule}; {fix}")


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def read_text(path: str | os.PathLike, name: str = "file", *,
              max_bytes: int = MAX_FILE_BYTES) -> str:
    """UTF-8 text of the regular file ``path``, refusing more than ``max_bytes`` bytes before
    reading them and anything else (a FIFO, a directory, a device) by its type: opened without
    blocking, so a FIFO nobody writes never hangs the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise InputFileError(name, path, f"cannot be read ({err.strerror or err})",
                             "give a readable file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((k for test, k in _KINDS if test(info.st_mode)), "not a regular file")
            raise InputFileError(name, path, f"is {kind}, not a regular file",
                                 "give the path of a file")
        if info.st_size > max_bytes:
            raise _too_big(name, path, max_bytes)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as err:
        raise InputFileError(name, path, f"cannot be read ({err.strerror or err})",
                             "give a readable file") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise _too_big(name, path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputFileError(name, path, f"is not UTF-8 text ({err.reason} at byte "
                             f"{err.start})", "give a text file") from None


def _too_big(name: str, path: str | os.PathLike, max_bytes: int) -> InputFileError:
    return InputFileError(name, path, f"is larger than the limit of {max_bytes} bytes",
                          "give a smaller file (is it the right one?)")


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def check_depth(text: str, name: str, path: str | os.PathLike, *,
                max_depth: int = MAX_DEPTH) -> None:
    """Refuse JSON (or YAML flow) text nested deeper than ``max_depth``, without recursion."""
    # brackets counted everywhere bound the depth from above; only when that bound is over
    # the limit are the strings (which may hold brackets) taken out and the count repeated
    if _max_depth(text) > max_depth and _max_depth(_JSON_STRING.sub('""', text)) > max_depth:
        raise InputFileError(name, path, f"nests lists or objects deeper than the limit of "
                             f"{max_depth} levels", "give a flat file")


def _max_depth(text: str) -> int:
    import numpy as np

    codes = np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8)
    step = (np.isin(codes, (ord("["), ord("{"))).astype(np.int8)
            - np.isin(codes, (ord("]"), ord("}"))).astype(np.int8))
    return int(np.cumsum(step, dtype=np.int64).max()) if step.size else 0


def _int(text: str) -> int:
    value = int(text)
    if abs(value) > MAX_INT:
        raise ValueError(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is "
                         f"outside the limit of +-{MAX_INT} (int64)")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:24]} is not a finite number")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a finite number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique (a repeated key would silently keep the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            shown = key if len(key) <= 40 else key[:37] + "..."
            raise ValueError(f"the key {shown!r} appears twice in one object")
        out[key] = value
    return out


def loads_json(text: str, name: str, path: str | os.PathLike = "<text>", *,
               finite: bool = True, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON ``text`` within the bounds (``finite=False`` lets NaN/Infinity through);
    an object with a repeated key is refused."""
    check_depth(text, name, path, max_depth=max_depth)
    hooks: dict[str, Any] = {"parse_int": _int, "object_pairs_hook": _unique_keys}
    if finite:
        hooks.update(parse_float=_float, parse_constant=_no_constant)
    try:
        return json.loads(text, **hooks)
    except (ValueError, RecursionError) as err:
        raise InputFileError(name, path, f"is not valid JSON within the limits "
                             f"({' '.join(str(err).split())})", "fix or regenerate the file"
                             ) from None


def read_json(path: str | os.PathLike, name: str = "JSON file", *,
              max_bytes: int = MAX_FILE_BYTES, finite: bool = True) -> Any:
    """The JSON value in ``path`` (bounds: module docstring)."""
    return loads_json(read_text(path, name, max_bytes=max_bytes), name, path, finite=finite)


def _yaml_shape(text: str, name: str, path: str | os.PathLike, max_depth: int) -> None:
    """Depth and aliases from the event stream (PyYAML's parser does not recurse; its
    composer does, so the shape is checked before composing)."""
    import yaml

    aliases = 0
    # nodes of each open collection with aliases expanded, and of each anchor
    open_sizes: list[tuple[int, str | None]] = []
    anchored: dict[str, int] = {}
    total = 0
    # per open collection: the keys of a mapping so far and whether its next node is a key
    # (None for a sequence)
    keys: list[tuple[dict[str, int], list[bool]] | None] = []

    def node(event: Any) -> None:
        """A node starts: in a mapping where a key is due, a plain key seen before is refused
        (``yaml.safe_load`` would keep the last value silently)."""
        frame = keys[-1] if keys else None
        if frame is None or not frame[1][0] or not isinstance(event, yaml.ScalarEvent):
            return
        if event.value == "<<" and event.tag is None:
            return  # a merge key: its values are defaults, overridden on purpose
        line = event.start_mark.line + 1
        if event.value in frame[0]:
            shown = event.value if len(event.value) <= 40 else event.value[:37] + "..."
            raise InputFileError(name, path, f"has the key {shown!r} twice in one mapping "
                                 f"(lines {frame[0][event.value]} and {line}; the last would "
                                 "silently win)", "keep one of them")
        frame[0][event.value] = line

    def done() -> None:
        """A node ended: in a mapping, a key is followed by its value and a value by a key."""
        frame = keys[-1] if keys else None
        if frame is not None:
            frame[1][0] = not frame[1][0]

    def add(size: int) -> None:
        nonlocal total
        if open_sizes:
            count, anchor = open_sizes[-1]
            open_sizes[-1] = (count + size, anchor)
        else:
            total += size
        if total + sum(c for c, _ in open_sizes) > MAX_YAML_NODES:
            raise InputFileError(name, path, f"expands to more than {MAX_YAML_NODES} nodes "
                                 "(its aliases repeat whole subtrees)", "write the values out")

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            node(event)
            open_sizes.append((1, event.anchor))
            keys.append(({}, [True]) if isinstance(event, yaml.MappingStartEvent) else None)
            if len(open_sizes) > max_depth:
                raise InputFileError(name, path, f"nests lists or mappings deeper than the "
                                     f"limit of {max_depth} levels", "give a flat file")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            size, anchor = open_sizes.pop()
            keys.pop()
            done()
            if anchor is not None:
                anchored[anchor] = size
            add(size)
        elif isinstance(event, yaml.ScalarEvent):
            node(event)
            done()
            if event.anchor is not None:
                anchored[event.anchor] = 1
            add(1)
        elif isinstance(event, yaml.AliasEvent):
            node(event)
            done()
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise InputFileError(name, path, f"has more than {MAX_YAML_ALIASES} YAML "
                                     "aliases", "write the values out")
            add(anchored.get(event.anchor, 1))


def _check_numbers(value: Any, name: str, path: str | os.PathLike, finite: bool) -> None:
    """Integers within int64 and (``finite``) finite floats, anywhere in ``value``."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            stack.extend(item if not isinstance(item, dict) else
                         [*item.keys(), *item.values()])
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_INT:
            raise InputFileError(name, path, f"holds an integer outside the limit of "
                                 f"+-{MAX_INT} (int64)", "use a smaller number")
        elif isinstance(item, float) and finite and not math.isfinite(item):
            raise InputFileError(name, path, f"holds {item}, not a finite number",
                                 "use a finite number")


def loads_yaml(text: str, name: str, path: str | os.PathLike = "<text>", *,
               finite: bool = True, max_depth: int = MAX_DEPTH) -> Any:
    """Parse YAML ``text`` with ``yaml.safe_load`` within the bounds."""
    import yaml

    try:
        _yaml_shape(text, name, path, max_depth)
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InputFileError(name, path, f"is not plain YAML ({' '.join(str(err).split())})",
                             "write plain YAML (no Python tags)") from None
    except RecursionError:
        raise InputFileError(name, path, f"nests deeper than the limit of {max_depth} levels",
                             "give a flat file") from None
    _check_numbers(value, name, path, finite)
    return value


def read_yaml(path: str | os.PathLike, name: str = "YAML file", *,
              max_bytes: int = MAX_YAML_BYTES, finite: bool = True) -> Any:
    """The YAML value in ``path`` (``yaml.safe_load``; bounds: module docstring)."""
    return loads_yaml(read_text(path, name, max_bytes=max_bytes), name, Path(path),
                      finite=finite)
