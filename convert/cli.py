"""raven-convert (also installed as `convert`, not ImageMagick's), of the raven-hybrid toolkit: turn a pretrained
Hugging Face decoder into a hybrid with linear-time mixers (Raven, SSE, SILA, or your own) in chosen layers.
Installed as `convert`, it hands a command line that is not its own (`convert in.png -resize 50% out.jpg`) to the
next `convert` on PATH, so that ImageMagick's keeps working where this one stands before it.

    convert --src Qwen/Qwen3-0.6B --mixer raven --layers 0-23:5 --out qwen3-raven
    convert --src model.gguf --mixer raven --layers 0-3 --mixer raven --layers -2,-1 \\
            --raven-num-slots 64 --raven-top-k 8 --sliding-window 512 --out out
    convert --src model.gguf --mixer mypkg.gla:MIXER --layers 0-29:2 --gla-expand 2 --out out
    convert --src model.gguf --mixer sse --layers auto:15 --choice-data corpus/ --out out
    convert --src out --mixer sse --layers auto:22 --choice-data corpus/ --out out-22   # a hybrid, further
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from raven_layers import DEFAULT_MIXER, mixer_names, registered_mixers, resolve_mixer

from .console import command_line, interrupted, invoked_as, reporting_interrupt
from .files import DiskSpaceError
from .layer_choice import ChoiceSettings
from .layer_spec import ACCEPTED_FORMS, AUTO_FORM
from .pipeline import ConvertRequest, convert_model
from .sources import DEFAULT_SRC, DTYPES


def _value_parser(hint):
    """argparse `type=` for a settings field annotated `int`, `float`, `str`, `bool`, `X | None` or a Literal."""
    if typing.get_origin(hint) is typing.Literal:
        allowed = typing.get_args(hint)

        def choose(text: str):
            if text not in allowed:
                raise argparse.ArgumentTypeError(f"expected one of {list(allowed)}, got {text!r}")
            return text

        choose.__name__ = "choice"
        return choose
    kinds = set(typing.get_args(hint)) or {hint}
    optional = type(None) in kinds
    (base,) = kinds - {type(None)}

    def parse(text: str):
        if optional and text.lower() in ("auto", "none"):
            return None
        if typing.get_origin(base) is list:  # comma-separated: --choice-round-sizes 1,1,1,1
            (item,) = typing.get_args(base)
            item = typing.get_args(item)[0] if typing.get_origin(item) is typing.Annotated else item
            try:
                return [item(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected a comma-separated list such as 1,1,2, got {text!r}"
                ) from None
        if base is bool:
            if text.lower() in ("true", "on", "yes", "1"):
                return True
            if text.lower() in ("false", "off", "no", "0"):
                return False
            raise argparse.ArgumentTypeError(f"expected true or false{' or auto' if optional else ''}, got {text!r}")
        value = base(text)
        if base is float and not math.isfinite(value):  # inf or nan would write a model whose logits are nan
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        return value

    parse.__name__ = base.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def mixer_name(text: str) -> str:
    """argparse `type=` for --mixer: a mixer's name or the import path of its declaration (registered here)."""
    try:
        return resolve_mixer(text).name
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def load_named_mixers(argv: list[str]) -> None:
    """Register the mixers that `--mixer` names by import path in `argv`, so that their settings get flags.
    A value that fails is left for the parser, which reports it."""
    values = [b for a, b in zip(argv, argv[1:]) if a == "--mixer"]
    values += [a.removeprefix("--mixer=") for a in argv if a.startswith("--mixer=")]
    for value in values:
        try:
            mixer_name(value)
        except argparse.ArgumentTypeError:
            pass


