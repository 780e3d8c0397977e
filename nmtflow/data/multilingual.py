"""Multilingual data: translation directions of a multi-way prepared directory, and the language-rotating
scheduler that cycles through them batch by batch (Vázquez et al. 2020 §2.2; SPEC §5).

A prepared directory holds ``SPLIT.LANG`` for every language, row i being the same sentence in all of them,
so any ordered pair of languages (and a language with itself: a monolingual copy direction) is a bitext.

The scheduler's epoch is a deterministic list of ``(direction index, row indices)`` entries, a pure
function of ``(seed, epoch)`` like :class:`~nmtflow.data.batching.TokenBatchSampler`'s, so a trainer that
stores ``(epoch, position)`` resumes exactly:

* ``round_robin`` (default): rounds that visit every direction once, in order; an epoch has as many rounds
  as the direction with the most batches, shorter directions starting their batch list over;
* ``uniform``: each step draws a direction uniformly at random;
* ``weighted``: each step draws a direction with probability ∝ its number of sentence pairs.
The random schedules give an epoch the total number of batches of all directions.

For data parallelism (``num_shards`` > 1) the epoch's entry list is cut to a multiple of ``num_shards`` and
shard ``shard_id`` takes every ``num_shards``-th entry, as :class:`~nmtflow.data.batching.TokenBatchSampler`
does with batches: N ranks with one entry each per update see what one process accumulating N entries sees.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from nmtflow.config import ConfigError, MultilingualConfig
from nmtflow.data.batching import Batch, TokenBatchSampler
from nmtflow.data.bitext import Bitext, open_bitext

Entry = tuple[int, np.ndarray]  # (direction index, dataset rows)
SCHEDULES = ("round_robin", "uniform", "weighted")


@dataclass(frozen=True, order=True)
class Direction:
    """A translation direction ``src → tgt`` (``src == tgt``: a monolingual copy direction)."""

    src: str
    tgt: str

    @classmethod
    def parse(cls, text: str) -> "Direction":
        """``"en-de"`` or ``"en>de"`` (the latter for codes that contain '-')."""
        parts = text.split(">") if ">" in text else text.split("-")
        if len(parts) != 2 or not all(p.strip() for p in parts):
            raise ConfigError(f"direction {text!r}: expected SRC-TGT (or SRC>TGT), e.g. en-de")
        return cls(parts[0].strip(), parts[1].strip())

    @property
    def is_copy(self) -> bool:
        return self.src == self.tgt

    def __str__(self) -> str:
        return f"{self.src}>{self.tgt}" if "-" in self.src + self.tgt else f"{self.src}-{self.tgt}"


def parse_directions(option: str, texts: Sequence[str]) -> list[Direction]:
    """``data.multilingual.OPTION``'s directions; a malformed one is a ConfigError naming the option."""
    try:
        return [Direction.parse(text) for text in texts]
    except ConfigError as exc:
        raise ConfigError(f"data.multilingual.{option}: {exc}") from None


def plan_directions(prepared: Sequence[str], cfg: MultilingualConfig) -> tuple[list[Direction], list[Direction]]:
    """(training directions, zero-shot directions) from the prepared languages and the multilingual config.

    With ``new_langs`` (adding languages to a trained model) only directions that involve a new language
    are trained: everything else is frozen.
    """
    for option, given in (("langs", cfg.langs), ("new_langs", cfg.new_langs)):
        repeated = sorted({lang for lang in given if list(given).count(lang) > 1})
        if repeated:
            raise ConfigError(f"data.multilingual.{option}: {repeated[0]!r} is listed more than once "
                              "(copy directions A-A: copy_pairs: true)")
    langs = list(cfg.langs) or list(prepared)
    for lang in [*langs, *cfg.new_langs]:
        if lang not in prepared:
            raise ConfigError(f"data.multilingual: language {lang!r} is not prepared (have {', '.join(prepared)})")
    for lang in cfg.new_langs:
        if lang not in langs:
            langs.append(lang)
    zero_shot = parse_directions("zero_shot", cfg.zero_shot)
    if cfg.pairs:
        train = parse_directions("pairs", cfg.pairs)
        both = [d for d in train if d in zero_shot]
        if both:  # held out without a word, before
            raise ConfigError(f"data.multilingual: {both[0]} is in both pairs (trained) and zero_shot (held out)")
    else:
        train = [Direction(s, t) for s, t in itertools.permutations(langs, 2)]
    if cfg.copy_pairs:
        train += [Direction(lang, lang) for lang in langs]
    for d in [*train, *zero_shot]:
        for lang in (d.src, d.tgt):
            if lang not in prepared:
                raise ConfigError(f"data.multilingual: direction {d}: language {lang!r} is not prepared")
    train = [d for d in dict.fromkeys(train) if d not in zero_shot]
    if cfg.new_langs:
        train = [d for d in train if d.src in cfg.new_langs or d.tgt in cfg.new_langs]
    if not train:
        hint = (f" (one language: copy_pairs: true trains {langs[0]}-{langs[0]})"
                if len(langs) == 1 and not cfg.copy_pairs else "")
        raise ConfigError(f"data.multilingual: no training direction left{hint}")
    return train, list(dict.fromkeys(zero_shot))


