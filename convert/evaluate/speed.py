"""Decode speed as users decode (`generate()`), time to first token, peak memory and cache size at several context
lengths and batch sizes.

For each context length L and batch size B, `measure_speed` times `model.generate()` after a random prompt of
[B, L] tokens, greedy with fixed lengths, on the path users decode on (decode_bench.py): on CUDA a hybrid's default
generate() (static hybrid cache, compiled step replayed as CUDA graphs) and transformers' compiled static cache
(`cache_implementation="static"`) for any other model; elsewhere generate() on the dynamic cache, eager. Each row
says which under `path`. One untimed warm-up call (compilation, graph capture), then `repeats` calls of 1 new token
(time to first token, TTFT) and as many of `decode_tokens + 1`; the decode step is timed inside the best of the
long calls, from its second decode step to its last (decode_bench.StepClock; `decode_step_seconds_wall` is the
best calls' difference over `decode_tokens`, prompt and first step's one-time work included).
`prefill_tokens_per_second` is the prompt's tokens over the TTFT.

The bytes the cache holds per sequence are measured apart, from one eager forward of the prompt's first row on the
model's dynamic cache (then `decode_tokens` more tokens): a hybrid's `HybridCache` splits them into constant-size
mixer states and the attention layers' growing KV cache; a transformers `DynamicCache` holds keys and values only.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` over the timed calls (it includes the weights, and
`peak_memory_growth_bytes` is the part above what was allocated before the row's warm-up). On CPU (Linux) the
process's peak resident set size, reset through `/proc/self/clear_refs` (VmHWM); where that cannot be reset, the
growth of `resource.getrusage(...).ru_maxrss` (a lower bound: 0 when an earlier peak was higher);
`peak_memory_method` says which, and both values are null where neither is available. A row that runs out of
memory is recorded with `skipped: true` and the reason, and the next one is tried.

Command line:

    python -m raven_convert.evaluate.speed --model Qwen/Qwen3-0.6B --model qwen3-raven --lengths 1k,4k,16k,64k \\
        --batches 1,8 --dtype bfloat16 --out speed.json --plot speed.png
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from raven_layers.cache import cache_argument, output_cache

from ..files import write_png
from .decode_bench import decode_path, generate_times, warm_up
from .runtime import OutOfMemory, compare_models, free, model_device, parse_batches, parse_lengths, run_info, sync

MiB = 1024**2
BATCHES = (1, 8)  # the batch sizes timed unless asked otherwise: one user, and a small server batch


def cache_bytes(cache) -> dict[str, int]:
    """Bytes a generation cache holds, all sequences of the batch together: {"attention", "mixer", "total"}.

    A `HybridCache` answers `state_bytes()`. For a transformers cache, every layer's `keys` / `values` count as
    attention and any other tensor whose name says it is a state (`conv_states`, `recurrent_states` of the linear
    attention layers some models have) as mixer; a legacy tuple of (key, value) pairs counts as attention.
    """
    sizes = {"attention": 0, "mixer": 0}
    if cache is None:
        pass
    elif callable(getattr(cache, "state_bytes", None)):
        sizes.update(cache.state_bytes())
    elif hasattr(cache, "layers"):
        for layer in cache.layers:
            for name, value in vars(layer).items():
                tensors = [value] if isinstance(value, torch.Tensor) else []
                if isinstance(value, (tuple, list)):
                    tensors = [v for v in value if isinstance(v, torch.Tensor)]
                n = sum(t.numel() * t.element_size() for t in tensors)
                if name in ("keys", "values"):
                    sizes["attention"] += n
                elif "state" in name:
                    sizes["mixer"] += n
    elif isinstance(cache, (tuple, list)):
        for layer in cache:
            for t in layer:
                if isinstance(t, torch.Tensor):
                    sizes["attention"] += t.numel() * t.element_size()
    sizes = {k: int(v) for k, v in sizes.items()}
    sizes["total"] = sizes["attention"] + sizes["mixer"]
    return sizes


def status_kib(field: str) -> int | None:
    """A memory field of this process's /proc/self/status (VmRSS, VmHWM, RssAnon, ...) in KiB; None off Linux."""
    try:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