def build_parser() -> argparse.ArgumentParser:
    """The parser, with flags for the settings of every registered mixer (see `load_named_mixers`)."""
    p = argparse.ArgumentParser(
        prog=invoked_as("raven_convert", ("convert", "raven-convert")),
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--src",
        default=DEFAULT_SRC,
        help=f"Hub id, model directory or .gguf file (default {DEFAULT_SRC}); a hybrid this toolkit saved is "
        "converted further, keeping the layers it converted (docs/DEPTH.md)",
    )
    p.add_argument(
        "--mixer",
        action="append",
        type=mixer_name,
        metavar="MIXER",
        help=f"mixer for the next --layers: {', '.join(mixer_names())} (default {DEFAULT_MIXER}), or the import path "
        "of one declared elsewhere, mypkg.module:NAME (see docs/ADD_A_MIXER.md)",
    )
    p.add_argument(
        "--layers", action="append", required=True, help=f"layers to replace: {ACCEPTED_FORMS}, or {AUTO_FORM}"
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (exactly what --push-to-hub uploads)")
    p.add_argument("--sliding-window", type=int, metavar="W", help="kept attention layers attend to the last W tokens")
    p.add_argument("--window-layers", metavar="SPEC", help="which kept attention layers get --sliding-window (all)")
    p.add_argument(
        "--attention-sinks",
        type=int,
        metavar="S",
        help="windowed attention layers also attend to each sequence's first S tokens (default: the source's, 0)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights dtype (default: the source's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixers' new parameters")
    p.add_argument("--max-shard-size", default="2GB", help="safetensors shard size")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload --out to this Hub model repository")
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")

    choice = p.add_argument_group("--layers auto:N options (see raven_convert.layer_choice)")
    choice.add_argument("--choice-data", metavar="PATH", help="corpus the layers are measured on (required by auto:N)")
    choice.add_argument("--choice-text-field", default="text", metavar="NAME", help="its text field (default text)")
    choice.add_argument("--choice-cache", type=Path, metavar="DIR", help="where the scores are kept (default ~/.cache)")
    hints = typing.get_type_hints(ChoiceSettings)
    for name, info in ChoiceSettings.model_fields.items():
        choice.add_argument(
            f"--choice-{name.replace('_', '-')}",
            dest=f"choice.{name}",
            type=_value_parser(hints[name]),
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{info.description or name} (default {info.default})",
        )

    # One option per field of each mixer's settings: --raven-num-slots, --raven-top-k, ...
    for spec in registered_mixers():
        group = p.add_argument_group(f"{spec.name} options (see {spec.layer.__module__})")
        hints, notes = typing.get_type_hints(spec.settings), setting_notes(spec.settings)
        for field in dataclasses.fields(spec.settings):
            group.add_argument(
                f"--{spec.name}-{field.name.replace('_', '-')}",
                dest=f"{spec.name}.{field.name}",
                type=_value_parser(hints[field.name]),
                default=argparse.SUPPRESS,
                metavar="VALUE",
                help=f"{notes.get(field.name, field.name)} (default: {_shown(field.default)})",
            )
    return p


def _shown(default) -> str:
    return "auto" if default is None else str(default)


def setting_notes(settings_class) -> dict[str, str]:
    """{field: its comment} of a mixer's settings dataclass, from the trailing comments of its declaration (the one
    place each setting is described): `num_slots: int = 256  # M, paper default` -> {"num_slots": "M, paper
    default"}."""
    try:
        source = inspect.getsource(settings_class)
    except (OSError, TypeError):  # a class declared where its source cannot be read
        return {}
    found = re.findall(r"^    (\w+): [^#\n]*#\s*(.+)$", source, flags=re.MULTILINE)
    return {name: note.strip() for name, note in found}


def request_from_args(args: argparse.Namespace) -> ConvertRequest:
    mixers = args.mixer or [DEFAULT_MIXER] * len(args.layers)
    if len(mixers) != len(args.layers):
        raise ValueError(f"each --mixer needs one --layers: got {len(mixers)} --mixer and {len(args.layers)} --layers")
    settings: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "." in key:
            mixer, name = key.split(".", 1)
            settings.setdefault(mixer, {})[name] = value
    used = {resolve_mixer(mixer).name for mixer in mixers}  # --mixer names them already (mixer_name)
    for mixer, values in settings.items():
        if mixer != "choice" and mixer not in used:  # a setting of a mixer this command converts no layer to
            flags = ", ".join(f"--{mixer}-{name.replace('_', '-')}" for name in values)
            raise ValueError(
                f"{flags} set{'s' if len(values) == 1 else ''} the {mixer} mixer, but no --mixer {mixer} converts a "
                f"layer here (converted to: {', '.join(sorted(used))}); drop it, or add --mixer {mixer} --layers SPEC"
            )
    given = settings.get("choice") or args.choice_data or args.choice_cache
    if given and not any(spec.strip().lower().startswith("auto") for spec in args.layers):  # N checked later
        raise ValueError("the --choice-* options set how --layers auto:N measures the layers; no --layers is auto:N")
    try:
        choice = ChoiceSettings(**settings.pop("choice", {}))
    except ValidationError as err:
        problems = "; ".join(
            f"--choice-{e['loc'][0].replace('_', '-')} {e['input']!r}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(problems) from None
    return ConvertRequest.of(
        vars(args), assignments=list(zip(mixers, args.layers)), mixer_settings=settings, choice_settings=choice
    )


def _stamp(out: Path) -> int | None:
    return out.stat().st_mtime_ns if out.exists() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    load_named_mixers(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    before = _stamp(args.out)
    try:
        convert_model(request_from_args(args))
    except (ValueError, FileExistsError) as err:  # bad input: a one-line message, not a traceback
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except DiskSpaceError as err:  # what was needed, what was free; the partial output is already gone
        parser.exit(1, f"{parser.prog}: error: {err.strerror}\n")
    except KeyboardInterrupt:
        with reporting_interrupt():
            if _stamp(args.out) == before:  # the output is swapped in whole, so it is either untouched or complete
                saved = f"--out {args.out} is as it was" if before else f"nothing was written to --out {args.out}"
                return interrupted(saved, command_line(parser.prog, argv))
            again = argv if args.overwrite else [*argv, "--overwrite"]
            saved = f"the model was written to {args.out}" + (", not pushed" if args.push_to_hub else "")
            return interrupted(saved, command_line(parser.prog, again))
    return 0


# the `convert` programs a hand-off has tried, as real paths joined by os.pathsep: one that brings the command
# back here (a pyenv shim, a wrapper script) is passed over the next time
TRIED = "RAVEN_CONVERT_TRIED"


def is_foreign(argv: list[str]) -> bool:
    """Whether a command line is not this program's: every option here is `--NAME` (or -h), and none takes a word
    before it, while ImageMagick's start with a file or a one-dash option (`convert in.png ...`, `convert -version`)."""
    return bool(argv) and not argv[0].startswith("--") and argv[0] != "-h"


def other_convert(own: str) -> str | None:
    """The first `convert` on PATH that is neither this script (`own`) nor one a hand-off already tried."""
    skip = {os.path.realpath(own), *filter(None, os.environ.get(TRIED, "").split(os.pathsep))}
    for folder in os.get_exec_path():
        path = os.path.join(folder, "convert")
        if os.path.isfile(path) and os.access(path, os.X_OK) and os.path.realpath(path) not in skip:
            return path
    return None


def convert_main() -> int:
    """The `convert` console script: this program's command lines run here, any other goes to the next `convert` on
    PATH (ImageMagick's, where installed)."""
    argv = sys.argv[1:]
    if not is_foreign(argv):
        return main(argv)
    other = other_convert(sys.argv[0])
    if other is None:
        sys.exit(
            f"convert: {argv[0]!r} is not an option of raven-convert (which this `convert` is: its options are --src, "
            "--mixer, --layers, --out, ...: see convert --help), and there is no other `convert` on PATH, such as "
            "ImageMagick's, to hand the command line to"
        )
    tried = os.environ.get(TRIED, "")
    os.environ[TRIED] = os.pathsep.join(filter(None, [tried, os.path.realpath(other)]))
    os.execv(other, [other, *argv])


if __name__ == "__main__":
    sys.exit(main())
