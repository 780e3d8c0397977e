"""Token-budget batching of parallel data and collation into padded tensors.

Resumable training: :meth:`TokenBatchSampler.batches` is a pure function of
``(seed, epoch)`` (and the sizes), so a trainer that stores ``(epoch, position)`` can rebuild
the exact same batch list and continue with ``ParallelBatches(..., epoch, start=position)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from .binarize import IndexedDataset
from .vocab import BOS, EOS, PAD


@dataclass
class Batch:
    """A padded batch. ``src (B,S)`` = [tag] ids EOS; ``tgt_in (B,T)`` = BOS ids;
    ``tgt_out (B,T)`` = ids EOS; PAD on the right; ``indices (B,)`` = dataset row of each sentence."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    indices: torch.Tensor

    @property
    def size(self) -> int:
        """Number of sentences."""
        return int(self.src.shape[0])

    @property
    def num_tgt_tokens(self) -> int:
        """Non-pad target tokens (the tokens a loss is computed on)."""
        return int((self.tgt_out != PAD).sum())

    @property
    def num_src_tokens(self) -> int:
        """Non-pad source tokens."""
        return int((self.src != PAD).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor on ``device``."""
        return Batch(
            src=self.src.to(device, non_blocking=non_blocking),
            tgt_in=self.tgt_in.to(device, non_blocking=non_blocking),
            tgt_out=self.tgt_out.to(device, non_blocking=non_blocking),
            indices=self.indices.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        """A copy in pinned host memory (for asynchronous transfers)."""
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(),
                     self.tgt_out.pin_memory(), self.indices.pin_memory())


def _flatten(seqs: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lengths (int64) and the concatenation of ``seqs``."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    total = int(lens.sum())
    if total == 0:
        flat = np.zeros(0, dtype=np.int64)
    elif isinstance(seqs[0], (np.ndarray, torch.Tensor)):
        flat = np.concatenate([np.asarray(s).reshape(-1) for s in seqs])
    else:
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
    return lens, flat


def _pad_rows(flat: np.ndarray, lens: np.ndarray, width: int, start: int) -> np.ndarray:
    """``(B, width)`` PAD-filled array with row ``b`` holding its ids at columns ``start..``."""
    out = np.full((len(lens), width), PAD, dtype=np.int64)
    cols = np.arange(width)
    mask = (cols >= start) & (cols < start + lens[:, None])
    out[mask] = flat  # boolean assignment fills row-major, i.e. sequence by sequence
    return out


def collate(
    src_seqs: Sequence[Sequence[int] | np.ndarray],
    tgt_seqs: Sequence[Sequence[int] | np.ndarray],
    indices: Sequence[int] | np.ndarray | None = None,
    *,
    src_prefix: int | None = None,
) -> Batch:
    """Build a :class:`Batch` from raw id sequences (no BOS/EOS in the inputs).

    ``src_prefix`` (e.g. a target-language tag id) is put before every source sentence.
    ``indices`` defaults to ``0..B-1``.
    """
    b = len(src_seqs)
    if b == 0:
        raise ValueError("collate needs at least one sentence")
    if len(tgt_seqs) != b:
        raise ValueError(f"collate: {b} source but {len(tgt_seqs)} target sequences")
    idx = np.arange(b, dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(idx) != b:
        raise ValueError(f"collate: {b} sentences but {len(idx)} indices")
    return _collate(*_flatten(src_seqs), *_flatten(tgt_seqs), idx, src_prefix)


def _collate(s_lens: np.ndarray, s_flat: np.ndarray, t_lens: np.ndarray, t_flat: np.ndarray, idx: np.ndarray,
             src_prefix: int | None) -> Batch:
    """:func:`collate` from lengths and concatenated ids of each side (``len(idx)`` >= 1 rows)."""
    rows = np.arange(len(idx))
    p = 0 if src_prefix is None else 1
    src = _pad_rows(s_flat, s_lens, int(s_lens.max()) + 1 + p, p)
    src[rows, p + s_lens] = EOS
    if p:
        src[:, 0] = src_prefix

    width = int(t_lens.max()) + 1
    tgt_out = _pad_rows(t_flat, t_lens, width, 0)
    tgt_out[rows, t_lens] = EOS
    tgt_in = _pad_rows(t_flat, t_lens, width, 1)
    tgt_in[:, 0] = BOS

    return Batch(
        src=torch.from_numpy(src),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        indices=torch.from_numpy(idx.copy()),
    )


def gather_rows(ds: IndexedDataset, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lengths (int64) and the concatenated ids of rows ``indices`` of ``ds``: :meth:`IndexedDataset.gather`
    (one vectorised gather, no Python code per sentence), or row by row for another kind of dataset."""
    gather = getattr(ds, "gather", None)
    if gather is not None:
        return gather(indices)
    return _flatten([ds[i] for i in np.asarray(indices, dtype=np.int64).reshape(-1)])


def collate_rows(src_ds: IndexedDataset, tgt_ds: IndexedDataset, indices: Sequence[int] | np.ndarray, *,
                 src_prefix: int | None = None) -> Batch:
    """:func:`collate` of rows ``indices`` of two aligned datasets, gathered with :func:`gather_rows`."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        raise ValueError("collate needs at least one sentence")
    return _collate(*gather_rows(src_ds, idx), *gather_rows(tgt_ds, idx), idx, src_prefix)


class TokenBatchSampler:
    """Length-bucketed batches under a padding-aware token budget.

    Sentences are sorted by (target length, source length) (ties broken at random per epoch when
    ``shuffle``), then cut greedily into batches with ``B * max(src_len + 1 + src_prefix_len,
    tgt_len + 1) <= max_tokens`` and at most ``max_sentences`` rows; a sentence over the budget
    on its own forms a batch of one. With ``shuffle`` the batch order is permuted with
    ``np.random.default_rng([seed, epoch])`` (not ``seed + epoch``, which would give seed ``s`` at
    epoch ``e + 1`` the batches of seed ``s + 1`` at epoch ``e``). For data parallelism, shard ``shard_id`` of
    ``num_shards`` takes every ``num_shards``-th batch after dropping the tail so all shards get
    the same number of batches.
    """

    def __init__(
        self,
        src_sizes: Sequence[int] | np.ndarray,
        tgt_sizes: Sequence[int] | np.ndarray,
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 1,
        *,
        max_sentences: int | None = None,
        num_shards: int = 1,
        shard_id: int = 0,
        src_prefix_len: int = 0,
    ) -> None:
        self.src_sizes = np.asarray(src_sizes, dtype=np.int64).reshape(-1)
        self.tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64).reshape(-1)
        if len(self.src_sizes) != len(self.tgt_sizes):
            raise ValueError(f"{len(self.src_sizes)} source sizes but {len(self.tgt_sizes)} target sizes")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_sentences is not None and max_sentences < 1:
            raise ValueError(f"max_sentences must be >= 1 or None, got {max_sentences}")
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise ValueError(f"invalid shard {shard_id} of {num_shards}")
        if len(self.src_sizes) and min(self.src_sizes.min(), self.tgt_sizes.min()) < 0:
            raise ValueError("sizes must be non-negative")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.max_tokens = int(max_tokens)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.max_sentences = max_sentences
        self.num_shards = int(num_shards)
        self.shard_id = int(shard_id)
        # padded width each sentence needs: ids + EOS (+ tag) on the source, BOS/EOS + ids on the target
        self.widths = np.maximum(self.src_sizes + 1 + int(src_prefix_len), self.tgt_sizes + 1)
        self._cache: tuple[int, list[np.ndarray]] | None = None
        self._key: np.ndarray | None = None

    @classmethod
    def from_datasets(cls, src_ds: IndexedDataset, tgt_ds: IndexedDataset, max_tokens: int,
                      shuffle: bool = True, seed: int = 1, **kwargs) -> "TokenBatchSampler":
        """Sampler over the sizes of two aligned datasets."""
        return cls(src_ds.sizes, tgt_ds.sizes, max_tokens, shuffle, seed, **kwargs)

    def __len__(self) -> int:
        """Number of sentences."""
        return len(self.src_sizes)

    def _sort_key(self) -> np.ndarray:
        """Combined (tgt, src) key; uint16 when it fits, so that stable argsort is a radix sort."""
        s_max = int(self.src_sizes.max())
        key = self.tgt_sizes * (s_max + 1) + self.src_sizes
        return key.astype(np.uint16) if int(key.max()) < 1 << 16 else key

    def _order(self, rng: np.random.Generator | None) -> np.ndarray:
        """Indices sorted by (tgt, src), ties in random (``rng``) or index order."""
        if self._key is None:
            self._key = self._sort_key()
        if rng is None:
            return np.argsort(self._key, kind="stable")
        perm = rng.permutation(len(self._key))
        return perm[np.argsort(self._key[perm], kind="stable")]

    def _cut(self, widths: np.ndarray) -> np.ndarray:
        """Batch boundaries (start positions plus the end) over widths in batch order.

        One small vectorised step per batch: the running max width times the batch size is
        non-decreasing, so the admissible batch sizes form a prefix found by ``searchsorted``.
        """
        n = len(widths)
        max_tokens = self.max_tokens
        cap = min(self.max_sentences or n, n)
        steps = np.arange(1, min(cap, max_tokens) + 1, dtype=np.int64)
        buf = np.empty_like(steps)
        acc, mul = np.maximum.accumulate, np.multiply
        bounds = [0]
        start = 0
        while start < n:
            limit = min(max_tokens // int(widths[start]), cap, n - start)
            if limit <= 1:
                start += 1  # a sentence over the budget on its own is a batch of one
            else:
                need = buf[:limit]
                acc(widths[start:start + limit], out=need)
                mul(need, steps[:limit], out=need)
                start += int(need.searchsorted(max_tokens, side="right")) or 1
            bounds.append(start)
        return np.asarray(bounds, dtype=np.int64)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This shard's batches (arrays of int64 row indices) for ``epoch``; deterministic."""
        key = epoch if self.shuffle else -1
        if self._cache is not None and self._cache[0] == key:
            return list(self._cache[1])
        n = len(self)
        if self.shuffle and epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if n == 0:
            out: list[np.ndarray] = []
        else:
            rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
            order = self._order(rng)
            order.setflags(write=False)  # batches are views of it and are cached
            bounds = self._cut(self.widths[order])
            out = np.split(order, bounds[1:-1])
            if rng is not None:
                out = [out[i] for i in rng.permutation(len(out))]
            if self.num_shards > 1:
                per_shard = len(out) // self.num_shards
                out = out[: per_shard * self.num_shards][self.shard_id::self.num_shards]
        self._cache = (key, out)
        return list(out)

    def num_batches(self, epoch: int) -> int:
        """``len(self.batches(epoch))``."""
        return len(self.batches(epoch))


class ParallelBatches:
    """Iterable of :class:`Batch` for one epoch, starting at batch ``start`` of that epoch.

    After each yielded batch, :attr:`position` is the index of the next batch, so a trainer
    that checkpoints ``(epoch, position)`` resumes exactly with ``start=position``. With a
    ``src_prefix`` tag, build the sampler with ``src_prefix_len=1`` to keep the token budget exact.
    """

    def __init__(
        self,
        src_ds: IndexedDataset,
        tgt_ds: IndexedDataset,
        sampler: TokenBatchSampler,
        epoch: int,
        start: int = 0,
        *,
        src_prefix: int | None = None,
    ) -> None:
        if len(src_ds) != len(tgt_ds):
            raise ValueError(f"source has {len(src_ds)} rows but target has {len(tgt_ds)}")
        if len(sampler) != len(src_ds):
            raise ValueError(f"sampler covers {len(sampler)} rows but the datasets have {len(src_ds)}")
        self.src_ds, self.tgt_ds, self.sampler = src_ds, tgt_ds, sampler
        self.epoch = int(epoch)
        self.src_prefix = src_prefix
        self.batch_indices = sampler.batches(self.epoch)
        if not 0 <= start <= len(self.batch_indices):
            raise ValueError(f"start={start} outside 0..{len(self.batch_indices)} for epoch {epoch}")
        self.start = int(start)
        self.position = self.start

    @property
    def total(self) -> int:
        """Number of batches in the whole epoch (for this shard)."""
        return len(self.batch_indices)

    def __len__(self) -> int:
        """Number of batches this iterable yields (``total - start``)."""
        return len(self.batch_indices) - self.start

    def __iter__(self) -> Iterator[Batch]:
        src_ds, tgt_ds = self.src_ds, self.tgt_ds
        for pos in range(self.start, len(self.batch_indices)):
            idx = self.batch_indices[pos]
            batch = collate_rows(src_ds, tgt_ds, idx, src_prefix=self.src_prefix)
            self.position = pos + 1
            yield batch


__all__ = ["Batch", "collate", "collate_rows", "gather_rows", "TokenBatchSampler", "ParallelBatches"]