class _PeakMemory:
    """Peak memory over a stretch of work: CUDA allocator statistics, or the Linux process high-water mark."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method: str | None = None
        self.start = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method, self.start = "cuda_max_memory_allocated", torch.cuda.memory_allocated(self.device)
            return
        rss = status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM := current RSS
            hwm = status_kib("VmHWM")
            if rss is not None and hwm is not None and hwm <= rss * 1.05 + 1024:
                self.method, self.start = "linux_vmhwm", rss * 1024
                return
        except OSError:
            pass
        try:
            import resource

            self.method, self.start = "ru_maxrss_growth", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except (ImportError, OSError):
            self.method, self.start = None, 0

    def clear_peak(self) -> None:
        """Start the peak afresh, keeping the start `reset` recorded (no-op where the peak cannot be reset)."""
        if self.method == "cuda_max_memory_allocated":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == "linux_vmhwm":
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass

    def read(self) -> tuple[int | None, int | None]:
        """(peak bytes, peak bytes above the start) since `reset`."""
        if self.method == "cuda_max_memory_allocated":
            sync(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return int(peak), int(max(0, peak - self.start))
        if self.method == "linux_vmhwm":
            hwm = status_kib("VmHWM")
            return (None, None) if hwm is None else (hwm * 1024, max(0, hwm * 1024 - self.start))
        if self.method == "ru_maxrss_growth":
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if sys.platform == "darwin":  # bytes there, not KiB
                peak //= 1024
            return int(peak), int(max(0, peak - self.start))
        return None, None


def _forward(model: nn.Module, ids: torch.Tensor, cache=None):
    """One forward pass with the cache; logits of the last position only where the model allows it."""
    kwargs = {"input_ids": ids, "use_cache": True}
    if cache is not None:
        kwargs[cache_argument(model.forward)] = cache
    try:
        out = model(**kwargs, logits_to_keep=1)
    except TypeError:
        out = model(**kwargs)
    return output_cache(out)


def cache_sizes(model: nn.Module, prompt: torch.Tensor, more_tokens: int) -> tuple[dict, dict]:
    """Bytes the model's dynamic cache holds for `prompt` [B, L] (see `cache_bytes`), and after `more_tokens` more."""
    with torch.inference_mode():
        cache = _forward(model, prompt)
        after_prompt = cache_bytes(cache)
        for _ in range(more_tokens):  # one at a time, as decoding adds them (a window's cache may hold a chunk whole)
            cache = _forward(model, prompt[:, -1:], cache)
        return after_prompt, cache_bytes(cache)


def _oom_reason(err: BaseException) -> str:
    if isinstance(err, MemoryError):
        return f"out of memory (host): {err}"
    return f"out of memory: {str(err).splitlines()[0][:200]}"


