"""Fixtures of the fault tests: a private datasets cache, and a tiny run converted once per test module."""

import pytest

from raven_convert.train.recipe import parse_recipe
from raven_convert.train.stages import run_recipe
from tests.convert.faults import recipe_data
from tests.helpers import corpus


@pytest.fixture
def private_datasets_cache(tmp_path, monkeypatch):
    """datasets leaves lock files in its cache: keep them out of ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def converted(tiny_sources, tmp_path_factory) -> dict:
    """{"source", "data", "run"}: a run directory whose convert stage is DONE (copy it before changing it)."""
    root = tmp_path_factory.mktemp("converted")
    data = corpus(root / "corpus")
    run_recipe(parse_recipe(recipe_data(tiny_sources["llama"], data)), root / "run", stages=["convert"])
    return {"source": tiny_sources["llama"], "data": data, "run": root / "run"}
