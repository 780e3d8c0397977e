"""Per-layer hidden states of a frozen Transformer on a prepared split (shared by the SPEC §2 analyses).

Layer 0 of a stack is its embedding layer ``E`` (scaled embeddings plus positions: the input of layer 1);
layer n ≥ 1 is the output of layer n, i.e. the residual stream after its feed-forward sub-layer (Emelin et al.
2019, §4.1 fn. 4), before the final LayerNorm of a pre-norm stack. Encoder position i holds source token i
(sub-words, then EOS); decoder position t holds its input token ``tgt_in[t]`` (BOS, then the sub-words).
Only non-padding positions are kept, flattened over the batch.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from nmtflow.checkpoint import load_checkpoint
from nmtflow.data.bitext import Bitext, open_bitext, tokenizer_path
from nmtflow.data.prepare import load_meta
from nmtflow.data.vocab import PAD
from nmtflow.decode.multilingual import is_multilingual
from nmtflow.decode.translate import Translator, batches_by_length
from nmtflow.evaluate.perplexity import check_positions
from nmtflow.models.base import EncoderDecoder
from nmtflow.nn.shortcuts import ShortcutAttention


@dataclass
class Model:
    """A checkpoint loaded for analysis: the frozen model, its label, and the split it is analysed on."""

    label: str
    path: Path
    model: EncoderDecoder
    data: Bitext

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class BatchStates:
    """One batch at its non-padding positions: ids (N,) and per-layer states (N,D) for layers 0…L."""

    src_ids: Tensor
    tgt_ids: Tensor
    encoder: list[Tensor]
    decoder: list[Tensor]
    gates: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # module name → {"k","v"}: (N,D)


def default_labels(paths: Sequence[str | Path]) -> list[str]:
    """The shortest distinct ``…/DIR/FILE`` endings (without ``.pt``) of the paths, at least ``DIR/FILE``: e.g.
    ``shortcuts/checkpoint_best``, or ``rnn/seed-1/averaged`` and ``bridge-k10/seed-1/averaged`` for two runs of
    ``nmtflow compare``; the full paths where even those collide."""
    parts = [Path(p).with_suffix("").parts if Path(p).suffix == ".pt" else Path(p).parts for p in paths]
    for depth in range(2, max(map(len, parts), default=2) + 1):
        labels = ["/".join(q[-depth:]) for q in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def load_models(paths: Sequence[str | Path], data_dir: str | Path, split: str, labels: Sequence[str] | None = None,
                device: str | torch.device = "cpu") -> list[Model]:
    """Load checkpoints (eval mode, frozen) and open ``split`` of ``data_dir`` in each one's language pair.

    Bilingual checkpoints only: a multilingual one is an error. Labels (default: :func:`default_labels`) must differ.
    A sentence of the split longer than a model's positions is an error naming its line (nothing is truncated).
    """
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels given for {len(paths)} checkpoints")
    resolved = [Path(p).resolve() for p in paths]
    twice = next((paths[i] for i, r in enumerate(resolved) if r in resolved[:i]), None)
    if labels is None and twice is not None:
        raise ValueError(f"{twice} is given twice; to analyse it twice, name each with --labels")
    given = labels is not None
    labels = list(labels) if labels is not None else default_labels(paths)
    if len(set(labels)) != len(labels):
        raise ValueError(f"--labels must differ, got {', '.join(labels)}" if given else
                         f"labels must differ, got {', '.join(labels)} (name them with --labels)")
    meta = load_meta(data_dir)
    models = []
    for label, path in zip(labels, paths):
        ckpt = load_checkpoint(path)
        if is_multilingual(ckpt):
            raise ValueError(f"{path}: a multilingual checkpoint; these analyses support bilingual checkpoints only")
        translator = Translator.from_checkpoint(path, device, ckpt=ckpt)
        model, dc = translator.model, translator.config.data
        if not (hasattr(model, "encoder") and hasattr(getattr(model, "decoder", None), "features")):
            raise ValueError(f"{path}: the analyses need a Transformer (model {type(model).__name__})")
        for lang, tok in ((dc.src_lang, translator.src_tokenizer), (dc.tgt_lang, translator.tgt_tokenizer)):
            if tokenizer_path(data_dir, meta, lang).read_bytes() != tok.model_proto:
                raise ValueError(f"{data_dir}: its {lang} tokenizer is not the one {path} was trained with")
        model.requires_grad_(False)
        data = open_bitext(data_dir, split, dc.src_lang, dc.tgt_lang)
        check_positions(translator, data, data_dir, split)  # the sentence too long for the model, named
        models.append(Model(label, Path(path), model, data))
    return models


def check_limits(max_sentences: int | None, max_tokens: int | None) -> None:
    """One-line errors for sentence and batch limits (named as the options of ``nmtflow analyze``; None: no limit
    given)."""
    if max_sentences is not None and max_sentences < 1:
        raise ValueError(f"--max-sentences: must be >= 1, got {max_sentences}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--batch-tokens: must be >= 1, got {max_tokens}")


def sentence_rows(n: int, max_sentences: int | None, seed: int) -> np.ndarray:
    """A seeded random choice of at most ``max_sentences`` of ``n`` rows (the same for every checkpoint)."""
    rows = np.random.default_rng(seed).permutation(n)
    return rows[:max_sentences] if max_sentences is not None else rows


@contextmanager
def recording_gates(model: nn.Module, active: bool = True) -> Iterator[list[ShortcutAttention]]:
    """Inside the block every lexical-shortcut module of ``model`` (none unless ``active``) keeps the gates of its
    last call in ``mod.gates`` (``{"k": r_k, "v": r_v}``, (B,S,D) over its key positions); cleared after."""
    shortcuts = [mod for mod in model.modules() if isinstance(mod, ShortcutAttention)] if active else []
    for mod in shortcuts:
        mod.record_gates = True
    try:
        yield shortcuts
    finally:
        for mod in shortcuts:
            mod.record_gates = False
            mod.gates, mod.gate_stats = {}, {}


def gates_on_target(mod: ShortcutAttention) -> bool:
    """Whether a shortcut module's keys are target positions (decoder self-attention: ``tgt_in``) or source ones."""
    return mod.name.startswith("decoder.") and mod.self_attention


