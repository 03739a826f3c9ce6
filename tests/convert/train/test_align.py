"""Stage 1: every converted layer gets closer to the teacher's attention; nothing but the mixers changes."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.align import align, alignment_losses, attention_taps
from raven_convert.train.common import mixer_parameters
from raven_layers.common import Mixer

SETTINGS = {"raven": {"num_slots": 16, "top_k": 4}, "sse": {"lora_rank": 8}, "sila": {}}


def batches(seed: int, n: int, B: int = 4, T: int = 24):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(3, 100, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, :5] = 0  # one left-padded row: padding must not count
        yield {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def models(tiny_sources):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    kinds = plan_layers([("raven", "0"), ("sse", "1"), ("sila", "2")], 4)
    return teacher, build_hybrid(teacher, kinds, SETTINGS)


def held_out_losses(teacher, hybrid):
    batch = next(batches(seed=99, n=1))
    with torch.no_grad():
        return {i: v.item() for i, v in alignment_losses(teacher, hybrid, **batch).items()}


def test_alignment_lowers_every_layer_and_touches_only_mixers(models):
    teacher, hybrid = models
    before = held_out_losses(teacher, hybrid)
    mixers = {id(p) for p in mixer_parameters(hybrid)}
    frozen = {n: p.detach().clone() for n, p in hybrid.named_parameters() if id(p) not in mixers}
    history = align(teacher, hybrid, batches(seed=0, n=60), steps=60, lr=3e-3, warmup_steps=5, log_every=0)
    after = held_out_losses(teacher, hybrid)
    assert set(before) == {0, 1, 2} and len(history) == 60
    for layer in before:
        assert after[layer] < 0.8 * before[layer], (layer, before[layer], after[layer])
    assert all(torch.equal(p, frozen[n]) for n, p in hybrid.named_parameters() if n in frozen)
    assert all(p.requires_grad for p in hybrid.parameters())  # flags restored
    assert history[-1]["tokens_per_second"] > 0 and set(history[-1]["layers"]) == {0, 1, 2}


def test_taps_record_the_teachers_attention_input_and_output(models):
    teacher, _ = models
    ids = next(batches(seed=1, n=1))["input_ids"]
    with torch.no_grad(), attention_taps(teacher, [1, 3]) as captured:
        out = teacher(ids, output_hidden_states=True)
    for i in (1, 3):
        layer = teacher.model.layers[i]
        x = layer.input_layernorm(out.hidden_states[i])  # what the attention of layer i reads
        torch.testing.assert_close(captured[i][0], x)
        residual = out.hidden_states[i] + captured[i][1]  # attention output, added back
        mlp_out = layer.mlp(layer.post_attention_layernorm(residual))
        expected_next = out.hidden_states[i + 1] if i + 1 < len(teacher.model.layers) else None
        if expected_next is not None:
            torch.testing.assert_close(residual + mlp_out, expected_next)


def test_a_fresh_run_fits_centred_routers_to_the_teachers_inputs_and_a_resumed_one_does_not(
    tiny_sources, tmp_path, monkeypatch
):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    settings = {name: values | {"router_init": "centred"} for name, values in SETTINGS.items() if name != "sila"}
    hybrid = build_hybrid(teacher, plan_layers([("raven", "0"), ("sila", "1"), ("sse", "2")], 4), settings)
    first = next(batches(seed=0, n=1))
    calls = []
    fit = Mixer.calibrate

    def recorded(self, x, mean):
        if self.calibrates:
            calls.append((self.layer_idx, x))
        fit(self, x, mean)

    monkeypatch.setattr(Mixer, "calibrate", recorded)
    align(teacher, hybrid, batches(seed=0, n=2), steps=2, lr=1e-6, log_every=0, out_dir=tmp_path, save_every=1)
    assert [layer for layer, _ in calls] == [0, 2]  # the Raven and SSE layers, once each
    with torch.no_grad(), attention_taps(teacher, [0, 2]) as captured:
        teacher(**first)
    real = first["attention_mask"].bool()
    for layer, x in calls:
        torch.testing.assert_close(x, captured[layer][0][real])  # the first batch's real tokens
        mixer = hybrid.model.layers[layer].self_attn
        w = getattr(mixer, mixer.router_weight_name).detach()
        offsets = w @ x.mean(0)  # what every token would share: about nothing after 2 tiny steps
        assert offsets.abs().max() < 0.05 * (x @ w.T).std(0).min(), layer
    calls.clear()
    align(teacher, hybrid, batches(seed=0, n=3), steps=3, lr=1e-6, log_every=0, out_dir=tmp_path, save_every=1)
    assert calls == []  # resumed after step 2: the checkpoint holds the fitted and trained routers


def test_non_finite_loss_stops_with_a_clear_error(models):
    teacher, hybrid = models
    with torch.no_grad():
        hybrid.model.layers[2].self_attn.v_proj.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"alignment loss is not finite at step 1 in layer\(s\) \[2\]"):
        align(teacher, hybrid, batches(seed=0, n=2), steps=2, log_every=0)


def test_sse_balance_loss_counts_in_align(models):
    # the SSE layer's balance loss joins its MSE (as in stage 2), so its router learns during align too
    teacher, hybrid = models
    history = align(teacher, hybrid, batches(seed=0, n=2), steps=2, log_every=0)
    for record in history:
        assert record["aux"] > 0
        assert record["loss"] == pytest.approx(sum(record["layers"].values()) + record["aux"], rel=1e-5)
    mixer = hybrid.model.layers[1].self_attn
    mixer.settings = dataclasses.replace(mixer.settings, balance_coef=0.0)  # off: no aux, the MSE alone
    assert "aux" not in align(teacher, hybrid, batches(seed=1, n=1), steps=1, log_every=0)[0]


def test_a_non_finite_step_applies_no_update(models, monkeypatch):
    """A step's losses are read back during the next step: a non-finite one skips its own update on the device
    and raises before the next update, so the mixers stay as the last good step left them."""
    import copy

    from raven_convert.train import align as align_module

    teacher, hybrid = models
    reference = copy.deepcopy(hybrid)
    align(teacher, reference, batches(seed=0, n=1), steps=1, log_every=0, seed=0)
    real, calls = align_module.alignment_losses, []

    def nan_at_second(*args, **kwargs):
        losses = real(*args, **kwargs)
        calls.append(1)
        return {i: v * float("nan") for i, v in losses.items()} if len(calls) == 2 else losses

    monkeypatch.setattr(align_module, "alignment_losses", nan_at_second)
    with pytest.raises(FloatingPointError, match=r"not finite at step 2 in layer\(s\) \[0, 1, 2\]"):
        align(teacher, hybrid, batches(seed=0, n=3), steps=3, log_every=0, seed=0)
    assert len(calls) == 3  # the third step ran its forward, never its update
    for (name, p), q in zip(hybrid.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_document_mask_is_the_one_transformers_builds(models):
    """The packed documents' mask align hands an sdpa teacher: the same outputs as transformers' own, which it
    finds by reading the position ids back."""
    from raven_convert.train.common import document_mask
    from raven_layers.masks import find_packed_documents

    teacher, hybrid = models
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in (7, 1, 16)]).repeat(2, 1)
    documents, _ = find_packed_documents(positions)
    with torch.no_grad():  # no cache: transformers finds packed documents only then
        own = teacher(ids, position_ids=positions, use_cache=False).logits
        given = teacher(ids, position_ids=positions, attention_mask=document_mask(documents), use_cache=False).logits
        alone = torch.cat([teacher(ids[:, a:b], use_cache=False).logits for a, b in ((0, 7), (7, 8), (8, 24))], 1)
    torch.testing.assert_close(given, own, rtol=0, atol=0)
    torch.testing.assert_close(given, alone)  # each document as if alone
    packed = find_packed_documents(positions)
    found = alignment_losses(teacher, hybrid, ids, position_ids=positions)
    ahead = alignment_losses(teacher, hybrid, ids, position_ids=positions, packed=packed)
    assert found.keys() == ahead.keys() and all(torch.equal(found[i], ahead[i]) for i in found)


def test_one_layer_at_a_time_gives_the_summed_losss_gradients(models):
    """alignment_losses(backward=True), what an eager align step runs so that it holds one layer's activations at a
    time, leaves the gradients one backward of the summed loss (SSE's balance loss with it) leaves."""
    teacher, hybrid = models
    batch = next(batches(seed=5, n=1))
    params = mixer_parameters(hybrid)
    grads = {}
    for per_layer in (False, True):
        hybrid.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # Raven's router noise: the same draw both times
        losses = alignment_losses(teacher, hybrid, **batch, backward=per_layer)
        if not per_layer:
            aux = [hybrid.model.layers[i].self_attn.aux_loss for i in losses]
            (sum(losses.values()) + sum(a.float() for a in aux if a is not None)).backward()
        else:
            assert all(not loss.requires_grad for loss in losses.values())
        grads[per_layer] = [p.grad.clone() for p in params]
    assert any(g.abs().sum() > 0 for g in grads[True])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_hybrid_teacher_aligns_only_the_layers_it_runs_as_attention(tiny_sources):
    """A further conversion aligns against the hybrid it starts from: only the layers that hybrid still runs as
    attention, on its own hidden states (packed documents reach it as the student takes them); its mixer stays."""
    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    start = build_hybrid(source, plan_layers([("sila", "1")], 4), {})
    further = build_hybrid(start, plan_layers([("sila", "1,3"), ("raven", "2")], 4), SETTINGS)
    kept = {n: p.detach().clone() for n, p in further.named_parameters() if ".1.self_attn." in n}
    positions = torch.cat([torch.arange(n) for n in (10, 14)]).repeat(4, 1)  # two documents a row

    def packed(seed: int, n: int):
        for batch in batches(seed, n):
            yield {"input_ids": batch["input_ids"], "position_ids": positions}

    before = alignment_losses(start, further, **next(packed(99, 1)))
    history = align(start, further, packed(0, 40), steps=40, lr=3e-3, warmup_steps=5, log_every=0)
    after = alignment_losses(start, further, **next(packed(99, 1)))
    assert set(before) == set(history[-1]["layers"]) == {2, 3}
    assert all(after[i] < before[i] for i in (2, 3))
    assert all(torch.equal(p, kept[n]) for n, p in further.named_parameters() if n in kept)
    with pytest.raises(ValueError, match="align has no layer to align"):
        align(further, further, packed(0, 1), steps=1, log_every=0)
