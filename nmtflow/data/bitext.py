"""A direction (source → target) of a prepared data directory: memory-mapped ids, tokenizers, batches."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nmtflow.data.batching import Batch, collate
from nmtflow.data.binarize import IndexedDataset
from nmtflow.data.prepare import load_meta


@dataclass
class Bitext:
    """Aligned source/target ids of one split; ``batch(indices)`` collates rows into a :class:`Batch`."""

    src: IndexedDataset
    tgt: IndexedDataset
    src_prefix: int | None = None  # an id prepended to every source (e.g. a <2xx> language tag)

    def __len__(self) -> int:
        return len(self.src)

    def batch(self, indices: np.ndarray) -> Batch:
        return collate([self.src[i] for i in indices], [self.tgt[i] for i in indices], indices,
                       src_prefix=self.src_prefix)


def tokenizer_path(data_dir: str | Path, meta: dict[str, Any], lang: str) -> Path:
    if lang not in meta["langs"]:
        raise ValueError(f"{data_dir}: language {lang!r} not prepared (languages: {', '.join(meta['langs'])})")
    return Path(data_dir) / meta["tokenizers"][lang]


def open_bitext(data_dir: str | Path, split: str, src_lang: str, tgt_lang: str) -> Bitext:
    """Open ``SPLIT.{src,tgt}`` of a prepared directory (errors name the directory and what is missing)."""
    meta = load_meta(data_dir)
    for lang in (src_lang, tgt_lang):
        tokenizer_path(data_dir, meta, lang)
    if split not in meta["splits"]:
        raise ValueError(f"{data_dir}: split {split!r} not prepared (splits: {', '.join(meta['splits'])})")
    return Bitext(IndexedDataset(Path(data_dir) / f"{split}.{src_lang}"),
                  IndexedDataset(Path(data_dir) / f"{split}.{tgt_lang}"))
