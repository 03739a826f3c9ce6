"""How many of Raven's slots its routers write, on the model's own layer inputs: a fresh conversion's or a trained
hybrid's.

    python scripts/tools/raven_router_occupancy.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --layers 2,12,25 --raven-num-slots 64 --raven-top-k 8
    python scripts/tools/raven_router_occupancy.py --src runs/smollm2-raven/model \
        --json runs/smollm2-raven/router_occupancy.json                               # a trained hybrid: its layers

Runs `--text` through the hybrid (a Transformer `--src` is converted first, its `--layers` to Raven) and hands each
Raven layer's input to its router, as evaluation routes (no noise) and as training does (Gumbel noise). Per layer
and key/value head it prints how many slots the prompt writes at all and the effective number of slots (the
exponential of the entropy of their write counts: 64 when all 64 are written equally). `common` is the share of a
token's input that every token shares (|mean over tokens| / mean |x|): that part gives every token the same
per-slot scores W mu. `centred` routes the inputs without it (x - mu), which a per-slot router bias of -W mu would
give. `tokens` and `slots` are the spread of the router's scores Wx (their standard deviation across the tokens for
one slot, and across the slots for one token, averaged); training's Gumbel noise has a spread of pi / sqrt(6) = 1.28,
so scores that vary less than that route training's tokens almost at random. `margin` is the median gap between a
token's K-th and (K+1)-th best score: where it is several times 1.28, the noise seldom changes which slots are taken.
"""

from __future__ import annotations

import argparse

import torch

from raven_convert import Source, build_hybrid, plan_layers
from raven_convert.files import write_json
from raven_convert.train.common import converted_layers, is_hybrid


def occupancy(idx: torch.Tensor, num_slots: int) -> tuple[list[int], list[float]]:
    """Per key/value head of the top-K choices idx [T, H_kv, K]: slots written at least once, effective slots."""
    used, effective = [], []
    for head in range(idx.shape[1]):
        counts = torch.bincount(idx[:, head].flatten(), minlength=num_slots).double()
        p = counts[counts > 0] / counts.sum()
        used.append(int((counts > 0).sum()))
        effective.append(float(torch.exp(-(p * p.log()).sum())))
    return used, effective


def routed(mixer, x: torch.Tensor, noise: bool) -> torch.Tensor:
    """The slots mixer's router picks for x [1, T, hidden]: [T, H_kv, K]; `noise`: as in training (Gumbel)."""
    was = mixer.training
    mixer.train(noise)
    try:
        _, idx, _ = mixer.route(x, None)
    finally:
        mixer.train(was)
    return idx[0]


def report(hybrid, ids: torch.Tensor, seed: int = 0) -> list[dict]:
    """One row per Raven layer and way of routing: layer, routing, common share, the scores' spread across tokens
    and across slots, slots used and effective per key/value head."""
    layers = [i for i in converted_layers(hybrid) if hybrid.config.layer_mixers[i] == "raven"]
    if not layers:
        raise SystemExit(f"no Raven layer in the model (its layers: {sorted(set(hybrid.config.layer_mixers))})")
    inputs = {}
    hooks = [
        hybrid.model.layers[i].self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: inputs.__setitem__(
                i, kwargs.get("hidden_states", args[0] if args else None)
            ),
            with_kwargs=True,
        )
        for i in layers
    ]
    with torch.no_grad():
        hybrid(ids)
    for hook in hooks:
        hook.remove()
    torch.manual_seed(seed)
    rows = []
    with torch.no_grad():
        for i in layers:
            mixer, x = hybrid.model.layers[i].self_attn, inputs[i].float()  # [1, T, hidden]
            mean = x[0].mean(0)
            common = (mean.norm() / x[0].norm(dim=-1).mean()).item()
            m = mixer.settings.num_slots
            scores = (x[0] @ mixer.router_weight.float().T).view(x.shape[1], -1, m)  # [T, H_kv, M]
            top = scores.topk(mixer.settings.top_k + 1, dim=-1).values  # [T, H_kv, K + 1]
            spread = {
                "tokens": scores.std(0).mean().item(),
                "slots": scores.std(-1).mean().item(),
                "margin": (top[..., -2] - top[..., -1]).median().item(),  # K-th best score - (K+1)-th
            }
            for name, xx, noise in (
                ("evaluation", x, False),
                ("training (Gumbel)", x, True),
                ("centred", x - mean, False),
            ):
                used, effective = occupancy(routed(mixer, xx.to(mixer.router_weight.dtype), noise), m)
                rows.append(
                    {"layer": i, "routing": name, "common": common, **spread, "used": used, "effective": effective}
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True, help="a Transformer (Hub id, directory or .gguf) or a trained hybrid")
    p.add_argument("--layers", default="2,12,25", help="a Transformer's layers to convert (--layers grammar)")
    p.add_argument("--raven-num-slots", type=int, default=64)
    p.add_argument("--raven-top-k", type=int, default=8)
    p.add_argument("--text", default="../shared/data/pg_essays/apple.txt", help="a text file for the inputs")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0, help="the conversion's and the noise's seed")
    p.add_argument("--json", help="also write the rows to this file, with --src and --text")
    args = p.parse_args(argv)

    source = Source.resolve(args.src)
    model, tokenizer = source.load_model("float32"), source.load_tokenizer()
    if is_hybrid(model):
        hybrid = model
    else:
        settings = {"raven": {"num_slots": args.raven_num_slots, "top_k": args.raven_top_k}}
        kinds = plan_layers([("raven", args.layers)], model.config.num_hidden_layers)
        hybrid = build_hybrid(model, kinds, settings, seed=args.seed)
    with open(args.text) as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : args.tokens]

    print(f"{ids.shape[1]} tokens of {args.text}; slots written / effective slots, per key/value head")
    print(
        f"{'layer':>5} {'common':>6} {'tokens':>6} {'slots':>6} {'margin':>6}  {'routing':<18} {'used':<18} effective"
    )
    rows = report(hybrid.eval(), ids, args.seed)
    if args.json:
        record = {"src": args.src, "text": args.text, "tokens": ids.shape[1], "rows": rows}
        write_json(record, args.json)
    for row in rows:
        effective = ", ".join(f"{e:.1f}" for e in row["effective"])
        used = ", ".join(map(str, row["used"]))
        spread = f"{row['common']:>6.2f} {row['tokens']:>6.2f} {row['slots']:>6.2f} {row['margin']:>6.2f}"
        print(f"{row['layer']:>5} {spread}  {row['routing']:<18} {used:<18} {effective}")


if __name__ == "__main__":
    main()
