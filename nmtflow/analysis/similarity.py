"""Similarity of each layer to the embeddings, and shortcut-gate statistics (SPEC §2; Emelin et al. 2019 §4.1, A.3).

* **similarity**: for every non-padding position i, ``cos(E_i, H^l_i)`` between the embedding layer and the
  output of layer l of the same stack, averaged over positions (layer 0, E itself, is 1 by definition).
* **gates**: for every shortcut sub-layer, the mean and standard deviation of ``r_k`` and ``r_v`` over the
  non-padding key positions and all features (a spread near 0 with a mean near 0 or 1 means saturated gates).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from nmtflow.analysis import plots
from nmtflow.analysis.report import write_json
from nmtflow.analysis.states import Model, check_limits, iter_states, load_models, sentence_rows

SIDES = ("encoder", "decoder")


@dataclass
class SimilarityConfig:
    max_sentences: int | None = 2000  # sentences of the split used (a seeded random choice)
    max_tokens: int = 4000  # tokens per batch when running the frozen model
    seed: int = 1

    def validate(self) -> None:
        check_limits(self.max_sentences, self.max_tokens)


class Moments:
    """Running count, mean and variance of a stream of tensors (float64 sums)."""

    def __init__(self) -> None:
        self.n, self.total, self.squares = 0, 0.0, 0.0

    def add(self, x: Tensor) -> None:
        x = x.double()
        self.n += x.numel()
        self.total += float(x.sum())
        self.squares += float((x * x).sum())

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def std(self) -> float:
        return math.sqrt(max(self.squares / self.n - self.mean ** 2, 0.0)) if self.n else math.nan


def gate_slot(name: str) -> tuple[str, int | None]:
    """``decoder.2.self_attn`` → (``decoder.self_attn``, 3): the slot and the paper's 1-based layer."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1].isdigit():
        return f"{parts[0]}.{parts[2]}", int(parts[1]) + 1
    return name, None


def similarity_model(m: Model, cfg: SimilarityConfig) -> dict[str, Any]:
    """Mean cosine similarity to E per layer (encoder, decoder) and gate statistics of one model."""
    cosine: dict[str, list[Moments]] = {}
    gates: dict[str, dict[str, Moments]] = {}
    for st in iter_states(m, sentence_rows(len(m.data), cfg.max_sentences, cfg.seed), cfg.max_tokens, gates=True):
        for side, layers in (("encoder", st.encoder), ("decoder", st.decoder)):
            moments = cosine.setdefault(side, [Moments() for _ in layers])
            for acc, h in zip(moments, layers):
                acc.add(F.cosine_similarity(layers[0].float(), h.float(), dim=-1))  # (N,)
        for name, r in st.gates.items():
            for kv, values in r.items():
                gates.setdefault(name, {}).setdefault(kv, Moments()).add(values)
    result: dict[str, Any] = {"checkpoint": str(m.path)}
    result.update({side: [acc.mean for acc in cosine.get(side, [])] for side in SIDES})
    result["gates"] = {}
    for name, stats in gates.items():
        slot, layer = gate_slot(name)
        result["gates"][name] = {"slot": slot, "layer": layer,
                                 **{f"{kv}_{s}": getattr(acc, s) for kv, acc in stats.items() for s in ("mean", "std")}}
    return result


def run_similarity(checkpoints: Sequence[str | Path], data: str | Path, out_dir: str | Path, *,
                   split: str = "valid", labels: Sequence[str] | None = None, device: str | torch.device = "cpu",
                   cfg: SimilarityConfig | None = None) -> dict[str, Any]:
    """Write ``similarity.json``, ``similarity.png`` and (when a model has shortcuts) ``gates.png``."""
    cfg = cfg or SimilarityConfig()
    cfg.validate()
    models = load_models(checkpoints, data, split, labels, device)
    result = {"analysis": "similarity", "data": str(data), "split": split, "settings": asdict(cfg),
              "layers": "0 = embeddings E; n = output of layer n", "metric": "mean cosine similarity to E",
              "models": {m.label: similarity_model(m, cfg) for m in models}}
    out = Path(out_dir)
    files = [out / "similarity.json", out / "similarity.png"]
    write_json(result, files[0])
    plots.plot_layers({k: {s: v[s] for s in SIDES} for k, v in result["models"].items()}, files[1],
                      ylabel="cosine similarity to E", title="Similarity of each layer to the embeddings")
    gates = {label: v["gates"] for label, v in result["models"].items() if v["gates"]}
    if gates:
        files.append(out / "gates.png")
        plots.plot_gates(gates, files[-1])
    else:  # not a stale plot of an earlier analysis in the same directory
        (out / "gates.png").unlink(missing_ok=True)
    result["files"] = [str(f) for f in files]
    return result
