"""The mixer-memory analyses: routing and gates recomputed exactly, the papers' invariants, and every plot."""

from pathlib import Path

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid
from raven_convert.evaluate import analysis as A
from raven_convert.evaluate import analysis_plots as P
from raven_layers import sila_chunked
from tests.conftest import tiny_config

KINDS = ["raven", "sse", "sila", "attention"]
SETTINGS = {"raven": {"num_slots": 16, "top_k": 4}, "sse": {"lora_rank": 8, "top_k": 1}, "sila": {}}
RAVEN, SSE, SILA = 0, 1, 2
T = 24


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    hybrid = build_hybrid(source, KINDS, SETTINGS)
    with torch.no_grad():  # untrained gates are constants; move every fresh parameter so the gates see the input
        for i, kind in enumerate(KINDS):
            if kind != "attention":
                mixer = hybrid.model.layers[i].self_attn
                for name in sorted(mixer.fresh_parameter_names()):  # sorted: a set's order varies by process
                    param = mixer.get_parameter(name)
                    param.add_(0.3 * torch.randn_like(param))
    return hybrid


@pytest.fixture(scope="module")
def ids():
    # distinct ids, so each token's layer-0 input is a different vector (the forced routing below needs it)
    return torch.randperm(120, generator=torch.Generator().manual_seed(1))[:T] + 3


def test_capture_gets_each_mixer_input_and_leaves_no_hooks(model, ids):
    inputs, out = A.capture_mixer_inputs(model, ids)
    assert sorted(inputs) == [RAVEN, SSE, SILA]
    assert all(x.shape == (1, T, model.config.hidden_size) for x in inputs.values())
    layer0 = model.model.layers[0]
    torch.testing.assert_close(inputs[RAVEN], layer0.input_layernorm(model.model.embed_tokens(ids[None])))
    assert out.logits.shape == (1, T, model.config.vocab_size)
    assert all(not layer.self_attn._forward_pre_hooks for layer in model.model.layers)


def test_raven_writes_top_k_slots_and_esl_sums_to_top_k(model, ids):
    writes = A.raven_slot_writes(model, ids, RAVEN)
    assert writes.shape == (T, 2, 16) and writes.dtype == torch.bool
    assert (writes.sum(-1) == 4).all()  # exactly K slots per token and head
    esl = A.effective_sequence_length(writes)
    assert esl.shape == (2, 16)
    torch.testing.assert_close(esl.sum(-1), torch.full((2,), 4.0))


def test_slot_allocation_partitions_the_slots(model, ids):
    writes = A.raven_slot_writes(model, ids, RAVEN)
    special = torch.zeros(T, dtype=torch.bool)
    special[10:13] = True
    category = A.slot_allocation(writes, special)
    assert category.shape == (2, 16)
    counts = sum((category == c).long() for c in A.CATEGORY_NAMES)
    assert (counts == 1).all()  # every slot in exactly one category
    by_special, by_other = writes[special].any(0), writes[~special].any(0)
    assert ((category == A.SPECIAL_ONLY) == (by_special & ~by_other)).all()
    assert ((category == A.BOTH) == (by_special & by_other)).all()
    assert ((category == A.NEVER) == ~(by_special | by_other)).all()


def test_a_token_routed_to_a_dedicated_slot_shows_up_red(model, ids):
    passkey, head, slot = 17, 1, 5
    mixer = model.model.layers[RAVEN].self_attn
    M = mixer.settings.num_slots
    inputs, _ = A.capture_mixer_inputs(model, ids, [RAVEN])
    x = inputs[RAVEN][0].double()  # [T, hidden]
    target = torch.full((T, 1), -12.0, dtype=torch.float64)
    target[passkey] = 12.0  # router logit of the dedicated slot: high for the passkey token, low for all others
    row = torch.linalg.lstsq(x, target).solution[:, 0]  # T distinct inputs < hidden: solved exactly
    saved = mixer.router_weight.detach().clone()
    try:
        with torch.no_grad():
            mixer.router_weight[head * M + slot] = row.float()
        writes = A.raven_slot_writes(model, ids, RAVEN)
    finally:
        with torch.no_grad():
            mixer.router_weight.copy_(saved)
    assert writes[:, head, slot].nonzero().flatten().tolist() == [passkey]
    mask = A.token_span_mask(ids, ids[passkey : passkey + 1])
    assert mask.nonzero().flatten().tolist() == [passkey]
    assert A.slot_allocation(writes, mask)[head, slot] == A.SPECIAL_ONLY


