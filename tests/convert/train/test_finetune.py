"""Fine-tuning any causal LM with a reference's token weights (finetune.py): a plain Llama with a Qwen3 reference
trains, saves and reloads as its own class; the weights change the run and are computed once per reference and
data; a reference with another tokenizer is refused first; a trust_remote_code model trains from a recipe; an
interrupted recipe run resumes to the uninterrupted result."""

import json
import string

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import raven_convert.train.finetune
import raven_convert.train.stage2
from raven_convert.train.__main__ import main
from raven_convert.train.data import build_dataset
from raven_convert.train.finetune import check_same_tokenizer, finetune, weights_cache_key
from raven_convert.train.lora import is_lora, select_trainable
from raven_convert.train.recipe import FinetuneWeights, parse_recipe
from raven_convert.train.stage2_config import TrainConfig
from tests.conftest import make_tiny_source, tiny_tokenizer
from tests.convert.faults import fail_at, interrupt
from tests.helpers import corpus

CONFIG = dict(steps=3, batch_size=4, lr=1e-2, log_every=0, save_every=1000, token_weight_tau=50.0)
CONFIGURATION = """
from transformers import PretrainedConfig


class TinyRnnConfig(PretrainedConfig):
    model_type = "tiny_rnn"

    def __init__(self, vocab_size=128, hidden_size=32, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        super().__init__(**kwargs)
"""
MODELING = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_rnn import TinyRnnConfig


class TinyRnnForCausalLM(PreTrainedModel):
    """Not a Transformer: a running mean of gated embeddings (a linear-time mixer) and a head."""

    config_class = TinyRnnConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=None, **kwargs):
        h = self.embed(input_ids)  # [B, T, D]
        steps = torch.arange(1, h.shape[1] + 1, device=h.device)[None, :, None]
        h = h + torch.cumsum(torch.tanh(self.mix(h)), dim=1) / steps
        return CausalLMOutput(logits=self.head(h))