def measure_speed(
    model: nn.Module,
    context_lengths: list[int],
    batches: Sequence[int] = BATCHES,
    decode_tokens: int = 32,
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """generate() speed, time to first token, peak memory and cache bytes per sequence of `model`: one row per
    context length and batch size (see the module), each naming the decode `path` timed.

    Per row: `warmup` untimed generate() calls, then `repeats` timed ones of each length on the same random prompt of
    [batch, L] tokens, in the model's dtype on its device. A row that runs out of memory is recorded with
    `skipped: true` and the reason, and the next one is tried.
    """
    if min(batches, default=0) < 1 or decode_tokens < 1 or warmup < 0 or repeats < 1:
        raise ValueError("batches must be one or more sizes >= 1; decode_tokens and repeats >= 1, warmup >= 0")
    device = model_device(model)
    info = run_info(model)
    path = decode_path(model, device)
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    vocab = emb.num_embeddings if isinstance(emb, nn.Embedding) else model.config.vocab_size
    memory = _PeakMemory(device)
    was_training = model.training
    model.eval()
    results = []
    try:
        for L in [int(x) for x in context_lengths]:
            g = torch.Generator().manual_seed(seed + L)
            prompts = torch.randint(0, vocab, (max(batches), L), generator=g).to(device)  # [max batch, L]
            sizes, reason = None, None
            try:
                sizes = cache_sizes(model, prompts[:1], decode_tokens)
            except (*OutOfMemory, MemoryError) as err:
                reason = _oom_reason(err)
                free(device, collect=True)
            for batch in batches:
                entry = {**info, "context_length": L, "batch_size": batch, "path": path}
                entry |= {"decode_tokens": decode_tokens, "warmup": warmup, "repeats": repeats}
                if sizes is not None:
                    entry, reason = _timed_row(model, prompts[:batch], entry, sizes, memory)
                if reason is not None:
                    free(device, collect=True)
                    entry = {**entry, "skipped": True, "reason": reason}
                results.append(entry)
                if progress:
                    print(f"[speed] {format_speed_row(info['model'], entry)}", file=sys.stderr, flush=True)
            del prompts
    finally:
        model.train(was_training)
    free(device)
    return results


def _timed_row(model: nn.Module, prompt: torch.Tensor, entry: dict, sizes, memory: _PeakMemory):
    """(entry with the timings of `prompt` [B, L], None), or (entry, why it was skipped) where memory ran out."""
    batch, L = prompt.shape
    steps, device = entry["decode_tokens"], prompt.device
    free(device)
    memory.reset()
    try:
        for _ in range(entry["warmup"]):
            warm_up(model, prompt, steps)
        memory.clear_peak()
        times = generate_times(model, prompt, steps, entry["repeats"])
    except (*OutOfMemory, MemoryError) as err:
        return entry, _oom_reason(err)
    peak, growth = memory.read()
    step = times["step_s"]
    entry |= {
        "skipped": False,
        "ttft_seconds": times["ttft_s"],
        "prefill_tokens_per_second": batch * L / times["ttft_s"],
        "decode_seconds": step * steps,
        "decode_ms_per_token": 1e3 * step if step > 0 else None,  # one step: a token for each of the batch's rows
        "decode_tokens_per_second": batch / step if step > 0 else None,
        "ttft_seconds_all": times["ttft_all"],
        "generate_seconds_all": times["long_all"],
        "decode_step_seconds_all": times["step_all"],
        "decode_step_seconds_wall": times["step_wall_s"],
        "first_decode_step_seconds": times["first_step_s"],
        "cache_bytes_per_sequence": sizes[0],
        "cache_bytes_per_sequence_after_decode": sizes[1],
        "peak_memory_bytes": peak,
        "peak_memory_growth_bytes": growth,
        "peak_memory_method": memory.method,
    }
    return entry, None


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


def _rate(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:,.1f}"


def format_speed_row(name: str, e: dict) -> str:
    where = f"{name}  L={e['context_length']}  B={e.get('batch_size', 1)}  {e.get('path', '-')}:"
    if e.get("skipped"):
        return f"{where}  skipped: {e['reason']}"
    c = e["cache_bytes_per_sequence"]
    return (
        f"{where}  TTFT {_ms(e.get('ttft_seconds'))} ms  decode {_rate(e['decode_tokens_per_second'])} tok/s  "
        f"cache {_mib(c['total'])} MiB (attention {_mib(c['attention'])}, mixer {_mib(c['mixer'])})  "
        f"peak {_mib(e['peak_memory_bytes'])} MiB"
    )


def format_speed_table(results_by_model: dict[str, list[dict]]) -> str:
    """One row per model, length and batch: the decode path timed, time to first token, decode tokens/s (all the
    batch's rows together), cache MiB per sequence after the prompt (attention KV + mixer state), peak MiB (CUDA
    allocated or process RSS, see the module)."""
    header = ("model", "length", "batch", "path", "TTFT ms", "decode tok/s", "cache MiB", "(attn / mixer)", "peak MiB")
    rows = [header]
    for name, entries in results_by_model.items():
        for e in entries:
            where = (name, str(e["context_length"]), str(e.get("batch_size", 1)), e.get("path", "-"))
            if e.get("skipped"):
                rows.append((*where, "skipped: " + e["reason"], "", "", "", ""))
                continue
            c = e["cache_bytes_per_sequence"]
            rows.append(
                (
                    *where,
                    _ms(e.get("ttft_seconds")),
                    _rate(e["decode_tokens_per_second"]),
                    _mib(c["total"]),
                    f"{_mib(c['attention'])} / {_mib(c['mixer'])}",
                    _mib(e.get("peak_memory_bytes")),
                )
            )
    widths = [max([len(r[i]) for r in rows if not r[i].startswith("skipped")], default=0) for i in range(len(header))]
    numeric = {1, 2, 4, 5, 6, 7, 8}
    lines = []
    for r in rows:
        cells = [c if c.startswith("skipped") else (c.rjust(w) if i in numeric else c.ljust(w))
                 for i, (c, w) in enumerate(zip(r, widths))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def plot_speed(results_by_model: dict[str, list[dict]], path: str | Path) -> Path:
    """PNG with three panels against context length (log x), a line per model and batch: prefill tokens/s (prompt
    tokens over the time to first token), decode tokens/s through generate(), and memory (peak memory solid; per
    model, the cache per sequence after the prompt: attention KV dashed, mixer state dotted)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8))
    FigureCanvasAgg(fig)  # PNG rendering, without pyplot or a global backend switch
    axes = fig.subplots(1, 3)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "os^vDP"
    for m, (name, entries) in enumerate(results_by_model.items()):
        ok = sorted((e for e in entries if not e.get("skipped")), key=lambda e: e["context_length"])
        colour = colours[m % len(colours)]
        batches = sorted({e.get("batch_size", 1) for e in ok})
        for b, batch in enumerate(batches):
            rows = [e for e in ok if e.get("batch_size", 1) == batch]
            style = dict(color=colour, marker=markers[b % len(markers)], label=f"{name}, batch {batch}")
            axes[0].plot([e["context_length"] for e in rows], [e["prefill_tokens_per_second"] for e in rows], **style)
            dec = [(e["context_length"], e["decode_tokens_per_second"]) for e in rows if e["decode_tokens_per_second"]]
            if dec:
                axes[1].plot(*zip(*dec), **style)
            peak = [(e["context_length"], e.get("peak_memory_bytes")) for e in rows if e.get("peak_memory_bytes")]
            if peak:
                axes[2].plot(
                    [x for x, _ in peak], [y / MiB for _, y in peak], **(style | {"label": f"{style['label']}: peak"})
                )
        first = [e for e in ok if e.get("batch_size", 1) == batches[0]] if batches else []
        for label, style, key in (("attention KV", "--", "attention"), ("mixer state", ":", "mixer")):
            points = [(e["context_length"], e["cache_bytes_per_sequence"][key] / MiB) for e in first]
            points = [(x, y) for x, y in points if y]
            if points:
                axes[2].plot(*zip(*points), linestyle=style, marker="s", color=colour, label=f"{name}: {label}")
    titles = ("prefill (prompt tokens / time to first token)", "decode: generate(), every row of the batch",
              "memory: peak (solid), cache per sequence")  # fmt: skip
    ylabels = ("tokens / s", "tokens / s", "MiB")
    for ax, title, ylabel in zip(axes, titles, ylabels):
        ax.set_xscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
            ax.set_yscale("log")
    rows = [e for es in results_by_model.values() for e in es]
    device = next((e.get("device_name") for e in rows), None)
    paths = ", ".join(dict.fromkeys(e["path"] for e in rows if e.get("path")))
    title = "; ".join(t for t in (device, paths) if t)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return write_png(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m raven_convert.evaluate.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="repeatable; Hub id, directory or .gguf")
    p.add_argument("--lengths", type=parse_lengths, default=parse_lengths("1k,4k,16k"))
    p.add_argument(
        "--batches",
        type=parse_batches,
        default=list(BATCHES),
        help=f"batch sizes, comma-separated integers >= 1 (default: {','.join(map(str, BATCHES))})",
    )
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="JSON file for {model: [entries]}")
    p.add_argument("--plot", default=None, help="PNG of the three panels")
    args = p.parse_args(argv)

    def measure(model, _tokenizer):
        return measure_speed(model, args.lengths, args.batches, args.decode_tokens, args.warmup, args.repeats)

    compare_models(args, measure, format_speed_table, plot_speed)


if __name__ == "__main__":
    main()
