"""How long each mixer memory of a hybrid holds a passkey (raven_convert.evaluate.memory_reach), in one run.

    python scripts/tools/memory_reach.py RUN/extend/model --out RUN/memory-reach --length 16384 --attention-window 4096

Writes OUT/memory_reach.json and OUT/memory_reach.png (the passkey kept in each mixer's state against the tokens
after the needle; SILA's forget-gate product dashed) and prints the table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from raven_convert.evaluate.memory_reach import format_reach, measure_reach, plot_reach  # noqa: E402
from raven_convert.evaluate.runtime import load_for_evaluation  # noqa: E402
from raven_convert.files import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", help="an exported hybrid (directory)")
    p.add_argument("--out", required=True, help="folder for memory_reach.json and memory_reach.png")
    p.add_argument("--length", type=int, default=16384, help="prompt length in tokens")
    p.add_argument("--depth", type=float, default=0.0, help="needle depth in [0, 1]: 0 puts it first")
    p.add_argument("--prompts", type=int, default=3, help="twin pairs; medians over them")
    p.add_argument("--every", type=int, default=512, help="tokens between two reads of the states")
    p.add_argument("--attention-window", type=int, default=None, help="kept attention as sliding windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if args.length < 64 or not 0.0 <= args.depth <= 1.0:
        p.error(f"--length must be >= 64 and --depth in [0, 1], got {args.length} and {args.depth}")

    model, tokenizer = load_for_evaluation(args.model, args.dtype, args.device)
    if getattr(model.config, "layer_mixers", None) is None:
        p.error(f"{args.model} is not a hybrid model: it has no mixer memories to trace")
    if args.attention_window is not None:
        model.set_attention_window(args.attention_window)
    reach = measure_reach(model, tokenizer, args.length, args.depth, args.prompts, args.every, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json({"args": vars(args), **reach.to_json()}, out / "memory_reach.json")
    plot_reach(reach, out / "memory_reach.png", title=f"{Path(args.model).name}, {args.length} tokens")
    print(format_reach(reach))


if __name__ == "__main__":
    main()
