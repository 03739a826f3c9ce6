"""The evaluation settings, one schema: a recipe's evaluate section, raven-eval's flags and EvalRequest agree."""

from pathlib import Path

import pytest
from pydantic import ValidationError

import raven_convert.evaluate.__main__ as cli
from raven_convert.evaluate.settings import EvalRequest, EvaluateSettings
from raven_convert.train import recipe


def test_raven_eval_defaults_are_the_schemas(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "evaluate_model", lambda request, resume: seen.append(request) or {})
    assert cli.main(["some/model", "--out", str(tmp_path / "eval")]) == 0
    assert seen == [EvalRequest(model="some/model", out=tmp_path / "eval")]


def test_a_recipes_evaluate_section_is_the_same_schema():
    assert recipe.EvaluateSettings is EvaluateSettings
    section = recipe.parse_recipe({"source": "m", "layers": [{"mixer": "raven", "layers": "0"}], "evaluate": {}})
    request = EvalRequest(model="m", out=Path("eval"), **section.evaluate.model_dump())
    assert request == EvalRequest(model="m", out=Path("eval"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("depths", [0.5, 2.0]), ("tasks", ["niah"]), ("variants", ["loud"]), ("samples", 0), ("lengths", [0])],
)
def test_bad_values_are_refused_with_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        EvalRequest(model="m", out=Path("eval"), **{field: value})
    with pytest.raises(ValidationError, match="unknown_field"):
        EvaluateSettings(unknown_field=1)
