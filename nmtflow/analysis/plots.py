"""Layer-by-layer comparison plots (PNG through matplotlib's Agg canvas; no global pyplot state is touched)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

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
