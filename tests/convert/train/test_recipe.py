"""Recipes: every shipped recipe validates, bad ones fail naming the field, the pipeline runs end to end and resumes."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from raven_convert.layer_spec import parse_layer_spec
from raven_convert.train.__main__ import build_parser, main, resume_command
from raven_convert.train.recipe import INPUT_FLAGS, STAGES, FinetuneRecipe, input_overrides, load_recipe, parse_recipe
from raven_convert.train.stages import run_recipe
from tests.helpers import WORDS, corpus

SHIPPED = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))
FINETUNE_RECIPES = [p for p in SHIPPED if "layers" not in yaml.safe_load(p.read_text())]  # FinetuneRecipe
RECIPES = [p for p in SHIPPED if p not in FINETUNE_RECIPES]
MINIMAL = {"source": "Qwen/Qwen3-0.6B", "layers": [{"mixer": "raven", "layers": "0-23:5"}], "data": {"source": "x"}}


def test_the_shipped_recipes_are_there():
    names = {p.name for p in RECIPES}
    for mixer in ("raven", "sse", "sila"):
        assert {f"smollm2-{mixer}.yaml", f"qwen3-0.6b-{mixer}.yaml"} <= names


@pytest.mark.parametrize(
    "mixer, settings",
    [
        ("raven", {"num_slots": 64, "top_k": 8, "router_init": "centred"}),
        ("sse", {"num_partitions": 4, "top_k": 1, "lora_rank": 64, "balance_coef": 0.01}),
    ],
)
def test_the_smollm2_raven_and_sse_recipes_train_as_the_sila_one(mixer, settings):
    """smollm2-raven.yaml and smollm2-sse.yaml are smollm2-sila.yaml with the mixer's layers (15, as its layer choice
    picks them) and settings: the same data, token weights, stages and evaluation (their headers say so, with the
    measurement)."""
    recipe, sila = (load_recipe(RECIPES[0].parent / f"smollm2-{name}.yaml") for name in (mixer, "sila"))
    own = {"layers", "layer_choice", "mixer_settings"}
    assert recipe.model_dump(exclude=own) == sila.model_dump(exclude=own)
    (assignment,) = recipe.layers
    assert assignment.mixer == mixer and len(parse_layer_spec(assignment.layers, 30)) == 15
    assert recipe.layer_choice.ablation == "mixer"  # what picked them, for auto:N on another model
    assert recipe.token_weights.enabled and recipe.mixer_settings[mixer] == settings


@pytest.mark.parametrize(
    "depth, windowed, extend",
    [(22, {1, 16}, {}), (26, {17, 20}, {"steps": 600, "answer_weight": 30})],
)
def test_the_windows_recipes_are_the_deep_ones_with_two_windows_and_sinks(depth, windowed, extend):
    """smollm2-sila-deepN-windows.yaml trains as smollm2-sila-deepN.yaml (its header says so, with the measurement),
    with 4K windows and 4 sinks on two of its kept layers, and at 26 a longer extend with weighted answers."""
    windows, deep = (load_recipe(RECIPES[0].parent / f"smollm2-sila-deep{depth}{n}.yaml") for n in ("-windows", ""))
    own = {"sliding_window", "window_layers", "attention_sinks"}
    expected = deep.model_dump(exclude=own)
    expected["extend"] |= extend
    assert windows.model_dump(exclude=own) == expected
    layers = ",".join(map(str, sorted(windowed)))
    assert (windows.sliding_window, windows.window_layers, windows.attention_sinks) == (4096, layers, 4)
    converted = set(parse_layer_spec(windows.layers[0].layers, 30))
    assert len(converted) == depth and windowed < set(range(30)) - converted  # two of the kept layers


def header_commands(path: Path) -> list[list[str]]:
    """The commands in a recipe's first comment lines (each continued with backslashes), as words."""
    commands, text = [], ""
    for line in path.read_text().splitlines():
        if not text and not line.startswith("# python "):
            return commands
        text += line.removeprefix("#").strip().removesuffix("\\") + " "
        if not line.endswith("\\"):
            commands.append(shlex.split(text))
            text = ""
    return commands


def header_command(path: Path) -> list[str]:
    """The header's command that runs the recipe (a further conversion's header runs the one it starts from first)."""
    return next(words for words in header_commands(path) if f"recipes/{path.name}" in words)


