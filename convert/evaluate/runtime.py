"""What the evaluation's measurements share about the model they run on: where it lives, in what precision, what
it ran on (run_info), loading any model the toolkit reads, freeing and synchronising the device, the lengths and
batches flags, and the command-line comparison of several models (perplexity.py and speed.py each measure; this
runs them).

    model, tokenizer = load_for_evaluation("runs/sila/model", "bfloat16")
    record = run_info(model)       # {"model", "device", "dtype", "torch", "transformers", ...}
"""

from __future__ import annotations

import argparse
import platform
import re
import time

import torch
from torch import nn

from ..files import write_json

OutOfMemory: tuple[type[BaseException], ...] = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


def model_device(model: nn.Module) -> torch.device:
    """Where input ids go: the device of the input embeddings (or of the first parameter)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


def model_dtype(model: nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def model_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None) or type(model).__name__


def run_info(model: nn.Module) -> dict:
    """What a measurement ran on: model, device, dtype, library versions (JSON-serialisable)."""
    import transformers

    config = getattr(model, "config", None)
    device = model_device(model)
    info = {
        "model": model_name(model),
        "model_class": type(model).__name__,
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(model_dtype(model)).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trained_length": getattr(config, "max_position_embeddings", None),
    }
    if getattr(config, "layer_mixers", None) is not None:
        info["layer_mixers"] = list(config.layer_mixers)
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stream_mark(cuda: bool):
    """A point in the work queued so far: on CUDA an event recorded on the current stream (the host does not wait
    for it), elsewhere the host clock, the work being done by then. Two marks give the time between
    (seconds_between)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end) -> float:
    """Seconds from one stream_mark to a later one (on CUDA it waits for the GPU to reach `end`)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def free(device: torch.device, collect: bool = False) -> None:
    """Hand cached CUDA blocks back; `collect` first runs the garbage collector (slow with a big heap: after an
    out-of-memory error, whose traceback held tensors)."""
    if collect:
        import gc

        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_lengths(text: str) -> list[int]:
    """'512,4k,32k' -> [512, 4096, 32768]"""
    out = []
    for part in re.split(r"[,\s]+", text.strip()):
        if part:
            m = re.fullmatch(r"(\d+)([kK]?)", part)
            if not m or int(m.group(1)) < 1:
                raise argparse.ArgumentTypeError(f"{part!r} is not a length; expected integers >= 1 such as 512,4k,32k")
            out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} names no length; expected integers >= 1 such as 512,4k,32k")
    return out


def parse_batches(text: str) -> list[int]:
    """'1,8' -> [1, 8]"""
    parts = [part for part in re.split(r"[,\s]+", text.strip()) if part]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of batch sizes; expected integers >= 1 such as 1,8")
    return [int(part) for part in parts]


def load_for_evaluation(src: str, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) from a Hub id, a directory (teacher or exported hybrid) or a .gguf file."""
    from raven_convert import Source

    source = Source.resolve(src)
    model = source.load_model(dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval(), source.load_tokenizer()


def compare_models(args, measure, table, plot) -> dict:
    """What the comparison commands (`python -m raven_convert.evaluate.perplexity` and `.speed`) do with their models:
    load each `--model` in turn (args.dtype, args.device), measure(model, tokenizer) it and free it before the next;
    then print table(results), write them to `--out` as JSON and plot(results, path) them to `--plot`, where given.
    Returns {model: result}."""
    results = {}
    for src in args.model:
        model, tokenizer = load_for_evaluation(src, args.dtype, args.device)
        results[src] = measure(model, tokenizer)
        del model
        free(torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    print(table(results))
    if args.out:
        write_json(results, args.out)
    if args.plot:
        plot(results, args.plot)
    return results
