"""The hybrid model: decoding with the cache equals a full forward; padding, batching and beams are exact."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_layers import output_cache

# Every mixer in several positions of every supported architecture (mistral: all layers windowed).
ASSIGNMENTS = {
    "llama": [("raven", "0"), ("sila", "2"), ("sse", "3")],
    "qwen3": [("raven", "0-23:5"), ("sila", "1-23:6"), ("sse", "3,12,22")],
    "mistral": [("sila", "1"), ("raven", "3"), ("sse", "0")],
    "qwen2": [("sse", "1"), ("sila", "0"), ("raven", "-1")],
}
SETTINGS = {
    "raven": {"num_slots": 16, "top_k": 4, "chunk_size": 4},
    "sila": {"chunk_size": 4},
    "sse": {"num_partitions": 4, "top_k": 2, "lora_rank": 8, "chunk_size": 4},
}


def mixers(model):
    return [
        (i, layer.self_attn)
        for i, layer in enumerate(model.model.layers)
        if model.config.layer_mixers[i] != "attention"
    ]


@torch.no_grad()
def perturb_fresh_parameters(model):
    """Untrained gates start at special values (identity convolutions, zero gates); move them so that the tests see
    every parameter at work."""
    for _, mixer in mixers(model):
        for name in sorted(mixer.fresh_parameter_names()):  # sorted: the same draws in every process
            param = mixer.get_parameter(name)
            param.add_(0.05 * torch.randn_like(param))
    return model


def packed_documents(lengths: list[list[int]], seed: int):
    """Random documents of the given lengths packed into rows: (documents per row, ids [B, T], position ids)."""
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(3, 100, (1, n), generator=g) for n in row] for row in lengths]
    ids = torch.cat([torch.cat(row, dim=1) for row in docs])
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    return docs, ids, positions


@torch.no_grad()
def logits_alone(model, docs) -> torch.Tensor:
    """Each document's logits when it runs on its own, laid out as in the packed rows."""
    return torch.cat([torch.cat([model(d, use_cache=False).logits for d in row], dim=1) for row in docs])


@pytest.fixture(scope="module", params=sorted(ASSIGNMENTS))
def hybrid(request, tiny_sources):
    source = AutoModelForCausalLM.from_pretrained(tiny_sources[request.param]).eval()
    kinds = plan_layers(ASSIGNMENTS[request.param], source.config.num_hidden_layers)
    return perturb_fresh_parameters(build_hybrid(source, kinds, {k: v for k, v in SETTINGS.items() if k in kinds}))