def runnable_header(path) -> list[str]:
    """The recipe's header command, which runs it from the repository root into runs/<its name>."""
    words = header_command(path)
    run = [f"recipes/{path.name}", "--run-dir", f"runs/{path.stem}"]
    assert words[:6] == ["python", "-m", "raven_convert.train", *run]
    return words


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipe_loads_and_its_header_command_sets_every_input(path):
    words = runnable_header(path)
    bare = load_recipe(path)
    assert bare.layers and bare.data.seq_len >= 2
    assert bare.data.source is None and bare.evaluate.haystack_dir is None and bare.evaluate.ppl_data is None
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", bare.source), "the teacher is named by its Hub id"
    assert "../shared" not in "".join(line.split("#")[0] for line in path.read_text().splitlines())
    args = build_parser().parse_args(words[3:])
    recipe = load_recipe(path, input_overrides(args))
    assert recipe.data.source.endswith("shared/data/corpus")
    assert recipe.evaluate.haystack_dir.endswith("shared/data/pg_essays")
    if path.stem.startswith("smollm2"):
        assert recipe.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and recipe.evaluate.ppl_data


@pytest.mark.parametrize("path", FINETUNE_RECIPES, ids=[p.stem for p in FINETUNE_RECIPES])
def test_shipped_finetune_recipe_loads_and_its_header_command_sets_every_input(path):
    words = runnable_header(path)
    bare = load_recipe(path)
    assert isinstance(bare, FinetuneRecipe) and bare.data.source is None and bare.token_weights.enabled
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", bare.source), "the model is named by its Hub id"
    args = build_parser().parse_args(words[3:])
    recipe = load_recipe(path, input_overrides(args))
    assert recipe.data.source.endswith("shared/data/corpus")
    assert recipe.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def tokens(n: int) -> str:
    """A length as the recipes' table writes it: 512, 1K, 16K."""
    return f"{n // 1024}K" if n >= 1024 else str(n)


def test_recipes_readme_matches_the_recipes():
    readme = (RECIPES[0].parent / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2:-1] for line in readme.splitlines() if ".yaml` |" in line}
    assert sorted(rows) == [p.name for p in SHIPPED]
    for path in FINETUNE_RECIPES:
        recipe, cells = load_recipe(path), [c.strip() for c in rows[path.name]]
        source, reference, dtype, weights, train = cells
        assert source == recipe.source and reference == (recipe.reference or "the model itself"), path.name
        assert dtype == recipe.dtype and weights == ("yes" if recipe.token_weights.enabled else "no"), path.name
        assert train == f"{recipe.train.steps} ({recipe.train.trainable})", path.name
    for path in RECIPES:
        recipe, cells = load_recipe(path), [c.strip() for c in rows[path.name]]
        source, mixer, dtype, align, weights, retrieval, train, extend, evaluate = cells
        mix = recipe.data.retrieval
        assert retrieval == ("no" if mix is None else f"{round(100 * mix.ratio)}%"), path.name
        assert source == recipe.source and align == str(recipe.align.steps), path.name
        assert {a.mixer for a in recipe.layers} == {mixer.split()[0]} and dtype == recipe.dtype, path.name
        if len(recipe.layers) == 1:
            assert f"`{recipe.layers[0].layers}`" in mixer, path.name
        assert weights == ("yes" if recipe.token_weights.enabled else "no"), path.name
        assert train == f"{recipe.train.steps} ({recipe.train.trainable})", path.name
        e = recipe.extend
        weighted = "" if e is None or e.answer_weight == 1 else f", answers x{e.answer_weight:g}"
        assert extend == ("no" if e is None else f"{e.steps} steps at {e.seq_len // 1024}K{weighted}"), path.name
        if evaluate.startswith("as "):  # the same evaluation as another recipe's
            assert load_recipe(path.parent / f"{evaluate[3:]}.yaml").evaluate == recipe.evaluate, path.name
            continue
        lengths = f"{tokens(min(recipe.evaluate.lengths))}-{tokens(max(recipe.evaluate.lengths))}"
        assert evaluate.startswith(", ".join(recipe.evaluate.tasks)) and lengths in evaluate, path.name
        for task_lengths in recipe.evaluate.task_lengths.values():  # tasks at their own lengths say so
            assert f"{tokens(min(task_lengths))}-{tokens(max(task_lengths))})" in evaluate, path.name
        assert ("prompts" in evaluate) == (len(recipe.evaluate.variants) > 1), path.name
    for field, (flag, metavar, _) in INPUT_FLAGS.items():
        assert f"| `{flag} {metavar}` | `{field}` |" in readme