'''


def other_tokenizer() -> PreTrainedTokenizerFast:
    """tiny_tokenizer's characters in reverse order: as many tokens, other ids."""
    chars = sorted(set(string.printable), reverse=True)
    vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def custom_model(folder):
    """A model directory whose class exists only in its own code files (loads with trust_remote_code)."""
    folder.mkdir()
    (folder / "configuration_tiny_rnn.py").write_text(CONFIGURATION)
    (folder / "modeling_tiny_rnn.py").write_text(MODELING)
    auto_map = {
        "AutoConfig": "configuration_tiny_rnn.TinyRnnConfig",
        "AutoModelForCausalLM": "modeling_tiny_rnn.TinyRnnForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny_rnn", "auto_map": auto_map}))
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    AutoModelForCausalLM.from_config(config, trust_remote_code=True).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sources(tiny_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    other = make_tiny_source("qwen3", root / "other", seed=1, num_hidden_layers=2)
    other_tokenizer().save_pretrained(other)
    return {
        "student": tiny_sources["llama"],
        "second_student": tiny_sources["qwen2"],
        "reference": make_tiny_source("qwen3", root / "qwen3", seed=1, num_hidden_layers=2),
        "other": other,
        "custom": custom_model(root / "custom"),
        "data": corpus(root / "corpus"),
    }


def load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def rows(sources, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(sources["student"])
    return build_dataset(sources["data"], tokenizer, 32, tmp_path / "data", validation_fraction=0.1)


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plain_student_trains_with_reference_weights_and_reloads_as_its_own_class(sources, tmp_path):
    student, reference = load(sources["student"]), load(sources["reference"])
    before = params(student)
    train_rows, held_out = rows(sources, tmp_path)
    history = finetune(
        student, reference, train_rows, CONFIG, tmp_path / "run", validation=held_out, save_to=tmp_path / "out"
    )
    assert [r["step"] for r in history] == [1, 2, 3] and "val_ce" in history[-1]
    reloaded = load(tmp_path / "out")
    assert type(reloaded) is type(student) and type(reloaded).__name__ == "LlamaForCausalLM"
    after = params(reloaded)
    assert after.keys() == before.keys()
    for name, value in params(student).items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    assert all(not torch.equal(after[n], before[n]) for n in before)  # "all" trained every parameter
    assert AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == tiny_tokenizer().get_vocab()


def test_weights_change_the_run_and_are_computed_once_per_reference_and_data(sources, tmp_path, monkeypatch):
    computed = []
    original = raven_convert.train.finetune.weight_table
    monkeypatch.setattr(
        raven_convert.train.finetune, "weight_table", lambda *a, **k: computed.append(1) or original(*a, **k)
    )
    train_rows, _ = rows(sources, tmp_path)
    reference, cache = load(sources["reference"]), tmp_path / "cache"
    runs = {}
    for name, ref in [("weighted", reference), ("uniform", None), ("again", reference)]:
        student = load(sources["student"])
        runs[name] = finetune(student, ref, train_rows, CONFIG, tmp_path / name, cache_dir=cache), params(student)
    assert computed == [1]  # the second weighted run read the cache
    assert runs["weighted"][0][0]["ce"] != runs["uniform"][0][0]["ce"]
    assert any(not torch.equal(runs["weighted"][1][n], runs["uniform"][1][n]) for n in runs["uniform"][1])
    for n, value in runs["weighted"][1].items():
        torch.testing.assert_close(runs["again"][1][n], value, rtol=0, atol=0, msg=n)
    finetune(load(sources["second_student"]), reference, train_rows, CONFIG, tmp_path / "qwen2", cache_dir=cache)
    assert computed == [1]  # another student of the same tokenizer: the same table
    settings = FinetuneWeights()
    key = weights_cache_key(reference, train_rows, settings)
    assert weights_cache_key(load(sources["student"]), train_rows, settings) != key  # another reference
    assert weights_cache_key(reference, rows(sources, tmp_path)[1], settings) != key  # other rows
    assert weights_cache_key(reference, train_rows, FinetuneWeights(lam=1.0)) != key
    assert weights_cache_key(reference, train_rows, FinetuneWeights(precision="bf16")) != key


def test_a_reference_with_another_tokenizer_is_refused_before_any_work(sources, tmp_path, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("weights computed")

    monkeypatch.setattr(raven_convert.train.finetune, "weight_table", forbidden)
    recipe = {
        "source": str(sources["student"]),
        "reference": str(sources["other"]),
        "data": {"source": str(sources["data"]), "seq_len": 32},
        "train": {"steps": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"error: the reference {sources['other']} does not share the tokenizer of the student ")
    assert "the vocabularies differ (104 vs 104 tokens; other ids for " in said
    assert not (tmp_path / "run" / "cache").exists()  # refused before the data was packed
    with pytest.raises(ValueError, match="does not share the tokenizer of the student"):
        check_same_tokenizer(tiny_tokenizer(), other_tokenizer(), "a", "b")
    check_same_tokenizer(tiny_tokenizer(), tiny_tokenizer(), "a", "b")


def recipe_file(tmp_path, source, **sections) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"source": str(source), **sections}))
    return str(path)


def test_trust_remote_code_student_trains_lora_from_a_recipe(sources, tmp_path):
    data = {"source": str(sources["data"]), "seq_len": 32, "validation_fraction": 0.1}
    train = dict(CONFIG, trainable="lora", lora_targets=["mix"], lora_rank=4)
    recipe = recipe_file(
        tmp_path,
        sources["custom"],
        reference=str(sources["student"]),
        trust_remote_code=True,
        data=data,
        train=train,
        export={},
    )
    assert main([recipe, "--run-dir", str(tmp_path / "run")]) == 0
    out = tmp_path / "run" / "model"
    assert (out / "modeling_tiny_rnn.py").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    before = AutoModelForCausalLM.from_pretrained(sources["custom"], trust_remote_code=True)
    assert type(model).__name__ == "TinyRnnForCausalLM" and not any(is_lora(n) for n, _ in model.named_parameters())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))}
    assert changed == {"mix.weight"}  # LoRA on `mix`, merged into it; nothing else moved
    done = yaml.safe_load((tmp_path / "run" / "train" / "DONE").read_text())
    assert done["class"] == "TinyRnnForCausalLM" and done["tokens_per_second"] > 0


def test_an_interrupted_recipe_run_resumes_to_the_uninterrupted_result(sources, tmp_path, monkeypatch, capsys):
    sections = dict(
        reference=str(sources["reference"]),
        data={"source": str(sources["data"]), "seq_len": 32, "cache_dir": str(tmp_path / "shared")},
        token_weights={"batch_size": 16},
        train=dict(CONFIG, steps=4, save_every=2),
    )
    recipe = recipe_file(tmp_path, sources["student"], **sections)
    assert main([recipe, "--run-dir", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    with monkeypatch.context() as patch:
        fail_at(patch, raven_convert.train.stage2, "ce_loss", 3, interrupt, counted=torch.is_grad_enabled)
        assert main([recipe, "--run-dir", str(tmp_path / "cut")]) != 0
    err = capsys.readouterr().err
    assert "loaded (73, 32) token weights from the cache" in err  # the first run's table, in the shared cache
    assert f"stages done in {tmp_path / 'cut'}: weights; the train stage's last good checkpoint" in err
    assert main([recipe, "--run-dir", str(tmp_path / "cut")]) == 0
    assert "resumed from" in capsys.readouterr().err
    whole = load_file(tmp_path / "whole" / "train" / "model" / "model.safetensors")
    cut = load_file(tmp_path / "cut" / "train" / "model" / "model.safetensors")
    for name, value in whole.items():
        torch.testing.assert_close(cut[name], value, rtol=0, atol=0, msg=name)


def test_the_weights_stage_weights_the_rows_train_reads_and_ctrl_c_names_its_checkpoint(
    sources, tmp_path, monkeypatch, capsys
):
    """A short run (train.steps 2 of 4 rows: 8 of the corpus's 73 rows) weights those rows only; interrupted
    midway, it says which checkpoint of its cache it keeps (not 'nothing was saved'), and the rerun resumes there."""
    import raven_convert.train.token_weights

    sections = dict(
        reference=str(sources["reference"]),
        data={"source": str(sources["data"]), "seq_len": 32},
        token_weights={"batch_size": 2, "save_every": 1},
        train=dict(CONFIG, steps=2),
    )
    recipe, run = recipe_file(tmp_path, sources["student"], **sections), tmp_path / "run"
    with monkeypatch.context() as patch:
        fail_at(patch, raven_convert.train.token_weights, "token_weights", 3, interrupt)
        assert main([recipe, "--run-dir", str(run)]) != 0
    err = capsys.readouterr().err
    assert "[weights] 8 of 73 rows: those 2 train steps read" in err
    assert "the weights stage's last good checkpoint " in err and "a rerun resumes after step 2" in err
    assert str(run / "cache") in err.split("the weights stage's last good checkpoint ")[1]  # in the cache
    assert main([recipe, "--run-dir", str(run)]) == 0
    done = json.loads((run / "weights" / "DONE").read_text())
    assert done["rows"] == 8 and done["shape"] == [73, 32] and done["mean"] == done["mean"]  # no NaN
    assert json.loads((run / "train" / "DONE").read_text())["steps_this_run"] == 2


@pytest.mark.parametrize(
    "change, hint",
    [
        ({"align": {"steps": 1}}, "align: not a field of a fine-tuning recipe (one without `layers`"),
        (
            {"train": {"steps": 1, "trainable": "mixers"}},
            "train.trainable: Input should be 'all', 'patterns' or 'lora'",
        ),
        ({"train": {"steps": 1, "trainable": "patterns"}}, "trainable = 'patterns' needs trainable_patterns"),
        ({"train": {"steps": 1, "trainable_patterns": ["("]}}, "'(' is not a regular expression"),
        ({"token_weights": {"enabled": True, "tua": 0.1}}, "token_weights.tua: not a field of token_weights; did you"),
    ],
)
def test_a_malformed_finetune_recipe_names_the_field(change, hint):
    with pytest.raises(ValueError, match="is not a valid fine-tuning recipe") as info:
        parse_recipe({"source": "org/model", "train": {"steps": 1}, **change})
    assert any(hint in line for line in str(info.value).splitlines()[1:]), str(info.value)


def test_what_trains_in_a_plain_model(sources):
    model = load(sources["student"])
    with pytest.raises(ValueError, match="is not a hybrid; choose 'all', 'patterns'"):
        select_trainable(model, TrainConfig(steps=1, trainable="mixers"))
    chosen = select_trainable(model, TrainConfig(steps=1, trainable="patterns", trainable_patterns=[r"mlp\.up"]))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)
    } and len(chosen) == 4
    with pytest.raises(ValueError, match="match no parameter"):
        select_trainable(model, TrainConfig(steps=1, trainable="patterns", trainable_patterns=["nowhere"]))
    with pytest.raises(ValueError, match=r"lora_targets \['qkv'\] name no module of LlamaForCausalLM"):
        select_trainable(model, TrainConfig(steps=1, trainable="lora", lora_targets=["qkv"]))
    select_trainable(model, TrainConfig(steps=1, trainable="lora", lora_targets=["q_proj", "down_proj"]))
    lora = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert all(is_lora(n) for n, p in model.named_parameters() if p.requires_grad)
    assert lora == {f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn.q_proj", "mlp.down_proj")}
