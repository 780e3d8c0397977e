import numpy as np
import pytest
import torch

from nmtflow.data.batching import Batch, ParallelBatches, TokenBatchSampler, collate
from nmtflow.data.binarize import IndexedDataset, write_indexed
from nmtflow.data.vocab import BOS, EOS, PAD


def random_sizes(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 60, n)
    tgt = np.clip((src * rng.uniform(0.5, 1.5, n)).astype(np.int64), 0, None)
    return src, tgt


def widths(src, tgt, idx, prefix=0):
    return np.maximum(src[idx] + 1 + prefix, tgt[idx] + 1)


def test_collate_layout():
    b = collate([[5, 6, 7], [8]], [[9], [10, 11, 12, 13]], [4, 2])
    assert b.src.tolist() == [[5, 6, 7, EOS], [8, EOS, PAD, PAD]]
    assert b.tgt_in.tolist() == [[BOS, 9, PAD, PAD, PAD], [BOS, 10, 11, 12, 13]]
    assert b.tgt_out.tolist() == [[9, EOS, PAD, PAD, PAD], [10, 11, 12, 13, EOS]]
    assert b.indices.tolist() == [4, 2]
    for t in (b.src, b.tgt_in, b.tgt_out, b.indices):
        assert t.dtype == torch.long
    assert b.size == 2
    assert b.num_src_tokens == 4 + 2
    assert b.num_tgt_tokens == 2 + 5
    # teacher forcing: tgt_in shifted left is tgt_out with its EOS turned into PAD
    shifted = b.tgt_out[:, :-1].masked_fill(b.tgt_out[:, :-1] == EOS, PAD)
    assert torch.equal(b.tgt_in[:, 1:], shifted)


def test_collate_prefix_numpy_inputs_and_empty_sequences():
    src = [np.array([7, 8], dtype=np.uint16), np.array([], dtype=np.uint16)]
    tgt = [np.array([], dtype=np.uint16), np.array([9], dtype=np.uint16)]
    b = collate(src, tgt, src_prefix=42)
    assert b.src.tolist() == [[42, 7, 8, EOS], [42, EOS, PAD, PAD]]
    assert b.tgt_in.tolist() == [[BOS, PAD], [BOS, 9]]
    assert b.tgt_out.tolist() == [[EOS, PAD], [9, EOS]]
    assert b.indices.tolist() == [0, 1]
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.src, b.src)
    with pytest.raises(ValueError):
        collate([[1]], [[1], [2]])


@pytest.mark.parametrize("max_tokens", [64, 300, 4096])
def test_batches_respect_budget_and_cover_each_index_once(max_tokens):
    src, tgt = random_sizes()
    sampler = TokenBatchSampler(src, tgt, max_tokens, seed=3)
    batches = sampler.batches(0)
    for b in batches:
        assert b.dtype == np.int64
        w = widths(src, tgt, b)
        assert len(b) * w.max() <= max_tokens or (len(b) == 1 and w[0] > max_tokens)
    everything = np.concatenate(batches)
    assert len(everything) == len(src)
    assert np.array_equal(np.sort(everything), np.arange(len(src)))


def test_batches_are_reasonably_full_and_bucketed():
    src, tgt = random_sizes()
    batches = TokenBatchSampler(src, tgt, 1000, shuffle=False).batches(0)
    padded = sum(len(b) * widths(src, tgt, b).max() for b in batches)
    assert padded <= 1000 * len(batches)
    assert padded / (1000 * len(batches)) > 0.8  # greedy packing
    order = np.concatenate(batches)
    assert np.all(np.diff(tgt[order]) >= 0)  # sorted by target length without shuffling


