"""Surgery from a hybrid (progressive conversion): `convert --src HYBRID` keeps the mixers the hybrid had, bit for
bit, initialises the new ones as a conversion of a Transformer does, takes every other weight from the hybrid, records
the chain; a plan that drops or changes a converted layer, converts nothing new or changes a mixer's settings is
refused before any weight is loaded."""

from __future__ import annotations

import json

import pytest
import torch

from raven_convert import build_hybrid, plan_layers
from raven_convert.cli import main
from raven_convert.export import save_hybrid
from raven_convert.sources import Source
from raven_layers import HybridForCausalLM
from tests.conftest import tiny_tokenizer
from tests.helpers import read_weights, words_corpus

SILA = ["--sila-conv-size", "2"]


def convert(*argv) -> int:
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def trained(tiny_sources, tmp_path_factory):
    """{"teacher", "hybrid"}: the tiny Llama converted at layer 1 to SILA (conv_size 2), every weight then moved as
    training would move it (so the hybrid's attention and mixers differ from the teacher's), saved."""
    root = tmp_path_factory.mktemp("trained")
    teacher = tiny_sources["llama"]
    assert convert("--src", teacher, "--mixer", "sila", "--layers", "1", *SILA, "--out", root / "converted") == 0
    model = HybridForCausalLM.from_pretrained(root / "converted")
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hybrid(model, tiny_tokenizer(), root / "hybrid", base_model=str(teacher))
    return {"teacher": teacher, "hybrid": root / "hybrid"}


def test_a_hybrid_converted_further_keeps_its_mixers_and_starts_the_new_ones_as_a_conversion_does(trained, tmp_path):
    hybrid, teacher = trained["hybrid"], trained["teacher"]
    out = tmp_path / "further"
    assert convert("--src", hybrid, "--mixer", "sila", "--layers", "1,2", "--seed", "3", "--out", out) == 0
    before, after = read_weights(hybrid), read_weights(out)
    new = set(after) - set(before)  # layer 2's mixer-only parameters (its q/k/v/o keep their names)
    assert new and all(name.startswith("model.layers.2.self_attn.") for name in new)
    for name, tensor in after.items():  # everything but layer 2's new parameters: the hybrid's, bit for bit
        if name not in new:
            assert torch.equal(tensor, before[name]), name
    assert not torch.equal(
        before["model.layers.1.self_attn.q_proj.weight"],
        read_weights(teacher)["model.layers.1.self_attn.q_proj.weight"],
    )  # the hybrid's trained weights, not the teacher's

    # the new layer's own parameters are those a conversion of the teacher to the same plan gives (same seed)
    direct = build_hybrid(
        Source.resolve(str(teacher)).load_model("float32"),
        plan_layers([("sila", "1,2")], 4),
        {"sila": {"conv_size": 2}},
        3,
    ).state_dict()
    assert all(torch.equal(after[name], direct[name]) for name in new)

    config = json.loads((out / "config.json").read_text())
    assert config["layer_mixers"] == ["attention", "sila", "sila", "attention"]
    assert config["mixer_settings"]["sila"]["conv_size"] == 2  # the source's settings, carried
    assert config["converted_from"] == [
        {"model": str(hybrid), "layer_mixers": ["attention", "sila", "attention", "attention"]}
    ]
    assert f"- `{hybrid}`, which had converted layers 1 (sila)" in (out / "README.md").read_text()

    # a third step records the chain, oldest first
    third = tmp_path / "third"
    assert convert("--src", out, "--mixer", "sila", "--layers", "1-3", "--out", third) == 0
    chain = json.loads((third / "config.json").read_text())["converted_from"]
    assert [step["model"] for step in chain] == [str(hybrid), str(out)]
    assert torch.equal(
        read_weights(third)["model.layers.2.self_attn.q_proj.weight"], after["model.layers.2.self_attn.q_proj.weight"]
    )


@pytest.mark.parametrize(
    "plan, problem",
    [
        (["--mixer", "sila", "--layers", "2"], "layer 1 is sila in the source and kept as attention in the plan"),
        (["--mixer", "raven", "--layers", "1,2"], "layer 1 is sila in the source and raven in the plan"),
        (["--mixer", "sila", "--layers", "1,2", "--mixer", "sse", "--layers", "0"], None),
        (["--mixer", "sila", "--layers", "1"], "the plan converts no layer that the source hybrid"),
        (["--mixer", "sila", "--layers", "1,2", "--sila-conv-size", "4"], "sila.conv_size = 4, but the source"),
        (
            ["--mixer", "sila", "--layers", "auto:1", "--choice-data", "CORPUS"],
            "auto:1 counts every converted layer, the 1 the source",
        ),
    ],
)
def test_a_further_conversion_refuses_a_plan_that_does_not_keep_the_source_before_loading_it(
    trained, tmp_path, capsys, monkeypatch, plan, problem
):
    if problem is None:  # a mixer of another kind on a layer the source kept: allowed (SSE's rank fits the model)
        plan += ["--sse-lora-rank", "8"]
        assert convert("--src", trained["hybrid"], *plan, "--out", tmp_path / "mixed") == 0
        assert json.loads((tmp_path / "mixed" / "config.json").read_text())["layer_mixers"][:3] == [
            "sse",
            "sila",
            "sila",
        ]
        return

    def no_weights(*args, **kwargs):
        raise AssertionError("the source's weights were loaded")

    monkeypatch.setattr(Source, "load_model", no_weights)
    plan = [str(words_corpus(tmp_path / "corpus")) if word == "CORPUS" else word for word in plan]
    with pytest.raises(SystemExit) as info:
        convert("--src", trained["hybrid"], *plan, "--out", tmp_path / "out")
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert problem in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()


