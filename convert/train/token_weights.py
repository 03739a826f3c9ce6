"""SILA's per-token loss weights (SILA paper, Section 5.2 and Appendix C.3, Algorithm 1).

A reference Transformer's attention says how far back each token reaches: tokens that only look at their
neighbours get a low weight, tokens that retrieve something far away a high one. With A[l, h, t, j] the softmax
attention of layer l, head h, query t and key j <= t:

    1. zero the first column (the attention sink, key j = 0)                       Algorithm 1, line 821
    2. keep only weights >= tau (tau = 0.2), set the others to 0, no renormalising   line 822
    3. d_t = 1 / (L H) * sum_l sum_h sum_j A[l, h, t, j] * (t - j)                 line 824
    4. w_t = log(lambda * d_t + 1) (lambda = 0.5)                                   line 825

and while training, the loss of a token is weighted by exp(-tokens_seen / tau_tokens) + w_t (Appendix C.3,
line 814: tau_tokens = 1e9 tokens), so that training starts as plain next-token prediction and becomes purely
weighted after a few billion tokens.

    w = token_weights(teacher, input_ids, attention_mask)       # [B, T], never the full [L, H, T, T] maps
    table = weight_table(teacher, rows, 32, out_dir="run/weights")  # [len(rows), T], checkpointed and resumable
    loss_weights = schedule_weights(w, tokens_seen)              # [B, T]
    plot_token_weights(tokenizer.convert_ids_to_tokens(input_ids[0]), w[0], "weights.png")

Choices where the paper leaves room (line numbers are those of the paper's text, as printed in it):

- Which token a weight belongs to: the query t (row t of A), as in Algorithm 1 (line 824: the sum runs over keys
  j <= t of row t). Query t's hidden state produces the logits at position t, so w[:, t] weights the loss of the
  prediction made at position t, i.e. of the label input_ids[:, t + 1] (the "predicted token" of line 814).
- Threshold: `>=` as in Algorithm 1 (line 822); the prose of Section 5.2 says "above a threshold" (line 369).
  The kept weights are not renormalised (line 822 only multiplies by the indicator), and the sink is zeroed after
  the softmax (line 821 edits A, the attention probabilities).
- Average: over all L layers and all H query heads (line 824, 1 / (LH)); with GQA every query head counts.
- Padding (the paper has none): padded tokens never count as keys and get weight 0; the sink is the first real
  token of each row, and distances count real tokens (t - j for unpadded or left/right-padded rows).
- Sliding-window layers (Mistral, windowed Qwen2/Qwen3 layers) use their window, as the model does.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from raven_convert.console import eta
from raven_convert.files import write_png
from raven_convert.train.checkpoint import latest_checkpoint, save_checkpoint
from raven_kernels.attention import attention_distance, attention_distance_torch, first_keys
from raven_layers.architectures import get_architecture
from raven_layers.masks import find_packed_documents


def _real_tokens(attention_mask: Tensor | None, batch: int, length: int, device) -> Tensor:
    """Boolean [B, T]: True at real tokens (all of them without a mask)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, length)}")
    return attention_mask.to(device=device).bool()


def _positions(real: Tensor) -> Tensor:
    """[B, T] position of every token among the real tokens of its row (0 for the first real one; pads clamp to 0).

    The same position ids `generate()` derives from a left-padded mask; distances t - j are taken between them.
    """
    return (real.long().cumsum(-1) - 1).clamp(min=0)


