"""What a run directory records of its stages (see stages.py): each stage's DONE, the fingerprint of the recipe
fields it read, why a DONE no longer matches the recipe, and what an unfinished stage resumes from.

    done = read_done(run_dir, "train")               # the stage's summary, or None while it has not finished
    prints = fingerprints(recipe)                    # {stage: hash of its inputs and the earlier stages'}
    print(saved_so_far(run_dir, ["train"]))          # one sentence: what is done, what a rerun starts from
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from raven_convert.console import is_main_process
from raven_convert.files import disk_bytes
from raven_convert.train.checkpoint import CHECKPOINTS
from raven_convert.train.distributed import world_size
from raven_convert.train.recipe import STAGES, FinetuneRecipe, Recipe

MARKER = "DONE"
CHECKPOINTS_AT = "CHECKPOINTS_AT"  # in a stage's folder: the folder its checkpoints go to, where not that one
# Fields that change how a stage logs, checkpoints or runs, not what it computes (torch.compile, CUDA graphs and the
# token weights' kernels round differently, no more; max_skipped decides whether a run may start, not its data):
# changing them keeps its results valid.
BOOKKEEPING = ("log_every", "save_every", "keep_checkpoints", "compile", "cuda_graphs", "kernel", "max_skipped")
PER_PROCESS = ("align", "train", "extend")  # the sections whose batch_size counts the rows of one process

# `distributed` is in no stage's fields (recipe.stage_fields): the strategy and the process count change memory and
# speed, not results (at one global batch).
CHOICE_FIELDS = ("layer_choice", "data.source", "data.text_field")  # what convert also reads under layers: auto:N
# what convert and align also read in a further conversion (left out without one: older runs' fingerprints stand)
START_FIELDS = ("start_from",)
SINK_FIELDS = ("attention_sinks",)  # read by convert where set: runs made before the field keep their fingerprints


def read_done(run_dir: Path, stage: str, damaged_ok: bool = False) -> dict | None:
    """The stage's summary from its DONE, None while it has not finished; ValueError naming the file and the fix
    where the marker is damaged (truncated, edited, not JSON), or None then with `damaged_ok`."""
    marker = Path(run_dir) / stage / MARKER
    if not marker.is_file():
        return None
    try:
        done = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        done = err
    if not isinstance(done, dict):
        if damaged_ok:
            return None
        why = f"not JSON ({done})" if isinstance(done, Exception) else "not a JSON object"
        raise ValueError(
            f"{marker} is damaged: {why}. It marks the {stage} stage as finished; rerun with --redo {stage} to run "
            "that stage (and the later ones) again"
        )
    return done


def stage_inputs(recipe: Recipe | FinetuneRecipe, stage: str, processes: int = 1) -> dict:
    """{"field.path": value} of the recipe fields `stage` reads (JSON-ready), without BOOKKEEPING. The batch sizes
    of align, train and extend (rows per process) count as the global batch, batch_size x `processes` (those the
    stage runs or ran on): a run may go on under another number of processes with the same global batch."""
    data = recipe.model_dump(mode="json")
    for section in PER_PROCESS:
        if isinstance(data.get(section), dict):
            data[section]["batch_size"] *= processes
    inputs, fields = {}, recipe.stage_fields[stage]
    fields += CHOICE_FIELDS if stage == "convert" and recipe.auto() else ()
    fields += START_FIELDS if stage in ("convert", "align") and getattr(recipe, "start_from", None) else ()
    fields += SINK_FIELDS if stage == "convert" and getattr(recipe, "attention_sinks", None) is not None else ()
    for path in fields:
        value = data
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        inputs[path] = {k: v for k, v in value.items() if k not in BOOKKEEPING} if isinstance(value, dict) else value
    return inputs


def fingerprints(recipe: Recipe | FinetuneRecipe, processes: dict[str, int] | None = None) -> dict[str, str]:
    """{stage: hash of its inputs and of every earlier stage's fingerprint}; `processes`: {stage: the processes it
    ran on} (default 1)."""
    out, previous = {}, ""
    for stage in recipe.stages:
        text = previous + json.dumps(stage_inputs(recipe, stage, (processes or {}).get(stage, 1)), sort_keys=True)
        out[stage] = previous = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def changed_fields(old: dict, new: dict) -> list[str]:
    """Dotted paths where two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            f"{k}.{sub}" if sub else k
            for k in sorted(set(old) | set(new))
            for sub in changed_fields(old.get(k), new.get(k))
        ]
    return [] if old == new else [""]


def recorded_processes(run_dir: Path) -> dict[str, int]:
    """{stage: the processes it ran on}: those its DONE records (1 before they were recorded), else this launch's."""
    return {s: (read_done(run_dir, s, True) or {"processes": world_size()}).get("processes", 1) for s in STAGES}


def turned_off(recipe: Recipe | FinetuneRecipe, stage: str) -> bool:
    """Whether the recipe skips `stage`: a skipped stage computed nothing, so no changed field makes its DONE stale
    while the recipe still skips it."""
    if stage in ("extend", "evaluate", "export"):
        return getattr(recipe, stage, None) is None
    if stage in ("align", "train"):
        return getattr(recipe, stage).steps == 0
    if stage == "weights":
        return not recipe.token_weights.enabled or recipe.train.steps == 0  # as both recipes' weights stages skip
    return False


