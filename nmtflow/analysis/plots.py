"""Layer-by-layer comparison plots (PNG through matplotlib's Agg canvas; no global pyplot state is touched)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

SLOT_TITLES = {"encoder.self_attn": "encoder self-attention", "decoder.self_attn": "decoder self-attention",
               "decoder.cross_attn": "decoder-to-encoder attention"}


def _save(fig: Figure, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)


def plot_layers(models: dict[str, dict[str, list[float]]], path: str | Path, *, ylabel: str, title: str) -> None:
    """One panel per side (encoder, decoder), x = layer (0 = E), one line per model."""
    sides = [s for s in ("encoder", "decoder") if any(v.get(s) for v in models.values())]
    fig = Figure(figsize=(5 * max(1, len(sides)), 3.8), layout="constrained")
    axes = fig.subplots(1, max(1, len(sides)), squeeze=False)[0]
    for ax, side in zip(axes, sides):
        for label, values in models.items():
            ys = [float("nan") if y is None else y for y in values.get(side, [])]
            ax.plot(range(len(ys)), ys, marker="o", label=label)
        depth = max(len(v.get(side, [])) for v in models.values())
        ax.set_xticks(range(depth), ["E", *map(str, range(1, depth))])
        ax.set(title=side, xlabel="layer", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)


def plot_gates(gates: dict[str, dict[str, dict[str, Any]]], path: str | Path) -> None:
    """Gate mean ± std per layer: one panel per shortcut slot, r_k solid and r_v dashed, one colour per model."""
    found = {g["slot"] for per_model in gates.values() for g in per_model.values()}
    slots = [s for s in SLOT_TITLES if s in found] + sorted(found - set(SLOT_TITLES))
    fig = Figure(figsize=(5 * len(slots), 3.8), layout="constrained")
    axes = fig.subplots(1, len(slots), squeeze=False)[0]
    for ax, slot in zip(axes, slots):
        for i, (label, per_model) in enumerate(gates.items()):
            rows = sorted((g["layer"] or 0, g) for g in per_model.values() if g["slot"] == slot)
            if not rows:
                continue
            layers = [layer for layer, _ in rows]
            for kv, style in (("k", "-"), ("v", "--")):
                ax.errorbar(layers, [g[f"{kv}_mean"] for _, g in rows], yerr=[g[f"{kv}_std"] for _, g in rows],
                            linestyle=style, marker="o", capsize=3, color=f"C{i}", label=f"{label} r_{kv}")
        depth = max((g["layer"] or 0 for per_model in gates.values() for g in per_model.values()), default=0)
        ax.set_xticks(range(1, depth + 1))
        ax.set(title=SLOT_TITLES.get(slot, slot), xlabel="layer", ylabel="gate value (mean ± std)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Lexical-shortcut gates")
    _save(fig, path)


def plot_length_bleu(result: dict[str, Any], path: str | Path) -> None:
    """BLEU per source-length bucket, one line per model (the attention-bridge paper's Figure 3)."""
    buckets = result["buckets"]
    fig = Figure(figsize=(max(5.0, 1.1 * len(buckets) + 2), 3.8), layout="constrained")
    ax = fig.subplots()
    for label, m in result["models"].items():
        ys = [float("nan") if b["bleu"] is None else b["bleu"] for b in m["buckets"]]
        ax.plot(range(len(ys)), ys, marker="o", label=f"{label} ({m['bleu']:.1f})")
    ax.set_xticks(range(len(buckets)), [f"{b['bucket']}\n({b['sentences']})" for b in buckets])
    ax.set(xlabel="source length in words (sentences)", ylabel="BLEU", title="BLEU by source length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", title="model (all sentences)", title_fontsize="small")
    _save(fig, path)


def plot_bridge_attention(result: dict[str, Any], path: str | Path) -> None:
    """The bridge's A (k × n) per model: one heat map each (rows = heads, columns = source tokens), one scale."""
    models = result["models"]
    vmax = max((max(map(max, m["attention"])) for m in models.values()), default=1.0)
    heights = [len(m["attention"]) for m in models.values()]
    width = max(len(m["tokens"]) for m in models.values())
    fig = Figure(figsize=(2.5 + 0.35 * width, 1.2 + 0.25 * sum(heights) + 0.9 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    image = None
    for ax, (label, m) in zip(axes, models.items()):
        image = ax.imshow(m["attention"], aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_xticks(range(len(m["tokens"])), m["tokens"], rotation=90, fontsize=7)
        ax.set_yticks(range(len(m["attention"])), [str(i + 1) for i in range(len(m["attention"]))], fontsize=7)
        ax.set(ylabel="head", title=label)
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.8)
    fig.suptitle("Attention bridge: A over the source, per head")
    _save(fig, path)


def plot_head_entropy(result: dict[str, Any], path: str | Path) -> None:
    """Left: mean head entropy (all heads / index < n / index ≥ n) per model; right: per head index."""
    groups = [("all_heads", "all heads"), ("within_length", "index < n"), ("beyond_length", "index ≥ n")]
    models = result["models"]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    width = 0.8 / max(len(models), 1)
    for i, (label, m) in enumerate(models.items()):
        ys = [float("nan") if m[g] is None else m[g] for g, _ in groups]
        left.bar([x + (i - (len(models) - 1) / 2) * width for x in range(len(groups))], ys, width, label=label)
        per_head = [float("nan") if y is None else y for y in m["per_head"]]
        right.plot(range(1, len(per_head) + 1), per_head, marker="o", markersize=3, label=label)
    left.set_xticks(range(len(groups)), [name for _, name in groups])
    left.set(ylabel="entropy (nats)", title="Mean head entropy (n = sentence length)")
    right.set(xlabel="head", ylabel="entropy (nats)", title="Mean entropy per head")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, path)
