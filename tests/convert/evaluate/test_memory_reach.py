"""The passkey's trace in mixer memories: twins differ only in the needle, the trace is 1 where it starts and
follows the states, SILA's gate product is the forget gates', and the script writes its files."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid
from raven_convert.evaluate import analysis as A
from raven_convert.evaluate import memory_reach as M
from raven_layers.cache import output_cache
from raven_layers.sila import sila_chunked, sila_phi
from tests.conftest import tiny_config, tiny_tokenizer

KINDS = ["sila", "attention", "sse", "raven"]
SETTINGS = {"raven": {"num_slots": 16, "top_k": 4}, "sse": {"lora_rank": 8, "top_k": 1}, "sila": {}}
LENGTH = 400


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    hybrid = build_hybrid(AutoModelForCausalLM.from_config(tiny_config("llama")).eval(), KINDS, SETTINGS)
    with torch.no_grad():  # untrained gates are constants: move them so that they depend on the input
        for i, kind in enumerate(KINDS):
            if kind != "attention":
                mixer = hybrid.model.layers[i].self_attn
                for name in sorted(mixer.fresh_parameter_names()):
                    param = mixer.get_parameter(name)
                    param.add_(0.3 * torch.randn_like(param))
        sila = hybrid.model.layers[0].self_attn  # a forget gate near phi(-0.3) = 0.96: a trace over 400 tokens
        sila.gamma_weight.mul_(0.02)
        sila.gamma_bias.fill_(-0.3)
    return hybrid


def test_twins_differ_only_inside_the_needle_and_the_control_just_before():
    twins = M.make_twins(tiny_tokenizer(), LENGTH, 0.2, seed=3, device="cpu")
    a, b, c = twins.ids
    differ = (a != b).nonzero().flatten().tolist()
    assert differ and twins.needle_start <= differ[0] and differ[-1] < twins.needle_end
    assert len(differ) % 5 == 0  # the 5 digits of each mention of the passkey in the needle
    assert (a != c).nonzero().flatten().tolist() == [twins.needle_start - 1]
    assert all(x != y for x, y in zip(*twins.passkeys))  # every digit differs


def test_trace_follows_the_states(model):
    twins = M.make_twins(tiny_tokenizer(), LENGTH, 0.1, seed=0, device="cpu")
    trace = M.trace_twins(model, twins, every=64)
    assert trace["distances"][0] == M.PAST_NEEDLE and trace["distances"][1] == M.PAST_NEEDLE + 64
    assert sorted(trace["diff"]) == [0, 2, 3]  # every mixer layer, no attention layer
    end = twins.needle_end + trace["distances"][-1]
    with torch.no_grad():  # the last point, recomputed from one full forward of the twins' prefixes
        cache = output_cache(model(input_ids=twins.ids[:, :end], use_cache=True))
    memory = cache.get_mixer_state(0)[0]  # SILA's [3, H_kv, d, d]
    assert math.isclose(trace["diff"][0][-1], (memory[0] - memory[1]).double().norm().item(), rel_tol=1e-3)
    assert math.isclose(trace["control"][0][-1], (memory[0] - memory[2]).double().norm().item(), rel_tol=1e-3)
    for key in ("diff", "control"):  # the passkey and the control's token reach every memory
        assert all(d > 0 for layer in trace[key] for d in trace[key][layer])
    assert 0 < trace["answer_tv"] <= 1 and 0 < trace["control_tv"] <= 1


def test_sila_decay_is_the_forget_gates_product(model):
    twins = M.make_twins(tiny_tokenizer(), LENGTH, 0.1, seed=0, device="cpu")
    trace = M.trace_twins(model, twins, every=64)
    inputs, _ = A.capture_mixer_inputs(model, twins.ids[:1], [0])
    _, gamma = A.sila_gate_traces(model.model.layers[0].self_attn, inputs[0])  # [T, H_kv]
    first = twins.needle_end + M.PAST_NEEDLE
    for k, distance in enumerate(trace["distances"]):
        expected = gamma[first : twins.needle_end + distance].double().prod(0).max().item()
        assert math.isclose(trace["decay"][0][k], expected, rel_tol=1e-6)
        assert max(trace["decay_heads"][0][k]) == trace["decay"][0][k] and len(trace["decay_heads"][0][k]) == 2
    assert trace["decay"][0][0] == 1.0 and trace["decay"][0][-1] < 1.0  # perturbed gates decay


def test_sila_gate_traces_forget_gate_is_phi_of_its_preactivation(model):
    ids = torch.arange(3, 40)
    inputs, _ = A.capture_mixer_inputs(model, ids, [0])
    mixer = model.model.layers[0].self_attn
    beta, gamma = A.sila_gate_traces(mixer, inputs[0])
    torch.testing.assert_close(beta, A.sila_input_gate_trace(model, ids, 0))
    with torch.no_grad():  # first token: memory 0, so gamma = phi(W_g2 x + b)
        x = inputs[0][0, 0]
        torch.testing.assert_close(gamma[0], sila_phi(x @ mixer.gamma_weight.T + mixer.gamma_bias))
        # later tokens: M_{t-1} from the chunked form over the prefix, an independent computation of the memory
        (q, k, v, alpha, bx, gx), _ = mixer.recurrence_inputs(inputs[0])
        wb, wg = mixer.beta_state_weight, mixer.gamma_state_weight
        for t in (1, 7, ids.numel() - 1):
            _, memory = sila_chunked(q[:, :t], k[:, :t], v[:, :t], alpha[:, :t], bx[:, :t], gx[:, :t], wb, wg)
            recalled = torch.einsum("hvk,hk->hv", memory[0], k[0, t])
            torch.testing.assert_close(gamma[t], sila_phi((recalled * wg).sum(-1) + gx[0, t]), rtol=1e-5, atol=1e-6)


def test_measure_reach_takes_medians_and_kept_starts_at_one(model):
    reach = M.measure_reach(model, tiny_tokenizer(), LENGTH, 0.1, prompts=2, every=40, log=lambda m: None)
    assert set(reach.kept) == {0, 2, 3} and set(reach.decay) == {0}
    assert reach.layer_kinds == {0: "sila", 2: "sse", 3: "raven"}
    assert all(kept[0] == 1.0 for kept in reach.kept.values())
    assert all(len(v) == len(reach.distances) for v in [*reach.kept.values(), *reach.share.values()])
    assert all(control[0] == 1.0 for control in reach.control.values())
    assert len(reach.answer_tv) == len(reach.control_tv) == 2
    table = M.format_reach(reach, columns=3)
    first, last = int(reach.distances[0]), int(reach.distances[-1])
    assert len(reach.distances) > 3 and f"after the needle: {first} / " in table and f" / {last}\n" in table
    assert "| 0 | sila |" in table and "| 3 | raven |" in table and "prompt and control" in table


def test_needle_past_the_end_and_bad_counts_are_clear_errors(model):
    with pytest.raises(ValueError, match="prompts and every must be >= 1"):
        M.measure_reach(model, tiny_tokenizer(), LENGTH, 0.1, prompts=0, every=64)
    twins = M.make_twins(tiny_tokenizer(), LENGTH, 1.0, seed=0, device="cpu")
    twins.needle_end = twins.ids.shape[1] - 2
    with pytest.raises(ValueError, match="move it earlier"):
        M.trace_twins(model, twins, every=64)


def test_script_writes_json_plot_and_table(model, tmp_path, capsys):
    src = tmp_path / "hybrid"
    model.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "tools"))
    import memory_reach as script

    out = tmp_path / "reach"
    script.main([str(src), "--out", str(out), "--length", "300", "--prompts", "1", "--every", "128",
                 "--dtype", "float32", "--device", "cpu", "--attention-window", "64"])  # fmt: skip
    data = json.loads((out / "memory_reach.json").read_text())
    assert data["args"]["attention_window"] == 64 and set(data["kept"]) == {"0", "2", "3"}
    assert (out / "memory_reach.png").stat().st_size > 1000
    assert "| 2 | sse |" in capsys.readouterr().out