def test_token_span_mask_finds_every_occurrence():
    mask = A.token_span_mask([5, 7, 8, 1, 7, 8, 7], [7, 8])
    assert mask.tolist() == [False, True, True, False, True, True, False]


def test_sila_gate_trace_is_the_exact_input_gate(model, ids):
    mixer = model.model.layers[SILA].self_attn
    beta = A.sila_input_gate_trace(model, ids, SILA)
    assert beta.shape == (T, mixer.num_kv_heads)
    assert ((beta > 0) & (beta < 1)).all()
    inputs, _ = A.capture_mixer_inputs(model, ids, [SILA])
    x = inputs[SILA][0]  # [T, hidden]
    with torch.no_grad():
        # first token: memory 0, so beta = sigmoid(W_b2 x + b)
        first = torch.sigmoid(x[0] @ mixer.beta_weight.T + mixer.beta_bias)
        torch.testing.assert_close(beta[0], first)
        # later tokens: M_{t-1} from the chunked form over the prefix, an independent computation of the memory
        (q, k, v, alpha, bx, gx), _ = mixer.recurrence_inputs(inputs[SILA])
        wb, wg = mixer.beta_state_weight, mixer.gamma_state_weight
        for t in (1, 7, T - 1):
            _, memory = sila_chunked(q[:, :t], k[:, :t], v[:, :t], alpha[:, :t], bx[:, :t], gx[:, :t], wb, wg)
            recalled = torch.einsum("hvk,hk->hv", memory[0], k[0, t])
            torch.testing.assert_close(beta[t], torch.sigmoid((recalled * wb).sum(-1) + bx[0, t]), rtol=1e-5, atol=1e-6)
        # the memory-dependent term is really there
        assert not torch.allclose(beta, torch.sigmoid(bx[0]), atol=1e-4)


def test_sse_usage_sums_to_top_k(model, ids):
    usage = A.sse_partition_usage(model, ids, SSE)
    assert usage.shape == (2, 4)
    torch.testing.assert_close(usage.sum(-1), torch.ones(2))
    assert ((usage >= 0) & (usage <= 1)).all()


def test_state_entropy_is_in_unit_interval(model, ids):
    entropy = A.state_singular_value_entropy(model, ids, SSE)
    assert entropy.shape == (2, 5)  # 4 routed + the shared partition
    written = ~entropy.isnan()
    assert written[:, -1].all()  # the shared partition is written by every token
    assert ((entropy[written] >= 0) & (entropy[written] <= 1)).all()
    usage = A.sse_partition_usage(model, ids, SSE)
    assert (written[:, :-1] == (usage > 0)).all()  # nan exactly where no token wrote


def test_a_rank_one_state_has_entropy_zero(model, ids):
    one_token = A.state_singular_value_entropy(model, ids[:1], SSE)  # one write: every state is k^T v
    written = one_token[~one_token.isnan()]
    assert written.numel() == 2 * 2  # per head: its top-1 partition and the shared one
    assert (written.abs() < 1e-6).all()
    u, v = torch.randn(3, 16, 1), torch.randn(3, 1, 16)
    assert (A.singular_value_entropy(u @ v).abs() < 1e-6).all()
    torch.testing.assert_close(A.singular_value_entropy(torch.eye(16)), torch.tensor(1.0))
    assert A.singular_value_entropy(torch.zeros(4, 4)).isnan()


