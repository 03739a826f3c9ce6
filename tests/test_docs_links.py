"""Every relative Markdown link in README.md and the Markdown pages under docs/, recipes/, scripts/ and kernels/
points at a file or folder that exists (web links and links to an anchor of the same page are not checked; a link's
own anchor is cut off)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO

PAGES = sorted(
    [REPO / "README.md", *(p for d in ("docs", "recipes", "scripts", "kernels") for p in (REPO / d).rglob("*.md"))]
)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def relative_links(text: str) -> list[str]:
    """The link targets of a page outside its code blocks and code spans, without web links and bare anchors."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [t for t in LINK.findall(text) if not re.match(r"^(#|[a-z][a-z0-9+.-]*:)", t, re.I)]
    return [t.split("#", 1)[0] for t in targets]


def test_the_checker_finds_links():
    text = '[a](x.md) ![b](img/p.png "title") [c](https://e.org) [d](#here) [e](y.md#part) `[f](no.md)`\n'
    assert relative_links(text + "```\n[g](no.md)\n```\n") == ["x.md", "img/p.png", "y.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert missing == [], f"{page.relative_to(REPO)} links to files that do not exist: {missing}"
