"""Where a training step's time goes: align, train or extend of a recipe under torch.profiler, after warm-up steps.

    python scripts/bench/profile_train.py recipes/smollm2-raven.yaml --src MODEL --data CORPUS --stage train --out OUT

Runs convert (kept in OUT/run-STAGE and reused; align is skipped before train, align and train before extend) and the
token weights where the recipe trains with them, then STAGE for --warmup + 1 + --active + --timed steps through the
recipe pipeline (the code of python -m raven_convert.train), checkpoints, evaluation and export off. The profiler
records --active steps after the warm-up (a step ends at its optimizer step, or where a CUDA graph's replay of it
returns: the recipe's cuda_graphs as they are), each step waiting for the GPU to finish the one before, so that its
kernels are its own; the --timed steps after them run as the recipe runs them, with no wait between steps, their
ends marked on the GPU (CUDA events): a step whose work overlaps the next one's (stage 2's graphed steps prepare the
next inputs on a side stream while they replay) is only that fast unsynchronised. Prints the step's time both ways
and, per recorded step:
- the phases of a step, the record_function ranges of align.py and stage2.py (teacher, mixers or student forward,
  backward, optimizer; extend's token weights, computed from the teacher as each batch is drawn): CPU time (launching
  included) and GPU time of the kernels each launched (none for replayed graphs, whose ranges ran at their capture);
- the GPU kernels and copies with the most time, and the ops with the most CPU time of their own;
- the GPU's busy share: kernel time over a recorded step's wall time (low: the step waits on the CPU, launches or
  host syncs); over the timed step's (`gpu_busy_timed`), above 100% where two streams' kernels overlap.
`--inputs-in-place` makes stage 2's graphed steps prepare their next inputs on the step's own stream, after it (as
before graphs.StepInputs ran them beside the step): the same command with and without it measures what the overlap
buys. Writes OUT/profile-STAGE.json (the same tables as data) and OUT/trace-STAGE.json.gz (Perfetto, chrome://tracing).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

PHASE_PREFIX = {"align": "align.", "train": "train.", "extend": "train."}  # extend runs stage 2's loop


def recipe_overrides(args) -> list[str]:
    """The recipe's fields this profile changes, as --set overrides."""
    steps = args.warmup + 1 + args.active + args.timed
    overrides = {
        "source": str(Path(args.src).resolve()) if Path(args.src).exists() else args.src,
        "data.source": str(Path(args.data).resolve()),
        f"{args.stage}.steps": steps,
        f"{args.stage}.log_every": 1,
        f"{args.stage}.save_every": 10**6,
        "data.max_documents": args.max_documents,
        "evaluate": None,
        "export": None,
    }
    if args.stage == "align":
        overrides["token_weights.enabled"] = False
    else:  # the speed of stage 2 does not depend on how well the mixers were aligned (or trained, for extend)
        overrides["align.steps"] = 0
        overrides[f"{args.stage}.eval_every"] = 0  # validation only after the last step, outside every timed one
    if args.stage == "extend":
        overrides["train.steps"] = 0
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def device_time(event) -> float:
    """GPU microseconds of an averaged profiler event (the field's name changed across torch versions)."""
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def self_device_time(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def on_gpu(event) -> bool:
    """A kernel or a copy as the GPU ran it: not an op's row (which holds the same time again) and not a range
    (record_function's and the profiler's own steps, which span the kernels in them)."""
    from torch.autograd import DeviceType

    annotation = getattr(event, "is_user_annotation", False) or event.key.startswith("ProfilerStep")
    return event.device_type == DeviceType.CUDA and not annotation


def profile(args) -> dict:
    from raven_convert.evaluate.runtime import seconds_between, stream_mark
    from raven_convert.train.graphs import CapturedStep, StepInputs
    from raven_convert.train.recipe import load_recipe
    from raven_convert.train.stages import run_recipe

    out = Path(args.out)
    run_dir = out / f"run-{args.stage}"
    recipe = load_recipe(args.recipe, recipe_overrides(args))
    stages = ["convert", "align", "weights", "train", "extend"]
    before = stages[: stages.index(args.stage)]  # align: convert alone
    run_recipe(recipe, run_dir, stages=before)
    shutil.rmtree(run_dir / args.stage, ignore_errors=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    window = args.warmup + 1 + args.active
    schedule = torch.profiler.schedule(wait=args.warmup, warmup=1, active=args.active, repeat=1)
    step_ends: list[float] = []  # host clock, each step synchronised: the profiled ones and those before
    marks: list = []  # the timed steps' ends: CUDA events on the step's stream (the host clock without CUDA)
    in_graph_step = False  # while a CapturedStep runs: its optimizer step (eager, or being captured) ends no step
    replay, made = CapturedStep.__call__, StepInputs.__init__
    with torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=False) as prof:

        def after_step(optimizer=None, *_):  # one optimizer step per training step in align and stage 2
            if in_graph_step:
                return
            if len(step_ends) == window:
                marks.append(stream_mark(torch.cuda.is_available()))
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())
            prof.step()

        def graphed_step(self, inputs):
            nonlocal in_graph_step
            in_graph_step = True
            try:
                output = replay(self, inputs)
            finally:
                in_graph_step = False
            after_step()
            return output

        handle = register_optimizer_step_post_hook(after_step)
        CapturedStep.__call__ = graphed_step
        if args.inputs_in_place:
            StepInputs.__init__ = functools.partialmethod(made, beside=False)
        try:
            run_recipe(recipe, run_dir, stages=[args.stage])
        finally:
            handle.remove()
            CapturedStep.__call__, StepInputs.__init__ = replay, made
    active = step_ends[-args.active - 1 :]  # the active window: from the end of the step before it
    wall_us = (active[-1] - active[0]) * 1e6 / args.active
    # from the first timed step's end: that step's own inputs were made after the last recorded step's wait
    timed_ms = seconds_between(marks[0], marks[-1]) * 1e3 / (len(marks) - 1)
    events = prof.key_averages()
    prefix = PHASE_PREFIX[args.stage]
    phases: dict[str, dict] = {}  # a range appears twice: as the CPU ran it and as the GPU did
    for e in events:
        if e.key.startswith(prefix):
            phase = phases.setdefault(e.key, {"cpu_ms": 0.0, "gpu_ms": 0.0})
            phase["cpu_ms"] = max(phase["cpu_ms"], e.cpu_time_total / 1e3 / args.active)
            phase["gpu_ms"] = max(phase["gpu_ms"], device_time(e) / 1e3 / args.active)
    gpu_events = [e for e in events if on_gpu(e) and not e.key.startswith(prefix)]
    kernels = sum(self_device_time(e) for e in gpu_events) / args.active
    top_gpu = sorted(gpu_events, key=self_device_time, reverse=True)[: args.rows]
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]
    trace = out / f"trace-{args.stage}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw_trace, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw_trace, packed)
    trace.unlink()
    return {
        "stage": args.stage,
        "inputs_in_place": args.inputs_in_place,
        "active_steps": args.active,
        "timed_steps": len(marks) - 1,
        "step_ms": timed_ms,
        "profiled_step_ms": wall_us / 1e3,
        "kernel_ms": kernels / 1e3 if torch.cuda.is_available() else None,
        "gpu_busy": kernels / wall_us if torch.cuda.is_available() else None,
        "gpu_busy_timed": kernels / 1e3 / timed_ms if torch.cuda.is_available() else None,
        "phases": phases,
        "top_gpu": [
            {"op": e.key, "gpu_ms": self_device_time(e) / 1e3 / args.active, "calls": e.count} for e in top_gpu
        ],
        "top_cpu": [
            {"op": e.key, "cpu_ms": e.self_cpu_time_total / 1e3 / args.active, "calls": e.count} for e in top_cpu
        ],
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def print_tables(result: dict) -> None:
    busy = "-" if result["gpu_busy"] is None else f"{result['gpu_busy']:.0%}"
    kernels = "" if result["kernel_ms"] is None else f", {result['kernel_ms']:.1f} ms of kernels"
    timed = "" if result["gpu_busy_timed"] is None else f", the kernels' time {result['gpu_busy_timed']:.0%} of it"
    print(
        f"\n{result['stage']} on {result['device']}: {result['step_ms']:.1f} ms per step as the recipe runs it"
        f" ({result['timed_steps']} steps, none waiting for the one before{timed}); recorded, each step after the"
        f" one before: {result['profiled_step_ms']:.1f} ms{kernels}, GPU busy {busy}\n"
    )
    print("| phase | CPU ms per step | GPU ms per step |\n| --- | --- | --- |")
    for name, t in sorted(result["phases"].items(), key=lambda kv: -kv[1]["gpu_ms"] - kv[1]["cpu_ms"]):
        print(f"| {name} | {t['cpu_ms']:.1f} | {t['gpu_ms']:.1f} |")
    print("\n| GPU kernel or copy (most time) | GPU ms per step | calls |\n| --- | --- | --- |")
    for row in result["top_gpu"]:
        print(f"| {row['op'][:90]} | {row['gpu_ms']:.2f} | {row['calls']} |")
    print("\n| op (most CPU time of its own) | CPU ms per step | calls |\n| --- | --- | --- |")
    for row in result["top_cpu"]:
        print(f"| {row['op'][:90]} | {row['cpu_ms']:.2f} | {row['calls']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--src", required=True, help="the teacher (a model directory or GGUF)")
    parser.add_argument("--data", required=True, help="the training text")
    parser.add_argument("--stage", choices=sorted(PHASE_PREFIX), default="train")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the recorded ones (compilation, autotune)")
    parser.add_argument("--active", type=int, default=5, help="steps recorded")
    parser.add_argument("--timed", type=int, default=8, help="steps timed after them, unsynchronised (at least 2)")
    parser.add_argument("--max-documents", type=int, default=300)
    parser.add_argument(
        "--inputs-in-place", action="store_true", help="stage 2's next inputs made after the step, on its stream"
    )
    parser.add_argument("--rows", type=int, default=20, help="ops listed in each table")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for name in ("warmup", "active", "rows", "max_documents"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.timed < 2:
        parser.error(f"--timed {args.timed}: must be >= 2 (the first timed step only starts the clock)")
    from raven_convert.files import write_json

    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = profile(args)
    write_json(result, Path(args.out) / f"profile-{args.stage}.json")
    print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
