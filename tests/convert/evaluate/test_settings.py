"""The evaluation settings, one schema: a recipe's evaluate section, raven-eval's flags and EvalRequest agree."""

from pathlib import Path

import pytest
from pydantic import ValidationError

import raven_convert.evaluate.__main__ as cli
from raven_convert.evaluate.settings import EvalRequest, EvaluateSettings
from raven_convert.train import recipe, recipe_schema


def test_raven_eval_defaults_are_the_schemas(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "evaluate_model", lambda request, resume: seen.append(request) or {})
    assert cli.main(["some/model", "--out", str(tmp_path / "eval")]) == 0
    assert seen == [EvalRequest(model="some/model", out=tmp_path / "eval")]


def test_a_recipes_evaluate_section_is_the_same_schema():
    assert recipe_schema.EvaluateSettings is EvaluateSettings
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


def test_named_haystacks_and_the_tasks_on_them():
    settings = EvaluateSettings(
        haystacks={"papers": "p", "code_2": "c"}, tasks=["niah_single_2", "niah_single_2@papers", "niah_word@code_2"]
    )
    assert settings.tasks[1:] == ["niah_single_2@papers", "niah_word@code_2"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tasks": ["niah_singel_2"]}, "unknown task 'niah_singel_2'; did you mean 'niah_single_2'? allowed: passkey,"),
        ({"tasks": ["niah_single_2@papers"]}, "task 'niah_single_2@papers': no haystack named 'papers'; defined: none"),
        (
            {"tasks": ["niah_multikey@paper"], "haystacks": {"papers": "p", "code": "c"}},
            "no haystack named 'paper'; did you mean 'papers'? defined: papers, code",
        ),
        (
            {"tasks": ["passkey@papers"], "haystacks": {"papers": "p"}},
            "task 'passkey@papers': passkey hides its needles in repeated noise, not in a text haystack; @NAME applies "
            "to the essay tasks: niah_single_2,",
        ),
        ({"tasks": ["niah_single_1@papers"], "haystacks": {"papers": "p"}}, "niah_single_1 hides its needles in"),
        ({"haystacks": {"Papers": "p"}}, "haystack name 'Papers' is not a short identifier: a lowercase letter, then"),
        ({"haystacks": {"a" * 25: "p"}}, f"haystack name '{'a' * 25}' is not a short identifier"),
        ({"haystacks": {"essay": "p"}}, "haystack name 'essay' is built in (noise, essay); choose another"),
        ({"haystacks": {"papers": " "}}, "haystack 'papers' names no folder"),
        (
            {"task_lengths": {"niah_multikei": [1024]}, "tasks": ["passkey", "niah_multikey"]},
            "task_lengths names 'niah_multikei', which is not one of tasks ['passkey', 'niah_multikey']; did you mean "
            "'niah_multikey'? task_lengths sets the lengths of a task that runs",
        ),
        ({"task_lengths": {"passkey": [1024, 0]}}, "task_lengths of 'passkey' must be lengths >= 1, got [1024, 0]"),
        ({"task_lengths": {"passkey": []}}, "task_lengths of 'passkey' must be lengths >= 1, got []"),
    ],
)
def test_bad_tasks_and_haystacks_are_refused_naming_the_value(values, message):
    with pytest.raises(ValidationError) as err:
        EvaluateSettings(**values)
    assert message in str(err.value)
    assert [e["loc"] for e in err.value.errors()] == [(next(iter(values)),)]  # one error, on the field at fault


@pytest.mark.parametrize("value", [[1, 0], []])
def test_speed_batches_are_one_or_more_sizes(value):
    assert EvaluateSettings().speed_batches == [1, 8]
    with pytest.raises(ValidationError) as err:
        EvaluateSettings(speed_batches=value)
    assert f"speed_batches must be one or more batch sizes, integers >= 1; got {value}" in str(err.value)
    assert [e["loc"] for e in err.value.errors()] == [("speed_batches",)]


def test_task_lengths_replace_the_lengths_of_their_task_only():
    settings = EvaluateSettings(
        tasks=["passkey", "niah_multikey"], lengths=[1024, 16384], task_lengths={"niah_multikey": [1024, 8192]}
    )
    assert settings.lengths_of("passkey") == [1024, 16384] and settings.lengths_of("niah_multikey") == [1024, 8192]


def test_raven_eval_task_lengths_flag(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "evaluate_model", lambda request, resume: seen.append(request) or {})
    args = ["m", "--out", str(tmp_path / "eval"), "--tasks", "passkey,niah_word", "--task-lengths", "niah_word=1k,2k"]
    assert cli.main(args) == 0
    assert seen[0].task_lengths == {"niah_word": [1024, 2048]}
    with pytest.raises(SystemExit):
        cli.main([*args[:5], "--task-lengths", "niah_word"])
    assert "'niah_word' is not TASK=LENGTHS (e.g. niah_multikey=1k,2k,4k,8k)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*args[:5], "--task-lengths", "niah_wrd=1k"])
    assert "argument --task-lengths: task_lengths names 'niah_wrd'" in capsys.readouterr().err