def test_deterministic_per_seed_and_epoch():
    src, tgt = random_sizes()
    a = TokenBatchSampler(src, tgt, 500, seed=7)
    b = TokenBatchSampler(src, tgt, 500, seed=7)

    def same(x, y):
        return len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))

    assert same(a.batches(0), b.batches(0))
    assert same(a.batches(3), b.batches(3))
    assert same(a.batches(1), a.batches(1))  # cached result is not corrupted by callers
    assert not same(a.batches(0), a.batches(1))
    assert not same(a.batches(0), TokenBatchSampler(src, tgt, 500, seed=8).batches(0))
    c = TokenBatchSampler(src, tgt, 500, shuffle=False)
    assert same(c.batches(0), c.batches(5))


def test_overlong_sentence_is_its_own_batch():
    src = np.array([3, 100, 2, 4])
    tgt = np.array([3, 5, 2, 4])
    batches = TokenBatchSampler(src, tgt, 20, shuffle=False).batches(0)
    assert any(b.tolist() == [1] for b in batches)
    assert sorted(np.concatenate(batches).tolist()) == [0, 1, 2, 3]


def test_max_sentences_and_src_prefix():
    src, tgt = random_sizes()
    for b in TokenBatchSampler(src, tgt, 4096, max_sentences=16, src_prefix_len=1).batches(0):
        assert len(b) <= 16
        assert len(b) * widths(src, tgt, b, prefix=1).max() <= 4096 or len(b) == 1


@pytest.mark.parametrize("num_shards", [2, 3])
def test_shards_are_disjoint_and_equal_length(num_shards):
    src, tgt = random_sizes()
    full = TokenBatchSampler(src, tgt, 300, seed=5).batches(2)
    shards = [TokenBatchSampler(src, tgt, 300, seed=5, num_shards=num_shards, shard_id=k).batches(2)
              for k in range(num_shards)]
    per = len(full) // num_shards
    assert all(len(s) == per for s in shards)
    seen = np.concatenate([np.concatenate(s) for s in shards])
    assert len(np.unique(seen)) == len(seen)
    # shard k gets batches k, k + num_shards, ... of the common order
    for k, s in enumerate(shards):
        assert all(np.array_equal(x, full[k + i * num_shards]) for i, x in enumerate(s))
    with pytest.raises(ValueError):
        TokenBatchSampler(src, tgt, 300, num_shards=2, shard_id=2)


def test_parallel_batches_resume(tmp_path):
    rng = np.random.default_rng(1)
    src = [rng.integers(4, 100, rng.integers(1, 15)).tolist() for _ in range(200)]
    tgt = [rng.integers(4, 100, rng.integers(1, 15)).tolist() for _ in range(200)]
    write_indexed(tmp_path / "s", src, max_id=100)
    write_indexed(tmp_path / "t", tgt, max_id=100)
    sds, tds = IndexedDataset(tmp_path / "s"), IndexedDataset(tmp_path / "t")
    sampler = TokenBatchSampler.from_datasets(sds, tds, 64, seed=2)

    full = ParallelBatches(sds, tds, sampler, epoch=1)
    assert len(full) == full.total == len(sampler.batches(1))
    batches = []
    for b in full:
        batches.append(b)
        assert full.position == len(batches)
    assert len(batches) == full.total > 5
    # contents are the collated rows
    b0 = batches[0]
    i = int(b0.indices[0])
    assert b0.src[0, : len(src[i]) + 1].tolist() == src[i] + [EOS]
    assert b0.tgt_out[0, : len(tgt[i]) + 1].tolist() == tgt[i] + [EOS]

    k = 4
    resumed = ParallelBatches(sds, tds, TokenBatchSampler.from_datasets(sds, tds, 64, seed=2), 1, start=k)
    assert len(resumed) == full.total - k
    rest = list(resumed)
    assert len(rest) == len(batches) - k
    for a, b in zip(rest, batches[k:]):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.src, b.src)
        assert torch.equal(a.tgt_in, b.tgt_in) and torch.equal(a.tgt_out, b.tgt_out)
    with pytest.raises(ValueError):
        ParallelBatches(sds, tds, sampler, 1, start=full.total + 1)