def test_the_recipes_readme_commands_run_the_recipes():
    readme = (RECIPES[0].parent / "README.md").read_text()
    block = readme.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines()]
    assert commands[0] == header_command(RECIPES[0].parent / "smollm2-raven.yaml")
    for words in commands:
        assert words[:3] == ["python", "-m", "raven_convert.train"]
        args = build_parser().parse_args(words[3:])
        load_recipe(RECIPES[0].parents[1] / args.recipe, input_overrides(args) + args.overrides)  # from the root


@pytest.mark.parametrize(
    "change, field, hint",
    [
        ({"bogus": 1}, "bogus", "not a field of the recipe; allowed: source, layers"),
        ({"align": {"steps": -1}}, "align.steps", "greater than or equal to 0"),
        ({"train": {"steps": -5}}, "train.steps", "greater than or equal to 0"),
        ({"train": {"lr_typo": 1}}, "train.lr_typo", "not a field of train; allowed: steps, batch_size"),
        ({"align": {"learning_rate": 1}}, "align.learning_rate", "did you mean 'lr'?"),
        ({"layers": [{"mixer": "mamba", "layers": "0"}]}, "layers.0.mixer", "unknown mixer 'mamba'; allowed: raven"),
        ({"layers": [{"mixer": "raven", "layers": "0-x"}]}, "layers.0.layers", "accepted forms"),
        ({"mixer_settings": {"mamba": {}}}, "mixer_settings", "unknown mixer 'mamba'"),
        ({"layers": [{"mixer": "rave", "layers": "0"}]}, "layers.0.mixer", "did you mean 'raven'?"),
        ({"mixer_settings": {"raven": {"slots": 3}}}, "mixer_settings", "allowed"),
        ({"token_weights": {"reference": "student"}}, "token_weights.reference", "'teacher'"),
        ({"data": {"source": "x", "validation_fraction": 1.5}}, "data.validation_fraction", "less than 1"),
    ],
)
def test_malformed_recipe_names_the_field(change, field, hint):
    with pytest.raises(ValueError) as info:
        parse_recipe({**MINIMAL, **change})
    lines = str(info.value).splitlines()
    assert any(line.startswith(f"{field}: ") and hint in line for line in lines[1:]), str(info.value)


def test_load_recipe_rejects_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "align": {"steps": -1, "batch_size": 0}}))
    with pytest.raises(ValueError, match=r"(?m)^align\.steps: .*\n^align\.batch_size: "):
        load_recipe(path)
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == 2


def haystack(folder: Path) -> Path:
    folder.mkdir()
    text = "\n\n".join(f"Paragraph {i}. " + " ".join(WORDS) + "." for i in range(40))
    (folder / "essay.txt").write_text(text)
    return folder