@pytest.mark.transformers_api
def test_prefill_then_decode_equals_full_forward(hybrid):
    ids = torch.randint(3, 100, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = hybrid(ids).logits
        out = hybrid(ids[:, :11], use_cache=True)  # 11 > the mistral window of 8, and not a chunk multiple
        steps, cache = [out.logits], output_cache(out)
        for t in range(11, 19):
            out = hybrid(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.transformers_api
def test_left_padding_changes_nothing_for_real_tokens(hybrid):
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = hybrid(ids).logits
        together = hybrid(padded, attention_mask=mask).logits[:, 4:]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.transformers_api
@pytest.mark.parametrize("num_beams", [1, 2])
def test_batched_generation_with_left_padding_equals_one_at_a_time(hybrid, num_beams):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in (5, 12, 9)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=num_beams, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        batched = hybrid.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]
        for i, p in enumerate(prompts):
            single = hybrid.generate(
                input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs
            )
            assert torch.equal(batched[i], single[0, len(p) :]), f"prompt {i}"


@pytest.mark.transformers_api
def test_mixer_state_is_constant_while_kv_cache_grows(hybrid):
    ids = torch.randint(3, 100, (1, 6))
    sizes = []
    with torch.no_grad():
        for n in (4, 16):
            out = hybrid.generate(
                input_ids=ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            sizes.append(output_cache(out).state_bytes())
    assert sizes[0]["mixer"] == sizes[1]["mixer"] > 0
    window = hybrid.model.windows[hybrid.config.layer_mixers.index("attention")]
    if window is None:
        assert sizes[1]["attention"] > sizes[0]["attention"] > 0
    else:  # a sliding-window layer keeps its last window - 1 tokens, however long the generation
        n_attention = hybrid.config.layer_mixers.count("attention")
        cfg = hybrid.config
        assert sizes[1]["attention"] == sizes[0]["attention"] == n_attention * 2 * 2 * (window - 1) * cfg.head_dim * 4
    assert sizes[0]["mixer"] == sum(mixer.state_numel() * 4 for _, mixer in mixers(hybrid))  # fp32 states


def test_training_forward_backward_reaches_mixer_parameters(hybrid):
    hybrid.train()
    try:
        ids = torch.randint(3, 100, (2, 10))
        hybrid(ids, labels=ids, use_cache=False).loss.backward()
        for i, mixer in mixers(hybrid):
            for name in [*mixer.fresh_parameter_names(), "q_proj.weight", "o_proj.weight"]:
                grad = mixer.get_parameter(name).grad
                assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, (i, name)
    finally:
        hybrid.zero_grad()
        hybrid.eval()


def test_gradient_checkpointing(hybrid):
    # transformers 5.23 renamed it; 5.17 has only the old name
    enable = getattr(hybrid, "activation_checkpointing_enable", None) or hybrid.gradient_checkpointing_enable
    disable = getattr(hybrid, "activation_checkpointing_disable", None) or hybrid.gradient_checkpointing_disable
    enable()
    hybrid.train()
    try:
        ids = torch.randint(3, 100, (1, 9))
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])  # two packed documents: cu_seqlens survives too
        torch.manual_seed(0)  # the same router noise for both forwards
        out = hybrid(ids, position_ids=positions, labels=ids, use_cache=False)
        assert out.aux_loss is not None and out.aux_loss.requires_grad  # SSE's balance loss survives checkpointing
        disable()
        torch.manual_seed(0)
        with torch.no_grad():
            plain = hybrid(ids, position_ids=positions, use_cache=False).logits
        enable()
        torch.testing.assert_close(out.logits.detach(), plain)  # the packing reached every layer
        out.loss.backward()
        for i, mixer in mixers(hybrid):
            for name in mixer.fresh_parameter_names():
                grad = mixer.get_parameter(name).grad
                assert grad is not None and grad.abs().sum() > 0, (i, name)
    finally:
        disable()
        hybrid.zero_grad()
        hybrid.eval()


def test_model_from_config_gets_the_mixer_initialisation(tiny_sources):
    from transformers import AutoConfig

    from raven_layers import HybridConfig, HybridForCausalLM

    source_config = AutoConfig.from_pretrained(tiny_sources["llama"])
    model = HybridForCausalLM(HybridConfig.from_source(source_config, ["raven", "attention"] * 2, SETTINGS))
    assert set(model.config.mixer_settings) == {"raven"}  # only the mixers in use are recorded
    mixer = model.model.layers[0].self_attn
    assert torch.equal(mixer.gate_weight, torch.zeros_like(mixer.gate_weight))
    torch.testing.assert_close(mixer.decay_bias, torch.full_like(mixer.decay_bias, 0.5413248546129181))
    assert 0.01 < mixer.router_weight.std().item() < 0.03


@pytest.mark.transformers_api
def test_rejects_a_foreign_cache_and_a_bad_mask(hybrid):
    from transformers import DynamicCache

    ids = torch.randint(3, 100, (1, 4))
    with pytest.raises(TypeError, match="the generation cache must be a HybridCache, got DynamicCache"):
        hybrid(ids, past_key_values=DynamicCache())
    with pytest.raises(
        ValueError, match=r"attention_mask must be a 2D padding mask of shape .* = \[1, 4\], got \(1, 3\)"
    ):
        hybrid(ids, attention_mask=torch.ones(1, 3, dtype=torch.long))