def _layout(real: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(positions [B, T] float, documents [B, T], sinks [B, T] bool) of padded rows (position_ids None) or of rows of
    packed documents (position_ids restarting at 0 at each document, no padding). Every document has its own sink,
    its first token; distances are differences of positions within a document."""
    if position_ids is None:
        documents = torch.zeros_like(real, dtype=torch.long)
        first = real.long().argmax(-1)  # [B] first real token of each row
        sinks = torch.zeros_like(real).scatter(1, first[:, None], True)
        return _positions(real).float(), documents, sinks
    if position_ids.shape != real.shape:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {tuple(real.shape)}")
    packed = find_packed_documents(position_ids)
    documents = packed[0] if packed is not None else torch.zeros_like(position_ids, dtype=torch.long)
    sinks = torch.ones_like(real)
    sinks[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return position_ids.float(), documents, sinks


def _finish(distance_sum: Tensor, count: int, real: Tensor, lam: float) -> Tensor:
    """Average the summed distances over the L * H maps and log-scale: w_t = log(lam * d_t + 1); pads get 0."""
    d = distance_sum / count  # [B, T]
    return torch.log1p(lam * d) * real


def token_weights_naive(
    attn: Sequence[Tensor] | Tensor,
    tau: float = 0.2,
    lam: float = 0.5,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """Algorithm 1 applied directly to full attention maps.

    attn: L maps [B, H, T, T] (e.g. `model(..., output_attentions=True).attentions` of an eager model) or one tensor
    [L, B, H, T, T]; rows are queries t, columns keys j. attention_mask [B, T] (1 real, 0 pad) is optional; padded
    queries and keys are dropped whatever the maps hold there. position_ids [B, T] restarting at 0 mark packed
    documents: keys of other documents are dropped too. Returns w [B, T] (float32).
    """
    a = torch.stack(tuple(attn)) if not isinstance(attn, Tensor) else attn
    if a.dim() != 5 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"expected attention maps [L, B, H, T, T], got {tuple(a.shape)}")
    a = a.float()  # [L, B, H, T, T]
    n_layers, batch, n_heads, length, _ = a.shape
    real = _real_tokens(attention_mask, batch, length, a.device)  # [B, T]
    positions, documents, sinks = _layout(real, position_ids)  # [B, T] each
    idx = torch.arange(length, device=a.device)

    causal = idx[None, :] <= idx[:, None]  # [T, T]: key j <= query t
    same = documents[:, :, None] == documents[:, None, :]  # [B, T, T]
    keep = causal[None] & same & real[:, None, :] & real[:, :, None] & ~sinks[:, None, :]  # [B, T, T]
    a = a * keep[None, :, None]  # sink column zeroed, pads and the future dropped
    a = a * (a >= tau)  # threshold, no renormalisation
    distance = positions[:, :, None] - positions[:, None, :]  # [B, T, T]: t - j
    distance_sum = (a * distance[None, :, None]).sum(dim=(0, 2, 4))  # [B, T]: over layers, heads, keys
    return _finish(distance_sum, n_layers * n_heads, real, lam)


def _sliding_window(attn) -> int | None:
    """The layer's attention window: the module's own `sliding_window` (Qwen2/Qwen3 per layer type), else the
    config's (Mistral windows every layer through the mask), else None."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


KERNELS = ("triton", "compiled", "eager")  # how each layer's distance is computed (`token_weights`)
# the reference's forward: float32, or bf16 autocast (SmolLM2 on 2 x 2,048 corpus tokens: weights correlate 0.998
# with float32's, mean relative difference 2.4%; docs/lab/TRAINING_SPEED.md)
PRECISIONS = ("float32", "bf16")


def resolve_kernel(setting: str, device: torch.device) -> str:
    """The kernel that `setting` names on `device`: "auto" is "triton" on CUDA and "eager" elsewhere (the Triton kernel
    runs on the CPU only interpreted, far slower); the others are obeyed."""
    if setting == "auto":
        return "triton" if torch.device(device).type == "cuda" else "eager"
    if setting not in KERNELS:
        raise ValueError(f"kernel must be one of 'auto', {', '.join(map(repr, KERNELS))}; got {setting!r}")
    return setting


def _decoder(model):
    """The causal LM's decoder stack (`model.model` for Llama/Qwen/Mistral), its attention modules and its
    architecture's adapter (architectures.py), which recomputes their queries and keys."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder layers found (expected base_model.layers)")
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    bad = [i for i, a in enumerate(attns) if a is None or not (hasattr(a, "q_proj") and hasattr(a, "k_proj"))]
    if bad:
        raise TypeError(f"layers {bad} have no standard self_attn with q_proj/k_proj: not a reference Transformer")
    return base, attns, get_architecture(model.config.model_type)


@torch.no_grad()
def token_weights(
    model,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    tau: float = 0.2,
    lam: float = 0.5,
    query_block: int = 256,
    position_ids: Tensor | None = None,
    kernel: str = "auto",
    precision: str = "float32",
) -> Tensor:
    """Algorithm 1 on a reference causal LM, without ever holding its full [L, H, T, T] attention.

    One forward of the decoder stack (no LM head, no cache); a forward pre-hook on every layer's `self_attn` takes
    its input hidden states and (cos, sin), recomputes queries and keys as the module does (the architecture's
    adapter, see raven_layers/architectures.py: projections, Qwen3's q_norm/k_norm, RoPE), and sums the layer's
    thresholded attention times distance (GQA as transformers' repeat_kv): causal, padding-aware and windowed
    softmax in float32, sink column zeroed, weights < tau dropped, weighted distance summed. `kernel` says how
    (raven_kernels.attention): "triton" fuses it all in one Triton kernel (`attention_distance`, nothing of size
    T x T stored; CUDA, or the CPU interpreted); "eager" streams over blocks of `query_block` queries in PyTorch
    (`attention_distance_torch`, the reference: only [B, H, query_block, T] probabilities live at a time);
    "compiled" runs those blocks through torch.compile; "auto" is "triton" on CUDA, else "eager" (`resolve_kernel`).
    All give the same sums up to rounding. The model's own attention runs as loaded: load the reference with
    "sdpa" (or flash) attention, since the "eager" attention implementation builds each layer's [B, H, T, T] map.
    `precision` "bf16" runs the forward (and so the queries and keys) under bfloat16 autocast: faster where the
    float32 forward dominates, with weights that differ a little (PRECISIONS); the softmax stays float32.

    input_ids [B, T]; attention_mask [B, T] (1 real, 0 pad; left or right padding). Position ids follow the mask
    (as in `generate()`), so a left-padded row gets the weights of the same sequence unpadded. Rows of packed
    documents instead come with position_ids [B, T] restarting at 0 at each document (and no attention_mask): each
    document then gets exactly the weights it would get alone (its own sink, no attention across). Returns float32
    w [B, T] on the input's device, 0 at padded tokens; w[:, t] belongs to query t (see the module docstring).
    """
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r} is not allowed; expected one of {list(PRECISIONS)}")
    base, attns, architecture = _decoder(model)
    batch, length = input_ids.shape
    device = input_ids.device
    kernel = resolve_kernel(kernel, device)
    if attention_mask is not None and position_ids is not None:
        raise ValueError("pass attention_mask (padded rows) or position_ids (packed documents), not both")
    real = _real_tokens(attention_mask, batch, length, device)  # [B, T]
    distance_positions, documents, sinks = _layout(real, position_ids)  # [B, T] each
    distance_sum = torch.zeros(batch, length, dtype=torch.float32, device=device)
    n_maps = 0
    first = first_keys(real, documents) if kernel == "triton" else None  # [B, T]: the same for every layer

    def make_hook(attn):
        window = _sliding_window(attn)

        def hook(module, args, kwargs):
            nonlocal distance_sum, n_maps
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rope = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            q, k = architecture.queries_keys(module, hidden, rope)
            at = q.device  # the layer's device (models spread over devices by device_map)
            layout = (real.to(at), distance_positions.to(at), documents.to(at), sinks.to(at))
            if kernel == "triton":
                distance = attention_distance(q, k, module.scaling, *layout, window, tau, first=first.to(at))
            else:
                compiled = kernel == "compiled"
                distance = attention_distance_torch(q, k, module.scaling, *layout, window, tau, query_block, compiled)
            distance_sum += distance.to(device)
            n_maps += q.shape[1]

        return hook

    was_training = model.training
    model.eval()
    handles = [a.register_forward_pre_hook(make_hook(a), with_kwargs=True) for a in attns]
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            base(
                input_ids=input_ids,
                attention_mask=real.long() if attention_mask is not None else None,
                position_ids=distance_positions.long(),
                use_cache=False,
            )
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if n_maps == 0:
        raise RuntimeError("no attention layer ran")
    return _finish(distance_sum, n_maps, real, lam)


def _selection(order: Tensor) -> str:
    """A short hash of the rows a weight table weights, in order (its checkpoints record it)."""
    return hashlib.sha256(order.numpy().astype("int64").tobytes()).hexdigest()[:16]


def weight_table(
    teacher,
    rows,
    batch_size: int,
    *,
    tau: float = 0.2,
    lam: float = 0.5,
    query_block: int = 256,
    out_dir=None,
    save_every: int = 100,
    keep_checkpoints: int = 2,
    log: Callable[[str], None] = print,
    parallel=None,
    kernel: str = "auto",
    only: Tensor | None = None,
    precision: str = "float32",
) -> Tensor:
    """token_weights of every row of `rows` (a PackedDataset, each packed document weighted on its own), computed
    `batch_size` rows at a time: float32 [len(rows), T], row i's weights at index i, on the CPU. With `only` (row
    positions [K], e.g. stage2_rows.rows_read: the rows a training run will read), just those rows, in that order; the
    others are NaN, so that reading one fails loudly (stage2.train checks before its first step). tau, lam,
    query_block, kernel and precision are token_weights'.

    With `out_dir`, a checkpoint (see checkpoint.py; step k: the first k batches done) of the rows done so far is
    written every `save_every` batches and at the end, the newest `keep_checkpoints` kept, and a call resumes after
    the newest intact one: the batches are the same, so the table is the one an uninterrupted call returns.

    Under a launch of N processes (`parallel`, see distributed.py) the batches are dealt out N at a time (batch k to
    process k mod N) and every process returns the whole table; only the main process logs and writes checkpoints,
    which resume on any number of processes.
    """
    from raven_convert.train.distributed import Parallel

    parallel = parallel or Parallel()
    log = log if parallel.is_main else (lambda message: None)
    total, length = len(rows), rows.seq_len
    order = torch.arange(total) if only is None else torch.as_tensor(only, dtype=torch.long)  # [n] rows to weight
    n, selection = len(order), _selection(order)
    batches = -(-n // batch_size)
    device = next(teacher.parameters()).device
    found = None if out_dir is None else latest_checkpoint(out_dir, warn=lambda m: log(f"[weights] {m}"))
    parts, first = [], 0
    if found is not None:
        path, meta = found
        saved = load_file(path / "weights.safetensors")["weights"]  # [rows done, T]
        first = meta["step"]
        expected = (min(first * batch_size, n), length)
        weighted = meta.get("selection", _selection(torch.arange(total)))  # checkpoints before `only`: every row
        got = (meta.get("rows"), meta.get("batch_size"), weighted, tuple(saved.shape))
        if got != (total, batch_size, selection, expected):
            raise ValueError(
                f"{path} holds weights of other data ({tuple(saved.shape)} done of {meta.get('rows')} rows in "
                f"batches of {meta.get('batch_size')}, now {n} of {total} rows of {length} in batches of "
                f"{batch_size}); delete {path.parent} to start the weights over"
            )
        parts = [saved]
        log(f"[weights] resumed from {path} (step {first}, {len(saved)} of {n} rows done)")
    clock = time.perf_counter()
    for first_of_round in range(first, batches, parallel.world):
        done = min(first_of_round + parallel.world, batches)  # batches done after this round
        # a process past the last batch repeats it and drops the result: a sharded teacher needs every process
        step = min(first_of_round + parallel.rank, batches - 1)
        start, stop = step * batch_size, min((step + 1) * batch_size, n)
        batch = rows.batch(order[start:stop])
        w = token_weights(
            teacher,
            batch["input_ids"].to(device),
            position_ids=batch["position_ids"].to(device),  # packed documents: each weighted on its own
            tau=tau,
            lam=lam,
            query_block=query_block,
            kernel=kernel,
            precision=precision,
        )
        parts += parallel.gather(w.cpu())[: done - first_of_round]
        elapsed = time.perf_counter() - clock
        rate = (done - first) / max(elapsed, 1e-9)  # batches per second in this call
        rows_done, left = min(done * batch_size, n), eta((batches - done) / rate)
        log(f"[weights] rows {rows_done}/{n} | {rate * batch_size * length:,.0f} tok/s | {left}")
        if out_dir is not None and (done // save_every > first_of_round // save_every or done == batches):
            parts = [torch.cat(parts)]
            meta = {"step": done, "rows": total, "batch_size": batch_size, "selection": selection}

            def write(folder, table=parts[0]):
                if parallel.is_main:
                    save_file({"weights": table}, folder / "weights.safetensors")

            save_checkpoint(
                out_dir, done, write, meta, keep_checkpoints, main=parallel.is_main, barrier=parallel.barrier
            )
    if only is None:
        return torch.cat(parts)
    table = torch.full((total, length), float("nan"))  # [len(rows), T]: NaN where no row was weighted
    if n:
        table[order] = torch.cat(parts)
    return table


def load_weight_table(path: Path, rows) -> Tensor:
    """The weight table saved at `path` for the training rows `rows` (a PackedDataset): [len(rows), T], else a
    ValueError saying that it belongs to other data."""
    weights = torch.load(path, weights_only=True)
    if tuple(weights.shape) != (len(rows), rows.seq_len):
        raise ValueError(
            f"{path} has shape {tuple(weights.shape)} but the training data has {len(rows)} rows of {rows.seq_len}: "
            f"delete {Path(path).parent} and rerun weights"
        )
    return weights


def schedule_weights(
    w: Tensor, tokens_seen: float, tau_tokens: float = 1e9, attention_mask: Tensor | None = None
) -> Tensor:
    """The training-time loss weights: exp(-tokens_seen / tau_tokens) + w (Appendix C.3, line 814).

    Counted in training tokens with tau_tokens = 1e9 as in Appendix C.3 (Section 5.2, line 376, writes
    training_step / tau); 1 + w at the start, w after a few tau_tokens. With attention_mask, pads stay 0.
    """
    return scheduled(w, schedule_uniform(tokens_seen, tau_tokens), attention_mask)


def schedule_uniform(tokens_seen: float, tau_tokens: float = 1e9) -> float:
    """The uniform part of schedule_weights after `tokens_seen` training tokens: exp(-tokens_seen / tau_tokens)."""
    if tau_tokens <= 0:
        raise ValueError(f"tau_tokens must be positive, got {tau_tokens}")
    return math.exp(-float(tokens_seen) / float(tau_tokens))


def scheduled(w: Tensor, uniform: float | Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """w + uniform (a number, or a device scalar a CUDA graph reads), 0 where attention_mask is 0."""
    out = w + uniform
    if attention_mask is not None:
        out = out * attention_mask.to(out.device).bool()
    return out


def plot_first_row(tokenizer, rows, table: Tensor, path: str | Path, shown: int = 400) -> Path:
    """The weights stage's picture: the first `shown` tokens of the first weighted row (no NaN) of `table`, shaded by
    their weights."""
    weighted = (~table.isnan().any(dim=1)).nonzero()
    if len(weighted) == 0:
        raise ValueError("the weight table has no weighted row to plot")
    first = int(weighted[0])
    ids = rows[first]["input_ids"][:shown]
    return plot_token_weights(
        tokenizer.convert_ids_to_tokens(ids.tolist()),
        table[first, : len(ids)],
        path,
        title="token loss weights of the first training row (darker: retrieves from further back)",
    )


def plot_token_weights(
    tokens: Sequence[str],
    weights: Tensor | Sequence[float],
    path: str | Path,
    *,
    title: str | None = None,
    line_chars: int = 100,
    cmap: str = "Reds",
    vmax: float | None = None,
    fontsize: float = 10.0,
    dpi: int = 120,
) -> Path:
    """Fig. 7-style picture: the text, each token's background shaded by its weight, wrapped over lines of about
    `line_chars` characters, with a colour bar. Newlines in tokens are shown as "\\n" and start a new line.

    tokens: the T tokens as strings (e.g. `tokenizer.convert_ids_to_tokens(ids)` or each id decoded);
    weights: [T]. Drawn on a bare matplotlib Figure (Agg), so pyplot's backend is left alone. Returns `path`.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    w = torch.as_tensor(weights, dtype=torch.float32).flatten().cpu().tolist()
    if len(w) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(w)} weights")
    top = vmax if vmax is not None else max([*w, 0.0])
    norm = Normalize(vmin=0.0, vmax=top if top > 0 else 1.0)
    colours = colormaps[cmap]

    # Lay the tokens out on a grid of monospace character cells: (line, column, width, text, weight).
    cells, line, col = [], 0, 0
    for token, weight in zip(tokens, w):
        breaks = token.endswith("\n")
        text = token.replace("\n", "\\n").replace("\t", "    ").replace("\r", "\\r")
        text = text[:line_chars] if text else " "
        if col + len(text) > line_chars and col > 0:
            line, col = line + 1, 0
        cells.append((line, col, len(text), text, weight))
        col += len(text)
        if breaks:
            line, col = line + 1, 0
    n_lines = max(1, (cells[-1][0] + 1) if cells else 1)

    char_w, line_h = fontsize * 0.62 / 72, fontsize * 1.8 / 72  # inches per character and per line
    pad, title_h, bar_h = 0.3, (0.4 if title else 0.15), 1.0
    text_w, text_h = line_chars * char_w, n_lines * line_h
    width, height = text_w + 2 * pad, text_h + title_h + bar_h
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)  # PNG rendering, without pyplot or a global backend switch
    ax = fig.add_axes((pad / width, bar_h / height, text_w / width, text_h / height))
    ax.set_xlim(0, line_chars)
    ax.set_ylim(n_lines, 0)
    ax.set_axis_off()
    for line, col, size, text, weight in cells:
        rgba = colours(norm(weight))
        ax.add_patch(Rectangle((col, line + 0.05), size, 0.9, facecolor=rgba, edgecolor="none"))
        dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
        ax.text(
            col + size / 2,
            line + 0.5,
            text,
            ha="center",
            va="center",
            family="monospace",
            fontsize=fontsize,
            color="white" if dark else "black",
            parse_math=False,
        )
    if title:
        fig.suptitle(title, y=1 - 0.1 / height, va="top", fontsize=fontsize + 1)
    cax = fig.add_axes((pad / width, 0.55 / height, text_w / width, 0.12 / height))
    fig.colorbar(ScalarMappable(norm=norm, cmap=colours), cax=cax, orientation="horizontal")
    cax.set_xlabel("loss weight  w_t = log(lambda d_t + 1)", fontsize=fontsize - 1)
    return write_png(fig, path, dpi=fig.dpi)
