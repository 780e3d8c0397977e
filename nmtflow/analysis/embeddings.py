"""Fixed-size sentence embeddings from a multilingual model (Vázquez et al. 2020 §4; SPEC §5).

With an attention bridge the embedding of a sentence is its M (k × d_h): ``mean`` pooling over the k rows
gives (d_h,) vectors (the paper's choice, §4), ``flat`` gives (k·d_h,). A model without a bridge (e.g. the
language-label baseline) gets the mean of its encoder states over the non-padding positions (``mean``
only); its sources carry the tag of the sentence's own language, as if translating into it.
Sentences are batched by length; the result does not depend on the batching (padding is masked). A sentence
longer than the model's positions is cut to what it reads, with a warning naming its line.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from nmtflow.data.batching import collate
from nmtflow.decode.multilingual import MultilingualCheckpoint
from nmtflow.decode.translate import batches_by_length
from nmtflow.models.base import EncoderOut
from nmtflow.models.rnn import masked_mean
from nmtflow.nn.bridge import pool_bridge

POOLINGS = ("mean", "flat")
log = logging.getLogger(__name__)


def pool(enc: EncoderOut, pooling: str) -> torch.Tensor:
    """An encoder output → sentence embeddings (B,D); see the module docstring."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r} (known: {', '.join(POOLINGS)})")
    if "bridge" in enc:
        return pool_bridge(enc["bridge"], pooling)
    if pooling != "mean":
        raise ValueError("pooling 'flat' needs an attention bridge (a fixed number of rows); use mean")
    return masked_mean(enc["out"], enc["padding_mask"])


@torch.no_grad()
def sentence_embeddings(ckpt: MultilingualCheckpoint, lang: str, lines: list[str], *, pooling: str = "mean",
                        max_tokens: int = 6000, max_input_tokens: int | None = None, name: str | None = None,
                        line_numbers: Sequence[int] | None = None) -> np.ndarray:
    """Sentences of ``lang`` → float32 (N, d_h) for ``mean``, (N, k·d_h) for ``flat``.

    A sentence longer than the model reads (its positions less EOS and any tag; ``max_input_tokens`` caps it
    further) is cut, with a warning naming ``name`` and its line (``line_numbers``, default 1…N).
    """
    if not lines:
        raise ValueError(f"{name}: no sentences to embed" if name else "no sentences to embed")
    model = ckpt.model.eval()
    device = next(model.parameters()).device
    limits = [n for n in (ckpt.max_source_tokens(lang), max_input_tokens) if n is not None]
    limit = min(limits) if limits else None
    ids = ckpt.tokenizer(lang).encode_batch(list(lines))
    if limit is not None:
        for n, seq in enumerate(ids):
            if len(seq) > limit:
                line = line_numbers[n] if line_numbers is not None else n + 1
                where = f"{name}:{line}" if name else f"input line {line}"
                log.warning("%s: %d tokens; embedding the first %d (what the model reads)", where, len(seq), limit)
                ids[n] = seq[:limit]
    prefix = ckpt.source_prefix(lang)
    out: np.ndarray | None = None
    for rows in batches_by_length([len(s) for s in ids], max_tokens):
        src = collate([ids[r] for r in rows], [[]] * len(rows), src_prefix=prefix).src.to(device)
        vectors = pool(model.encode(src, lang=lang), pooling).float().cpu().numpy()  # (B,D)
        if out is None:
            out = np.zeros((len(ids), vectors.shape[1]), dtype=np.float32)
        out[rows] = vectors
    assert out is not None
    return out