def stale_reason(run_dir: Path, stage: str, done: dict, recipe: Recipe, prints: dict[str, str], now=None) -> str | None:
    """Why `stage`'s DONE no longer matches the recipe (a message naming the changed fields), or None."""
    if done.get("fingerprint", prints[stage]) in (prints[stage], (now or prints)[stage]):
        return None
    if done.get("skipped") and turned_off(recipe, stage):
        return None
    changed, first = [], stage
    for earlier in recipe.stages[: recipe.stages.index(stage) + 1]:
        recorded = (read_done(run_dir, earlier) or {}).get("inputs")
        if recorded is not None:
            now = stage_inputs(recipe, earlier, recorded_processes(run_dir)[earlier])
            new = [p for p in changed_fields(recorded, now) if p not in changed]
            if new and not changed:
                first = earlier  # the earliest stage whose own settings changed
            changed += new
    what = ", ".join(changed) or "an earlier stage's inputs"
    return (
        f"stage {stage!r} in {run_dir} ran under a different recipe (changed: {what}); rerun from there with "
        f"--redo {first}, or use another --run-dir"
    )


def stage_state(run_dir: Path, stage: str) -> str:
    """What a rerun of an unfinished `stage` starts from: its latest complete checkpoint (evaluate: the parts its
    report.json finished), or nothing of it."""
    from raven_convert.train.checkpoint import latest_checkpoint

    report = Path(run_dir) / "evaluate" / "report.json"
    finished = json.loads(report.read_text()).get("finished") if stage == "evaluate" and report.is_file() else None
    if finished:
        return (
            f"the evaluate stage's finished parts ({', '.join(finished)}) are kept in {report}, a rerun runs the rest"
        )
    found = latest_checkpoint(Path(run_dir) / stage)
    pointer = Path(run_dir) / stage / CHECKPOINTS_AT
    if found is None and pointer.is_file():  # a fine-tuning recipe's token weights checkpoint in their cache
        found = latest_checkpoint(Path(pointer.read_text().strip()))
    if found is None:
        return f"nothing of the {stage} stage was saved, a rerun starts it afresh"
    return f"the {stage} stage's last good checkpoint {found[0]} is kept, a rerun resumes after step {found[1]['step']}"


def resumable_checkpoints(run_dir: Path, stages) -> list[str]:
    """For each of `stages` with a checkpoint but no DONE: 'PATH (step N) of the unfinished STAGE stage'."""
    from raven_convert.train.checkpoint import latest_checkpoint

    found = []
    for stage in stages:
        finished = (Path(run_dir) / stage / MARKER).is_file()  # a damaged DONE too: no checkpoint is resumed
        latest = None if finished else latest_checkpoint(Path(run_dir) / stage)
        if latest is not None:
            found.append(f"{latest[0]} (step {latest[1]['step']}) of the unfinished {stage} stage")
    return found


def saved_so_far(run_dir: str | Path, stages: list[str] | None = None, order: tuple[str, ...] = STAGES) -> str:
    """One sentence: the stages DONE in run_dir, and what the first unfinished one of `stages` resumes from (`order`:
    the recipe's stages)."""
    run_dir = Path(run_dir).resolve()
    finished = [s for s in order if (run_dir / s / MARKER).is_file()]
    text = f"stages done in {run_dir}: {', '.join(finished)}" if finished else f"no stage finished in {run_dir}"
    pending = [s for s in (stages or order) if s in order and s not in finished]
    return f"{text}; {stage_state(run_dir, pending[0])}" if pending else text


def require_done(run_dir: Path, stage: str, order: tuple[str, ...]) -> dict:
    """DONE of every stage before `stage` in `order`, all present, else a ValueError naming the first missing one."""
    done = {}
    for earlier in order[: order.index(stage)]:
        summary = read_done(run_dir, earlier)
        if summary is None:
            raise ValueError(
                f"stage {stage!r} needs the outputs of stage {earlier!r}, but {run_dir / earlier / MARKER} is "
                f"missing; run it first (--stages {earlier}) or run the whole recipe"
            )
        done[earlier] = summary
    return done


def drop_checkpoints(run_dir: Path, stage: str) -> None:
    """A finished stage's checkpoints go once its DONE is written: a rerun starts after DONE, never from them."""
    if is_main_process():
        shutil.rmtree(run_dir / stage / CHECKPOINTS, ignore_errors=True)


def disk_use(run_dir: Path, stage: str, summary: dict) -> int:
    """Bytes a finished stage (and its export) adds: no checkpoint, DONE or weight file linked from earlier stages."""
    folders = [run_dir / stage, *([summary["exported_to"]] if "exported_to" in summary else [])]
    earlier = [run_dir / s for s in STAGES[: STAGES.index(stage)]]
    return disk_bytes(*folders, besides=earlier) - disk_bytes(run_dir / stage / CHECKPOINTS)
