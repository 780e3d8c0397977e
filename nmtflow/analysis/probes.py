"""Per-layer lexical probes (SPEC §2; Emelin et al. 2019 §4.1, after Belinkov et al. 2017).

For each layer of a frozen model (encoder and decoder, layer 0 = the embeddings E), a classifier — one hidden
layer of 512 units, ReLU, dropout 0.5 — learns to predict the sub-word at each position from that layer's
state. It trains on one part of the split's sentences and reports accuracy on the held-out rest: the more
a layer still carries the token's identity, the higher the accuracy.

Choices the paper leaves open: the split's sentences are divided at random (seeded, the same for every
checkpoint) into training and held-out parts, a repeated sentence pair kept once; BOS and EOS positions are
not probed; states are standardised with the training part's per-feature mean and std (layers differ in
scale under pre-norm); the probe predicts among the sub-words seen in its training part, so an unseen
held-out sub-word counts as an error (its share is reported as ``unseen``); Adam, lr 1e-3, a fixed number of
epochs.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.analysis import plots
from nmtflow.analysis.report import write_json
from nmtflow.analysis.states import Model, check_limits, iter_states, load_models, sentence_rows
from nmtflow.data.vocab import BOS, EOS

log = logging.getLogger("nmtflow.analysis")
SIDES = ("encoder", "decoder")


@dataclass
class ProbeConfig:
    """The classifier (Emelin et al. 2019, A.1) and how it is trained and evaluated."""

    hidden: int = 512
    dropout: float = 0.5
    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-3
    holdout: float = 0.2  # share of the sentences held out for evaluation
    max_sentences: int | None = 2000  # sentences of the split used (a seeded random choice)
    max_tokens: int = 4000  # tokens per batch when running the frozen model
    seed: int = 1

    def validate(self) -> None:
        """One-line errors for settings that cannot work (named as the options of ``nmtflow analyze probe``)."""
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"--holdout: the share of sentences held out must be between 0 and 1, got {self.holdout}")
        if self.epochs < 1:
            raise ValueError(f"--epochs: must be >= 1, got {self.epochs}")
        check_limits(self.max_sentences, self.max_tokens)


def lexical_probe(d_model: int, classes: int, cfg: ProbeConfig) -> nn.Module:
    """state (N,D) → logits over sub-words (N,C): Linear → ReLU → Dropout → Linear."""
    return nn.Sequential(nn.Linear(d_model, cfg.hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.hidden, classes))


def collect(m: Model, rows: np.ndarray, cfg: ProbeConfig) -> dict[str, tuple[Tensor, list[Tensor]]]:
    """side → (ids (N,), states per layer [(N,D)]) at the probed (non-BOS/EOS) positions of ``rows``."""
    parts: dict[str, tuple[list[Tensor], list[list[Tensor]]]] = {s: ([], []) for s in SIDES}
    for st in iter_states(m, rows, cfg.max_tokens):
        for side, ids, layers in (("encoder", st.src_ids, st.encoder), ("decoder", st.tgt_ids, st.decoder)):
            keep = ids.ne(BOS) & ids.ne(EOS)
            parts[side][0].append(ids[keep].cpu())
            parts[side][1].append([h[keep].float().cpu() for h in layers])
    return {side: (torch.cat(ids), [torch.cat(layer) for layer in zip(*states)])
            for side, (ids, states) in parts.items()}


def train_and_score(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, cfg: ProbeConfig) -> float:
    """Train one probe on (x_train, y_train) and return its accuracy on (x_test, y_test)."""
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    classes = torch.unique(y_train)
    lookup = torch.full((int(torch.cat([y_train, y_test]).max()) + 1,), -1, dtype=torch.long)
    lookup[classes] = torch.arange(len(classes))
    y_train, y_test = lookup[y_train], lookup[y_test]  # unseen held-out sub-words → -1: always wrong
    torch.manual_seed(cfg.seed)
    probe = lexical_probe(x_train.size(1), len(classes), cfg)
    optimizer = torch.optim.Adam(probe.parameters(), lr=cfg.lr)
    probe.train()
    for _ in range(cfg.epochs):
        for idx in torch.randperm(len(y_train)).split(cfg.batch_size):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(probe(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
    probe.eval()
    with torch.no_grad():
        predicted = torch.cat([probe(x).argmax(-1) for x in x_test.split(4096)])
    return float((predicted == y_test).float().mean()) if len(y_test) else float("nan")


def distinct_pairs(m: Model, rows: np.ndarray) -> np.ndarray:
    """``rows`` less repeats of an earlier row's sentence pair: a pair in both parts would let the probe be scored
    on the very states it was trained on."""
    seen: set[tuple[bytes, bytes]] = set()
    keep = []
    for row in rows.tolist():
        pair = (m.data.src[row].tobytes(), m.data.tgt[row].tobytes())
        if pair not in seen:
            seen.add(pair)
            keep.append(row)
    if len(keep) < len(rows):
        log.info("%s: %d repeated sentence pair(s) of the split left out of the probes", m.label, len(rows) - len(keep))
    return np.asarray(keep, dtype=rows.dtype)


def probe_model(m: Model, cfg: ProbeConfig) -> dict[str, Any]:
    """Held-out probe accuracy per layer of the encoder and the decoder of one model."""
    rows = distinct_pairs(m, sentence_rows(len(m.data), cfg.max_sentences, cfg.seed))
    n_test = max(1, round(len(rows) * cfg.holdout))
    if len(rows) - n_test < 1:
        raise ValueError(f"{m.path}: too few sentences ({len(rows)}) to train and evaluate probes")
    train, test = collect(m, rows[n_test:], cfg), collect(m, rows[:n_test], cfg)
    result: dict[str, Any] = {"checkpoint": str(m.path), "sentences": {"train": len(rows) - n_test, "held_out": n_test}}
    for side in SIDES:
        (y_train, x_train), (y_test, x_test) = train[side], test[side]
        result[side] = []
        for layer, (xtr, xte) in enumerate(zip(x_train, x_test)):
            result[side].append(train_and_score(xtr, y_train, xte, y_test, cfg))
            log.info("%s %s layer %d: probe accuracy %.4f", m.label, side, layer, result[side][-1])
        seen = torch.isin(y_test, torch.unique(y_train))
        result[f"{side}_tokens"] = {"train": len(y_train), "held_out": len(y_test),
                                    "unseen": float(1 - seen.float().mean()) if len(y_test) else 0.0}
    return result


def run_probes(checkpoints: Sequence[str | Path], data: str | Path, out_dir: str | Path, *, split: str = "valid",
               labels: Sequence[str] | None = None, device: str | torch.device = "cpu",
               cfg: ProbeConfig | None = None) -> dict[str, Any]:
    """Probe every checkpoint on the same sentences; write ``probes.json`` and ``probes.png`` to ``out_dir``."""
    cfg = cfg or ProbeConfig()
    cfg.validate()
    models = load_models(checkpoints, data, split, labels, device)
    result = {"analysis": "probe", "data": str(data), "split": split, "settings": asdict(cfg),
              "layers": "0 = embeddings E; n = output of layer n", "metric": "held-out accuracy",
              "models": {m.label: probe_model(m, cfg) for m in models}}
    out = Path(out_dir)
    write_json(result, out / "probes.json")
    plots.plot_layers({k: {s: v[s] for s in SIDES} for k, v in result["models"].items()}, out / "probes.png",
                      ylabel="probe accuracy", title="Lexical probes (held-out accuracy per layer)")
    result["files"] = [str(out / "probes.json"), str(out / "probes.png")]
    return result
