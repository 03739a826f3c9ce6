"""Load a trained hybrid the way a user without this toolkit does, and generate: the issue-6 loading check.

    bash scripts/tools/clean_load.sh RUN_DIR/train/model RUN_DIR/load_check.json

Run by clean_load.sh with `python -S` and only site-packages on the path, so the toolkit's packages cannot be
imported: everything comes from the model directory's own code (`trust_remote_code=True`). Writes a JSON record
(library versions, the layer mixers, greedy continuations of a short and a longer prompt, and the cache sizes after
each, which show the mixer state staying constant while the kept attention layers grow) and fails on any mismatch.

It also checks that cached decoding is right under the installed transformers: the logits of every generate() step
must equal those of one forward over the whole sequence without a cache (relative error below CACHED_DECODE_TOL).
"""

import importlib.util
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import __version__ as transformers_version

TOOLKIT_PACKAGES = ("raven_convert", "raven_layers", "raven_kernels")
PROMPT = "The capital of France is"
PASSKEY = "There is a pass key hidden in this text. The pass key is 52817. Remember it. "
# relative error allowed between cached steps and a full forward: float rounding of two equal computations (the
# chunked and the step-by-step form of each mixer), in float32 and in bfloat16
CACHED_DECODE_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def output_cache(out):
    """The cache of a generate() output: the field is `cache` from transformers 5.24, `past_key_values` before."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def cached_decode_error(model, out, prompt_tokens: int) -> float:
    """Relative error between the logits of generate()'s cached steps and one forward over the same tokens."""
    steps = torch.stack(out.logits, dim=1).float()  # [1, N, V], before any logits processor
    with torch.no_grad():
        full = model(out.sequences[:, :-1], use_cache=False).logits[:, prompt_tokens - 1 :].float()  # [1, N, V]
    return ((steps - full).norm() / full.norm()).item()


def generate(model, tokenizer, text: str, new_tokens: int) -> dict:
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    prompt_tokens = inputs["input_ids"].shape[1]
    new = out.sequences[0, prompt_tokens:]
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": int(new.numel()),
        "continuation": tokenizer.decode(new, skip_special_tokens=True),
        "cache_class": type(output_cache(out)).__name__,
        "state_bytes": output_cache(out).state_bytes(),
        "cached_decode_error": cached_decode_error(model, out, prompt_tokens),
    }


def main(model_dir: str, out_file: str) -> None:
    visible = [name for name in TOOLKIT_PACKAGES if importlib.util.find_spec(name) is not None]
    if visible:
        raise SystemExit(
            f"the toolkit's packages {visible} are importable here, so this would not test a clean environment: run "
            "it through scripts/tools/clean_load.sh (which hides an editable install) or where the toolkit is not "
            "installed"
        )
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=dtype)
    except (ValueError, OSError) as err:  # a damaged export: the model code's (or transformers') reason, one line
        raise SystemExit(f"clean_load: {model_dir} does not load: {' '.join(str(err).split())}") from None
    model = model.to(device).eval()
    if not hasattr(model.config, "layer_mixers"):
        raise SystemExit(f"{model_dir} holds a {type(model).__name__}, not a hybrid exported by this toolkit")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    short = generate(model, tokenizer, PROMPT, 16)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 40
    long = generate(model, tokenizer, PASSKEY + filler + "What is the pass key? The pass key is", 16)
    mixers = list(model.config.layer_mixers)
    record = {
        "model": model_dir,
        "model_class": type(model).__name__,
        "module": type(model).__module__,
        "torch": torch.__version__,
        "transformers": transformers_version,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "layer_mixers": mixers,
        "short": short,
        "long": long,
        "seconds": round(time.perf_counter() - start, 3),
    }
    problems = []
    if not type(model).__module__.startswith("transformers_modules"):
        problems.append(f"the model class comes from {type(model).__module__}, not the directory's code")
    if any(g["new_tokens"] != 16 for g in (short, long)):
        problems.append("generate() stopped early")
    tol = CACHED_DECODE_TOL.get(model.dtype, CACHED_DECODE_TOL[torch.bfloat16])
    for name, g in (("short", short), ("long", long)):
        if not g["cached_decode_error"] < tol:  # also catches NaN
            problems.append(
                f"{name} prompt: cached generate() steps differ from a full forward by {g['cached_decode_error']:.3g} "
                f"(relative; allowed {tol:g} in {model.dtype}) under transformers {transformers_version}"
            )
    if short["state_bytes"]["mixer"] != long["state_bytes"]["mixer"]:
        problems.append(f"the mixer state grew with the prompt: {short['state_bytes']} -> {long['state_bytes']}")
    record["problems"] = problems
    tmp = f"{out_file}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, out_file)
    print(json.dumps({k: record[k] for k in ("model_class", "short", "long", "problems")}, indent=1))
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