def test_loss_includes_the_balance_loss(hybrid):
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        out = hybrid(ids, labels=ids)
        lm_only = hybrid.loss_function(logits=out.logits, labels=ids, vocab_size=hybrid.config.vocab_size)
    sse_layers = [m for _, m in mixers(hybrid) if m.aux_loss is not None]
    assert len(sse_layers) == hybrid.config.layer_mixers.count("sse") > 0
    torch.testing.assert_close(out.aux_loss, sum(m.aux_loss for m in sse_layers))
    torch.testing.assert_close(out.loss, lm_only + out.aux_loss)


def test_packed_documents_equal_separate_forwards(hybrid):
    """Rows holding several documents (position ids restarting at 0) give each document exactly the logits it
    gets alone: no attention and no mixer state crosses a boundary, and gradients still reach the mixers."""
    # 18 > the mistral window of 8; 1-token documents are in the kernels' test below
    docs, ids, positions = packed_documents([[5, 9, 4], [18]], seed=7)  # ids [2, 18]
    packed = hybrid(ids, position_ids=positions, use_cache=False).logits
    alone = logits_alone(hybrid, docs)
    torch.testing.assert_close(packed.detach(), alone, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the same tokens read as one sequence per row differ: the test can fail
        assert not torch.allclose(hybrid(ids, use_cache=False).logits[0, 5:], alone[0, 5:], atol=1e-3)
    packed.float().pow(2).mean().backward()
    for _, mixer in mixers(hybrid):
        assert mixer.q_proj.weight.grad is not None and mixer.q_proj.weight.grad.abs().sum() > 0
    hybrid.zero_grad(set_to_none=True)


def test_packed_documents_found_ahead_give_the_same_logits(hybrid):
    """`packed_documents` (found on a training loop's host, padded with empty documents for a CUDA graph, or False
    for rows of one document each) stands for the forward's own search."""
    from raven_layers.masks import find_packed_documents

    _, ids, positions = packed_documents([[5, 9, 4], [18]], seed=7)
    documents, cu = find_packed_documents(positions)
    padded = torch.cat([cu, cu[-1:].expand(3)])  # three empty documents at the end
    with torch.no_grad():
        found = hybrid(ids, position_ids=positions, use_cache=False).logits
        ahead = hybrid(ids, position_ids=positions, use_cache=False, packed_documents=(documents, padded)).logits
        torch.testing.assert_close(ahead, found, rtol=1e-5, atol=1e-6)
        single = torch.arange(ids.shape[1]).expand_as(ids)
        plain = hybrid(ids, position_ids=single, use_cache=False).logits
        torch.testing.assert_close(
            hybrid(ids, position_ids=single, use_cache=False, packed_documents=False).logits, plain
        )


def test_packing_is_found_the_way_transformers_finds_it():
    from raven_layers.masks import find_packed_documents

    assert find_packed_documents(torch.arange(6).expand(2, -1)) is None
    documents, cu = find_packed_documents(torch.tensor([[0, 1, 0, 0, 1, 2], [0, 1, 2, 3, 0, 1]]))
    assert documents.tolist() == [[0, 0, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1]]
    assert cu.tolist() == [0, 2, 3, 6, 10, 12]


def test_packed_documents_under_the_kernels(tiny_sources):
    """The kernels take packed documents directly (cu_seqlens; SILA's convolution restarts at each document, SSE
    regroups by (document, head, partition)): the same logits as each document alone on the PyTorch path, and
    gradients reach Raven's and SILA's mixers (SSE's packed gradients: tests/kernels/test_sse.py; here SSE comes
    first and nothing before it trains, so the backward skips its interpreted kernels, most of the time)."""
    from raven_layers.backend import use_backend

    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    kinds = plan_layers([("sse", "1"), ("raven", "2"), ("sila", "3")], source.config.num_hidden_layers)
    # SSE at 2 partitions, top-1 (not 4, top-2): its interpreted heads were most of the time; the same packed path
    settings = {**SETTINGS, "sse": {**SETTINGS["sse"], "num_partitions": 2, "top_k": 1}}
    model = perturb_fresh_parameters(build_hybrid(source, kinds, settings))
    # three documents (the interpreter runs a chunk per document and SSE head): a 1-token one mid-pack, one of 17
    docs, ids, positions = packed_documents([[16, 1], [17]], seed=3)  # ids [2, 17]
    with use_backend("torch"):
        alone = logits_alone(model, docs)
    trained = [mixer for i, mixer in mixers(model) if kinds[i] != "sse"]
    model.requires_grad_(False)
    for mixer in trained:
        mixer.requires_grad_(True)
    with use_backend("triton"):
        packed = model(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed.detach(), alone, rtol=1e-4, atol=1e-4)
    packed.float().pow(2).mean().backward()
    for mixer in trained:
        assert mixer.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.transformers_api
def test_set_attention_window_equals_converting_with_it(tiny_sources):
    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    kinds = plan_layers(ASSIGNMENTS["llama"], source.config.num_hidden_layers)
    settings = {k: v for k, v in SETTINGS.items() if k in kinds}
    windows = [5 if kind == "attention" else None for kind in kinds]
    torch.manual_seed(0)
    converted = perturb_fresh_parameters(build_hybrid(source, kinds, settings, attention_windows=windows))
    later = build_hybrid(source, kinds, settings)
    later.load_state_dict(converted.state_dict())
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = later(ids).logits
        later.set_attention_window(5)
        windowed = later(ids).logits
        out = later(ids[:, :9], use_cache=True)  # the cache made after the change keeps only the window
        steps = [out.logits, later(ids[:, 9:], cache=output_cache(out), use_cache=True).logits]
    assert later.config.attention_windows == windows
    torch.testing.assert_close(windowed, converted(ids).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), windowed, rtol=1e-4, atol=1e-5)
    assert (windowed - full).abs().max() > 1e-3  # 13 tokens > 5: the window changes the attention layers
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="attention window"):
            later.set_attention_window(bad)
    first = kinds.index("attention")
    later.set_attention_window(5, layers=[first])  # one kept layer windowed, the others full again
    assert later.config.attention_windows == [5 if i == first else None for i in range(len(kinds))]
    one = build_hybrid(source, kinds, settings, attention_windows=later.config.attention_windows)
    one.load_state_dict(converted.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(later(ids).logits, one(ids).logits)
    with pytest.raises(ValueError, match=r"attention window on layers \[\d+\]: only kept attention layers"):
        later.set_attention_window(5, layers=[next(i for i, k in enumerate(kinds) if k != "attention")])


def test_a_mixer_setting_edited_after_saving_is_named_not_a_transformers_refusal(tiny_sources, tmp_path):
    """config.json's mixer_settings changed after the weights were saved: the load names the weight, its layer,
    its mixer, the settings and both shapes (HybridConfigError, a ValueError), where transformers raises a bare
    RuntimeError about ignore_mismatched_sizes."""
    import json

    from raven_layers import HybridForCausalLM
    from raven_layers.configuration_hybrid import HybridConfigError

    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"])
    kinds = plan_layers([("raven", "1")], teacher.config.num_hidden_layers)
    build_hybrid(teacher, kinds, {"raven": {"num_slots": 8, "top_k": 2}}).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.loads(path.read_text())
    config["mixer_settings"]["raven"]["num_slots"] = 16
    path.write_text(json.dumps(config))
    with pytest.raises(HybridConfigError) as info:
        HybridForCausalLM.from_pretrained(tmp_path / "m")
    message = str(info.value)
    assert "model.layers.1.self_attn.router_weight of layer 1 (raven) is [16," in message
    assert "'num_slots': 16" in message and "config.json was changed after the weights were saved" in message
    config["mixer_settings"]["raven"]["num_slots"] = 8  # set back: it loads
    path.write_text(json.dumps(config))
    HybridForCausalLM.from_pretrained(tmp_path / "m")
