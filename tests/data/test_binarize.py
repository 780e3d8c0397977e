import pickle

import numpy as np
import pytest

from nmtflow.data.binarize import IndexedDataset, write_indexed


def random_seqs(n=50, seed=0, high=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=rng.integers(0, 20)).tolist() for _ in range(n)]


def assert_same(ds, seqs):
    assert len(ds) == len(seqs)
    assert ds.sizes.dtype == np.int64
    assert ds.sizes.tolist() == [len(s) for s in seqs]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s


@pytest.mark.parametrize("chunk_size", [1, 7, 8192])
def test_round_trip(tmp_path, chunk_size):
    seqs = random_seqs() + [[], [5], []]
    n = write_indexed(tmp_path / "d", iter(seqs), chunk_size=chunk_size)  # any iterable, streamed
    assert n == len(seqs)
    ds = IndexedDataset(tmp_path / "d")
    assert_same(ds, seqs)
    assert ds[-1].tolist() == [] and ds[-2].tolist() == [5]
    assert ds.num_tokens == sum(map(len, seqs))
    with pytest.raises(IndexError):
        ds[len(seqs)]


def test_items_are_read_only_views(tmp_path):
    write_indexed(tmp_path / "d", [[1, 2, 3], [4, 5]], max_id=10)
    ds = IndexedDataset(tmp_path / "d")
    item = ds[1]
    assert isinstance(item, np.ndarray) and item.base is not None
    assert not item.flags.writeable


def test_dtype_selection(tmp_path):
    write_indexed(tmp_path / "small", [[1, 65535]], max_id=65535)
    assert IndexedDataset(tmp_path / "small").dtype == np.uint16
    write_indexed(tmp_path / "big", [[1, 70000]], max_id=70000)
    assert IndexedDataset(tmp_path / "big").dtype == np.int32
    write_indexed(tmp_path / "dflt", [[1, 2]])
    assert IndexedDataset(tmp_path / "dflt").dtype == np.int32
    write_indexed(tmp_path / "expl", [np.array([1, 2])], dtype=np.int64)
    ds = IndexedDataset(tmp_path / "expl")
    assert ds.dtype == np.int64 and ds[0].tolist() == [1, 2]
    assert (tmp_path / "small.bin").stat().st_size == 4  # 2 ids * 2 bytes


def test_ids_that_do_not_fit_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        write_indexed(tmp_path / "d", [[1, 2], [70000]], dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        write_indexed(tmp_path / "d", [[-1]], dtype=np.uint16)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_failing_stream_leaves_no_files(tmp_path):
    def gen():
        yield [1, 2]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_indexed(tmp_path / "d", gen())
    assert list(tmp_path.iterdir()) == []


def test_empty_dataset(tmp_path):
    write_indexed(tmp_path / "e", [])
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.sizes.tolist() == []


def test_truncated_idx_names_the_file(tmp_path):
    write_indexed(tmp_path / "d", random_seqs())
    idx = tmp_path / "d.idx"
    idx.write_bytes(idx.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"d\.idx.*truncated"):
        IndexedDataset(tmp_path / "d")
    idx.write_bytes(idx.read_bytes()[:10])
    with pytest.raises(ValueError, match=r"d\.idx"):
        IndexedDataset(tmp_path / "d")


def test_truncated_bin_names_the_file(tmp_path):
    write_indexed(tmp_path / "d", random_seqs())
    b = tmp_path / "d.bin"
    b.write_bytes(b.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"d\.bin.*truncated"):
        IndexedDataset(tmp_path / "d")


def test_bad_magic_and_missing_files(tmp_path):
    write_indexed(tmp_path / "d", [[1]])
    idx = tmp_path / "d.idx"
    data = bytearray(idx.read_bytes())
    data[:8] = b"XXXXXXXX"
    idx.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"d\.idx.*magic"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(ValueError, match=r"nothing\.idx"):
        IndexedDataset(tmp_path / "nothing")


def test_pickle_remaps(tmp_path):
    seqs = random_seqs(10)
    write_indexed(tmp_path / "d", seqs)
    ds = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "d")))
    assert_same(ds, seqs)
