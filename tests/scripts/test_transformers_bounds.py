"""transformers_bounds.py reads the transformers requirement that the oldest- and newest-release test runs use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))

import transformers_bounds  # noqa: E402

TEXT = 'dependencies = [\n    "torch>=2.11",\n    "transformers >= 5.17, <6",\n    "accelerate",\n]\n'


def test_the_bounds_are_read_from_the_requirement():
    assert transformers_bounds.oldest_transformers(TEXT) == "5.17"
    assert transformers_bounds.transformers_requirement(TEXT) == "transformers>=5.17,<6"


def test_the_projects_own_requirement_has_both_bounds():
    """The newest-release run installs the requirement as pip reads it: a lower bound (the oldest run's) and an
    upper one, so the newest release is one the project accepts."""
    text = transformers_bounds.PYPROJECT.read_text()
    requirement = transformers_bounds.transformers_requirement(text)
    assert requirement.startswith("transformers>=" + transformers_bounds.oldest_transformers(text))
    assert ",<" in requirement


def test_a_pyproject_without_transformers_is_refused():
    with pytest.raises(SystemExit, match="no transformers requirement"):
        transformers_bounds.transformers_requirement('dependencies = ["torch"]')