def test_pipeline_end_to_end_resumes_and_reruns_one_stage(tiny_sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the working directory
    corpus(tmp_path / "corpus")
    haystack(tmp_path / "essays")
    recipe = parse_recipe(
        {
            "source": str(tiny_sources["llama"]),
            "layers": [{"mixer": "raven", "layers": "1"}, {"mixer": "sila", "layers": "2"}],
            "mixer_settings": {"raven": {"num_slots": 8, "top_k": 2}},
            "dtype": "float32",
            "data": {"source": "corpus", "seq_len": 32, "validation_fraction": 0.1},
            "align": {"steps": 3, "batch_size": 2, "log_every": 1},
            "token_weights": {"enabled": True, "batch_size": 4, "query_block": 16},
            "train": {"steps": 3, "batch_size": 2, "trainable": "mixers+lora", "lora_rank": 2, "log_every": 1},
            "extend": {"seq_len": 48, "steps": 2, "batch_size": 2, "log_every": 1},
            "evaluate": {
                "tasks": ["passkey"],
                "lengths": [400],
                "depths": [0.5],
                "samples": 1,
                "batch_size": 1,
                "haystack_dir": "essays",
                "pictures": False,
            },
            "export": {"dir": "exported"},
        }
    )
    run = tmp_path / "run"
    results = run_recipe(recipe, run)
    assert list(results) == list(STAGES)
    for stage in STAGES:
        assert json.loads((run / stage / "DONE").read_text()) == results[stage]
    assert set(results["align"]["final_layer_losses"]) == {"1", "2"}
    assert (run / results["weights"]["picture"]).stat().st_size > 1000
    rows = results["weights"]["shape"]
    assert rows[1] == 32 and rows[0] >= 2
    assert results["train"]["steps_this_run"] == 3 and results["train"]["model"] == "train/model"
    assert results["train"]["val_ce"] > 0 and results["align"]["validation_after"] > 0
    assert results["extend"]["seq_len"] == 48 and results["extend"]["model"] == "extend/model"
    assert (run / "evaluate" / "report.json").is_file()
    exported = tmp_path / "exported"
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    assert list(model.config.layer_mixers) == ["attention", "raven", "sila", "attention"]
    assert not any("lora" in name for name, _ in model.named_parameters())

    # a rerun finds every DONE and does nothing
    stamps = {s: (run / s / "DONE").stat().st_mtime_ns for s in STAGES}
    assert run_recipe(recipe, run) == results
    assert {s: (run / s / "DONE").stat().st_mtime_ns for s in STAGES} == stamps

    # one stage again: only train reruns (from the start: a finished stage keeps no checkpoint), the others stay
    (run / "train" / "DONE").unlink()
    again = run_recipe(recipe, run, stages=["train"])
    assert list(again) == ["train"] and again["train"]["model"] == "train/model"
    assert (run / "train" / "DONE").is_file()
    for stage in STAGES:
        if stage != "train":
            assert (run / stage / "DONE").stat().st_mtime_ns == stamps[stage]
    AutoModelForCausalLM.from_pretrained(run / "train" / "model", trust_remote_code=True)

    # a changed recipe never reuses stale stages: the run stops naming the field, and --redo reruns from there
    changed = recipe.model_copy(deep=True)
    changed.train.lr = 1e-2
    with pytest.raises(ValueError, match=r"stage 'train' .*different recipe \(changed: train.lr\).*--redo train"):
        run_recipe(changed, run)
    with pytest.raises(ValueError, match=r"stage 'evaluate' .*\(changed: train.lr\).*--redo train"):
        run_recipe(changed, run, stages=["evaluate"])  # a later stage points back at the one whose settings moved
    redone = run_recipe(changed, run, redo="train")
    for stage in ("convert", "align", "weights"):
        assert (run / stage / "DONE").stat().st_mtime_ns == stamps[stage]
    assert redone["train"]["inputs"]["train"]["lr"] == 1e-2 and redone["train"]["steps_this_run"] == 3


def test_a_stage_without_its_inputs_fails_clearly(tmp_path):
    recipe = parse_recipe(MINIMAL)
    with pytest.raises(ValueError, match=r"stage 'align' needs the outputs of stage 'convert'.*--stages convert"):
        run_recipe(recipe, tmp_path / "run", stages=["align"])
    with pytest.raises(ValueError, match="unknown stage"):
        run_recipe(recipe, tmp_path / "run", stages=["distill"])


def test_a_multi_process_launch_refuses_redo(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--redo train deletes stages: run it in one process"):
        run_recipe(parse_recipe(MINIMAL), tmp_path / "run", redo="train")


@pytest.mark.parametrize("stage, strategy, refused", [("align", "ddp", False), ("align", "fsdp", True),
                                                       ("train", "ddp", False), ("extend", "ddp", False),
                                                       ("train", "fsdp", True)])  # fmt: skip
def test_graphs_demanded_on_several_processes_are_refused_but_under_ddp(stage, strategy, refused, monkeypatch):
    """Before any stage: `cuda_graphs: true` on several processes holds only under ddp, whose steps make their
    all-reduces themselves (graphs.holds_collectives); under fsdp it names the processes."""
    from raven_convert.train import distributed
    from raven_convert.train.recipe import check_inputs

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "on_cpu", lambda: False)  # as on a GPU host
    section = {"cuda_graphs": True} | ({"steps": 2, "seq_len": 64} if stage == "extend" else {})
    recipe = parse_recipe(MINIMAL | {"layers": [{"mixer": "sila", "layers": "1"}], stage: section,
                                     "distributed": {"strategy": strategy}})  # fmt: skip
    if refused:
        with pytest.raises(ValueError, match=rf"{stage}.cuda_graphs = true cannot be honoured: the run has 2 proc"):
            check_inputs(recipe, [stage])
    else:
        check_inputs(recipe, [stage])


def test_the_distributed_section_is_checked_and_changes_no_fingerprint():
    from raven_convert.train.run_state import fingerprints

    with pytest.raises(ValueError, match=r"distributed.strategy: Input should be 'ddp' or 'fsdp' \(got 'zero3'\)"):
        parse_recipe(MINIMAL | {"distributed": {"strategy": "zero3"}})
    allowed = "allowed: strategy, reshard_after_forward, cpu_offload"
    with pytest.raises(ValueError, match=rf"distributed.shards: not a field of distributed; {allowed}"):
        parse_recipe(MINIMAL | {"distributed": {"shards": 2}})
    fsdp = parse_recipe(MINIMAL | {"distributed": {"strategy": "fsdp", "cpu_offload": True}})
    assert fingerprints(fsdp) == fingerprints(parse_recipe(MINIMAL))  # same global batch, same results


def test_attention_sinks_are_checked_and_fingerprinted_only_where_set():
    from raven_convert.train.run_state import fingerprints, stage_inputs

    with pytest.raises(ValueError, match="attention_sinks: Input should be greater than or equal to 0"):
        parse_recipe(MINIMAL | {"attention_sinks": -1})
    window = parse_recipe(MINIMAL | {"sliding_window": 512})
    sinks = parse_recipe(MINIMAL | {"sliding_window": 512, "attention_sinks": 4})
    assert stage_inputs(sinks, "convert")["attention_sinks"] == 4
    assert fingerprints(sinks)["convert"] != fingerprints(window)["convert"]
    assert "attention_sinks" not in stage_inputs(window, "convert")  # runs made before the field resume as they were


def test_the_token_weights_kernel_is_checked_and_changes_no_fingerprint():
    from raven_convert.train.run_state import fingerprints

    weighted = MINIMAL | {"token_weights": {"enabled": True}}
    assert parse_recipe(weighted).token_weights.kernel == "auto"
    triton = parse_recipe(weighted | {"token_weights": {"enabled": True, "kernel": "triton"}})
    assert triton.token_weights.kernel == "triton"
    allowed = r"Input should be 'auto', 'triton', 'compiled' or 'eager' \(got 'trition'\)"
    with pytest.raises(ValueError, match=rf"token_weights.kernel: {allowed}"):
        parse_recipe(weighted | {"token_weights": {"kernel": "trition"}})
    before = fingerprints(parse_recipe(weighted))
    assert "weights" in before and fingerprints(triton) == before  # same weights up to rounding: results stay valid
    finetune = {"source": "Qwen/Qwen3-0.6B", "data": {"source": "x"}, "train": {"steps": 1}}
    assert fingerprints(parse_recipe(finetune | {"token_weights": {"kernel": "eager"}})) == fingerprints(
        parse_recipe(finetune)
    )


def test_answer_weight_needs_retrieval_samples_and_changes_no_fingerprint_at_1():
    from raven_convert.train.run_state import fingerprints

    train = {"steps": 10, "answer_weight": 20}
    with pytest.raises(ValueError, match=r"train.answer_weight = 20 .* set data.retrieval \(ratio > 0\)"):
        parse_recipe(MINIMAL | {"train": train})
    extend = {"seq_len": 64, "steps": 3, "answer_weight": 20}
    with pytest.raises(ValueError, match=r"extend.answer_weight = 20 .* set extend.retrieval or data.retrieval"):
        parse_recipe(MINIMAL | {"extend": extend})
    parse_recipe(MINIMAL | {"extend": extend | {"retrieval": {"ratio": 0.5}}})  # its own samples
    mixed = MINIMAL | {"data": {"source": "x", "retrieval": {"ratio": 0.2}}}
    before = fingerprints(parse_recipe(mixed | {"train": {"steps": 10}}))
    assert fingerprints(parse_recipe(mixed | {"train": {"steps": 10, "answer_weight": 1}})) == before
    weighted = fingerprints(parse_recipe(mixed | {"train": train}))
    assert weighted["align"] == before["align"] and weighted["train"] != before["train"]


def test_overrides_apply_before_validation(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(MINIMAL | {"evaluate": {"samples": 2}}))
    recipe = load_recipe(path, ["train.steps=20", "evaluate=null", "extend.seq_len=64", "extend.steps=3"])
    assert recipe.train.steps == 20 and recipe.evaluate is None and recipe.extend.seq_len == 64
    no = load_recipe(path, ["train.mixed_precision=no", "align.mixed_precision=no"])  # YAML's `no` is false
    assert no.train.mixed_precision == "no" and no.align.mixed_precision == "no"
    with pytest.raises(ValueError, match=r"train.steps: Input should be greater than or equal to 0"):
        load_recipe(path, ["train.steps=-1"])
    with pytest.raises(ValueError, match=r"override 'train.steps' is not of the form dotted.key=value"):
        load_recipe(path, ["train.steps"])
    with pytest.raises(ValueError, match=r"train.stepz: not a field of train; did you mean 'steps'\? allowed: steps, "):
        load_recipe(path, ["train.stepz=3"])


def run_main(tmp_path, capsys, recipe: dict, *flags: str) -> tuple[int, str]:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main([str(path), "--run-dir", str(tmp_path / "run"), *flags])
    return code, " ".join(capsys.readouterr().err.split())


ESSAY_EVAL = {"tasks": ["passkey", "niah_word"], "lengths": [400], "samples": 1}


@pytest.mark.parametrize(
    "recipe, flags, message",
    [
        ({"align": {"steps": 1}}, [], "data.source is not set: pass --data PATH or set data.source in the recipe"),
        (
            {"align": {"steps": 1}},
            ["--data", "../nowhere/corpus"],
            "data.source: no such file or directory: ../nowhere/corpus; pass --data PATH or set data.source in the",
        ),
        ({"source": "../models/x.gguf"}, [], "source: --src '../models/x.gguf': no such GGUF file"),
        (  # before align runs, not when train starts (this machine has no CUDA GPU)
            {"layers": [{"mixer": "sila", "layers": "1"}], "train": {"cuda_graphs": True}},
            [],
            "train.cuda_graphs = true cannot be honoured: the device is cpu, not cuda; use 'auto'",
        ),
        (
            {"evaluate": ESSAY_EVAL},
            ["--stages", "evaluate"],
            "evaluate.haystack_dir is not set, and tasks ['niah_word']",
        ),
        ({"evaluate": ESSAY_EVAL}, ["--stages", "evaluate"], "pass --haystack DIR or set evaluate.haystack_dir in the"),
        (
            {"evaluate": ESSAY_EVAL},
            ["--stages", "evaluate", "--haystack", "essays"],
            "essays: no such directory; pass --haystack DIR or set evaluate.haystack_dir in the recipe",
        ),
        (
            {"evaluate": ESSAY_EVAL | {"tasks": ["passkey", "niah_word@papers"], "haystacks": {"papers": "papers"}}},
            ["--stages", "evaluate"],
            "papers: no such directory; set it with --set evaluate.haystacks.papers=DIR",
        ),
        (
            {"evaluate": ESSAY_EVAL | {"tasks": ["niah_word@papers"]}},
            ["--stages", "evaluate", "--set", "evaluate.haystacks.papers=."],
            "no *.txt files in it; set it with --set evaluate.haystacks.papers=DIR",
        ),
        (
            {"evaluate": ESSAY_EVAL | {"tasks": ["passkey"]}},
            ["--stages", "evaluate", "--ppl-data", "texts.jsonl"],
            "texts.jsonl: no such file or directory; pass --ppl-data PATH or set evaluate.ppl_data in the recipe",
        ),
    ],
)
def test_a_missing_input_names_its_flag_and_field_before_any_stage(
    recipe, flags, message, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAVEN_HAYSTACK_DIR", raising=False)
    data = {k: v for k, v in MINIMAL.items() if k != "data"} | recipe
    code, err = run_main(tmp_path, capsys, data, *flags)
    assert code == 2 and message in err, err
    assert not (tmp_path / "run").exists()


def test_input_flags_are_set_overrides_read_as_plain_strings(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(MINIMAL | {"evaluate": {"samples": 1}}))
    args = build_parser().parse_args([str(path), "--run-dir", "run", "--data", "yes", "--haystack", "a: b#c"])
    recipe = load_recipe(path, input_overrides(args) + ["evaluate.samples=2"])
    assert recipe.data.source == "yes" and recipe.evaluate.haystack_dir == str(Path.cwd() / "a: b#c")
    assert recipe.source == MINIMAL["source"] and recipe.evaluate.samples == 2
    assert "--data yes --haystack 'a: b#c'" in resume_command(args)
    override = load_recipe(path, input_overrides(args) + ["data.source=other"])  # --set comes last and wins
    assert override.data.source == "other"


def test_start_from_names_a_hybrid_of_the_teacher_and_is_fingerprinted(tiny_sources, tmp_path, capsys, monkeypatch):
    """start_from (--start-from) must be a hybrid this toolkit saved, converted from a model shaped as the teacher:
    checked before any stage; it joins the convert and align fingerprints only where it is set."""
    from raven_convert.cli import main as convert
    from raven_convert.train.run_state import fingerprints, stage_inputs

    monkeypatch.chdir(tmp_path)
    teacher = str(tiny_sources["llama"])
    recipe = {"source": teacher, "layers": [{"mixer": "sila", "layers": "1,2"}], "data": {"source": "x"}}
    with pytest.raises(ValueError, match=r"start_from: String should have at least 1 character"):
        parse_recipe(recipe | {"start_from": ""})
    with pytest.raises(ValueError, match=r"start_from: not a field of a fine-tuning recipe"):
        parse_recipe({"source": teacher, "start_from": "h", "train": {"steps": 1}})
    other = tmp_path / "qwen3-hybrid"
    assert convert(["--src", str(tiny_sources["qwen3"]), "--mixer", "sila", "--layers", "1", "--out", str(other)]) == 0
    expected = "expected the folder of a hybrid this toolkit saved"
    for start, message in [
        ("nowhere", f"start_from {str(tmp_path / 'nowhere')!r}: no such directory; {expected}"),
        ("nowhere", "or convert's --out); pass --start-from DIR or set start_from in the recipe"),
        (teacher, f"holds a 'llama' model, not a hybrid (model_type 'raven_hybrid'); {expected}"),
        (str(other), "a hybrid of a qwen3 (num_hidden_layers 24, hidden_size 64, vocab_size 128), but the teacher"),
    ]:
        code, err = run_main(tmp_path, capsys, recipe, "--start-from", start, "--stages", "convert")
        assert code == 2 and message in err, err
        assert not (tmp_path / "run").exists()

    args = build_parser().parse_args(["r.yaml", "--run-dir", "run", "--start-from", "h"])
    assert input_overrides(args) == ['start_from="h"'] and "--start-from h" in resume_command(args)
    plain, further = parse_recipe(recipe), parse_recipe(recipe | {"start_from": "h"})
    assert all("start_from" not in stage_inputs(plain, stage) for stage in STAGES)  # older runs' fingerprints stand
    assert stage_inputs(further, "convert")["start_from"] == stage_inputs(further, "align")["start_from"]
    assert stage_inputs(further, "align")["start_from"] == str(tmp_path / "h")
    moved = fingerprints(parse_recipe(recipe | {"start_from": "g"}))
    assert fingerprints(plain)["convert"] != fingerprints(further)["convert"] != moved["convert"]


def test_unknown_evaluation_task_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"evaluate.tasks: .*unknown task 'niah'; .*allowed: passkey, "):
        parse_recipe(MINIMAL | {"evaluate": {"tasks": ["passkey", "niah"]}})
    with pytest.raises(ValueError, match=r"evaluate.tasks: .*no haystack named 'paper'; did you mean 'papers'\?"):
        parse_recipe(MINIMAL | {"evaluate": {"tasks": ["niah_word@paper"], "haystacks": {"papers": "p"}}})


def test_a_named_haystack_set_from_the_command_line_resolves_like_haystack_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(MINIMAL | {"evaluate": {"tasks": ["niah_word", "niah_word@papers"]}}))
    recipe = load_recipe(path, ["evaluate.haystack_dir=essays", "evaluate.haystacks.papers=../papers"])
    assert recipe.evaluate.haystacks == {"papers": str(tmp_path.parent / "papers")}
    assert recipe.evaluate.haystack_dir == str(tmp_path / "essays")


