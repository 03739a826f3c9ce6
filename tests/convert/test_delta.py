"""delta.py: a trained hybrid saved as its difference from the teacher comes back as the same model."""

import pytest
import torch
from safetensors import safe_open

from raven_convert import Source, build_hybrid, plan_layers
from raven_convert.delta import apply_delta, main, save_delta
from raven_convert.export import save_hybrid
from raven_convert.train.models import load_hybrid


def trained_hybrid(teacher, out):
    """A hybrid of `teacher` as training leaves it: new mixers, a merged rank-2 LoRA update in a kept layer's query
    projection, a changed norm; saved as a model directory."""
    source = Source.resolve(str(teacher))
    model = source.load_model("float32")
    hybrid = build_hybrid(model, plan_layers([("sila", "1"), ("raven", "2")], model.config.num_hidden_layers), {})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in hybrid.named_parameters():
            if "layers.1." in name or "layers.2." in name:
                p.add_(0.01 * torch.randn_like(p))  # the mixers, trained
        q = hybrid.model.layers[0].self_attn.q_proj.weight
        q.add_(torch.randn(q.shape[0], 2) @ torch.randn(2, q.shape[1]) * 0.05)
        hybrid.model.layers[3].input_layernorm.weight.mul_(1.1)
        if hybrid.config.tie_word_embeddings:  # trained too (trainable: all): embeddings and head change together
            hybrid.model.embed_tokens.weight.mul_(0.9)
    return save_hybrid(hybrid, source.load_tokenizer(), out, base_model=str(teacher))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: tied embeddings
def test_a_delta_rebuilds_the_trained_hybrid(model_type, tiny_sources, tmp_path):
    teacher = tiny_sources[model_type]
    model_dir = trained_hybrid(teacher, tmp_path / "trained")
    summary = save_delta(model_dir, str(teacher), tmp_path / "d.safetensors")
    assert summary["factored"] == 1 and summary["bytes"] < summary["model_bytes"]
    with safe_open(str(tmp_path / "d.safetensors"), "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert stored[q + ".delta_a"][1] == 2 == stored[q + ".delta_b"][0]  # the rank-2 update as two factors
    assert "model.layers.3.input_layernorm.weight" in stored and "model.layers.1.self_attn.beta_weight" in stored
    assert not any(n.startswith(("model.layers.3.mlp", "model.layers.0.mlp")) for n in stored)
    assert ("model.embed_tokens.weight" in stored) == (model_type == "qwen2")
    out = apply_delta(tmp_path / "d.safetensors", str(teacher), tmp_path / "again")
    want, got = load_hybrid(model_dir, "cpu"), load_hybrid(out, "cpu")
    assert (
        list(got.config.layer_mixers) == list(want.config.layer_mixers) == ["attention", "sila", "raven", "attention"]
    )
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)
    ids = torch.randint(3, 100, (1, 17))
    torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=1e-5, atol=1e-5)


def test_another_teacher_is_refused_and_the_cli_checks_its_inputs(tiny_sources, tmp_path, capsys):
    model_dir = trained_hybrid(tiny_sources["llama"], tmp_path / "trained")
    assert main(["save", str(model_dir), str(tiny_sources["llama"]), str(tmp_path / "d.safetensors")]) == 0
    assert "1 as low-rank factors" in capsys.readouterr().out
    assert main(["save", str(model_dir), str(tiny_sources["llama"]), str(tmp_path / "half.safetensors"), "--bf16"]) == 0
    assert (tmp_path / "half.safetensors").stat().st_size < 0.6 * (tmp_path / "d.safetensors").stat().st_size
    assert main(["apply", str(tmp_path / "half.safetensors"), str(tiny_sources["llama"]), str(tmp_path / "h")]) == 0
    want, got = load_hybrid(model_dir, "cpu"), load_hybrid(tmp_path / "h", "cpu")
    rounded = []
    for name, value in want.state_dict().items():  # the tensors stored whole rounded to bf16, the rest as before
        again = got.state_dict()[name]
        assert torch.allclose(again, value, rtol=0, atol=1e-6) or torch.equal(again, value.bfloat16().float()), name
        rounded += [name] if not torch.equal(again, value) and torch.equal(again, value.bfloat16().float()) else []
    assert "model.layers.1.self_attn.beta_weight" in rounded and "model.embed_tokens.weight" not in rounded
    with pytest.raises(ValueError, match="was saved against the teacher .* has other weights or config"):
        apply_delta(tmp_path / "d.safetensors", str(tiny_sources["qwen2"]), tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
    with pytest.raises(SystemExit):
        main(["apply", str(tmp_path / "missing.safetensors"), str(tiny_sources["llama"]), str(tmp_path / "o")])
    assert "missing.safetensors does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["save", str(tmp_path), str(tiny_sources["llama"]), str(tmp_path / "x"), "--max-rank", "0"])
    assert "--max-rank 0 is not allowed" in capsys.readouterr().err
