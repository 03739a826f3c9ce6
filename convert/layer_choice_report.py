"""How a layer choice (layer_choice.choice_record) is shown: the table `convert` prints, the bar chart and the model
card's section that export writes beside the converted model.

    print(format_table(record)); plot_choice(record, "layer_choice.png"); card = card_section(record)
"""

from __future__ import annotations

from pathlib import Path

from raven_convert.files import write_png


def _fixed(record: dict) -> set[int]:
    """The layers a source hybrid had converted already (converted further): kept as they were, never scored."""
    return set(record.get("fixed", ()))


def _converted(record: dict, i: int) -> str:
    return "before" if i in _fixed(record) else "yes" if i in record["chosen"] else "no"


def _restores(record: dict) -> bool:
    return record.get("direction", "cut") == "restore"


def _score_text(record: dict) -> str:
    """How a score is made, in words."""
    one = f"max(retrieval, 0) + {record['probes']['kl_weight']:g} * kl"
    one = f"{one}, {'recovered by restoring the layer' if _restores(record) else 'lost by ablating it'}"
    return f"the sum over the window and the mixer of {one}" if "parts" in record else one


def format_table(record: dict) -> str:
    """The per-layer score table: layer, round, retrieval and KL rise, score (and its parts under ablation
    "both"), rank, whether it is converted ("before": by the source hybrid, not scored)."""
    order, parts = record["order"], record.get("parts", {})
    copying = record.get("copying")
    lines = [
        f"layer choice ({record['method']}; score = {_score_text(record)}, nats/token):",
        "  layer  round  retrieval        kl  "
        + "".join(f"{k:>8}  " for k in parts)
        + "   score  "
        + ("copying  " if copying else "")
        + "rank  converted",
    ]
    for i, score in enumerate(record["score"]):
        copied = "" if not copying else f"{'-':>7}  " if copying[i] is None else f"{copying[i]:>7.3f}  "
        if score is None:
            lines.append(
                f"  {i:>5}  {'-':>5}  {'-':>9}  {'-':>8}  " + f"{'-':>8}  " * (len(parts) + 1) + copied + "   -  before"
            )
            continue
        lines.append(
            f"  {i:>5}  {record['round'][i]:>5}  {record['retrieval'][i]:>9.4f}  {record['kl'][i]:>8.4f}  "
            + "".join(f"{parts[kind][i]:>8.4f}  " for kind in parts)
            + f"{score:>8.4f}  {copied}{order.index(i) + 1:>4}  {_converted(record, i)}"
        )
    if copying:
        lines.append(
            f"  kept for copying (the strongest induction heads): {', '.join(map(str, record['kept_copying']))}"
        )
    return "\n".join(lines)


def _ablation_text(record: dict) -> str:
    """What replaced a scored layer's attention, in words."""
    p = record["probes"]
    window = f"the layer's attention cut to {p['window']} tokens"
    if p.get("ablation", "window") == "window":
        return window
    mixer = f"the layer's attention replaced by its {record['mixer']['name']} mixer after {p['fit_steps']} align steps"
    return mixer if p["ablation"] == "mixer" else f"{window}, and with {mixer}"


def plot_choice(record: dict, path: str | Path) -> Path:
    """A bar chart of every layer's score, the converted layers highlighted, written atomically to `path` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fixed, scores = _fixed(record), [s or 0.0 for s in record["score"]]
    colours = {"before": "tab:grey", "yes": "tab:orange", "no": "tab:blue"}
    fig = Figure(figsize=(max(6.0, 0.3 * len(scores)), 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(len(scores)), scores, color=[colours[_converted(record, i)] for i in range(len(scores))])
    ax.set_xlabel("layer")
    ax.set_ylabel("score (nats/token)")
    ax.set_xticks(range(len(scores)))
    ax.tick_params(axis="x", labelsize=7)
    ax.axhline(0, color="grey", linewidth=0.5)
    if _restores(record):
        title = f"loss recovered by restoring a layer, the rest ablated ({_ablation_text(record)})"
    else:
        title = f"loss rise with {_ablation_text(record)}"
    before = f", {len(fixed)} converted before (not scored)" if fixed else ""
    ax.set_title(f"{title}; {len(record['chosen']) - len(fixed)} lowest converted{before}", fontsize=9)
    labels = {"yes": "converted", "no": "kept attention", **({"before": "converted before"} if fixed else {})}
    ax.legend(handles=[Patch(color=colours[k], label=label) for k, label in labels.items()])
    fig.tight_layout()
    return write_png(fig, path)


def card_section(record: dict) -> str:
    """The model card's account of the choice (Markdown), with the picture save_hybrid writes beside it."""
    fixed = _fixed(record)
    chosen = ", ".join(str(i) for i in record["chosen"] if i not in fixed)
    before = f"\n- converted before, by the source: {', '.join(map(str, sorted(fixed)))}" if fixed else ""
    kept = ", ".join(str(i) for i in range(len(record["score"])) if i not in set(record["chosen"]))
    p, parts = record["probes"], record.get("parts", {})
    copying = (
        f"\n- kept whatever their scores, as the {len(record['kept_copying'])} layers of the strongest induction heads "
        f"(copying earlier tokens, on random tokens repeated): {', '.join(map(str, record['kept_copying']))}"
        if "kept_copying" in record
        else ""
    )
    if _restores(record):
        scan = (
            f"with every layer but the kept ones ablated ({_ablation_text(record)}), each layer's attention was "
            "restored in turn"
        )
        measure = (
            "the fall of the answer tokens' NLL (0 where it rises) plus "
            f"{p['kl_weight']:g} x the fall of the KL to the teacher on plain text (nats per token), when the "
            "layer is restored; each round kept its highest-scoring layers restored"
        )
    else:
        scan = f"each attention layer of the source was scored with {_ablation_text(record)}"
        measure = (
            f"the rise of the answer tokens' NLL (0 where it falls) plus {p['kl_weight']:g} x the rise of the KL "
            "to the unablated teacher on plain text (nats per token)"
        )
    return (
        f"""## Layer choice

The converted layers were chosen by measurement (`--layers auto:{record["n"]}`, {record["method"]}): {scan},
on {p["samples"]} synthetic retrieval probes and {p["text_rows"]} corpus rows of up to {p["seq_len"]} tokens (seed
{record["seed"]}, {max(r for r in record["round"] if r is not None)} greedy round(s)). Its score is {
            "the sum over both ablations of " if "parts" in record else ""
        }{measure}; {
            f"the source, a hybrid, had converted {len(fixed)} layers, which stayed; its "
            f"{record['n'] - len(fixed)} lowest-ranked attention layers were converted besides"
            if fixed
            else f"the {record['n']} lowest-ranked layers were converted"
        }.

- converted: {chosen}{before}
- kept attention: {kept}{copying}

![per-layer scores](layer_choice.png)

| layer | round | retrieval | KL | {"".join(f"{kind} | " for kind in parts)}score | converted |
| --- | --- | --- | --- | {"--- | " * len(parts)}--- | --- |
"""
        + "\n".join(
            f"| {i} | - | - | - | {'- | ' * len(parts)}- | before |"
            if s is None
            else f"| {i} | {record['round'][i]} | {record['retrieval'][i]:.4f} | {record['kl'][i]:.4f} | "
            + "".join(f"{parts[kind][i]:.4f} | " for kind in parts)
            + f"{s:.4f} | {_converted(record, i)} |"
            for i, s in enumerate(record["score"])
        )
        + "\n"
    )
