"""Attention sinks (sinks.py): a windowed layer also sees each sequence's first S tokens, in the full forward, over
both caches (decode, chunked prefill, rings that wrap), under left padding, short prompts and packing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_layers import HybridConfig, HybridForCausalLM, StaticHybridCache, output_cache
from raven_layers.backend import use_backend
from raven_layers.configuration_hybrid import HybridConfigError
from tests.conftest import tiny_config
from tests.raven_layers.test_hybrid_model import logits_alone, packed_documents, perturb_fresh_parameters

pytestmark = pytest.mark.transformers_api
WINDOW, SINKS = 5, 2
SETTINGS = {"sila": {"chunk_size": 4}}


def make(sinks: int, window: int | None = WINDOW) -> HybridForCausalLM:
    """SILA, a windowed attention layer, SILA, full attention: 4 layers of a tiny Llama (the same weights each call)."""
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=4)).eval()
    kinds = plan_layers([("sila", "0,2")], 4)
    windows = [window, None, None, None] if window is None else [None, window, None, None]
    hybrid = build_hybrid(source, kinds, SETTINGS, attention_windows=windows, attention_sinks=sinks)
    hybrid.config._attn_implementation = "sdpa"
    return perturb_fresh_parameters(hybrid).eval()


@pytest.fixture(scope="module")
def hybrid():
    return make(SINKS)


def padded_batch(lengths, seed: int):
    """Left-padded prompts of the given real lengths: (prompts, ids [B, width], mask [B, width])."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - n for n in lengths])[:, None]).long()
    return prompts, ids, mask


@torch.no_grad()
def test_sinks_are_what_lies_between_the_window_and_full_attention(hybrid):
    """Every token a sink is full attention; no sink is the bare window; 2 sinks differ from both past the window."""
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    sinks = hybrid(ids).logits
    full, bare, every = make(0, None)(ids).logits, make(0)(ids).logits, make(13)(ids).logits
    torch.testing.assert_close(every, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sinks[:, :WINDOW], bare[:, :WINDOW], rtol=1e-5, atol=1e-6)  # inside the window
    for other in (full, bare):
        assert (sinks[:, WINDOW + 1 :] - other[:, WINDOW + 1 :]).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_mask_is_the_window_and_each_rows_first_positions(hybrid, impl):
    """Without a cache: query q sees key k <= q when q - k < W or k's position (real tokens before it) is < S."""
    _, ids, mask = padded_batch([13, 9], seed=1)
    hybrid.config._attn_implementation = impl
    try:
        got = hybrid.model._attention_mask(mask, 13, 0, WINDOW, torch.zeros(1), None, None)
    finally:
        hybrid.config._attn_implementation = "sdpa"
    got = got if impl == "sdpa" else got == 0
    positions = mask.cumsum(-1) - 1
    q, k = torch.arange(13)[:, None], torch.arange(13)[None, :]
    for b in range(2):
        want = (k <= q) & ((q - k < WINDOW) | (positions[b][None, :] < SINKS)) & mask[b].bool()[None, :]
        want |= k == q  # a padded query sees itself
        assert torch.equal(got[b, 0], want)


@torch.no_grad()
@pytest.mark.parametrize(("kind", "backend"), [("dynamic", "torch"), ("static", "torch"), ("static", "triton")])
def test_decode_equals_a_full_forward(hybrid, kind, backend):
    """Prefill 1 token, then 12 steps: the second sink comes in a decode step, the ring wraps twice, the sinks stay."""
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(2))
    full = hybrid(ids, use_cache=False).logits
    cache = StaticHybridCache(hybrid.config, batch_size=2, max_length=16) if kind == "static" else None
    with use_backend(backend):
        out = hybrid(ids[:, :1], cache=cache, use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(1, 13):
            steps.append(hybrid(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_chunked_prefill_of_a_padded_batch_equals_one_prefill(hybrid, kind):
    """Chunks of 4 over 15 columns, one row with 3 real tokens: its sinks arrive in the last chunk."""
    _, ids, mask = padded_batch([15, 3, 11], seed=3)
    nxt = torch.randint(3, 100, (3, 1), generator=torch.Generator().manual_seed(4))
    logits = []
    for chunk in (15, 4):
        cache = StaticHybridCache(hybrid.config, batch_size=3, max_length=16) if kind == "static" else None
        parts = []
        for i in range(0, 15, chunk):
            out = hybrid(ids[:, i : i + chunk], attention_mask=mask[:, : i + chunk], cache=cache, use_cache=True)
            parts.append(out.logits)
            cache = output_cache(out)
        full_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        parts.append(hybrid(nxt, attention_mask=full_mask, cache=cache, use_cache=True).logits)
        logits.append(torch.cat(parts, dim=1))
    real = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1).bool()
    torch.testing.assert_close(logits[1][real], logits[0][real], rtol=1e-4, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_padded_generation_equals_each_prompt_alone(hybrid, implementation):
    """Left padding moves a row's sinks to its own first tokens; a 1-token prompt gets its second sink while
    decoding. Greedy tokens of the batch equal each prompt's alone, on either cache."""
    prompts, ids, mask = padded_batch([9, 1, 6], seed=5)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    batched = hybrid.generate(ids, attention_mask=mask, cache_implementation=implementation, **kwargs)[:, 9:]
    for i, p in enumerate(prompts):
        alone = hybrid.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
        assert torch.equal(batched[i], alone[0, len(p) :]), f"prompt {i}"
    scores = dict(output_logits=True, return_dict_in_generate=True, **kwargs)
    short = [m.generate(prompts[1][None], **scores).logits[-1] for m in (hybrid, make(0))]
    assert (short[0] - short[1]).abs().max() > 1e-3  # the sinks matter to the 1-token prompt's last step


def test_packed_documents_keep_their_own_sinks(hybrid):
    docs, ids, positions = packed_documents([[9, 8], [17]], seed=6)
    with torch.no_grad():
        packed = hybrid(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed, logits_alone(hybrid, docs), rtol=1e-4, atol=1e-5)


def test_sinks_are_saved_carried_and_checked(hybrid, tmp_path):
    hybrid.save_pretrained(tmp_path / "m")
    assert HybridConfig.from_pretrained(tmp_path / "m").attention_sinks == SINKS
    further = HybridConfig.from_source(hybrid.config, ["sila", "attention", "sila", "sila"], SETTINGS)
    assert further.attention_sinks == SINKS and further.attention_windows[1] == WINDOW
    for bad in (-1, 1.5, True):
        with pytest.raises(HybridConfigError, match=rf"attention_sinks = {bad!r}; expected an integer >= 0"):
            HybridConfig.from_source(hybrid.config, hybrid.config.layer_mixers, SETTINGS, attention_sinks=bad)
    with pytest.raises(ValueError, match="attention sinks -2 not allowed"):
        hybrid.set_attention_window(WINDOW, [1], sinks=-2)


def test_set_attention_window_sets_the_sinks_and_flash_attention_is_refused():
    model = make(0)
    model.set_attention_window(WINDOW, [1], sinks=SINKS)
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, make(SINKS)(ids).logits)
        model.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="attention_sinks = 2 needs the 'sdpa' or 'eager' attention"):
            model.model._attention_mask(None, 12, 0, WINDOW, torch.zeros(1), None, None)
