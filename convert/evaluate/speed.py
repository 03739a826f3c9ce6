"""Prefill and decode speed, peak memory and cache size at several context lengths.

For each context length L, `measure_speed` times the prefill of a random prompt of L tokens, then `decode_tokens`
greedy steps that feed one token at a time through the model's own cache (`model(input_ids=next_token, cache=cache,
use_cache=True)`, not `generate()`, so the timings hold no sampling or bookkeeping), and
records the bytes the cache holds per sequence after the prefill: a hybrid's `HybridCache` splits them into
constant-size mixer states and the attention layers' growing KV cache; a transformers `DynamicCache` holds keys and
values only.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` (reset before each length; it includes the weights, and
`peak_memory_growth_bytes` is the part above what was allocated before the length's first run). On CPU (Linux) the
process's peak resident set size, reset before each length through `/proc/self/clear_refs` (VmHWM); where that
cannot be reset, the growth of `resource.getrusage(...).ru_maxrss` (a lower bound: 0 when an earlier peak was
higher); `peak_memory_method` says which, and both values are null where neither is available.

Command line:

    python -m raven_convert.evaluate.speed --model Qwen/Qwen3-0.6B --model qwen3-raven --lengths 1k,4k,16k,64k \\
        --dtype bfloat16 --out speed.json --plot speed.png
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from raven_layers.cache import cache_argument, output_cache

from .runtime import OutOfMemory, compare_models, free, model_device, parse_lengths, run_info, sync

MiB = 1024**2


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


class _PeakMemory:
    """Peak memory over a stretch of work: CUDA allocator statistics, or the Linux process high-water mark."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method: str | None = None
        self.start = 0

    @staticmethod
    def _status_kib(field: str) -> int | None:
        try:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        except OSError:
            return None
        return int(m.group(1)) if m else None

    def reset(self) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method, self.start = "cuda_max_memory_allocated", torch.cuda.memory_allocated(self.device)
            return
        rss = self._status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM := current RSS
            hwm = self._status_kib("VmHWM")
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

    def read(self) -> tuple[int | None, int | None]:
        """(peak bytes, peak bytes above the start) since `reset`."""
        if self.method == "cuda_max_memory_allocated":
            sync(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return int(peak), int(max(0, peak - self.start))
        if self.method == "linux_vmhwm":
            hwm = self._status_kib("VmHWM")
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
    return out.logits[:, -1:], output_cache(out)


def _run_once(model: nn.Module, prompt: torch.Tensor, decode_tokens: int) -> dict:
    """Prefill `prompt`, then greedy-decode `decode_tokens` tokens one step at a time; times and cache sizes."""
    device = prompt.device
    sync(device)
    t0 = time.perf_counter()
    logits, cache = _forward(model, prompt)
    sync(device)
    prefill = time.perf_counter() - t0
    after_prefill = cache_bytes(cache)
    token = logits.argmax(-1)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        logits, cache = _forward(model, token, cache)
        token = logits.argmax(-1)
    sync(device)
    decode = time.perf_counter() - t0
    return {
        "prefill_s": prefill,
        "decode_s": decode,
        "after_prefill": after_prefill,
        "after_decode": cache_bytes(cache),
    }


def measure_speed(
    model: nn.Module,
    context_lengths: list[int],
    batch_size: int = 1,
    decode_tokens: int = 32,
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Prefill and decode speed, peak memory and cache bytes of `model` at each context length.

    Per length: `warmup` untimed runs, then `repeats` timed runs, each a fresh prefill of the same random prompt of
    [batch_size, L] tokens and `decode_tokens` greedy steps through the cache; the medians are reported. Runs under
    `torch.inference_mode()` in the model's dtype on its device, synchronising CUDA around every timed region.
    A length that runs out of memory is recorded with `skipped: true` and the reason, and the next one is tried.
    """
    if batch_size < 1 or decode_tokens < 0 or warmup < 0 or repeats < 1:
        raise ValueError("batch_size and repeats must be >= 1, decode_tokens and warmup >= 0")
    device = model_device(model)
    info = run_info(model)
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    vocab = emb.num_embeddings if isinstance(emb, nn.Embedding) else model.config.vocab_size
    memory = _PeakMemory(device)
    was_training = model.training
    model.eval()
    results = []
    try:
        for L in [int(x) for x in context_lengths]:
            entry = {
                **info,
                "context_length": L,
                "batch_size": batch_size,
                "decode_tokens": decode_tokens,
                "warmup": warmup,
                "repeats": repeats,
            }
            g = torch.Generator().manual_seed(seed + L)
            prompt = torch.randint(0, vocab, (batch_size, L), generator=g).to(device)
            free(device)
            memory.reset()
            runs, oom = [], None
            try:
                with torch.inference_mode():
                    for _ in range(warmup):
                        _run_once(model, prompt, min(decode_tokens, 2))
                    for _ in range(repeats):
                        runs.append(_run_once(model, prompt, decode_tokens))
            except OutOfMemory as err:
                oom = f"out of memory: {str(err).splitlines()[0][:200]}"
            except MemoryError as err:
                oom = f"out of memory (host): {err}"
            peak, growth = memory.read()
            if oom is not None:
                runs = []
                free(device, collect=True)
                results.append({**entry, "skipped": True, "reason": oom})
                if progress:
                    print(f"[speed] {info['model']} L={L}: skipped ({oom})", file=sys.stderr, flush=True)
                continue
            prefill_s = statistics.median(r["prefill_s"] for r in runs)
            decode_s = statistics.median(r["decode_s"] for r in runs)
            per_seq = {k: v // batch_size for k, v in runs[-1]["after_prefill"].items()}
            per_seq_decoded = {k: v // batch_size for k, v in runs[-1]["after_decode"].items()}
            entry.update(
                {
                    "skipped": False,
                    "prefill_seconds": prefill_s,
                    "prefill_tokens_per_second": batch_size * L / max(prefill_s, 1e-12),
                    "decode_seconds": decode_s,
                    "decode_ms_per_token": 1e3 * decode_s / decode_tokens if decode_tokens else None,
                    "decode_tokens_per_second": batch_size * decode_tokens / max(decode_s, 1e-12)
                    if decode_tokens
                    else None,
                    "prefill_seconds_all": [r["prefill_s"] for r in runs],
                    "decode_seconds_all": [r["decode_s"] for r in runs],
                    "cache_bytes_per_sequence": per_seq,
                    "cache_bytes_per_sequence_after_decode": per_seq_decoded,
                    "peak_memory_bytes": peak,
                    "peak_memory_growth_bytes": growth,
                    "peak_memory_method": memory.method,
                }
            )
            results.append(entry)
            if progress:
                print(f"[speed] {format_speed_row(info['model'], entry)}", file=sys.stderr, flush=True)
            del runs
    finally:
        model.train(was_training)
    free(device)
    return results


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


def _rate(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def format_speed_row(name: str, e: dict) -> str:
    if e.get("skipped"):
        return f"{name}  L={e['context_length']}  skipped: {e['reason']}"
    c = e["cache_bytes_per_sequence"]
    return (
        f"{name}  L={e['context_length']}  prefill {_rate(e['prefill_tokens_per_second'])} tok/s  "
        f"decode {_rate(e['decode_tokens_per_second'])} tok/s  cache {_mib(c['total'])} MiB "
        f"(attention {_mib(c['attention'])}, mixer {_mib(c['mixer'])})  peak {_mib(e['peak_memory_bytes'])} MiB"
    )


def format_speed_table(results_by_model: dict[str, list[dict]]) -> str:
    """One row per model and length: prefill and decode tokens/s, cache MiB per sequence after the prefill
    (attention KV + mixer state), peak MiB (CUDA allocated or process RSS, see the module docstring)."""
    header = ("model", "length", "prefill tok/s", "decode tok/s", "cache MiB", "(attn / mixer)", "peak MiB")
    rows = [header]
    for name, entries in results_by_model.items():
        for e in entries:
            if e.get("skipped"):
                rows.append((name, str(e["context_length"]), "skipped: " + e["reason"], "", "", "", ""))
                continue
            c = e["cache_bytes_per_sequence"]
            rows.append(
                (
                    name,
                    str(e["context_length"]),
                    _rate(e["prefill_tokens_per_second"]),
                    _rate(e["decode_tokens_per_second"]),
                    _mib(c["total"]),
                    f"{_mib(c['attention'])} / {_mib(c['mixer'])}",
                    _mib(e.get("peak_memory_bytes")),
                )
            )
    widths = [max([len(r[i]) for r in rows if not r[i].startswith("skipped")], default=0) for i in range(len(header))]
    numeric = {2, 3, 4, 5, 6}
    lines = []
    for r in rows:
        cells = [c if c.startswith("skipped") else (c.rjust(w) if i in numeric else c.ljust(w))
                 for i, (c, w) in enumerate(zip(r, widths))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def plot_speed(results_by_model: dict[str, list[dict]], path: str | Path) -> Path:
    """PNG with three panels against context length (log x): prefill tokens/s, decode tokens/s, and memory
    (peak memory solid; per-sequence cache after the prefill: attention KV dashed, mixer state dotted)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8))
    FigureCanvasAgg(fig)  # PNG rendering, without pyplot or a global backend switch
    axes = fig.subplots(1, 3)
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for m, (name, entries) in enumerate(results_by_model.items()):
        ok = sorted((e for e in entries if not e.get("skipped")), key=lambda e: e["context_length"])
        if not ok:
            continue
        colour = colours[m % len(colours)]
        x = [e["context_length"] for e in ok]
        axes[0].plot(x, [e["prefill_tokens_per_second"] for e in ok], "o-", color=colour, label=name)
        dec = [(e["context_length"], e["decode_tokens_per_second"]) for e in ok if e["decode_tokens_per_second"]]
        if dec:
            axes[1].plot(*zip(*dec), "o-", color=colour, label=name)
        series = [
            ("peak", "-", "o", [(e["context_length"], e.get("peak_memory_bytes")) for e in ok]),
            (
                "attention KV",
                "--",
                "s",
                [(e["context_length"], e["cache_bytes_per_sequence"]["attention"]) for e in ok],
            ),
            ("mixer state", ":", "^", [(e["context_length"], e["cache_bytes_per_sequence"]["mixer"]) for e in ok]),
        ]
        for label, style, marker, points in series:
            points = [(px, py / MiB) for px, py in points if py]
            if points:
                axes[2].plot(*zip(*points), linestyle=style, marker=marker, color=colour, label=f"{name}: {label}")
    titles = ("prefill", "decode (one token per step, cached)", "memory: peak (solid), cache per sequence")
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
    device = next((e.get("device_name") for es in results_by_model.values() for e in es), None)
    if device:
        fig.suptitle(f"{device}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m raven_convert.evaluate.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="repeatable; Hub id, directory or .gguf")
    p.add_argument("--lengths", type=parse_lengths, default=parse_lengths("1k,4k,16k"))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="JSON file for {model: [entries]}")
    p.add_argument("--plot", default=None, help="PNG of the three panels")
    args = p.parse_args(argv)

    def measure(model, _tokenizer):
        return measure_speed(model, args.lengths, args.batch_size, args.decode_tokens, args.warmup, args.repeats)

    compare_models(args, measure, format_speed_table, plot_speed)


if __name__ == "__main__":
    main()