def test_a_further_conversion_keeps_the_sources_sliding_windows_on_the_attention_it_keeps(tiny_sources, tmp_path):
    windowed = tmp_path / "windowed"
    argv = ["--src", tiny_sources["llama"], "--mixer", "sila", "--layers", "1", "--sliding-window", "4"]
    assert convert(*argv, "--out", windowed) == 0
    assert convert("--src", windowed, "--mixer", "sila", "--layers", "1,2", "--out", tmp_path / "further") == 0
    assert json.loads((tmp_path / "further" / "config.json").read_text())["attention_windows"] == [4, None, None, 4]


def test_a_bf16_source_converts_in_bf16_to_what_a_float32_build_cast_gives(tiny_sources):
    """The hybrid is built in its source's dtype (a float32 build of a bf16 model took twice its size on the host):
    every weight, fresh mixer parameters included, is the float32 build's cast, and RoPE's frequencies stay in
    float32, as the source keeps them."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"], dtype=torch.bfloat16)
    kinds = plan_layers([("sila", "0"), ("raven", "1"), ("sse", "2")], 4)
    settings = {"sse": {"lora_rank": 8}}  # the tiny model's q/k are narrower than SSE's default rank
    built = build_hybrid(source, kinds, settings)
    cast = build_hybrid(source.float(), kinds, settings).to(torch.bfloat16)
    ours, theirs = built.state_dict(), cast.state_dict()
    assert set(ours) == set(theirs) and {t.dtype for t in ours.values()} == {torch.bfloat16}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert {b.dtype for b in built.buffers()} == {b.dtype for b in source.buffers()} == {torch.float32}


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every new storage an op makes off the meta device while the mode is on."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in given:
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_a_shared_build_makes_only_the_mixers_new_parameters(tiny_sources):
    """convert's build takes the source's tensors and makes no model of its own to overwrite: what it allocates is
    the converted layers' fresh parameters (and RoPE's tables), a small part of the model, not the model again."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"])
    kinds = plan_layers([("raven", "1")], 4)
    with Allocations() as made:
        hybrid = build_hybrid(source, kinds, {}, share=True)
    fresh = {f"model.layers.1.self_attn.{n}" for n in hybrid.model.layers[1].self_attn.fresh_parameter_names()}
    fresh_bytes = sum(t.nbytes for n, t in hybrid.named_parameters() if n in fresh)
    model_bytes = sum(t.nbytes for t in source.state_dict().values())
    assert 0 < fresh_bytes <= made.bytes < fresh_bytes + model_bytes // 10, (made.bytes, fresh_bytes, model_bytes)


def test_a_mixers_own_buffers_are_made_on_the_host(tiny_sources, monkeypatch):
    """The build is on the meta device: a table a mixer's __init__ registers (a buffer, not a parameter) is made
    again on the host, as __init__ computes it."""
    from transformers import AutoModelForCausalLM

    from raven_layers.sila import SILAMixer

    init = SILAMixer.__init__

    def with_table(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_buffer("table", torch.arange(4.0) * self.layer_idx, persistent=False)

    monkeypatch.setattr(SILAMixer, "__init__", with_table)
    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"])
    hybrid = build_hybrid(source, plan_layers([("sila", "1,3")], 4), {}, share=True)
    for i in (1, 3):
        assert torch.equal(hybrid.model.layers[i].self_attn.table, torch.arange(4.0) * i)


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # qwen2: tied embeddings
def test_a_shared_build_holds_the_sources_tensors_and_equals_a_copied_one(tiny_sources, name):
    """`share` (convert's build): every weight the hybrid takes from its source is the source's tensor itself, not a
    copy, tied weights stay tied, and the model is the copied build's, fresh mixer parameters and a memory per query
    head (k/v widened from the source's as they load) included."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_sources[name])
    kinds = plan_layers([("sila", "0"), ("raven", "1")], 4)
    settings = {"sila": {"state_heads": "query"}}
    copied, shared = (build_hybrid(source, kinds, settings, seed=3, share=share) for share in (False, True))
    ours, theirs = shared.state_dict(), copied.state_dict()
    assert set(ours) == set(theirs)
    for key, tensor in ours.items():
        assert torch.equal(tensor, theirs[key]), key
    held = {t.data_ptr() for t in source.state_dict().values()}
    kept = [k for k in ours if not k.startswith(("model.layers.0.", "model.layers.1."))]
    assert kept and all(ours[k].data_ptr() in held for k in kept)  # embeddings, norms, MLPs, kept attention
    assert all(theirs[k].data_ptr() not in held for k in kept)
    tied = shared.config.tie_word_embeddings
    assert tied == (name == "qwen2") and (shared.lm_head.weight is shared.model.embed_tokens.weight) == tied
    x = torch.randint(0, source.config.vocab_size, (1, 8))
    assert torch.equal(shared(x).logits, copied(x).logits)
