"""A direction (source → target) of a prepared data directory: memory-mapped ids, tokenizers, batches."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nmtflow.config import ConfigError
from nmtflow.data.batching import Batch, collate_rows
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
        """Rows ``indices`` collated into a :class:`Batch` (one vectorised gather per side)."""
        return collate_rows(self.src, self.tgt, indices, src_prefix=self.src_prefix)


def tokenizer_path(data_dir: str | Path, meta: dict[str, Any], lang: str) -> Path:
    if lang not in meta["langs"]:
        raise ValueError(f"{data_dir}: language {lang!r} not prepared (languages: {', '.join(meta['langs'])})")
    return Path(data_dir) / meta["tokenizers"][lang]


def open_bitext(data_dir: str | Path, split: str, src_lang: str, tgt_lang: str) -> Bitext:
    """Open ``SPLIT.{src,tgt}`` of a prepared directory (errors name the directory and what is missing, or the file
    holding an id outside its language's vocabulary)."""
    meta = load_meta(data_dir)
    for lang in (src_lang, tgt_lang):
        tokenizer_path(data_dir, meta, lang)
    if split not in meta["splits"]:
        raise ValueError(f"{data_dir}: split {split!r} not prepared (splits: {', '.join(meta['splits'])})")
    return Bitext(*(IndexedDataset(Path(data_dir) / f"{split}.{lang}", vocab_size=meta["vocab_size"][lang])
                    for lang in (src_lang, tgt_lang)))


def long_sentence_message(data_dir: str | Path, split: str, lang: str, row: int, count: int, length: int,
                          limit: int, *, cleaned: bool, counted: str = "with EOS") -> str:
    """Where a prepared sentence too long for the model comes from, and what to do about it (``counted``: what
    its ``length`` includes besides the pieces, e.g. ``"with EOS and the <2xx> tag"``)."""
    meta = load_meta(data_dir)
    source = (meta.get("source_files") or {}).get(split, {}).get(lang)
    others = f" ({count - 1} more after it)" if count > 1 else ""
    if cleaned or not source:  # training rows are filtered by prepare, so a row is not a line of the text
        where = f"{data_dir}: {split}.{lang} row {row + 1}"
        fix = "prepare the data again with a smaller --max-len"
    else:
        where = f"{source}:{row + 1}"
        fix = "shorten or split that line and prepare again"
    return (f"{where}: a sentence of {length} positions ({counted}){others} does not fit the model's "
            f"max_positions={limit}; {fix}, or raise model.max_positions")


def check_sentence_lengths(data_dir: str | Path, split: str, lang: str, sizes: Any, extra: int, limit: int | None, *,
                           cleaned: bool, counted: str = "with EOS") -> None:
    """A :class:`ConfigError` (:func:`long_sentence_message`) if a sentence of ``sizes`` (pieces per row) plus
    ``extra`` positions (EOS, a tag) is longer than ``limit``; nothing when ``limit`` is None (no bound)."""
    if limit is None:
        return
    too_long = np.flatnonzero(np.asarray(sizes) + extra > limit)
    if too_long.size:
        row = int(too_long[0])
        raise ConfigError(long_sentence_message(data_dir, split, lang, row, len(too_long), int(sizes[row]) + extra,
                                                limit, cleaned=cleaned, counted=counted))
