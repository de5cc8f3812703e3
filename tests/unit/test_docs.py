"""The documentation holds together: README.md stays short, every relative link of README.md and
docs/*.md reaches an existing file (and heading, where it names one), every docs page is linked
from the README and opens with what a user does, and docs/architecture.md draws the floors the
architecture test checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_architecture import LAYERS, REFERENCE_LAYERS

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
DOCUMENTS = [README, *PAGES]
MAX_README_LINES = 220

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's anchors of the headings of a markdown text (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``; a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file or heading does not exist."""
    bad = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text(
                encoding="utf-8"))):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def test_readme_fits_on_a_few_screens():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_sees_broken_files_and_headings(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Set-up (`x.y`)\n\n## Set-up (`x.y`)\n")
    page.write_text("# Page\n\n[ok](other.md#set-up-xy) [again](other.md#set-up-xy-1) "
                    "[self](#page) [web](https://example.com) `[code](missing.md)`\n"
                    "[gone](missing.md) [no heading](other.md#nowhere) [bad self](#nowhere)\n"
                    "```\n[fenced](missing.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page)] == [
        "missing.md", "other.md#nowhere", "#nowhere"]


def test_every_docs_page_is_linked_from_the_readme_and_opens_with_what_a_user_does():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []
    for page in PAGES:
        body = page.read_text(encoding="utf-8").split("\n\n")
        assert body[0].startswith("# ") and body[1].startswith("**What you do.**"), page.name


def test_architecture_page_draws_the_reference_layers_the_architecture_test_checks():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Inside `attention/reference/`", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([a-zA-Z ]+?) \| ([^|]+?) \|", section, re.M)[1:]  # past the head
    drawn = [frozenset(re.findall(r"`([\w/]+(?:\.py)?)`", modules)) for _, modules in rows]
    checked = [frozenset("gpu/" if m == "gpu" else m.split(".")[-1] + ".py" for m in names)
               for names in REFERENCE_LAYERS]
    assert drawn == checked


def test_architecture_page_draws_the_floors_the_architecture_test_checks():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d+) ([^|]+?) \| ([^|]+?) \|", text, re.M)
    drawn = sorted((int(n), name, tuple(re.findall(r"`(\w+)`", members)))
                   for n, name, members in rows)
    assert drawn == [(i, name, members) for i, (name, members) in enumerate(LAYERS)]
