"""`python -m raven_convert.train RECIPE.yaml --run-dir DIR [--src MODEL] [--reference MODEL] [--data PATH]
[--haystack DIR] [--ppl-data PATH] [--stages align,train] [--redo STAGE] [--set key=value]`: a recipe with `layers`
runs the conversion pipeline (stages.run_recipe), one without a fine-tune (finetune.run_finetune_recipe)."""

from __future__ import annotations

import argparse
import sys

from raven_convert.console import command_line, interrupted, invoked_as, reporting_interrupt
from raven_convert.files import DiskSpaceError
from raven_convert.train.finetune import run_finetune_recipe
from raven_convert.train.recipe import (
    INPUT_FLAGS,
    SHIPPED_RECIPES,
    STAGES,
    FinetuneRecipe,
    input_overrides,
    load_recipe,
    shipped_recipes,
)
from raven_convert.train.run_state import saved_so_far
from raven_convert.train.stages import run_recipe


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues an interrupted run: the same one without --redo (which would delete again)."""
    words = [args.recipe, "--run-dir", args.run_dir]
    words += ["--stages", args.stages] if args.stages is not None else []
    for field, (flag, _, _) in INPUT_FLAGS.items():
        words += [flag, getattr(args, field)] if getattr(args, field) is not None else []
    for item in args.overrides:
        words += ["--set", item]
    return command_line(invoked_as("raven_convert.train", ("raven-train",)), words)


def build_parser() -> argparse.ArgumentParser:
    shipped = shipped_recipes()
    parser = argparse.ArgumentParser(
        prog=invoked_as("raven_convert.train", ("raven-train",)),
        description=f"Run a recipe's stages ({' -> '.join(STAGES)}; a recipe without `layers` fine-tunes: "
        "weights -> train -> export) into --run-dir, skipping those already DONE.",
        epilog=f"shipped recipes ({SHIPPED_RECIPES}): {', '.join(p.name for p in shipped)}" if shipped else None,
    )
    parser.add_argument("recipe", help="recipe YAML (relative paths in it resolve against the current directory)")
    parser.add_argument("--run-dir", required=True, help="where every stage writes its outputs and DONE marker")
    for field, (flag, metavar, text) in INPUT_FLAGS.items():
        parser.add_argument(flag, dest=field, metavar=metavar, help=f"{text}; sets {field} (as --set does)")
    parser.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} (default: all)")
    parser.add_argument(
        "--redo", default=None, choices=STAGES, help="delete this stage's and every later stage's outputs, then run"
    )
    parser.add_argument(
        "--discard-checkpoints",
        action="store_true",
        help="with --redo: also delete the checkpoints of an unfinished stage (refused otherwise, since a rerun "
        "without --redo resumes from them)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field before validation, e.g. --set train.steps=20 --set evaluate=null",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.discard_checkpoints and args.redo is None:
        parser.error("--discard-checkpoints only applies with --redo STAGE")
    stages = None if args.stages is None else [s.strip() for s in args.stages.split(",") if s.strip()]
    order = STAGES
    try:
        recipe = load_recipe(args.recipe, input_overrides(args) + args.overrides)
        order = recipe.stages
        run = run_finetune_recipe if isinstance(recipe, FinetuneRecipe) else run_recipe
        run(recipe, args.run_dir, stages, redo=args.redo, discard_checkpoints=args.discard_checkpoints)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except DiskSpaceError as err:  # what was needed, what was free; the partial output is already gone
        print(f"error: {err.strerror}", file=sys.stderr)
        return 1
    except FloatingPointError as err:  # a diverged training step: the message says what was kept
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        with reporting_interrupt():
            return interrupted(saved_so_far(args.run_dir, stages, order), resume_command(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
