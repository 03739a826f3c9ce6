"""Which of a model's attention layers copy: each head's induction score, per layer, on random tokens repeated.

    python scripts/tools/induction_scores.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --json runs/induction_scores.json

Feeds `--rows` sequences of `--length` random tokens, each followed by itself again, and reads every head's
attention weights (eager attention; raven_convert.copying). Per attention layer, over its heads, it prints the
`induction` score (max and mean: the weight a token of the second copy gives the token after its earlier
occurrence), and the strongest `duplicate` and `previous`-token weights. A hybrid (converted further) is scored on
the attention layers it kept. `convert --layers auto:N --choice-keep-copying K` keeps the K layers of the strongest
induction heads as attention (docs/LAYER_CHOICE.md).
"""

from __future__ import annotations

import argparse

from raven_convert import Source
from raven_convert.copying import attention_weights, head_scores, repeated_tokens
from raven_convert.files import write_json


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
    if 2 * args.length > config.max_position_embeddings:
        p.error(f"--length {args.length}: twice it must fit the model's {config.max_position_embeddings} positions")
    model = source.load_model("float32")
    ids = repeated_tokens(model.config.vocab_size, args.rows, args.length, args.seed)
    rows = head_scores(attention_weights(model, ids), args.length)
    print(table(rows))
    if args.json:
        settings = {"src": args.src, "length": args.length, "rows": args.rows, "seed": args.seed}
        write_json({"settings": settings, "layers": rows}, args.json)


if __name__ == "__main__":
    main()
