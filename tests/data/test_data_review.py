"""Review of the data pipeline: batch order across seeds, synthetic held-out splits, TSV reading, quickstart options."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import torch

from nmtflow.cli import main
from nmtflow.data.batching import ParallelBatches, TokenBatchSampler, collate, gather_rows
from nmtflow.data.binarize import IndexedDataset, write_indexed
from nmtflow.data.bitext import Bitext
from nmtflow.data.corpus import CorpusError, iter_tsv, read_lines
from nmtflow.data.synthetic import generate_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


def _same(x: list[np.ndarray], y: list[np.ndarray]) -> bool:
    return len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))


# ------------------------------------------------------------------------------------------ batching
def test_seeds_do_not_share_batch_orders_one_epoch_apart() -> None:
    """Before: the batch order came from ``default_rng(seed + epoch)``, so seed 1 at epoch 2 trained on exactly
    the batches of seed 2 at epoch 1 (and seed 3 at epoch 0): runs over seeds 1, 2, 3 saw one data order, shifted."""
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 50, 2000), rng.integers(1, 50, 2000)
    a = TokenBatchSampler(src, tgt, 400, seed=1)
    b = TokenBatchSampler(src, tgt, 400, seed=2)
    assert not _same(a.batches(2), b.batches(1))
    assert not _same(a.batches(1), b.batches(0))
    assert _same(a.batches(2), TokenBatchSampler(src, tgt, 400, seed=1).batches(2))  # still a function of (seed, epoch)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        TokenBatchSampler(src, tgt, 400, seed=-1)


@pytest.fixture()
def datasets(tmp_path: Path) -> tuple[IndexedDataset, IndexedDataset, list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(4)
    src = [rng.integers(4, 300, rng.integers(0, 12)).tolist() for _ in range(120)]  # empty rows included
    tgt = [rng.integers(4, 300, rng.integers(1, 12)).tolist() for _ in range(120)]
    write_indexed(tmp_path / "s", src, max_id=300)
    write_indexed(tmp_path / "t", tgt, max_id=300)
    return IndexedDataset(tmp_path / "s"), IndexedDataset(tmp_path / "t"), src, tgt


def test_training_batches_are_gathered_without_a_python_loop_over_sentences(datasets, monkeypatch) -> None:
    """Before: ``Bitext.batch`` and ``ParallelBatches`` read every sentence with ``IndexedDataset[i]`` (Python code
    per sentence, ~1.2-1.8 ms per 4k-token batch, in the training loop); now one gather per side (~0.55 ms)."""
    sds, tds, src, tgt = datasets
    rows = np.array([5, 0, 119, 7, 7, 42, 3])
    expected = collate([src[i] for i in rows], [tgt[i] for i in rows], rows, src_prefix=9)

    def per_row(self: IndexedDataset, i: int) -> np.ndarray:
        raise AssertionError("a sentence was read on its own")

    monkeypatch.setattr(IndexedDataset, "__getitem__", per_row)
    got = Bitext(sds, tds, src_prefix=9).batch(rows)
    for name in ("src", "tgt_in", "tgt_out", "indices"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    sampler = TokenBatchSampler(sds.sizes, tds.sizes, 60, seed=3, src_prefix_len=1)
    seen = [b.indices for b in ParallelBatches(sds, tds, sampler, epoch=1, src_prefix=9)]
    assert sorted(torch.cat(seen).tolist()) == list(range(120))


def test_gather_rows_matches_the_rows_and_rejects_out_of_range(datasets) -> None:
    sds, _, src, _ = datasets
    lens, flat = gather_rows(sds, np.array([3, -1, 0]))
    assert lens.tolist() == [len(src[3]), len(src[119]), len(src[0])]
    assert flat.tolist() == src[3] + src[119] + src[0]
    assert [a.tolist() for a in gather_rows(sds, np.zeros(0, dtype=np.int64))] == [[], []]
    with pytest.raises(IndexError, match="index 120 out of range for 120 sequences"):
        gather_rows(sds, np.array([1, 120]))
    with pytest.raises(IndexError, match="index -121 out of range"):
        gather_rows(sds, np.array([-121]))


# ------------------------------------------------------------------------------------------ synthetic corpus
def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_synthetic_held_out_splits_do_not_depend_on_the_training_size(tmp_path: Path) -> None:
    """Before: the splits were cut from the sentence stream as train, valid, test, so a corpus with --train 60
    had other valid/test sentences than one with --train 30 (same seed), and every held-out sentence of the
    smaller corpus was a training sentence of the larger one."""
    small, large = tmp_path / "small", tmp_path / "large"
    generate_corpus(small, langs=("en", "de"), n_train=30, n_valid=8, n_test=8, seed=5)
    generate_corpus(large, langs=("en", "de"), n_train=60, n_valid=8, n_test=8, seed=5)
    for lang in ("en", "de"):
        for split in ("valid", "test"):
            assert _lines(small / f"{split}.{lang}") == _lines(large / f"{split}.{lang}")
            assert not set(_lines(small / f"{split}.{lang}")) & set(_lines(large / f"train.{lang}"))
        assert _lines(large / f"train.{lang}")[:30] == _lines(small / f"train.{lang}")  # nested training sets
    assert [len(_lines(small / f"{s}.en")) for s in ("train", "valid", "test")] == [30, 8, 8]


def test_a_corpus_written_over_another_removes_the_other_languages_files(tmp_path: Path) -> None:
    """Before: en/de over an en/de/fr corpus left its train.fr, of the same length but not aligned with the new
    train.en, ready to be prepared with it."""
    generate_corpus(tmp_path, n_train=20, n_valid=4, n_test=4, seed=1)
    (tmp_path / "notes.txt").write_text("mine\n", encoding="utf-8")
    generate_corpus(tmp_path, langs=("en", "de"), n_train=20, n_valid=4, n_test=4, seed=2)
    written = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in ("en", "de")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["notes.txt", "corpus.json", *written])


def test_a_corpus_is_not_written_over_files_it_did_not_write(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `nmtflow corpus mydata` replaced the user's own train.en/train.de with synthetic text and deleted their
    train.fr (an INFO line), leaving their train.cs paired with synthetic English."""
    mine = {f"{split}.{lang}": f"my own {split} {lang}\n" for split in ("train", "valid", "test")
            for lang in ("en", "de", "fr", "cs")}
    for name, text in mine.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert main(["corpus", str(tmp_path), "--langs", "en", "de", "--train", "5", "--valid", "1", "--test", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: holds train.en, train.de, train.fr, valid.en and 5 more, which nmtflow corpus did not " \
           "write" in err and "nothing was changed" in err
    assert {p.name: p.read_text(encoding="utf-8") for p in tmp_path.iterdir()} == mine
    assert main(["corpus", str(tmp_path / "new"), "--train", "5", "--valid", "1", "--test", "1"]) == 0
    assert main(["corpus", str(tmp_path / "new"), "--train", "6", "--valid", "1", "--test", "1"]) == 0  # its own
    assert len(_lines(tmp_path / "new" / "train.en")) == 6
    (tmp_path / "new" / "corpus.json").unlink()  # as versions before the marker left a corpus
    assert main(["corpus", str(tmp_path / "new"), "--train", "7", "--valid", "1", "--test", "1"]) == 2
    assert "--force if an earlier nmtflow corpus wrote them" in capsys.readouterr().err
    assert main(["corpus", str(tmp_path / "new"), "--train", "7", "--valid", "1", "--test", "1", "--force"]) == 0
    assert len(_lines(tmp_path / "new" / "train.en")) == 7 and (tmp_path / "new" / "corpus.json").is_file()


# ------------------------------------------------------------------------------------------ TSV reading
def test_iter_tsv_drops_a_byte_order_mark_and_names_a_missing_file(tmp_path: Path) -> None:
    """Before: a TSV saved with a byte-order mark (e.g. by a spreadsheet) kept U+FEFF in its first field, and a
    missing file was a bare FileNotFoundError."""
    path = tmp_path / "pairs.tsv"
    path.write_bytes("\ufeffsrc\tgood\tbad\r\n\nx\ty\tz\n".encode("utf-8"))
    assert list(iter_tsv(path)) == [(1, ["src", "good", "bad"]), (3, ["x", "y", "z"])]
    with pytest.raises(CorpusError, match=r"missing\.tsv: file not found"):
        list(iter_tsv(tmp_path / "missing.tsv"))


# ------------------------------------------------------------------------------------------ quickstart
@pytest.mark.parametrize("options, message", [
    (["--minutes", "0"], "--minutes: the training budget must be a positive number of minutes, got 0.0"),
    (["--minutes", "-1"], "--minutes: the training budget must be a positive number of minutes, got -1.0"),
    (["--minutes", "nan"], "--minutes: the training budget must be a positive number of minutes, got nan"),
    (["--threads", "0"], "--threads: must be >= 1"),
    (["--threads", "-2"], "--threads: must be >= 1"),
])
def test_quickstart_rejects_bad_options_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture, options: list[str],
                                                        message: str) -> None:
    """Before: the corpus was generated and prepared (~15 s) before ``train.max_minutes=0.0`` (an override the
    user never wrote) was rejected; ``--threads 0`` was silently ignored."""
    from nmtflow.cli import main
    from nmtflow.data import synthetic

    def no_corpus(*args: object, **kwargs: object) -> None:
        raise AssertionError("the corpus is generated before the options are checked")

    monkeypatch.setattr(synthetic, "generate_corpus", no_corpus)
    workdir = tmp_path / "qs"
    assert main(["quickstart", "--workdir", str(workdir), *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not workdir.exists()


def test_quickstart_workdir_name_is_not_read_as_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the paths went to the config as ``data.path=WORKDIR/data-en-de`` overrides, parsed as YAML, so
    ``--workdir 'runs/a #2'`` trained from and saved to ``runs/a`` (the rest was a comment)."""
    from nmtflow import quickstart
    from nmtflow.train import trainer

    workdir = tmp_path / "runs" / "a #2"
    (workdir / "corpus").mkdir(parents=True)
    (workdir / "corpus" / "test.de").write_text("x\n", encoding="utf-8")  # steps already done: skipped
    (workdir / "data-en-de").mkdir()
    (workdir / "data-en-de" / "meta.json").write_text("{}", encoding="utf-8")
    seen = {}

    class Stop(Exception):
        pass

    def fake_trainer(config: object) -> None:
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(trainer, "Trainer", fake_trainer)
    with pytest.raises(Stop):
        quickstart.run_quickstart(workdir, minutes=0.5, threads=1)
    config = seen["config"]
    assert config.data.path == str(workdir / "data-en-de")
    assert config.train.save_dir == str(workdir / "model")
    assert config.train.max_minutes == 0.5 and config.train.threads == 1


# ------------------------------------------------------------------------------------------ tokenizer
@pytest.mark.parametrize("symbol", ["<s>", "</s>", "<pad>", "<unk>"])
def test_a_special_piece_as_user_symbol_is_refused_before_training(tmp_path: Path, symbol: str) -> None:
    """Before: SentencePiece trained a model whose special ids moved (e.g. ``<s>`` a user symbol: bos -1), wrote it
    over ``PREFIX.model``, and loading it then failed with "train the model with Tokenizer.train"."""
    from nmtflow.data.tokenizer import Tokenizer

    text = tmp_path / "text"
    text.write_text("a b c d\ne f g h\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"user symbol '{symbol}' is one of the special pieces"):
        Tokenizer.train([text], tmp_path / "spm", vocab_size=40, byte_fallback=False, user_symbols=["<2de>", symbol])
    assert not list(tmp_path.glob("*spm*"))


def test_a_file_of_lines_ended_by_cr_alone_is_named_not_read_as_one_line(tmp_path: Path) -> None:
    """Before: read as one line, so ``translate -i`` gave one output for three inputs."""
    mac, windows = tmp_path / "mac.txt", tmp_path / "windows.txt"
    mac.write_bytes(b"a b\rc d\re f\r")
    windows.write_bytes(b"a b\r\nc d\r\n")
    with pytest.raises(CorpusError, match=r"mac\.txt: lines ended by CR alone .*3 carriage returns"):
        read_lines(mac)
    assert read_lines(windows) == ["a b", "c d"]
    mac.write_bytes(b"one line\r")  # a single line with its CR end is a line
    assert read_lines(mac) == ["one line"]
    # the same for TSV files (score --candidates, downstream tasks): two items were read as one
    tsv = tmp_path / "mac.tsv"
    tsv.write_bytes(b"a\tb\rc\td\r")
    with pytest.raises(CorpusError, match=r"mac\.tsv: lines ended by CR alone \(classic Mac; 2 carriage returns"):
        list(iter_tsv(tsv))
    tsv.write_bytes(b"a\tb\r\nc\td\r\n")
    assert list(iter_tsv(tsv)) == [(1, ["a", "b"]), (2, ["c", "d"])]
    tsv.write_bytes(b"a\tb\r")
    assert list(iter_tsv(tsv)) == [(1, ["a", "b"])]
