"""How far each freshly converted (untrained) mixer is from the attention it replaces, layer by layer.

    python scripts/tools/mixer_init_error.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --layers 0,10,20

Feeds the teacher's own layer inputs (from a forward over `--text`) to each mixer and prints the relative error
||mixer(x) - attention(x)|| / ||attention(x)|| and the norm ratio, per mixer and layer. Untrained mixers only
approximate attention; this is the starting point that the alignment training improves on.
"""

from __future__ import annotations

import argparse

import torch

from raven_convert import Source, build_hybrid, parse_layer_spec, plan_layers
from raven_layers import mixer_names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True, help="source model (Hub id, directory or .gguf)")
    p.add_argument("--layers", default="0,10,20", help="layers to measure (--layers grammar)")
    p.add_argument("--text", default="../shared/data/pg_essays/apple.txt", help="a text file for the inputs")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--mixers", default=",".join(mixer_names()), help="comma-separated mixers to measure")
    args = p.parse_args(argv)

    source = Source.resolve(args.src)
    model, tokenizer = source.load_model("float32"), source.load_tokenizer()
    num_layers = model.config.num_hidden_layers
    layers = parse_layer_spec(args.layers, num_layers)
    with open(args.text) as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : args.tokens]

    captured = {}  # layer -> (attention input [1, T, hidden], attention output [1, T, hidden])

    def capture(i):
        return lambda module, a, kw, out: captured.__setitem__(i, (kw["hidden_states"], out[0]))

    hooks = [model.model.layers[i].self_attn.register_forward_hook(capture(i), with_kwargs=True) for i in layers]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()

    print(f"{'mixer':<6} {'layer':>5} {'rel err':>8} {'norm ratio':>10}")
    for mixer in args.mixers.split(","):
        hybrid = build_hybrid(model, plan_layers([(mixer, args.layers)], num_layers), {mixer: {}})
        for i in layers:
            x, y = captured[i]
            with torch.no_grad():
                out, _ = hybrid.model.layers[i].self_attn(x)
            rel = ((out - y).norm() / y.norm()).item()
            print(f"{mixer:<6} {i:>5} {rel:>8.2f} {(out.norm() / y.norm()).item():>10.2f}")


if __name__ == "__main__":
    main()
