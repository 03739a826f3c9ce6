"""SILA's token loss weights (Algorithm 1): the streamed computation equals the one on full attention maps."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert.train.token_weights import plot_token_weights, schedule_weights, token_weights, token_weights_naive
from tests.conftest import tiny_config, tiny_tokenizer

T = 37  # prime: no query block below divides it


def tiny_model(model_type: str, attn_implementation: str = "eager", **overrides):
    # A larger init than the default makes the random attention peaky, so that many weights pass tau.
    torch.manual_seed(0)
    config = tiny_config(model_type, initializer_range=0.2, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def reference(model, input_ids, attention_mask=None, tau=0.2, lam=0.5):
    """Algorithm 1 on the eager model's own attention maps (position ids from the mask, as token_weights uses)."""
    position_ids = None
    if attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, output_attentions=True)
    return token_weights_naive(out.attentions, tau=tau, lam=lam, attention_mask=attention_mask)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def random_ids(batch, length, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def one_hot_rows(length, rows: dict[int, dict[int, float]]):
    """[1, 1, 1, T, T] attention maps: row t holds the given {key: probability}; other rows attend to themselves."""
    a = torch.eye(length)
    for t, row in rows.items():
        a[t] = 0
        for j, p in row.items():
            a[t, j] = p
    return a[None, None, None]


def test_sink_only_token_gets_zero():
    w = token_weights_naive(one_hot_rows(8, {5: {0: 1.0}}))
    assert w[0, 5] == 0
    assert torch.all(w == 0)  # the other rows attend to themselves: distance 0


def test_token_retrieving_six_back():
    w = token_weights_naive(one_hot_rows(8, {7: {1: 1.0}}), tau=0.2, lam=0.5)
    assert w[0, 7].item() == pytest.approx(math.log(0.5 * 6 + 1))
    assert torch.all(w[0, :7] == 0)


def test_weights_below_tau_are_ignored_and_not_renormalised():
    # row 6: 0.1 on each of keys 1, 2, 3 (all below tau), 0.7 on key 4 (2 back); row 7: exactly tau is kept
    maps = one_hot_rows(8, {6: {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.7}, 7: {0: 0.6, 2: 0.2, 6: 0.2}})
    w = token_weights_naive(maps, tau=0.2, lam=0.5)
    assert w[0, 6].item() == pytest.approx(math.log(0.5 * 0.7 * 2 + 1))
    assert w[0, 7].item() == pytest.approx(math.log(0.5 * (0.2 * 5 + 0.2 * 1) + 1))
    assert token_weights_naive(maps, tau=0.75)[0, 6] == 0


def test_average_over_layers_and_heads():
    far, near = one_hot_rows(8, {7: {1: 1.0}}), one_hot_rows(8, {})
    maps = torch.cat([torch.cat([far, near], dim=2), torch.cat([near, near], dim=2)])  # [L=2, B=1, H=2, T, T]
    w = token_weights_naive(maps)
    assert w[0, 7].item() == pytest.approx(math.log(0.5 * 6 / 4 + 1))
    assert torch.allclose(token_weights_naive(list(maps)), w)  # a list of [B, H, T, T] maps works too


def test_naive_padding_moves_the_sink_and_zeroes_pads():
    maps = one_hot_rows(8, {4: {2: 1.0}, 7: {3: 0.5, 5: 0.5}})
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    w = token_weights_naive(maps, attention_mask=mask)
    assert w[0, 4] == 0  # key 2 is the first real token: the sink
    assert w[0, 7].item() == pytest.approx(math.log(0.5 * (0.5 * 4 + 0.5 * 2) + 1))
    assert torch.all(w[0, :2] == 0)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("query_block", [5, 16, 256])
def test_streamed_equals_full_maps(model_type, query_block):
    model = tiny_model(model_type)
    ids = random_ids(2, T)
    for tau in (0.2, 0.05):
        expected = reference(model, ids, tau=tau)
        got = token_weights(model, ids, tau=tau, query_block=query_block)
        assert got.shape == (2, T) and got.dtype == torch.float32
        assert (expected > 0).float().mean() > 0.5  # a meaningful comparison: most tokens retrieve something
        assert rel_err(got, expected) < 1e-5


@pytest.mark.parametrize("num_key_value_heads", [1, 4])  # MQA and plain multi-head (the fixture's 2 is GQA)
def test_streamed_equals_full_maps_kv_heads(num_key_value_heads):
    model = tiny_model("llama", num_key_value_heads=num_key_value_heads)
    ids = random_ids(2, T)
    assert rel_err(token_weights(model, ids, query_block=7), reference(model, ids)) < 1e-5


def test_sliding_window_layers():
    model = tiny_model("mistral")  # every layer windowed over 8 tokens
    ids = random_ids(2, T)
    assert rel_err(token_weights(model, ids, query_block=6), reference(model, ids)) < 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding(model_type, side):
    model = tiny_model(model_type)
    ids = random_ids(2, T)
    pad, n = 9, T - 9
    mask = torch.ones(2, T, dtype=torch.long)
    if side == "left":
        mask[1, :pad] = 0
        real = slice(pad, T)
    else:
        mask[1, n:] = 0
        real = slice(0, n)
    ids[1][mask[1] == 0] = 0

    got = token_weights(model, ids, attention_mask=mask, query_block=8)
    assert rel_err(got, reference(model, ids, attention_mask=mask)) < 1e-5
    assert torch.all(got[1][mask[1] == 0] == 0)
    alone = token_weights(model, ids[1:, real], query_block=8)[0]
    assert rel_err(got[1, real], alone) < 1e-5
    assert rel_err(got[0], token_weights(model, ids[:1])[0]) < 1e-5  # the unpadded row is unaffected


def test_any_attention_implementation_and_training_flag_restored():
    eager, sdpa = tiny_model("qwen3"), tiny_model("qwen3", attn_implementation="sdpa")
    sdpa.train()
    ids = random_ids(1, T)
    assert rel_err(token_weights(sdpa, ids, query_block=4), token_weights(eager, ids)) < 1e-5
    assert sdpa.training


def test_schedule_weights():
    w = torch.rand(2, 11)
    assert torch.allclose(schedule_weights(w, 0), 1 + w)
    assert torch.allclose(schedule_weights(w, 1e9), math.exp(-1) + w)
    assert torch.allclose(schedule_weights(w, 1e3, tau_tokens=1e3), math.exp(-1) + w)
    assert torch.allclose(schedule_weights(w, 5e10), w, atol=1e-12)
    offsets = [(schedule_weights(w, s) - w).mean().item() for s in (0, 1e8, 1e9, 5e9, 2e10)]
    assert all(a > b for a, b in zip(offsets, offsets[1:]))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0
    assert torch.all(schedule_weights(w, 0, attention_mask=mask)[0, :3] == 0)


def test_plot_writes_png(tmp_path):
    text = "The pass key is 71432. Remember it: $71432$.\nThe grass is green. " * 3 + "The pass key is"
    tokenizer = tiny_tokenizer()
    tokens = [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]
    weights = torch.rand(len(tokens))
    path = plot_token_weights(tokens, weights, tmp_path / "weights.png", title="SILA loss weights", line_chars=40)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


@pytest.mark.parametrize("query_block", [5, 64])
def test_packed_documents_get_the_weights_they_get_alone(query_block):
    """Rows of packed documents (position ids restarting at 0): every document has its own sink and attends only
    within itself, so its weights equal those of the document alone, streamed and naive alike."""
    model = tiny_model("llama", attn_implementation="sdpa")
    lengths = [[11, 19, 7], [37]]
    ids = random_ids(2, T, seed=5)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    packed = token_weights(model, ids, position_ids=positions, query_block=query_block)
    alone = torch.zeros_like(packed)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            alone[b, start : start + n] = token_weights(model, ids[b : b + 1, start : start + n])[0]
            start += n
    assert rel_err(packed, alone) < 1e-5
    assert alone[0, 11] == 0 and alone[0, 30] == 0  # each document's first token is its own sink
    assert not torch.allclose(token_weights(model, ids)[0, 11:], alone[0, 11:])  # packing changes the answer
    eager = tiny_model("llama")
    with torch.no_grad():
        maps = eager(ids, position_ids=positions, use_cache=False, output_attentions=True).attentions
    naive = token_weights_naive(maps, position_ids=positions)
    assert rel_err(naive, token_weights(eager, ids, position_ids=positions)) < 1e-5


def test_kernels_equal_eager():
    """The weights stage runs the fused Triton kernel on CUDA (recipe field token_weights.kernel; interpreted here)
    or the compiled blocks of queries: the same weights as the eager reference for windowed layers, packed
    documents, padding and a last block shorter than the others."""
    model = tiny_model("mistral")  # every layer windowed over 8 tokens
    ids = random_ids(2, T, seed=3)
    positions = torch.cat([torch.arange(n) for n in (11, 19, T - 30)])[None].repeat(2, 1)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :9] = 0
    for extra in ({"position_ids": positions}, {"attention_mask": mask}):
        eager = token_weights(model, ids, query_block=12, kernel="eager", **extra)
        assert (eager > 0).float().mean() > 0.3
        for kernel in ("triton", "compiled"):
            assert rel_err(token_weights(model, ids, query_block=12, kernel=kernel, **extra), eager) < 1e-5, kernel
    with pytest.raises(ValueError, match="kernel must be one of 'auto', 'triton', 'compiled', 'eager'; got 'fused'"):
        token_weights(model, ids, kernel="fused")