def test_outputs_are_readable_by_others_and_each_stage_reports_its_disk_use(tiny_sources, tmp_path, capsys):
    recipe = parse_recipe(
        {
            "source": str(tiny_sources["llama"]),
            "layers": [{"mixer": "raven", "layers": "1"}],
            "mixer_settings": {"raven": {"num_slots": 8, "top_k": 2}},
            "export": {"dir": str(tmp_path / "exported")},
        }
    )
    old = os.umask(0o022)
    try:
        results = run_recipe(recipe, tmp_path / "run")
    finally:
        os.umask(old)
    files = [*(tmp_path / "exported").rglob("*"), *(tmp_path / "run").rglob("*")]
    assert (tmp_path / "exported" / "config.json") in files and (tmp_path / "run" / "convert" / "DONE") in files
    modes = {str(f): oct(f.stat().st_mode & 0o777) for f in files}
    wrong = {f: m for f, m in modes.items() if m != (oct(0o755) if Path(f).is_dir() else oct(0o644))}
    assert not wrong
    err = capsys.readouterr().err
    for stage in ("convert", "export"):
        size = sum(f.stat().st_size for f in (tmp_path / "run" / stage / "model").rglob("*") if f.is_file())
        exported = [f for f in (tmp_path / "exported").rglob("*") if f.is_file() and f.suffix != ".safetensors"]
        size = size or sum(f.stat().st_size for f in exported)  # the export's weights are hard links: no new bytes
        assert results[stage]["disk_bytes"] == size > 0
        assert re.search(rf"\[{stage}\] done in [0-9.]+ s, {size / 1e6:.1f} MB on disk", err), err
    assert results["align"]["disk_bytes"] == 0 and "[align] skipped" in err