def test_every_plot_writes_a_png(model, ids, tmp_path):
    writes = A.raven_slot_writes(model, ids, RAVEN)
    special = A.token_span_mask(ids, ids[10:13])
    tokens = [f"t{int(i)}" for i in ids]
    beta = A.sila_input_gate_trace(model, ids, SILA)
    beta_inst = A.sila_input_gate_trace(model, torch.cat([ids[:5], ids]), SILA)
    traces = {"no_inst": (tokens, beta), "strong_inst": (tokens[:5] + tokens, beta_inst)}
    entropy = A.state_singular_value_entropy(model, ids, SSE)
    paths = [
        P.plot_effective_sequence_length(A.effective_sequence_length(writes), tmp_path / "esl.png"),
        P.plot_effective_sequence_length(A.effective_sequence_length(writes), tmp_path / "esl1.png", heads=[1]),
        P.plot_slot_allocation(writes, special, tmp_path / "alloc.png", head=1, tokens=tokens),
        P.plot_gate_trace(traces, tmp_path / "gates.png", marks={"no_inst": [10, 11], "strong_inst": [15, 16]}),
        P.plot_gate_trace(traces, tmp_path / "gates_head.png", head=0),
        P.plot_partition_usage(A.sse_partition_usage(model, ids, SSE), tmp_path / "usage.png"),
        P.plot_state_entropy(entropy, tmp_path / "entropy.png"),
        P.plot_state_entropy({"layer 1": entropy, "one token": entropy * 0.5}, tmp_path / "sub" / "entropy2.png"),
    ]
    for path in paths:
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


@pytest.mark.parametrize(
    "fn, layer, message",
    [
        (A.raven_slot_writes, SSE, "layer 1 is of kind 'sse', not 'raven'; the raven layers of this model are [0]"),
        (
            A.sila_input_gate_trace,
            RAVEN,
            "layer 0 is of kind 'raven', not 'sila'; the sila layers of this model are [2]",
        ),
        (A.sse_partition_usage, 3, "layer 3 is of kind 'attention', not 'sse'; the sse layers of this model are [1]"),
        (A.state_singular_value_entropy, SILA, "layer 2 is of kind 'sila', not 'sse'"),
        (A.raven_slot_writes, 9, "layer 9 does not exist; the model has 4 layers"),
    ],
)
def test_wrong_layer_kind_is_a_clear_error(model, ids, fn, layer, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fn(model, ids, layer)


def test_rejects_a_batch(model):
    with pytest.raises(ValueError, match="one non-empty sequence"):
        A.raven_slot_writes(model, torch.ones(2, 5, dtype=torch.long), RAVEN)


def test_raven_plots_stay_readable_at_256_slots(tmp_path, monkeypatch):
    # the paper's M = 256: at most 32 labelled slot rows, every label inside the figure, and the ESL bar colours
    # explained by a legend next to the reference lines
    figures = {}
    monkeypatch.setattr(P, "write_png", lambda fig, path, dpi: figures.setdefault(Path(path).stem, fig) and Path(path))
    g = torch.Generator().manual_seed(0)
    writes = torch.rand(600, 2, 256, generator=g) < torch.linspace(0.01, 0.3, 256)
    special = torch.zeros(600, dtype=torch.bool)
    special[300:304] = True
    P.plot_slot_allocation(writes, special, tmp_path / "alloc.png")
    P.plot_effective_sequence_length(A.effective_sequence_length(writes), tmp_path / "esl.png")
    grid_ax = figures["alloc"].axes[0]
    assert len(grid_ax.get_yticks()) <= 32
    esl = figures["esl"]
    labels = [t.get_text() for legend in esl.legends for t in legend.get_texts()]
    assert {"below half of K/M", "within 2x of K/M", "above twice K/M"} <= set(labels)
    for fig in figures.values():
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        ticks = {id(t) for ax in fig.axes for t in [*ax.get_xticklabels(), *ax.get_yticklabels()]}
        for text in fig.findobj(Text):  # titles, axis labels, legends (tick labels off the axis are never drawn)
            if text.get_visible() and text.get_text().strip() and id(text) not in ticks:
                extent = text.get_window_extent(canvas.get_renderer())
                assert fig.bbox.x0 - 1 <= extent.x0 and extent.x1 <= fig.bbox.x1 + 1, f"clipped: {text.get_text()!r}"
