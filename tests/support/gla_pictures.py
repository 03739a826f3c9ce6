"""The evaluation report's picture of a GLA layer (tests/support/gla_mixer.py): its forget gates on the passkey
prompt. Named by the mixer's declaration (`pictures=`); imported by the report only, so the model never needs it."""

from __future__ import annotations

import torch

from raven_convert.evaluate.analysis import capture_mixer_inputs
from raven_convert.evaluate.pictures import PictureContext


def gla_pictures(context: PictureContext, layer: int) -> dict[str, str]:
    """The mean forget gate g_t of each key/value head per token, needle tokens marked."""
    from matplotlib.figure import Figure

    prompt = context.passkey()
    inputs, _ = capture_mixer_inputs(context.model, prompt.ids, [layer])
    with torch.no_grad():
        gates = context.model.model.layers[layer].self_attn.log_gates(inputs[layer]).exp()[0].mean(-1)  # [T, H_kv]
    fig = Figure(figsize=(8, 3), layout="constrained")
    ax = fig.add_subplot()
    for head in range(gates.shape[1]):
        ax.plot(gates[:, head].float().cpu(), label=f"kv head {head}", linewidth=0.8)
    for t in prompt.needle_positions:
        ax.axvline(t, color="red", alpha=0.2)
    ax.set(title=f"GLA forget gates, layer {layer}", xlabel="token position", ylabel="mean g_t")
    ax.legend(fontsize=7)
    path = context.out / "gla_forget_gates.png"
    fig.savefig(path, dpi=100)
    return {"gla_forget_gates": path.name}
