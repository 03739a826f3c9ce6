"""The pictures of analysis.py's traces: PNGs drawn on a bare matplotlib `Figure` (Agg), so importing this module
never changes the pyplot backend of the caller.

- Raven: `plot_effective_sequence_length` (Figures 5 and 8), `plot_slot_allocation` (Figures 6 and 7).
- SILA: `plot_gate_trace` (Appendix D, Figure 11).
- SSE: `plot_partition_usage`, `plot_state_entropy` (Figure 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..files import write_png
from .analysis import BOTH, CATEGORY_NAMES, NEVER, OTHER_ONLY, SPECIAL_ONLY, slot_allocation

# the slot categories' colours, the Raven paper's (Figures 6 and 7)
CATEGORY_COLORS = {NEVER: "#bdbdbd", SPECIAL_ONLY: "#d62728", OTHER_ONLY: "#2ca02c", BOTH: "#1f77b4"}


def new_figure(width: float, height: float):
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's backend alone

    return Figure(figsize=(width, height), layout="constrained")


def _token_ticks(ax, tokens: Sequence[str] | None, T: int, max_labels: int = 64):
    """Token strings as x tick labels when they fit, positions otherwise."""
    if tokens is not None and len(tokens) == T and T <= max_labels:
        ax.set_xticks(range(T))
        ax.set_xticklabels([repr(t)[1:-1] for t in tokens], rotation=90, fontsize=6)
    else:
        ax.set_xlabel("token position")


def plot_effective_sequence_length(esl: torch.Tensor, path, heads: Sequence[int] | None = None, title=None) -> Path:
    """Raven Figures 5 and 8: per kv head, the normalised effective sequence length of each slot, slots sorted
    from most to least written. Bars are coloured by regime (red: below half the uniform K/M, green: above twice
    it, blue: in between); dashed lines mark uniform top-K routing (K/M) and a sliding window (1/M).

    Args:
        esl: [H_kv, M] from `effective_sequence_length`.
        heads: kv heads to draw (one panel each); None: all.
    """
    from matplotlib.patches import Patch

    esl = esl.detach().float().cpu()
    heads = list(range(esl.shape[0])) if heads is None else list(heads)
    M = esl.shape[1]
    fig = new_figure(7, 2.0 * len(heads) + 0.6)
    axes = fig.subplots(len(heads), 1, squeeze=False)[:, 0]
    for ax, h in zip(axes, heads):
        values = esl[h].sort(descending=True).values
        uniform = float(esl[h].sum()) / M  # K / M
        colors = [
            CATEGORY_COLORS[SPECIAL_ONLY] if v < uniform / 2 else CATEGORY_COLORS[OTHER_ONLY] if v > 2 * uniform
            else CATEGORY_COLORS[BOTH]
            for v in values.tolist()
        ]  # fmt: skip
        ax.bar(range(M), values.numpy(), width=1.0, color=colors)
        ax.axhline(uniform, ls="--", lw=1, color="k", label="uniform top-K routing (K/M)")
        ax.axhline(1 / M, ls=":", lw=1, color="gray", label=f"sliding window (1/M = {1 / M:.3g})")
        ax.set_xlim(-0.5, M - 0.5)
        ax.set_ylabel("ESL / T")
        ax.set_title(f"kv head {h} (K/M = {uniform:.3g})", fontsize=9)
    regimes = [  # what the bar colours mean, beside the two reference lines
        Patch(color=CATEGORY_COLORS[SPECIAL_ONLY], label="below half of K/M"),
        Patch(color=CATEGORY_COLORS[BOTH], label="within 2x of K/M"),
        Patch(color=CATEGORY_COLORS[OTHER_ONLY], label="above twice K/M"),
    ]
    lines = axes[0].get_legend_handles_labels()[0]
    fig.legend(handles=[*lines, *regimes], loc="outside lower center", ncols=3, fontsize=7)  # off the bars
    axes[-1].set_xlabel("slot (sorted by effective sequence length)")
    fig.suptitle(title or "Raven effective sequence length per slot")
    return write_png(fig, path, dpi=120)


def plot_slot_allocation(
    writes: torch.Tensor, special_token_mask, path, head: int = 0, tokens: Sequence[str] | None = None, title=None
) -> Path:
    """Raven Figures 6 and 7 for one kv head: left, slots x tokens, a cell coloured where the token wrote the slot
    (red: a special token such as the passkey, green: any other token); right, each slot's category after the
    prompt (red: only special tokens, green: only other tokens, blue: both, gray: never written). Slots are grouped
    by category (red, blue, green, gray), then sorted by how often they were written.

    Args:
        writes: [T, H_kv, M] bool from `raven_slot_writes`; special_token_mask: [T] bool.
        tokens: the T token strings, shown on the x axis when short enough.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    writes = writes.detach().cpu()
    special = torch.as_tensor(special_token_mask, dtype=torch.bool).flatten().cpu()
    category = slot_allocation(writes, special)[head]  # [M]
    w = writes[:, head]  # [T, M]
    T, M = w.shape
    rank = {SPECIAL_ONLY: 0, BOTH: 1, OTHER_ONLY: 2, NEVER: 3}
    order = sorted(range(M), key=lambda m: (rank[int(category[m])], -int(w[:, m].sum())))
    grid = torch.zeros(M, T, dtype=torch.long)  # 0 not written, 1 written by a special token, 2 by another
    grid[w.T & special[None, :]] = 1
    grid[w.T & ~special[None, :]] = 2
    grid = grid[order]

    fig = new_figure(min(3 + 0.12 * T, 16), min(2 + 0.12 * M, 12))
    # the category column keeps a readable width however long the prompt
    grid_ax, bar_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [max(T, 4), max(2, T / 30)]}, sharey=True)
    cell_colors = ListedColormap(["white", CATEGORY_COLORS[SPECIAL_ONLY], CATEGORY_COLORS[OTHER_ONLY]])
    grid_ax.imshow(grid.numpy(), cmap=cell_colors, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    grid_ax.set_ylabel("slot (grouped by category)")
    step = max(1, -(-M // 32))  # at most 32 labelled rows: 256 labels in one column overlap
    grid_ax.set_yticks(range(0, M, step))
    grid_ax.set_yticklabels([str(order[r]) for r in range(0, M, step)], fontsize=6)
    _token_ticks(grid_ax, tokens, T)
    for t in special.nonzero().flatten().tolist():
        grid_ax.axvline(t, color=CATEGORY_COLORS[SPECIAL_ONLY], lw=0.4, alpha=0.4)
    slot_colors = ListedColormap([CATEGORY_COLORS[c] for c in (NEVER, SPECIAL_ONLY, OTHER_ONLY, BOTH)])
    bar_ax.imshow(category[order].view(M, 1).numpy(), cmap=slot_colors, vmin=0, vmax=3, aspect="auto")
    bar_ax.set_xticks([])
    bar_ax.set_xlabel("after\nthe prompt", fontsize=7)
    counts = {c: int((category == c).sum()) for c in CATEGORY_NAMES}
    handles = [Patch(color=CATEGORY_COLORS[c], label=f"{CATEGORY_NAMES[c]}: {counts[c]}") for c in CATEGORY_NAMES]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=7)
    fig.suptitle(title or f"Raven slot allocation, kv head {head}")
    return write_png(fig, path, dpi=120)


def _common_suffix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def plot_gate_trace(
    traces: dict,
    path,
    head: int | None = None,
    marks: dict[str, Sequence[int]] | None = None,
    title=None,
) -> Path:
    """SILA Figure 11: the input gate beta over a prompt, one panel per variant (e.g. "no_inst", "strong_inst"),
    and, for two variants, the difference (second minus first) over the tokens they share at the end.

    Args:
        traces: variant name -> (tokens: list[str] of length T, beta: [T, H_kv] from `sila_input_gate_trace`).
        head: a kv head, drawn as a line; None draws every head as a heatmap (heads x tokens).
        marks: variant name -> token positions to mark (needle key, answer, ...), shaded in the panel.
    """
    marks = marks or {}
    names = list(traces)
    if not names:
        raise ValueError("traces is empty")
    betas = {n: torch.as_tensor(traces[n][1]).detach().float().cpu() for n in names}
    tokens = {n: list(traces[n][0]) for n in names}
    for n in names:
        if betas[n].dim() != 2 or len(tokens[n]) != betas[n].shape[0]:
            raise ValueError(f"traces[{n!r}]: {len(tokens[n])} tokens for beta of shape {tuple(betas[n].shape)}")
    shared = _common_suffix(tokens[names[0]], tokens[names[1]]) if len(names) == 2 else 0
    panels = [(n, betas[n], tokens[n], marks.get(n, ())) for n in names]
    if shared:
        a, b = names
        diff = betas[b][-shared:] - betas[a][-shared:]
        ta = len(tokens[a]) - shared  # marks of the first variant, shifted into the shared suffix
        shifted = [t - ta for t in marks.get(a, ()) if t >= ta]
        panels.append((f"{b} - {a} (last {shared} tokens)", diff, tokens[a][-shared:], shifted))

    width = min(4 + 0.12 * max(len(tokens[n]) for n in names), 18)
    fig = new_figure(width, 2.2 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for i, (ax, (name, beta, toks, marked)) in enumerate(zip(axes, panels)):
        T = beta.shape[0]
        is_diff = shared and i == len(panels) - 1
        if head is None:
            bound = float(beta.abs().max()) or 1.0
            image = ax.imshow(
                beta.T.numpy(), aspect="auto", interpolation="nearest",
                cmap="RdBu_r" if is_diff else "viridis",
                vmin=-bound if is_diff else 0.0, vmax=bound if is_diff else 1.0,
            )  # fmt: skip
            ax.set_ylabel("kv head")
            ax.set_yticks(range(beta.shape[1]))
            fig.colorbar(image, ax=ax, label="delta beta" if is_diff else "beta", shrink=0.9)
        else:
            ax.plot(range(T), beta[:, head].numpy(), lw=1, color="tab:purple" if is_diff else "tab:blue")
            ax.set_ylabel("delta beta" if is_diff else f"beta (kv head {head})")
            ax.axhline(0.0, color="gray", lw=0.5)
            ax.set_xlim(-0.5, T - 0.5)
            if not is_diff:
                ax.set_ylim(0, 1)
        _token_ticks(ax, toks, T, max_labels=96)
        for t in marked:  # shaded under a line, outlined on a heatmap; a marked token's label turns red
            if head is None:
                ax.axvline(t - 0.5, color="red", lw=1)
                ax.axvline(t + 0.5, color="red", lw=1)
            else:
                ax.axvspan(t - 0.5, t + 0.5, color="orange", alpha=0.35, lw=0)
        labels = ax.get_xticklabels() if len(ax.get_xticks()) == T else []
        for t in marked:
            if 0 <= t < len(labels):
                labels[t].set_color("red")
        ax.set_title(name, fontsize=9)
    fig.suptitle(title or "SILA input gate beta per token")
    return write_png(fig, path, dpi=120)


def plot_partition_usage(usage: torch.Tensor, path, title=None) -> Path:
    """SSE partition usage: per routed partition, the fraction of tokens that write it, one bar per kv head; the
    dashed line is perfectly balanced routing (k / N).

    Args:
        usage: [H_kv, N] from `sse_partition_usage`.
    """
    usage = usage.detach().float().cpu()
    H, N = usage.shape
    fig = new_figure(max(4, 1 + 0.6 * N * max(H, 2) / 2), 3)
    ax = fig.subplots()
    width = 0.8 / H
    for h in range(H):
        ax.bar([i - 0.4 + (h + 0.5) * width for i in range(N)], usage[h].numpy(), width=width, label=f"kv head {h}")
    balanced = float(usage.sum(1).mean()) / N
    ax.axhline(balanced, ls="--", lw=1, color="k", label=f"balanced (k/N = {balanced:.3g})")
    ax.set_xticks(range(N))
    ax.set_xlabel("routed partition")
    ax.set_ylabel("fraction of tokens writing it")
    ax.legend(fontsize=7, ncols=2)
    ax.set_title(title or "SSE partition usage", fontsize=10)
    return write_png(fig, path, dpi=120)


def plot_state_entropy(entropy, path, shared_partition: bool = True, title=None) -> Path:
    """SSE Figure 5: singular value entropy of the final states; per entry of `entropy` (e.g. one per layer), a bar
    per partition with the mean over kv heads and a dot per head, and a black line at the mean over heads and
    partitions (the paper's per-layer number). Unwritten partitions (nan) are left out.

    Args:
        entropy: [H_kv, P] from `state_singular_value_entropy`, or a dict label -> [H_kv, P] to compare.
        shared_partition: label the last partition "shared".
    """
    groups = entropy if isinstance(entropy, dict) else {"": entropy}
    groups = {k: torch.as_tensor(v).detach().float().cpu() for k, v in groups.items()}
    P = max(v.shape[1] for v in groups.values())
    labels = [str(i) for i in range(P - 1)] + (["shared"] if shared_partition else [str(P - 1)])
    fig = new_figure(max(4, 1.5 + 0.45 * P * len(groups)), 3.2)
    ax = fig.subplots()
    width = 0.8 / P
    for g, values in enumerate(groups.values()):
        for p in range(values.shape[1]):
            x = g - 0.4 + (p + 0.5) * width
            column = values[:, p][~values[:, p].isnan()]
            if column.numel():
                ax.bar(x, float(column.mean()), width=width, color=f"C{p}", label=labels[p] if g == 0 else None)
                ax.scatter([x] * column.numel(), column.numpy(), s=8, color="k", zorder=3)
        mean_label = "mean over heads and partitions" if g == 0 else None
        ax.hlines(float(values.nanmean()), g - 0.45, g + 0.45, color="k", lw=1.5, label=mean_label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups))
    ax.set_ylim(0, 1.3)
    ax.set_ylabel("singular value entropy")
    ax.legend(title="partition", fontsize=7, ncols=min(P, 5))
    ax.set_title(title or "SSE state singular value entropy", fontsize=10)
    return write_png(fig, path, dpi=120)
