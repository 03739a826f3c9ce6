"""The small operations compiled while a stage trains (the mixers' glue, the layers' norms and MLPs): the same
outputs and gradients as eager, each part compiled once for all its layers, everything put back afterwards; "auto"
compiles on CUDA only.

On the CPU the parts compile with dynamo's `aot_eager` backend: the tracing, guards, recompiles and AOT autograd's
forward and backward graphs that a stage relies on, with eager kernels. Inductor's CPU code (C++, a minute of
compiling here) is a path no stage takes; inductor on the GPU is checked against eager by the GPU tests of
test_graphs.py (`compile=True`).
"""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train import align as align_module
from raven_convert.train import stage2
from raven_convert.train.align import align
from raven_convert.train.compiling import compiled_parts, layer_parts, resolve_compile
from raven_convert.train.recipe import AlignSettings
from raven_convert.train.stage2_config import TrainConfig
from raven_layers import common
from raven_layers.backend import use_backend
from raven_layers.raven import RavenMixer
from raven_layers.sila import SILAMixer
from raven_layers.sse import SSEMixer
from tests.convert.train.test_precision import packed_rows
from tests.raven_layers.test_hybrid_model import perturb_fresh_parameters

SETTINGS = {"raven": {"num_slots": 16, "top_k": 4, "gumbel": False}, "sse": {"lora_rank": 8}, "sila": {}}


@pytest.fixture(autouse=True)
def aot_eager_on_cpu(monkeypatch):
    """torch.compile (which nn.Module.compile calls too) with the aot_eager backend while CUDA is absent, and the
    mixers' compiled glue built afresh with it."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
        monkeypatch.setattr(common, "_COMPILED", {})


@pytest.fixture(scope="module")
def hybrid(tiny_sources):
    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"])
    kinds = plan_layers([("raven", "0"), ("sse", "1,3"), ("sila", "2")], 4)  # two SSE layers share one graph
    return perturb_fresh_parameters(build_hybrid(source, kinds, SETTINGS)).train()


def forward_backward(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_compiled_parts_equal_eager_and_are_put_back(hybrid):
    ids = torch.randint(3, 100, (2, 19), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: the compiled gates must honour it too
    expected, expected_grads = forward_backward(hybrid, ids, mask)
    torch._dynamo.utils.counters.clear()
    with compiled_parts([hybrid, None]) as compiled:
        mixers = [m for m in compiled if isinstance(m, common.Mixer)]
        parts = layer_parts(hybrid)
        assert len(mixers) == 4 and all(m.compile_glue for m in mixers)
        assert len(parts) == 12 and all(p._compiled_call_impl is not None for p in parts)  # 4 layers: 2 norms, MLP
        logits, grads = forward_backward(hybrid, ids, mask)
    assert all("compile_glue" not in vars(m) for m in mixers) and not any(m.compile_glue for m in mixers)
    assert all(p._compiled_call_impl is None for p in parts)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    glue = {SSEMixer.kernel_inputs, SSEMixer.read_out, SILAMixer.recurrence_inputs, RavenMixer.projections}
    assert glue | {common.Mixer.read_out} <= set(common._COMPILED)
    # one graph per part and mixer, however many layers (the second SSE layer reuses the first's): SSE's two,
    # SILA's and Raven's inputs, Mixer.read_out for each of them, the norms' and the MLPs'
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 8


def test_packed_batches_share_the_graphs_whatever_their_documents(hybrid):
    """Align and train pack documents: the glue must take nothing shaped by their count (SILA's convolution gets
    positions, not cu_seqlens), or each batch would compile again."""
    sila = hybrid.model.layers[2].self_attn  # the one mixer whose glue reads the packing
    x = torch.randn(1, 20, hybrid.config.hidden_size, generator=torch.Generator().manual_seed(2))
    graphs = []
    with compiled_parts([sila]), use_backend("triton"), torch.no_grad():
        for lengths in ([20], [7, 13], [5, 1, 14]):
            sila(x, cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2]


def test_align_compiles_when_asked(hybrid, tiny_sources, monkeypatch):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()
    seen = []
    real = align_module.compiled_parts

    def spy(models, enabled=True):
        seen.append(enabled)
        return real(models, enabled)

    monkeypatch.setattr(align_module, "compiled_parts", spy)
    batch = {"input_ids": torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))}
    eager = align(teacher, hybrid, [batch], steps=1, lr=0.0, compile=False, log_every=0)
    compiled = align(teacher, hybrid, [batch], steps=1, lr=0.0, compile=True, log_every=0)
    assert seen == [False, True]
    for layer, mse in eager[0]["layers"].items():
        assert compiled[0]["layers"][layer] == pytest.approx(mse, rel=1e-5)


def test_stage2_compiles_the_student_with_lora_and_the_teacher(tiny_sources, tmp_path):
    """Stage 2 with LoRA (peft's layers inside the compiled MLPs) and distillation: compiled as eager, to rounding."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval().requires_grad_(False)

    def run(compile, out):
        torch.manual_seed(0)
        student = build_hybrid(teacher, plan_layers([("sse", "1")], 4), SETTINGS)
        config = TrainConfig(
            steps=2, batch_size=4, trainable="mixers+lora", kd_weight=1.0, log_every=0, compile=compile
        )
        history = stage2.train(student, teacher, packed_rows(), config, out)
        return [(r["ce"], r["kd"]) for r in history], student

    eager, _ = run(False, tmp_path / "eager")
    torch._dynamo.utils.counters.clear()
    compiled, student = run(True, tmp_path / "compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 4  # norms, MLPs (with and without LoRA), glue
    assert all(p._compiled_call_impl is None for p in layer_parts(student) + layer_parts(teacher))
    for (ce, kd), (ce0, kd0) in zip(compiled, eager):
        assert ce == pytest.approx(ce0, rel=1e-4) and kd == pytest.approx(kd0, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize(
    ("setting", "device", "sharded", "expected"),
    [
        ("auto", "cpu", False, False),  # a compile costs more on the CPU than it saves
        ("auto", "cuda", False, True),
        ("auto", "cuda", True, False),  # FSDP's sharded parameters
        (True, "cpu", False, True),
        (False, "cuda", False, False),
    ],
)
def test_auto_compiles_on_cuda_only(setting, device, sharded, expected):
    assert resolve_compile(setting, torch.device(device), sharded) is expected


def test_the_setting_is_validated():
    assert AlignSettings(compile=False).compile is False
    with pytest.raises(ValueError, match="compile"):
        AlignSettings(compile="sometimes")