@dataclass
class PairBatch(Batch):
    """A :class:`Batch` that knows its direction: the multilingual training contract."""

    src_lang: str = ""
    tgt_lang: str = ""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PairBatch":
        moved = Batch.to(self, device, non_blocking)
        return PairBatch(moved.src, moved.tgt_in, moved.tgt_out, moved.indices, self.src_lang, self.tgt_lang)

    def pin_memory(self) -> "PairBatch":
        pinned = Batch.pin_memory(self)
        return PairBatch(pinned.src, pinned.tgt_in, pinned.tgt_out, pinned.indices, self.src_lang, self.tgt_lang)


class MultiBitext:
    """The directions of one split: ``batch((direction index, rows)) → PairBatch``."""

    def __init__(self, directions: list[Direction], bitexts: list[Bitext], limits: list[int]) -> None:
        self.directions, self.bitexts, self.limits = directions, bitexts, limits

    def __len__(self) -> int:
        """Sentence pairs over all directions."""
        return sum(self.limits)

    def sizes(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Source and target lengths of direction ``i``'s (possibly limited) rows."""
        n = self.limits[i]
        return self.bitexts[i].src.sizes[:n], self.bitexts[i].tgt.sizes[:n]

    def batch(self, entry: Entry) -> PairBatch:
        i, rows = entry
        b = self.bitexts[i].batch(rows)
        d = self.directions[i]
        return PairBatch(b.src, b.tgt_in, b.tgt_out, b.indices, d.src, d.tgt)


def open_directions(data_dir: str | Path, split: str, directions: list[Direction],
                    src_prefixes: dict[Direction, int] | None = None,
                    max_sentences: dict[str, int] | None = None) -> MultiBitext:
    """Bitexts of ``directions`` in ``split``; ``src_prefixes`` (e.g. ``<2xx>`` tag ids) start each source,
    ``max_sentences`` (keyed ``SRC-TGT``) limits a direction to its first N rows."""
    limits_by_name = dict(zip(parse_directions("max_sentences", list(max_sentences or {})),
                              map(int, (max_sentences or {}).values())))
    unknown = [str(d) for d in limits_by_name if d not in directions]
    if unknown:
        raise ConfigError(f"data.multilingual.max_sentences: {', '.join(unknown)} is not a training direction")
    bitexts, limits = [], []
    for d in directions:
        bitext = open_bitext(data_dir, split, d.src, d.tgt)
        bitext.src_prefix = (src_prefixes or {}).get(d)
        bitexts.append(bitext)
        limits.append(min(len(bitext), limits_by_name.get(d, len(bitext))))
    return MultiBitext(directions, bitexts, limits)


class LanguageRotatingSampler:
    """Cycles through per-direction :class:`TokenBatchSampler` s; see the module docstring for schedules."""

    def __init__(self, samplers: list[TokenBatchSampler], schedule: str = "round_robin", seed: int = 1,
                 sizes: Sequence[int] | None = None, *, num_shards: int = 1, shard_id: int = 0) -> None:
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise ValueError(f"invalid shard {shard_id} of {num_shards}")
        self.num_shards, self.shard_id = int(num_shards), int(shard_id)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
        if not samplers:
            raise ValueError("the language-rotating sampler needs at least one direction")
        self.samplers, self.schedule, self.seed = samplers, schedule, int(seed)
        weights = np.asarray(sizes if sizes is not None else [len(s) for s in samplers], dtype=np.float64)
        self.probs = (np.full(len(samplers), 1.0 / len(samplers)) if schedule == "uniform"
                      else weights / weights.sum())
        self._cache: tuple[int, list[Entry]] | None = None

    def __len__(self) -> int:
        return sum(len(s) for s in self.samplers)

    def batches(self, epoch: int) -> list[Entry]:
        """This shard's ``(direction, rows)`` entries of ``epoch``; deterministic for ``(seed, epoch)``."""
        if self._cache is not None and self._cache[0] == epoch:
            return list(self._cache[1])
        per = [s.batches(epoch) for s in self.samplers]
        empty = [i for i, b in enumerate(per) if not b]
        if empty:
            raise ValueError(f"direction {empty[0]} has no training batches")
        if self.schedule == "round_robin":
            rounds = max(len(b) for b in per)
            picks = np.tile(np.arange(len(per)), rounds)
        else:
            rng = np.random.default_rng([self.seed, epoch])
            picks = rng.choice(len(per), size=sum(len(b) for b in per), p=self.probs)
        used = [0] * len(per)
        out: list[Entry] = []
        for i in picks.tolist():
            out.append((i, per[i][used[i] % len(per[i])]))
            used[i] += 1
        if self.num_shards > 1:
            out = out[: len(out) // self.num_shards * self.num_shards][self.shard_id::self.num_shards]
        self._cache = (epoch, out)
        return list(out)

