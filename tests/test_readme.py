"""The README's generated parts have one source: its results table is docs/results/depth/depth.md as
`python -m raven_convert.depth collect` wrote it, and every docs page it links to exists."""

from __future__ import annotations

import re

from tests.helpers import REPO


def test_the_results_table_is_the_generated_one():
    readme = (REPO / "README.md").read_text()
    marker = re.search(r"<!-- depth-table: (\S+) -->\n(.*?)\n<!-- end depth-table -->", readme, re.S)
    assert marker, "the README's depth table markers are missing"
    source, shown = marker.groups()
    generated = (REPO / source).read_text().split("\n", 2)[2].strip("\n")  # the table, without its title
    assert shown == generated, f"the README's table differs from {source}: copy it again from there"


def test_the_pages_the_readme_names_exist():
    readme = (REPO / "README.md").read_text()
    named = set(re.findall(r"\b((?:docs|recipes)/[\w./-]+\.(?:md|yaml))", readme))
    assert named and [n for n in sorted(named) if not (REPO / n).is_file()] == []
