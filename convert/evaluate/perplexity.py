"""Perplexity at several context lengths, and where in a window the loss goes up.

`perplexity(model, tokenizer, texts, [512, 4096, 32768], max_windows=16)` joins the documents (separated by the
end-of-sequence token) into one token stream, cuts it into non-overlapping windows of L tokens, and scores every
window with one forward pass and no cache. Besides the mean loss it keeps the mean loss at each position of the
window, so a model that holds up inside its trained context (`config.max_position_embeddings`) and breaks down
beyond it shows the break where it happens. `plot_loss_curve` draws those curves.

Command line (each --model a Hub id, a model directory, an exported hybrid or a .gguf file):

    python -m raven_convert.evaluate.perplexity --model Qwen/Qwen3-0.6B --model qwen3-raven \\
        --data ../shared/data/corpus/python-3.11-docs.jsonl.gz --lengths 1024,8192,32768 --max-windows 8 \\
        --out ppl.json --plot ppl.png
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..console import eta
from ..files import write_png
from .runtime import OutOfMemory, compare_models, free, model_device, model_dtype, parse_lengths, run_info, sync
from .shares import OneProcess, spread

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")
# Beyond this many positions the loss curve is averaged over log-spaced buckets of positions (see `perplexity`).
DEFAULT_CURVE_POINTS = 2048
# Logits are computed for at most this many (batch x position) rows at once on the memory-saving path.
DEFAULT_LOGITS_ROWS = 4096


def _is_text_file(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(TEXT_SUFFIXES)


def _read_documents(path: Path) -> Iterable[str]:
    name = path.name.lower()
    if name.endswith(".txt"):
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {err}") from err
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a "text" string')
            yield record["text"]


def load_texts(path_or_dir: str | Path, max_documents: int | None = None) -> list[str]:
    """Documents from a `.txt` file (one document), a corpus file (`.jsonl` or `.jsonl.gz`, one
    `{"source": ..., "text": ...}` object per line, one document each), or a directory of such files (searched
    recursively, in sorted path order). Empty documents are dropped; `max_documents` stops early."""
    path = Path(path_or_dir).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if _is_text_file(p))
        if not files:
            raise ValueError(f"{path}: no {', '.join(TEXT_SUFFIXES)} files in this directory")
    elif _is_text_file(path):
        files = [path]
    elif path.exists():
        raise ValueError(f"{path}: expected a {', '.join(TEXT_SUFFIXES)} file or a directory of them")
    else:
        raise FileNotFoundError(f"{path}: no such file or directory")
    texts: list[str] = []
    for file in files:
        for text in _read_documents(file):
            if text.strip():
                texts.append(text)
                if max_documents is not None and len(texts) >= max_documents:
                    return texts
    return texts


def token_stream(tokenizer, texts: Iterable[str], num_tokens: int | None = None, eos_token_id: int | None = None):
    """Token ids of the documents joined by `eos_token_id` (nothing between them when None), tokenized without
    special tokens; stops once `num_tokens` are there. Returns (ids, documents used)."""
    ids: list[int] = []
    used = 0
    for text in texts:
        if ids and eos_token_id is not None:
            ids.append(eos_token_id)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        used += 1
        if num_tokens is not None and len(ids) >= num_tokens:
            break
    return ids, used


def _eos_id(tokenizer, model) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


class _Scorer:
    """Per-token NLL of a batch of windows, in float32.

    A transformers causal LM computes logits for every position at once: [B, L, vocab] in the model's dtype, then
    float32 for the loss, tens of GB at 32k tokens and a 150k vocabulary. Where the model is a base model plus a
    linear head (`model.base_model`, `get_output_embeddings()`), the head is applied to at most `logits_rows` rows
    at a time instead; the first call checks on a short prefix that this gives the model's own logits, and falls
    back to the plain forward otherwise (e.g. a model that soft-caps or scales its logits).
    """

    def __init__(self, model: nn.Module, logits_rows: int = DEFAULT_LOGITS_ROWS):
        self.model = model
        self.logits_rows = max(1, logits_rows)
        self.split: tuple[nn.Module, nn.Module] | None = None
        self.checked = False
        base = getattr(model, "base_model", None)
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if base is not None and base is not model and isinstance(head, nn.Linear):
            self.split = (base, head)

    def _full(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(
            ids.shape[0], -1
        )

    def _split(self, ids: torch.Tensor) -> torch.Tensor:
        base, head = self.split
        out = base(input_ids=ids, use_cache=False)
        hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[:, :-1]
        targets = ids[:, 1:]
        B, T = targets.shape
        step = max(1, self.logits_rows // B)
        nll = torch.empty(B, T, dtype=torch.float32, device=hidden.device)
        for s in range(0, T, step):
            logits = head(hidden[:, s : s + step]).float()
            nll[:, s : s + step] = F.cross_entropy(
                logits.flatten(0, 1), targets[:, s : s + step].flatten(), reduction="none"
            ).view(B, -1)
        return nll

    def _check(self, ids: torch.Tensor) -> None:
        self.checked = True
        if self.split is None:
            return
        probe = ids[:1, : min(ids.shape[1], 64)]
        try:
            full, split = self._full(probe), self._split(probe)
            tol = 1e-3 if model_dtype(self.model) == torch.float32 else 5e-2
            ok = full.shape == split.shape and bool(torch.allclose(full, split, rtol=tol, atol=tol))
        except (TypeError, AttributeError, ValueError):
            ok = False
        if not ok:
            self.split = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.checked:
            self._check(ids)
        return self._split(ids) if self.split is not None else self._full(ids)


def _bucket_edges(num_positions: int, points: int | None) -> list[int] | None:
    """Edges (positions 1..num_positions, end exclusive) of log-spaced buckets, or None for the full curve."""
    if points is None or num_positions <= points:
        return None
    edges = {1, num_positions + 1}
    ratio = (num_positions + 1) ** (1 / points)
    edges.update(int(round(ratio**i)) for i in range(1, points))
    return sorted(e for e in edges if 1 <= e <= num_positions + 1)


def _curve(position_mean: torch.Tensor, points: int | None) -> dict:
    """The position-wise mean NLL (index 0 = position 1, i.e. the prediction from one token of context)."""
    n = position_mean.numel()
    edges = _bucket_edges(n, points)
    if edges is None:
        return {"bucketed": False, "positions": list(range(1, n + 1)), "loss": position_mean.tolist()}
    starts, ends, centres, loss = [], [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        starts.append(a)
        ends.append(b)
        centres.append((a + b - 1) / 2)
        loss.append(position_mean[a - 1 : b - 1].mean().item())
    return {"bucketed": True, "positions": centres, "loss": loss, "bucket_start": starts, "bucket_end": ends}


def perplexity(
    model: nn.Module,
    tokenizer,
    texts: Iterable[str] | str,
    context_lengths: list[int],
    max_windows: int,
    batch_size: int = 1,
    curve_points: int | None = DEFAULT_CURVE_POINTS,
    logits_rows: int = DEFAULT_LOGITS_ROWS,
    progress: bool = True,
    parallel=None,
) -> dict:
    """Mean NLL and perplexity of `model` on windows of each length in `context_lengths`.

    The documents are tokenized without special tokens and joined with the end-of-sequence token into one stream
    (only as many as the longest length needs); for each L the first `min(max_windows, len(stream) // L)`
    non-overlapping windows of L tokens are scored, `batch_size` windows per forward pass, with no cache. Every
    window predicts positions 1..L-1 from the tokens before them, so each length scores `windows * (L - 1)`
    tokens, and the position-wise curve (mean NLL at position p over the windows) has L - 1 points whose mean is
    the reported mean NLL. With `curve_points` set and L - 1 above it, the curve is averaged over about that many
    log-spaced buckets of positions instead (`bucketed: true`). Lengths the stream is too short for, or that run
    out of device memory, are returned with `skipped: true` and the reason. The model runs in its own dtype on its
    own device; the loss is computed in float32. Under a launch (`parallel`, see shares.py) each process scores every
    world-th batch of each length and the sums are added in window order, as one process adds them.
    """
    parallel = parallel or OneProcess()
    if isinstance(texts, str):
        texts = [texts]
    lengths = [int(L) for L in context_lengths]
    if not lengths or any(L < 2 for L in lengths):
        raise ValueError(f"context lengths must be at least 2 tokens, got {context_lengths}")
    if max_windows < 1 or batch_size < 1:
        raise ValueError("max_windows and batch_size must be at least 1")
    device = model_device(model)
    eos = _eos_id(tokenizer, model)
    stream, used = token_stream(tokenizer, texts, max(lengths) * max_windows, eos)
    stream_t = torch.tensor(stream, dtype=torch.long)
    info = run_info(model)
    trained = info["trained_length"]
    result = {
        **info,
        "documents": used,
        "stream_tokens": len(stream),
        "eos_token_id": eos,
        "max_windows": max_windows,
        "batch_size": batch_size,
        "results": [],
    }
    plan = {L: min(max_windows, len(stream) // L) for L in lengths}
    starts = {L: range(0, n, batch_size) for L, n in plan.items()}  # the first window of each batch
    share = {L: starts[L][parallel.rank :: parallel.world] for L in lengths}
    mine = {L: sum(min(batch_size, n - w0) for w0 in share[L]) for L, n in plan.items()}  # this process's windows
    total_tokens = sum(n * L for L, n in mine.items())
    done_tokens, started, last_report = 0, time.perf_counter(), 0.0
    scorer = _Scorer(model, logits_rows)

    def score(L: int, n: int, batches: range) -> list[torch.Tensor | str]:
        """This process's batches (by first window) -> the NLL at each position summed over the batch's windows
        (float64 [L - 1]), or, from the batch that ran out of memory on, why they stopped."""
        nonlocal done_tokens, last_report
        sums, windows = [], 0
        try:
            with torch.inference_mode():
                for w0 in batches:
                    k = min(batch_size, n - w0)
                    ids = stream_t[w0 * L : (w0 + k) * L].view(k, L).to(device)  # [k, L]
                    sums.append(scorer(ids).double().sum(0).cpu())
                    windows += k
                    done_tokens += k * L
                    now = time.perf_counter()
                    if progress and parallel.is_main and (now - last_report > 5 or windows == mine[L]):
                        last_report = now
                        rate = done_tokens / max(now - started, 1e-9)
                        print(
                            f"[perplexity] L={L}: windows {windows}/{mine[L]}, {rate:,.0f} tokens/s, "
                            f"{eta((total_tokens - done_tokens) / rate)}",
                            file=sys.stderr,
                            flush=True,
                        )
        except OutOfMemory as err:
            done_tokens += (mine[L] - windows) * L
            return sums + [str(err).splitlines()[0][:200]] * (len(batches) - len(sums))
        return sums

    was_training = model.training
    model.eval()
    try:
        for L in lengths:
            n = plan[L]
            entry = {"context_length": L, "beyond_trained": trained is not None and L > trained}
            if n == 0:
                result["results"].append(
                    {**entry, "skipped": True, "reason": f"the texts give {len(stream)} tokens, fewer than {L}"}
                )
                continue
            t0 = time.perf_counter()
            scored = spread(starts[L], functools.partial(score, L, n), parallel)
            oom = next((s for s in scored if isinstance(s, str)), None)
            if oom is not None:
                windows = sum(min(batch_size, n - w0) for w0, s in zip(starts[L], scored) if not isinstance(s, str))
                free(device, collect=True)
                reason = f"out of memory after {windows} of {n} windows: {oom}"
                result["results"].append({**entry, "skipped": True, "reason": reason})
                continue
            sums, windows = torch.zeros(L - 1, dtype=torch.float64), n
            for batch_sum in scored:  # in window order, as one process adds them
                sums += batch_sum
            sync(device)
            seconds = time.perf_counter() - t0
            position_mean = sums / windows
            mean_nll = (sums.sum() / (windows * (L - 1))).item()
            entry.update(
                {
                    "skipped": False,
                    "windows": windows,
                    "tokens_scored": windows * (L - 1),
                    "mean_nll": mean_nll,
                    "perplexity": math.exp(min(mean_nll, 700.0)),
                    "seconds": seconds,
                    "tokens_per_second": windows * L / max(seconds, 1e-9),
                }
            )
            if trained is not None and 1 < trained < L:  # positions < trained vs >= trained
                entry["mean_nll_within_trained"] = position_mean[: trained - 1].mean().item()
                entry["mean_nll_beyond_trained"] = position_mean[trained - 1 :].mean().item()
            entry["curve"] = _curve(position_mean, curve_points)
            result["results"].append(entry)
    finally:
        model.train(was_training)
    return result


def plot_loss_curve(results_by_model: dict[str, dict], path: str | Path) -> Path:
    """PNG of the position-wise mean NLL (log-scale position) of every model and context length, with a dashed
    vertical line at each model's trained length (`max_position_embeddings`)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)  # PNG rendering, without pyplot or a global backend switch
    ax = fig.subplots()
    trained_lengths: set[int] = set()
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", "-.", ":"]
    for m, (name, res) in enumerate(results_by_model.items()):
        entries = [e for e in res.get("results", []) if not e.get("skipped")]
        for j, e in enumerate(sorted(entries, key=lambda e: e["context_length"])):
            curve = e["curve"]
            ax.plot(
                curve["positions"],
                curve["loss"],
                color=colours[m % len(colours)],
                linestyle=styles[j % len(styles)],
                linewidth=1.2,
                label=f"{name}, L={e['context_length']} (ppl {e['perplexity']:.3g})",
            )
        if res.get("trained_length"):
            trained_lengths.add(int(res["trained_length"]))
    for t in sorted(trained_lengths):
        ax.axvline(t, color="grey", linestyle="--", linewidth=1)
        ax.annotate(
            f"trained length {t}", (t, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
            fontsize=8, color="grey",
        )  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("position in window (tokens of context)")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title("Loss by position")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return write_png(fig, path, dpi=120)


def format_perplexity_table(results_by_model: dict[str, dict]) -> str:
    rows = [("model", "length", "windows", "mean NLL", "ppl", "NLL<trained", "NLL>=trained")]
    for name, res in results_by_model.items():
        for e in res.get("results", []):
            if e.get("skipped"):
                rows.append((name, str(e["context_length"]), "skipped: " + e["reason"], "", "", "", ""))
                continue
            within, beyond = e.get("mean_nll_within_trained"), e.get("mean_nll_beyond_trained")
            rows.append(
                (
                    name,
                    str(e["context_length"]),
                    str(e["windows"]),
                    f"{e['mean_nll']:.4f}",
                    f"{e['perplexity']:.3f}",
                    "" if within is None else f"{within:.4f}",
                    "" if beyond is None else f"{beyond:.4f}",
                )
            )
    widths = [max(len(r[i]) for r in rows if not r[i].startswith("skipped")) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m raven_convert.evaluate.perplexity", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", action="append", required=True, help="repeatable; Hub id, directory or .gguf")
    p.add_argument("--data", required=True, help=".txt, .jsonl(.gz) or a directory of them")
    p.add_argument("--lengths", type=parse_lengths, default=parse_lengths("512,2048,8192"))
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--curve-points", type=int, default=DEFAULT_CURVE_POINTS)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="JSON file for {model: result}")
    p.add_argument("--plot", default=None, help="PNG of the loss curves")
    args = p.parse_args(argv)
    texts = load_texts(args.data, args.max_documents)

    def measure(model, tokenizer):
        return perplexity(model, tokenizer, texts, args.lengths, args.max_windows, args.batch_size, args.curve_points)

    compare_models(args, measure, format_perplexity_table, plot_loss_curve)


if __name__ == "__main__":
    main()