def test_export_defaults_outside_the_stage_directories_and_ships_nothing_internal(tiny_sources, tmp_path):
    recipe = {
        "source": str(tiny_sources["llama"]),
        "layers": [{"mixer": "raven", "layers": "1"}],
        "mixer_settings": {"raven": {"num_slots": 8, "top_k": 2}},
        "export": {},
    }
    results = run_recipe(parse_recipe(recipe), tmp_path / "run")
    model = tmp_path / "run" / "model"
    assert results["export"]["exported_to"] == str(model.resolve()) and (model / "config.json").is_file()
    assert not [p for p in model.rglob("*") if p.name in ("DONE", "checkpoints") or p.name.startswith(".")]
    inside = parse_recipe(recipe | {"export": {"dir": str(tmp_path / "run2" / "train" / "final")}})
    with pytest.raises(ValueError, match=r"export.dir = .* overlaps the train stage's directory"):
        run_recipe(inside, tmp_path / "run2")
    assert not (tmp_path / "run2" / "convert").exists()  # refused before the first stage


def test_extend_packs_its_rows_with_its_own_retrieval_mix(tiny_sources, tmp_path, monkeypatch):
    from raven_convert.train import stages
    from raven_convert.train.distributed import Parallel
    from raven_convert.train.retrieval_data import RetrievalMix

    far = {"ratio": 0.5, "length": [0.5, 0.95], "depth": [0.0, 0.4]}
    base = {
        "source": str(tiny_sources["llama"]),
        "layers": [{"mixer": "sila", "layers": "1"}],
        "data": {"source": str(tmp_path), "seq_len": 32, "retrieval": {"ratio": 0.2}},
        "extend": {"seq_len": 48, "steps": 1, "retrieval": far},
    }
    seen = []

    class Read(Exception):
        pass

    def dataset(recipe, run_dir, tokenizer, seq_len=None, retrieval=None):
        seen.append((seq_len, retrieval))
        raise Read  # the rows are all this test needs

    monkeypatch.setattr(stages, "recipe_dataset", dataset)
    done = {"convert": {"model": "convert/model"}}
    for extend, expected in ((far, RetrievalMix(**far)), (None, None)):  # None: data.retrieval's (recipe_dataset)
        recipe = parse_recipe(base | {"extend": {"seq_len": 48, "steps": 1, "retrieval": extend}})
        with pytest.raises(Read):
            stages._stage_extend(recipe, tmp_path, done, Parallel())
        assert seen.pop() == (48, expected)
    with pytest.raises(ValueError, match=r"extend.retrieval.depth"):
        parse_recipe(base | {"extend": {"seq_len": 48, "steps": 1, "retrieval": {"depth": [0.5, 0.2]}}})


def test_a_mistyped_recipe_path_names_the_shipped_recipes(tmp_path, capsys):
    assert main(["recipes/smollm2-sila.yml", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: recipes/smollm2-sila.yml: no such recipe file; did you mean 'smollm2-sila.yaml'?")
    assert "smollm2-raven.yaml" in err and not (tmp_path / "run").exists()
    assert "shipped recipes" in build_parser().format_help() and "smollm2-sse.yaml" in build_parser().format_help()
