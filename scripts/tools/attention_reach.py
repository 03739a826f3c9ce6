"""How far back each of a model's attention layers looks on real text: which kept layers can take a sliding window.

    python scripts/tools/attention_reach.py --src ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --text ../shared/data/pg_essays --json runs/attention_reach.json

Tokenizes the `--text` documents (a .txt/.jsonl file or a folder of them) into `--rows` rows of `--length` tokens,
reads every head's attention weights (eager attention, on the CPU unless --device says otherwise;
raven_convert.reach) and prints per attention layer, over its heads, the weight on the first token (`sink`), on
keys at least `--far` tokens back (`far`: what a window of that many tokens cuts) and on the last 64 tokens (`near`),
averaged over the queries past `--skip` tokens. A hybrid is measured on the attention layers it kept. The last
line orders the layers by far weight, least first, the copying layers (`--leave-out`, e.g. from
induction_scores.py) left out: the first are the candidates for `sliding_window` and `window_layers` in a recipe
(docs/DEPTH.md).
"""

from __future__ import annotations

import argparse

from raven_convert import Source
from raven_convert.copying import attention_weights
from raven_convert.evaluate.perplexity import load_texts
from raven_convert.files import write_json
from raven_convert.layer_spec import parse_layer_spec
from raven_convert.reach import by_far_weight, head_reach, text_rows


def table(rows: list[dict], far: int) -> str:
    lines = [f"layer  sink max  mean   far(>={far}) max  mean   near(<64) min  mean"]

    def stats(values: list[float]) -> tuple[float, float, float]:
        return max(values), sum(values) / len(values), min(values)

    for r in rows:
        s, f, n = stats(r["sink"]), stats(r["far"]), stats(r["near"])
        lines.append(f"{r['layer']:5d}  {s[0]:8.2f}  {s[1]:.2f}  {f[0]:15.3f}  {f[1]:.3f}  {n[2]:13.2f}  {n[1]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", required=True, help="a Transformer or hybrid: Hub id, directory or .gguf")
    p.add_argument("--text", required=True, help="a .txt/.jsonl(.gz) file or a folder of them")
    p.add_argument("--length", type=int, default=2048, help="tokens a row")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--far", type=int, default=512, help="keys this many tokens back or more count as far")
    p.add_argument("--skip", type=int, default=None, help="queries before this position are left out (--far x 2)")
    p.add_argument("--leave-out", default=None, help="layers the list of least far weight leaves out (17,18,20,23)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write every head's weights to this file, with the settings")
    args = p.parse_args(argv)
    skip = 2 * args.far if args.skip is None else args.skip
    for name, value, low in (("length", args.length, 2), ("rows", args.rows, 1), ("far", args.far, 1)):
        if value < low:
            p.error(f"--{name} {value}: at least {low}")
    if not 0 <= skip < args.length or args.far >= args.length:
        p.error(f"--far {args.far} and --skip {skip} must lie inside rows of --length {args.length}")
    source = Source.resolve(args.src)
    config = source.load_config()  # checked before the weights load
    if args.length > config.max_position_embeddings:
        p.error(f"--length {args.length}: the model has {config.max_position_embeddings} positions")
    leave_out = (
        set(parse_layer_spec(args.leave_out, config.num_hidden_layers, "--leave-out")) if args.leave_out else set()
    )
    ids = text_rows(source.load_tokenizer(), load_texts(args.text), args.rows, args.length)
    model = source.load_model("float32")
    rows = head_reach(attention_weights(model, ids, args.device), args.far, 64, skip)
    print(table(rows, args.far))
    left_out = f" ({args.leave_out} left out)" if leave_out else ""
    print(f"layers by least far weight{left_out}: " + ", ".join(map(str, by_far_weight(rows, leave_out))))
    if args.json:
        settings = {k: getattr(args, k) for k in ("src", "text", "length", "rows", "far", "leave_out")}
        write_json({"settings": {**settings, "skip": skip, "near": 64}, "layers": rows}, args.json)


if __name__ == "__main__":
    main()