@torch.no_grad()
def iter_states(m: Model, rows: np.ndarray, max_tokens: int = 4000, gates: bool = False) -> Iterator[BatchStates]:
    """Run the frozen model over ``rows`` of its split in length-sorted batches; yield their states."""
    model = m.model.eval()
    with recording_gates(model, gates) as shortcuts:
        lengths = np.maximum(m.data.src.sizes[rows], m.data.tgt.sizes[rows]).tolist()
        for idx in batches_by_length(lengths, max_tokens):
            b = m.data.batch(rows[idx]).to(m.device)
            enc_layers: list[Tensor] = []
            dec_layers: list[Tensor] = []
            enc = model.encoder(b.src, layer_outputs=enc_layers)
            model.decoder.features(b.tgt_in, enc, layer_outputs=dec_layers)
            src_keep, tgt_keep = b.src.ne(PAD), b.tgt_in.ne(PAD)  # (B,S), (B,T)
            tgt_emb = model.decoder.embedder(b.tgt_in)  # eval mode: the E the decoder saw
            out = BatchStates(b.src[src_keep], b.tgt_in[tgt_keep],
                              [h[src_keep] for h in [enc["embeddings"], *enc_layers]],
                              [h[tgt_keep] for h in [tgt_emb, *dec_layers]])
            for mod in shortcuts:
                keep = tgt_keep if gates_on_target(mod) else src_keep
                out.gates[mod.name] = {kv: r[keep] for kv, r in mod.gates.items()}
            yield out
