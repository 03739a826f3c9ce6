"""`raven-eval` (also `python -m raven_convert.evaluate`): evaluate a model and write a report.

raven-eval runs/smollm2-raven --out runs/smollm2-raven/eval --lengths 1k,2k,4k --tasks passkey,niah_single_2
raven-eval model.gguf --out eval --ppl-data ../shared/data/pg_essays --speed-lengths 1k,4k,16k --speed-batches 1,8
raven-eval MODEL --out eval --tasks niah_single_2,niah_single_2@papers --haystacks papers=../shared/papers

raven-eval table teacher=runs/teacher-eval sila=runs/smollm2-sila --reference teacher   # reports side by side
(`raven-eval table --help`; a model directory named `table` is given as ./table)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pydantic import ValidationError

from raven_convert.console import attach_negative_values, command_line, interrupted, reporting_interrupt
from raven_convert.files import check_writable

from .needles import haystack_files
from .report import EvalRequest, evaluate_model
from .retrieval import TASKS, VARIANTS
from .runtime import parse_batches, parse_lengths


def _names(allowed=None):
    """Comma-separated names, each one of `allowed` (None: any, checked with the other flags by EvalRequest)."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names none")
        bad = [n for n in names if allowed is not None and n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad!r} not allowed; choose from {sorted(allowed)}")
        return names

    return parse


def _haystack(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR (e.g. papers=../shared/papers)")
    try:
        haystack_files(folder, f"haystack {name!r}")
    except FileNotFoundError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, folder


def _task_lengths(text: str) -> tuple[str, list[int]]:
    task, sep, lengths = text.partition("=")
    if not sep or not task or not lengths:
        raise argparse.ArgumentTypeError(f"{text!r} is not TASK=LENGTHS (e.g. niah_multikey=1k,2k,4k,8k)")
    return task, parse_lengths(lengths)


def _depths(text: str) -> list[float]:
    try:
        depths = [float(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers such as 0,0.5,1") from None
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths {depths} must lie in [0, 1]")
    return depths


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _existing(text: str) -> str:
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["table"]:
        from .table import main as table

        return table(argv[1:])
    p = argparse.ArgumentParser(prog="raven-eval", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = EvalRequest(model="", out=Path())
    p.add_argument("model", help="Hub id, model directory (teacher or hybrid) or .gguf file")
    p.add_argument("--out", type=Path, required=True, help="report directory (report.json + PNGs)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the parts that --out's report.json finished with the same flags and model; run the others",
    )
    p.add_argument(
        "--tasks",
        type=_names(),  # TASK@NAME needs --haystacks NAME: checked by EvalRequest
        default=d.tasks,
        help=f"comma-separated, from {sorted(TASKS)}; TASK@NAME: an essay task on the --haystacks NAME",
    )
    p.add_argument(
        "--variants", type=_names(VARIANTS), default=d.variants, help=f"from {list(VARIANTS)} (default: %(default)s)"
    )
    p.add_argument(
        "--lengths",
        type=parse_lengths,
        default=d.lengths,
        help=f"prompt lengths in tokens, 1k = 1024 (default: {_listed(d.lengths)})",
    )
    p.add_argument(
        "--task-lengths",
        type=_task_lengths,
        action="append",
        default=[],
        metavar="TASK=LENGTHS",
        help="lengths of one of --tasks in place of --lengths, e.g. niah_multikey=1k,8k (repeatable)",
    )
    p.add_argument(
        "--depths", type=_depths, default=d.depths, help=f"needle depths in [0, 1] (default: {_listed(d.depths)})"
    )
    p.add_argument(
        "--samples", type=_positive, default=d.samples, help="prompts per (length, depth) (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size", type=_positive, default=d.batch_size, help="prompts a forward (default: %(default)s)"
    )
    p.add_argument("--haystack-dir", type=_existing, help="essay haystack directory (default: $RAVEN_HAYSTACK_DIR)")
    p.add_argument(
        "--haystacks",
        type=_haystack,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a further haystack, a folder of *.txt, for the tasks TASK@NAME (repeatable)",
    )
    p.add_argument(
        "--chat-template",
        choices=["off", "on", "auto"],
        default="off",
        help="wrap prompts in the tokenizer's chat template (auto: when it has one); off: plain completion prompts",
    )
    p.add_argument("--ppl-data", type=_existing, help="texts for perplexity (.txt, .jsonl(.gz) or a directory)")
    p.add_argument(
        "--ppl-lengths",
        type=parse_lengths,
        default=d.ppl_lengths,
        help=f"perplexity window lengths (default: {_listed(d.ppl_lengths)})",
    )
    p.add_argument(
        "--ppl-windows", type=_positive, default=d.ppl_windows, help="windows per length (default: %(default)s)"
    )
    p.add_argument(
        "--speed-lengths",
        type=parse_lengths,
        default=d.speed_lengths,
        help="prompt lengths the speed part times generate() after, 1k = 1024, e.g. 1k,4k,16k (default: none, "
        "which skips the speed part)",
    )
    p.add_argument(
        "--speed-batches",
        type=parse_batches,
        default=d.speed_batches,
        help="batch sizes the speed part times at, comma separated integers >= 1; a batch that runs out of memory "
        f"is recorded as skipped (default: {_listed(d.speed_batches)})",
    )
    p.add_argument("--no-pictures", dest="pictures", action="store_false", help="skip the mixer pictures")
    p.add_argument(
        "--picture-length",
        type=_positive,
        default=d.picture_length,
        help="tokens of the text the mixer pictures run on (default: %(default)s)",
    )
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the prompts (default: %(default)s)")
    p.add_argument(
        "--attention-window",
        type=_positive,
        default=d.attention_window,
        help="a hybrid's kept attention layers attend within this many tokens (default: as converted)",
    )
    args = p.parse_args(attach_negative_values(argv))
    args.chat_template = {"off": False, "on": True, "auto": None}[args.chat_template]
    resume = vars(args).pop("resume")
    args.haystacks, args.task_lengths = dict(args.haystacks), dict(args.task_lengths)
    try:
        request = EvalRequest(**vars(args))
    except ValidationError as err:  # what one flag cannot check alone: the tasks against --haystacks
        first = err.errors()[0]
        p.error(f"argument --{str(first['loc'][0]).replace('_', '-')}: {first['msg'].removeprefix('Value error, ')}")
    try:
        check_writable(args.out, "--out")
        report = evaluate_model(request, resume=resume)
    except (ValueError, FileNotFoundError) as err:
        p.exit(2, f"raven-eval: error: {_flags(str(err))}\n")
    except KeyboardInterrupt:
        with reporting_interrupt():
            report = args.out / "report.json"
            done = json.loads(report.read_text()).get("finished") if report.is_file() else None
            saved = f"finished parts are in {report}: {', '.join(done)}" if done else "no part had finished"
            return interrupted(saved, command_line("raven-eval", argv if resume else [*argv, "--resume"]))
    if report.get("failed"):
        parts = ", ".join(f"{part} ({error})" for part, error in report["failed"].items())
        print(f"raven-eval: error: {_flags(parts)} failed; the other parts are in {args.out / 'report.json'}")
        return 1
    return 0


def _listed(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _flags(message: str) -> str:
    """A message from the evaluation, with EvalRequest's field names as the flags that set them."""
    for name in EvalRequest.model_fields:
        message = re.sub(rf"\b{name}\b(?=\s*=)", "--" + name.replace("_", "-"), message)
    return message


if __name__ == "__main__":
    sys.exit(main())
