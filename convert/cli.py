"""`convert`: turn a pretrained decoder into a hybrid with linear-time mixers in chosen layers.

    convert --src Qwen/Qwen3-0.6B --mixer raven --layers 0-23:5 --out qwen3-raven
    convert --src model.gguf --mixer raven --layers 0-3 --mixer raven --layers -2,-1 --num-slots 64 --top-k 8 --out out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raven_layers import MIXER_CLASSES

from .layer_spec import ACCEPTED_FORMS
from .pipeline import ConvertRequest, convert_model
from .sources import DEFAULT_SRC, DTYPES, SourceError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", default=DEFAULT_SRC, help=f"Hub id, model directory or .gguf file (default {DEFAULT_SRC})")
    p.add_argument("--mixer", action="append", choices=sorted(MIXER_CLASSES), help="mixer for the next --layers")
    p.add_argument("--layers", action="append", required=True, help=f"layers to replace: {ACCEPTED_FORMS}")
    p.add_argument("--out", type=Path, required=True, help="output directory (exactly what --push-to-hub uploads)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights dtype (default: the source's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixers' new parameters")
    p.add_argument("--max-shard-size", default="2GB", help="safetensors shard size")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload --out to this Hub model repository")
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")

    raven = p.add_argument_group("raven options (Raven paper defaults)")
    raven.add_argument("--num-slots", type=int, help="slots M per head (256)")
    raven.add_argument("--top-k", type=int, help="slots written per token (32)")
    raven.add_argument("--alpha", type=float, help="router normaliser (1.0)")
    raven.add_argument("--no-gumbel", dest="gumbel", action="store_const", const=False, help="no router noise")
    raven.add_argument("--qk-norm", choices=["auto", "on", "off"], help="q/k RMSNorm (auto: as the source)")
    raven.add_argument("--feature-map", choices=["identity", "silu"], help="q/k feature map (identity)")
    raven.add_argument("--no-output-gate", dest="output_gate", action="store_const", const=False)
    raven.add_argument("--chunk-size", type=int, help="chunk of the parallel PyTorch form (16)")
    return p


def request_from_args(args: argparse.Namespace) -> ConvertRequest:
    mixers = args.mixer or ["raven"] * len(args.layers)
    if len(mixers) != len(args.layers):
        raise ValueError(f"each --mixer needs one --layers: got {len(mixers)} --mixer and {len(args.layers)} --layers")
    raven = {
        "num_slots": args.num_slots,
        "top_k": args.top_k,
        "alpha": args.alpha,
        "gumbel": args.gumbel,
        "qk_norm": {"on": True, "off": False}.get(args.qk_norm),
        "feature_map": args.feature_map,
        "output_gate": args.output_gate,
        "chunk_size": args.chunk_size,
    }
    return ConvertRequest(
        out=args.out,
        assignments=list(zip(mixers, args.layers)),
        src=args.src,
        mixer_settings={"raven": {k: v for k, v in raven.items() if v is not None}},
        dtype=args.dtype,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        push_to_hub=args.push_to_hub,
        private=args.private,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        convert_model(request_from_args(args))
    except (ValueError, FileExistsError) as err:  # bad input: a one-line message, not a traceback
        parser.exit(2, f"convert: error: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
