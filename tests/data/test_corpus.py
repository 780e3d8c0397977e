import pickle

import numpy as np
import pytest

from nmtflow.data.corpus import (
    CleanConfig,
    CorpusError,
    count_lines,
    iter_parallel,
    keep_mask,
    keep_row,
)


def write(path, data: bytes | str):
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_iter_parallel_normalises_and_numbers_lines(tmp_path):
    en = write(tmp_path / "c.en", "Hello   world\r\n\t a  b \nlast line")
    de = write(tmp_path / "c.de", "Hallo Welt\n a\u00a0b\nletzte  Zeile\n")
    rows = list(iter_parallel([en, de]))
    assert rows == [
        (1, ("Hello world", "Hallo Welt")),
        (2, ("a b", "a b")),
        (3, ("last line", "letzte Zeile")),
    ]


def test_byte_order_mark_is_dropped(tmp_path):
    a = write(tmp_path / "a", "\ufeffx\n")
    assert list(iter_parallel([a])) == [(1, ("x",))]


@pytest.mark.parametrize("short_first", [True, False])
def test_mismatched_line_counts_name_file_and_counts(tmp_path, short_first):
    short = write(tmp_path / "s.de", "a\nb\n")
    long = write(tmp_path / "l.en", "a\nb\nc\nd\ne\n")
    paths = [short, long] if short_first else [long, short]
    with pytest.raises(CorpusError) as err:
        list(iter_parallel(paths))
    msg = str(err.value)
    assert msg.startswith(f"{short}: ")
    assert "has 2 lines" in msg and f"{long} has 5 lines" in msg
    assert err.value.file == str(short)


def test_a_file_with_carriage_return_line_ends_is_named_as_such(tmp_path):
    """A classic-Mac file is an error, not one line (two such files made one row of every sentence); a file partly
    so reads as fewer lines, and the mismatch error says why."""
    mac = write(tmp_path / "mac.en", "a b\rc d\re f\r")
    unix = write(tmp_path / "unix.de", "a b\r\nc d\r\ne f\r\n")
    for paths in ([mac, unix], [unix, mac], [mac, mac]):
        with pytest.raises(CorpusError, match=r"mac.en: lines ended by CR alone \(classic Mac; 3 carriage returns"):
            list(iter_parallel(paths))
    mixed = write(tmp_path / "mixed.en", "a b\rc d\ne f\r")
    with pytest.raises(CorpusError, match=r"mixed.en: has 2 lines but .*unix.de has 3 lines .*; it has 2 carriage "
                                          r"returns not followed by a line feed: lines ended by CR alone"):
        list(iter_parallel([mixed, unix]))
    from nmtflow.data.corpus import _bare_carriage_returns

    assert [_bare_carriage_returns(unix, block_size=n) for n in (1, 2, 3, 64)] == [0, 0, 0, 0]
    assert [_bare_carriage_returns(mac, block_size=n) for n in (1, 2, 3, 64)] == [3, 3, 3, 3]


def test_missing_file(tmp_path):
    a = write(tmp_path / "a", "x\n")
    with pytest.raises(CorpusError, match="nope.de: file not found"):
        list(iter_parallel([a, tmp_path / "nope.de"]))


def test_invalid_utf8_names_file_line_and_offset(tmp_path):
    good = write(tmp_path / "g.en", "one\ntwo\nthree\n")
    bad = write(tmp_path / "b.de", b"eins\nzwei\ndrei \xff\xfe\n")
    it = iter_parallel([good, bad])
    # streaming: the good rows come out before the error
    assert next(it) == (1, ("one", "eins"))
    assert next(it) == (2, ("two", "zwei"))
    with pytest.raises(CorpusError) as err:
        next(it)
    assert str(err.value).startswith(f"{bad}:3: invalid UTF-8 at byte offset 5")
    assert err.value.line == 3


def test_empty_side_outside_training_is_an_error(tmp_path):
    en = write(tmp_path / "v.en", "a\nb\nc\n")
    de = write(tmp_path / "v.de", "a\n   \nc\n")
    assert [r for _, r in iter_parallel([en, de])][1] == ("b", "")  # allowed by default (training)
    with pytest.raises(CorpusError) as err:
        list(iter_parallel([en, de], allow_empty=False))
    assert str(err.value).startswith(f"{de}:2: empty line")


def test_count_lines(tmp_path):
    assert count_lines(write(tmp_path / "a", "")) == 0
    assert count_lines(write(tmp_path / "b", "x\ny\n")) == 2
    assert count_lines(write(tmp_path / "c", "x\ny")) == 2
    assert count_lines(write(tmp_path / "d", "\n\n\n")) == 3


def test_corpus_error_format_and_pickle():
    e = CorpusError("f.txt", "bad thing", 7)
    assert str(e) == "f.txt:7: bad thing"
    assert isinstance(e, ValueError)
    assert str(CorpusError("f.txt", "gone")) == "f.txt: gone"
    e2 = pickle.loads(pickle.dumps(e))
    assert (str(e2), e2.file, e2.line, e2.problem) == (str(e), "f.txt", 7, "bad thing")


def test_keep_row_filters():
    cfg = CleanConfig(max_len=10, max_ratio=2.0, min_len=2)
    assert keep_row([2, 4], cfg)
    assert keep_row([10, 5], cfg)
    assert not keep_row([1, 2], cfg)  # below min_len
    assert not keep_row([11, 10], cfg)  # above max_len
    assert not keep_row([3, 7], cfg)  # ratio 2.33
    assert not keep_row([0, 3], CleanConfig())  # empty side
    assert keep_row([5, 5, 9], cfg) and not keep_row([4, 5, 9], cfg)


def test_keep_mask_matches_keep_row():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, size=(2000, 3))
    cfg = CleanConfig(max_len=30, max_ratio=2.5, min_len=2)
    expected = [keep_row(row.tolist(), cfg) for row in lengths]
    assert keep_mask(lengths, cfg).tolist() == expected
    assert 0 < sum(expected) < len(expected)


@pytest.mark.parametrize("kwargs", [dict(min_len=0), dict(max_len=0), dict(max_ratio=0.5)])
def test_clean_config_validation(kwargs):
    with pytest.raises(ValueError):
        CleanConfig(**kwargs)


@pytest.mark.parametrize("block_size", [1, 2, 5, 1 << 20])
def test_block_boundaries(tmp_path, block_size):
    from nmtflow.data.corpus import _iter_lines

    text = "α  b\r\n\ncc c\nddd\n  e\nlast"
    path = write(tmp_path / "x", text)
    assert list(_iter_lines(path, block_size)) == ["α b", "", "cc c", "ddd", "e", "last"]
    bad = write(tmp_path / "bad", b"ok\nfine\nstill ok\nab\xffz\n")
    it = _iter_lines(bad, block_size)
    assert [next(it) for _ in range(3)] == ["ok", "fine", "still ok"]
    with pytest.raises(CorpusError, match=r"bad:4: invalid UTF-8 at byte offset 2 "):
        next(it)
