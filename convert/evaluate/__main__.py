"""`raven-eval` (also `python -m convert.evaluate`): evaluate a model and write a report.

raven-eval runs/smollm2-raven --out runs/smollm2-raven/eval --lengths 1k,2k,4k --tasks passkey,niah_single_2
raven-eval model.gguf --out eval --ppl-data ../shared/data/pg_essays --speed-lengths 1k,4k,16k
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .perplexity import parse_lengths
from .report import EvalRequest, evaluate_model
from .retrieval import TASKS, VARIANTS


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{bad or text!r} not allowed; choose from {sorted(allowed)}")
        return names

    return parse


def _depths(text: str) -> list[float]:
    depths = [float(d) for d in text.split(",")]
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths {depths} must lie in [0, 1]")
    return depths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raven-eval", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = EvalRequest(model="", out=Path())
    p.add_argument("model", help="Hub id, model directory (teacher or hybrid) or .gguf file")
    p.add_argument("--out", type=Path, required=True, help="report directory (report.json + PNGs)")
    p.add_argument("--tasks", type=_names(TASKS), default=d.tasks, help=f"comma-separated, from {sorted(TASKS)}")
    p.add_argument("--variants", type=_names(VARIANTS), default=d.variants, help=f"from {list(VARIANTS)}")
    p.add_argument("--lengths", type=parse_lengths, default=d.lengths, help="prompt lengths in tokens (1k = 1024)")
    p.add_argument("--depths", type=_depths, default=d.depths, help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=d.samples, help="prompts per (length, depth)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--haystack-dir", help="essay haystack directory (default: $RAVEN_HAYSTACK_DIR)")
    p.add_argument(
        "--chat-template",
        choices=["off", "on", "auto"],
        default="off",
        help="wrap prompts in the tokenizer's chat template (auto: when it has one); off: plain completion prompts",
    )
    p.add_argument("--ppl-data", help="texts for perplexity (.txt, .jsonl(.gz) or a directory)")
    p.add_argument("--ppl-lengths", type=parse_lengths, default=d.ppl_lengths)
    p.add_argument("--ppl-windows", type=int, default=d.ppl_windows)
    p.add_argument("--speed-lengths", type=parse_lengths, default=d.speed_lengths, help="e.g. 1k,4k,16k,64k")
    p.add_argument("--no-pictures", dest="pictures", action="store_false", help="skip the mixer pictures")
    p.add_argument("--picture-length", type=int, default=d.picture_length)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attention-window",
        type=int,
        default=None,
        help="a hybrid's kept attention layers attend within this many tokens (default: as converted)",
    )
    args = p.parse_args(argv)
    args.chat_template = {"off": False, "on": True, "auto": None}[args.chat_template]
    try:
        evaluate_model(EvalRequest(**vars(args)))
    except (ValueError, FileNotFoundError) as err:
        p.exit(2, f"raven-eval: error: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
