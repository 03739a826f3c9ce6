"""Which of a Transformer's attention layers copy: each head's induction score, per layer, on random tokens repeated.

    python scripts/tools/induction_scores.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --json runs/induction_scores.json

Feeds `--rows` sequences of `--length` random tokens, each followed by itself again, and reads every head's
attention weights over the second copy (eager attention). Per layer, over its heads, it prints:
- `induction`: the weight a token of the second copy gives the token after its earlier occurrence, the head that
  continues a sequence seen before (a copy), max and mean over heads;
- `duplicate`: the weight it gives its earlier occurrence itself;
- `previous`: the weight a token gives the token just before it, over the first copy.
The exact answers that deep hybrids lose first (words, codes, several values: docs/DEPTH.md) are copies, so the
layers with induction heads are the ones a deep conversion may want to keep as attention, and the layers with
previous-token heads the ones a mixer's short convolution can stand in for.
"""

from __future__ import annotations

import argparse

import torch

from raven_convert import Source
from raven_convert.files import write_json


def head_scores(attentions: tuple[torch.Tensor, ...], length: int) -> list[dict]:
    """Per layer, each head's mean induction, duplicate-token and previous-token weights, from the attention
    weights [B, H, 2 L, 2 L] of sequences whose second half repeats the first."""
    later = torch.arange(length, 2 * length - 1)  # the second copy's tokens that have a next token in the first
    first = torch.arange(1, length)
    rows = []
    for layer, a in enumerate(attentions):
        a = a.float()
        rows.append({
            "layer": layer,
            "induction": a[:, :, later, later - length + 1].mean(dim=(0, 2)).tolist(),  # [H]
            "duplicate": a[:, :, later, later - length].mean(dim=(0, 2)).tolist(),
            "previous": a[:, :, first, first - 1].mean(dim=(0, 2)).tolist(),
        })  # fmt: skip
    return rows


def repeated_tokens(vocab_size: int, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, 2 length] random tokens, each row's second half a copy of its first; the vocabulary's first eighth
    (special and byte tokens in most tokenizers) left out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab_size // 8, vocab_size, (rows, length), generator=g)
    return torch.cat([x, x], dim=1)


def table(rows: list[dict]) -> str:
    lines = ["layer  induction max  mean   duplicate max  previous max"]
    for r in rows:
        ind = r["induction"]
        lines.append(
            f"{r['layer']:5d}  {max(ind):13.3f}  {sum(ind) / len(ind):.3f}  {max(r['duplicate']):13.3f}"
            f"  {max(r['previous']):12.3f}"
        )
    ranked = sorted(rows, key=lambda r: -max(r["induction"]))
    lines.append("layers by their strongest induction head: " + ", ".join(str(r["layer"]) for r in ranked[:8]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True, help="a Transformer: Hub id, directory or .gguf")
    p.add_argument("--length", type=int, default=200, help="random tokens before they repeat")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write every head's scores to this file, with the settings")
    args = p.parse_args(argv)
    for name in ("length", "rows"):
        if getattr(args, name) < 2:
            p.error(f"--{name} {getattr(args, name)}: at least 2")
    source = Source.resolve(args.src)
    config = source.load_config()  # checked before the weights load
    if getattr(config, "layer_mixers", None) is not None:
        p.error(f"--src {args.src!r} is a converted hybrid: give the Transformer it was converted from")
    if 2 * args.length > config.max_position_embeddings:
        p.error(f"--length {args.length}: twice it must fit the model's {config.max_position_embeddings} positions")
    model = source.load_model("float32")
    model.set_attn_implementation("eager")  # the fused kernels return no weights
    ids = repeated_tokens(model.config.vocab_size, args.rows, args.length, args.seed)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    rows = head_scores(attentions, args.length)
    print(table(rows))
    if args.json:
        settings = {"src": args.src, "length": args.length, "rows": args.rows, "seed": args.seed}
        write_json({"settings": settings, "layers": rows}, args.json)


if __name__ == "__main__":
    main()
