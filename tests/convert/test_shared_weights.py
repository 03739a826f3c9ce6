"""The models of a run share the weights a stage left unchanged: align and train (trainable: mixers) write their
mixers' file and hard-link the rest from the model they started from, yet each model directory stays a complete
one that loads alone, and deleting or redoing a stage leaves the other stages' models whole."""

import hashlib
import os
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

import raven_convert.export
import raven_convert.pipeline
from raven_convert.files import disk_bytes
from raven_convert.train.models import load_hybrid
from raven_convert.train.recipe import parse_recipe
from raven_convert.train.run_state import read_done
from raven_convert.train.stages import run_recipe
from tests.convert.faults import recipe_data
from tests.helpers import corpus, read_weights, run_without_toolkit

pytestmark = pytest.mark.usefixtures("private_datasets_cache")
TRAIN = {"steps": 2, "batch_size": 2, "log_every": 1, "lr": 1e-3}
IDS = [[3, 14, 15, 9, 26, 5, 35, 8]]
MODELS = ("convert", "align", "train")
BASE, MIXERS = "model-base.safetensors", "model-mixers.safetensors"


def recipe(sources: dict, data: Path, **train):
    return parse_recipe(recipe_data(sources["llama"], data, align=TRAIN, train=TRAIN | train))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits


@pytest.fixture(scope="module")
def run(tiny_sources, tmp_path_factory) -> dict:
    """{"run", "data", "saved": {stage: the logits of the model each stage held in memory when it saved it}}."""
    root = tmp_path_factory.mktemp("shared")
    data, saved = corpus(root / "corpus"), {}
    original = raven_convert.export.save_hybrid

    def recording(model, tokenizer, out, **kwargs):
        saved[Path(out).parent.name] = logits(model)  # RUN_DIR/STAGE/model
        return original(model, tokenizer, out, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "hf_cache")  # its lock files stay out of ~/.cache
        patch.setattr(raven_convert.export, "save_hybrid", recording)
        patch.setattr(raven_convert.pipeline, "save_hybrid", recording)
        run_recipe(recipe(tiny_sources, data), root / "run", stages=["convert", "align", "weights", "train"])
    return {"run": root / "run", "data": data, "saved": saved}


def test_later_models_link_the_unchanged_file_and_take_less_disk(run):
    folder = run["run"]
    models = [folder / stage / "model" for stage in MODELS]
    assert all((m / BASE).samefile(models[0] / BASE) for m in models)  # one inode for the non-mixer weights
    assert len({os.stat(m / MIXERS).st_ino for m in models}) == 3  # each stage's own mixers
    assert (models[0] / BASE).stat().st_nlink == 3
    per_path = sum(f.stat().st_size for m in models for f in m.rglob("*") if f.is_file())  # before: a full copy each
    assert disk_bytes(*models) == per_path - 2 * (models[0] / BASE).stat().st_size
    for stage in ("align", "train"):  # a stage's disk use leaves out the file it links (and DONE, written after)
        done = read_done(folder, stage)["disk_bytes"]
        assert (
            done
            == disk_bytes(folder / stage) - (models[0] / BASE).stat().st_size - (folder / stage / "DONE").stat().st_size
        )


def test_each_model_directory_loads_alone_to_the_model_saved(run, tmp_path):
    for stage in MODELS:
        model = run["run"] / stage / "model"
        assert torch.equal(logits(load_hybrid(model, "cpu")), run["saved"][stage]), stage
        assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(model)), run["saved"][stage]), stage
    code = f"""
        import torch
        from transformers import AutoModelForCausalLM
        for stage in {list(MODELS)!r}:
            folder = {str(run["run"])!r} + f"/{{stage}}/model"
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
            with torch.no_grad():
                result[stage] = model.eval()(torch.tensor({IDS!r})).logits.tolist()
    """
    clean = run_without_toolkit(code, tmp_path)
    for stage in MODELS:
        assert torch.equal(torch.tensor(clean[stage]), run["saved"][stage]), stage


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.safetensors"))}


def linked_copy(run: dict, tmp_path: Path) -> Path:
    """A copy of the run whose every file is a hard link to the run's: a writer that wrote through a link would
    change the run's files."""
    copy = tmp_path / "run"
    shutil.copytree(run["run"], copy, copy_function=os.link)
    return copy


def test_redo_align_and_deleting_convert_leave_the_other_models_whole(run, tiny_sources, tmp_path):
    before = {stage: digests(run["run"] / stage / "model") for stage in MODELS}
    copy = linked_copy(run, tmp_path)
    run_recipe(recipe(tiny_sources, run["data"]), copy, stages=["align"], redo="align")
    assert not (copy / "train").exists()
    assert digests(copy / "convert" / "model") == before["convert"]
    assert (copy / "align" / "model" / BASE).samefile(copy / "convert" / "model" / BASE)
    assert {stage: digests(run["run"] / stage / "model") for stage in MODELS} == before  # nothing written through
    assert torch.equal(logits(load_hybrid(copy / "convert" / "model", "cpu")), run["saved"]["convert"])

    aligned = logits(load_hybrid(copy / "align" / "model", "cpu"))
    shutil.rmtree(copy / "convert")  # the align model keeps the data of the file it linked
    assert torch.equal(logits(load_hybrid(copy / "align" / "model", "cpu")), aligned)


def test_train_with_lora_writes_its_own_non_mixer_file(run, tiny_sources, tmp_path):
    copy = linked_copy(run, tmp_path)
    lora = recipe(tiny_sources, run["data"], trainable="mixers+lora", lora_rank=2)
    run_recipe(lora, copy, stages=["train"], redo="train")
    base = copy / "train" / "model" / BASE
    assert base.stat().st_nlink == 1 and not base.samefile(copy / "align" / "model" / BASE)  # LoRA merged into it
    trained, aligned = read_weights(copy / "train" / "model"), read_weights(copy / "align" / "model")
    assert any(not torch.equal(trained[n], aligned[n]) for n in trained if ".mlp." in n or "layers.0.self_attn" in n)
    assert (
        read_done(copy, "train")["disk_bytes"] == disk_bytes(copy / "train") - (copy / "train" / "DONE").stat().st_size
    )
