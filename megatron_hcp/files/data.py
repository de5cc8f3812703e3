"""Where the data the package ships lives: functional recipes and fork-style diffs.

A wheel carries them as package data (``megatron_hcp/_data/<name>``, copied there by
``setup.py``); a source checkout or an editable install reads them where they are kept in
megatron's layout (``tests/functional/test_cases``, ``patches``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["data_dir"]

_PACKAGED = Path(__file__).resolve().parents[1] / "_data"
_SOURCE_TREE = Path(__file__).resolve().parents[2]
_IN_SOURCE = {"recipes": ("tests", "functional", "test_cases"), "patches": ("patches",)}


def data_dir(name: str) -> Path:
    """The directory of ``name`` (``recipes`` or ``patches``): packaged copy, else source tree."""
    if name not in _IN_SOURCE:
        raise ValueError(f"unknown data {name!r}; known: {sorted(_IN_SOURCE)}")
    packaged = _PACKAGED / name
    if packaged.is_dir():
        return packaged
    source = _SOURCE_TREE.joinpath(*_IN_SOURCE[name])
    if source.is_dir():
        return source
    raise FileNotFoundError(
        f"megatron-hcp's {name} are missing: neither {packaged} (wheel) nor {source} (source "
        "checkout) exists; reinstall the package")
