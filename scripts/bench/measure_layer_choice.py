"""Time the layer scoring of `--layers auto:N` (raven_convert.layer_choice) on one teacher, uncached.

    python scripts/bench/measure_layer_choice.py --src MODEL --data CORPUS [--random-weights] [--n 15] [FIELD=VALUE ...]

FIELD=VALUE sets a ChoiceSettings field (window=64 samples=16 ...). --random-weights scores a randomly initialised
model of the source's config (the cost of a scan does not depend on the weights; the scores mean nothing), for a
machine without the weights. The corpus is read with load_documents, or as plain JSON lines (.jsonl/.jsonl.gz with a
"text" field) where `datasets` is missing. Prints the table, the seconds and the device.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from pathlib import Path

from raven_convert.layer_choice import ChoiceSettings, choice_record, rank_layers
from raven_convert.layer_choice_report import format_table
from raven_convert.sources import Source
from raven_convert.train.choice_parts import training_parts


def documents(path: str):
    try:
        from raven_convert.train.data import load_documents

        return load_documents(path)
    except ImportError:
        files = sorted(Path(path).glob("*.jsonl*")) if Path(path).is_dir() else [Path(path)]
        return (json.loads(line)["text"] for f in files for line in gzip.open(f, "rt") if line.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--n", type=int, default=15)
    p.add_argument("fields", nargs="*", metavar="FIELD=VALUE")
    args = p.parse_args()
    settings = ChoiceSettings(**dict(f.split("=", 1) for f in args.fields))
    source = Source.resolve(args.src)
    if args.random_weights:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(source.load_config()).eval()
    else:
        model = source.load_model("float32")
    with tempfile.TemporaryDirectory() as cache:
        result = rank_layers(
            model, source.load_tokenizer(), documents(args.data), settings, cache, parts=training_parts()
        )
    print(format_table(choice_record(result, args.n)))
    print(json.dumps({"seconds": result["seconds"], "device": result["device"], "settings": result["settings"]}))


if __name__ == "__main__":
    main()
