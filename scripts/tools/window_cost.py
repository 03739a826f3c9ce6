"""What a sliding window on chosen attention layers costs a model before any training: its loss past the window.

    python scripts/tools/window_cost.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --text ../shared/data/pg_essays --window 4096 --layers 16 1,16 7,8 1,7,8,16 --sinks 0,4

Reads `--rows` rows of `--length` tokens of the `--text` documents, and for each layer set of `--layers` (and the
model as it is first) runs the model with those attention layers as `--window`-token windows, each with every
count of `--sinks`: the first S tokens of the row stay visible to a windowed layer beside its window (attention
sinks, `convert --attention-sinks`; heads park weight there, scripts/tools/attention_reach.py's `sink`). Prints the
mean loss of the tokens inside the window and past it (from `--window` + 100 on), and the change against the model
as it is. On the CPU; 8K rows of SmolLM2-135M take about 2 minutes a configuration.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from raven_convert import Source
from raven_convert.evaluate.perplexity import load_texts
from raven_convert.layer_spec import parse_layer_spec
from raven_convert.reach import text_rows
from raven_convert.surgery import build_hybrid


@torch.no_grad()
def row_losses(hybrid, ids: torch.Tensor, window: int, layers: set[int], sinks: int) -> torch.Tensor:
    """[rows, T - 1]: each next token's loss with `layers` as `window`-token windows (and `sinks` sinks)."""
    hybrid.set_attention_window(window, layers, sinks=sinks)
    losses = []
    for row in ids:
        logits = hybrid(row[None], use_cache=False).logits[0, :-1].float()
        losses.append(F.cross_entropy(logits, row[1:], reduction="none"))
    return torch.stack(losses)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True, help="a Transformer: Hub id, directory or .gguf")
    p.add_argument("--text", required=True, help="a .txt/.jsonl(.gz) file or a folder of them")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--layers", nargs="+", required=True, help="layer sets to window, each a layer spec (1,16)")
    p.add_argument("--sinks", default="0", help="sink counts to try with each layer set (0,4)")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rows", type=int, default=2)
    args = p.parse_args(argv)
    try:
        sinks = [int(s) for s in args.sinks.split(",")]
    except ValueError:
        p.error(f"--sinks {args.sinks!r}: expected counts such as 0,4")
    if min(sinks) < 0 or args.window < 1 or args.length <= args.window + 100:
        p.error(f"--sinks {args.sinks}, --window {args.window}, --length {args.length}: expected sinks >= 0 and "
                "rows more than 100 tokens longer than the window")  # fmt: skip
    source = Source.resolve(args.src)
    config = source.load_config()
    layer_sets = [set(parse_layer_spec(spec, config.num_hidden_layers, "--layers")) for spec in args.layers]
    ids = text_rows(source.load_tokenizer(), load_texts(args.text), args.rows, args.length)
    model = source.load_model("float32")
    hybrid = build_hybrid(model, ["attention"] * config.num_hidden_layers, {}).eval()
    hybrid.config._attn_implementation = "sdpa"
    past = slice(args.window + 100, None)
    base = row_losses(hybrid, ids, args.window, set(), 0)
    print(f"{'windowed layers':18s} sinks  loss inside the window  past it")
    print(f"{'none':18s} {'-':>5s}  {base[:, : args.window].mean():.4f}  {base[:, past].mean():.4f}", flush=True)
    for layers in layer_sets:
        for count in sinks:
            loss = row_losses(hybrid, ids, args.window, layers, count)
            inside, beyond = loss[:, : args.window].mean(), loss[:, past].mean()
            change = beyond - base[:, past].mean()
            name = ",".join(map(str, sorted(layers)))
            print(f"{name:18s} {count:5d}  {inside:.4f}  {beyond:.4f} ({change:+.4f})", flush=True)


if __name__ == "__main__":
    main()