def test_bf16_forward_moves_the_weights_only_slightly():
    """precision "bf16" runs the reference under bf16 autocast: other roundings (so not equal), the same weights up
    to them, and still none at padding."""
    model = tiny_model("llama", attn_implementation="sdpa")
    ids, mask = random_ids(2, T, seed=5), torch.ones(2, T, dtype=torch.long)
    mask[0, :6] = 0
    full = token_weights(model, ids, mask, kernel="eager")
    half = token_weights(model, ids, mask, kernel="eager", precision="bf16")
    assert half.dtype == torch.float32 and not torch.equal(half, full)
    assert torch.corrcoef(torch.stack([full.flatten(), half.flatten()]))[0, 1] > 0.98
    assert (half[0, :6] == 0).all()
    with pytest.raises(ValueError, match=r"precision = 'fp16' is not allowed; expected one of \['float32', 'bf16'\]"):
        token_weights(model, ids, precision="fp16")


def test_weight_table_of_chosen_rows(tmp_path):
    """weight_table(only=...): the chosen rows get the weights the whole table gives them, the others NaN; a
    checkpoint of one choice does not resume another."""
    from raven_convert.train.data import PackedDataset
    from raven_convert.train.token_weights import weight_table

    model = tiny_model("llama", attn_implementation="sdpa")
    ids = random_ids(6, T, seed=9).int()
    rows = PackedDataset({"input_ids": ids, "document_ids": ids * 0, "position_ids": torch.arange(T).repeat(6, 1)})
    whole = weight_table(model, rows, 2, log=lambda m: None)
    only = torch.tensor([4, 1, 2])
    table = weight_table(model, rows, 2, out_dir=tmp_path, save_every=1, log=lambda m: None, only=only)
    assert torch.equal(table[only], whole[only]) and table[[0, 3, 5]].isnan().all()
    with pytest.raises(ValueError, match="holds weights of other data"):
        weight_table(model, rows, 2, out_dir=tmp_path, log=lambda m: None, only=torch.tensor([0, 1]))
