"""`nmtflow prepare` on awkward input: invisible-only lines, failed re-runs, all rows cleaned away, a small corpus."""
from __future__ import annotations

from pathlib import Path

import pytest

from nmtflow.cli import main
from nmtflow.data.prepare import load_meta, load_split
from tests.conftest import copy_sentences, write_split


def prepare_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["prepare", "--train", str(tmp_path / "raw" / "train"), "--valid", str(tmp_path / "raw" / "valid"),
                 "--langs", "en", "de", "--out", str(tmp_path / "out"), "--no-byte-fallback", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    train, valid = copy_sentences(40, 1), copy_sentences(5, 2)
    write_split(tmp_path / "raw" / "train", train, train, ("en", "de"))
    write_split(tmp_path / "raw" / "valid", valid, valid, ("en", "de"))
    return tmp_path / "raw"


@pytest.mark.parametrize("line", ["\u200b", "\ufeff", " \u200b \ufeff\t", "\x01\x02"])
def test_a_valid_line_of_only_invisible_characters_is_an_error(raw: Path, tmp_path: Path, line: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """SentencePiece encodes such a line to no tokens: an empty sentence, which only the training split may hold."""
    with open(raw / "valid.de", "a", encoding="utf-8") as f:
        f.write(line + "\n")
    with open(raw / "valid.en", "a", encoding="utf-8") as f:
        f.write("alpha bravo\n")
    code, _, err = prepare_cli(tmp_path, capsys, "--vocab-size", "60")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{raw / 'valid.de'}:6: line of only invisible characters" in err


def test_a_training_line_of_only_invisible_characters_is_cleaned_away(raw: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for lang, line in (("en", "\u200b \ufeff"), ("de", "alpha")):
        with open(raw / f"train.{lang}", "a", encoding="utf-8") as f:
            f.write(line + "\n")
    code, out, _ = prepare_cli(tmp_path, capsys, "--vocab-size", "60")
    assert code == 0 and "train: 40 rows (1 dropped by cleaning)" in out
    assert min(load_split(tmp_path / "out", "valid", "en").sizes) > 0


def test_a_failed_tokenizer_training_leaves_the_prepared_directory_usable(raw: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare_cli(tmp_path, capsys, "--vocab-size", "60")[0] == 0
    model = (tmp_path / "out" / "spm.model").read_bytes()
    code, _, err = prepare_cli(tmp_path, capsys, "--vocab-size", "5")  # fewer pieces than characters
    assert code == 2 and "SentencePiece training" in err
    assert load_meta(tmp_path / "out")["vocab_size"]["en"] == 60
    assert (tmp_path / "out" / "spm.model").read_bytes() == model
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
    code, _, _ = prepare_cli(tmp_path, capsys, "--vocab-size", "60", "--separate-vocab")  # still prepares afresh
    assert code == 0 and load_meta(tmp_path / "out")["tokenizers"] == {"en": "spm.en.model", "de": "spm.de.model"}


def test_all_training_rows_dropped_names_the_empty_file(raw: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (raw / "train.de").write_text(" \n" * 40, encoding="utf-8")
    code, _, err = prepare_cli(tmp_path, capsys, "--vocab-size", "60")
    assert code == 2 and err.startswith(f"nmtflow prepare: error: {raw / 'train.de'}: the training split has no row "
                                        "with text in every file: 40 of its 40 lines are blank")


def test_a_vocab_size_beyond_the_data_is_reported(raw: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = prepare_cli(tmp_path, capsys, "--vocab-size", "8000")
    size = load_meta(tmp_path / "out")["vocab_size"]["en"]
    assert code == 0 and size < 8000
    assert f"spm.model has {size} pieces, fewer than --vocab-size 8000" in err


def test_preparing_again_removes_what_the_earlier_preparation_wrote(raw: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: splits, languages and per-language tokenizers of an earlier run stayed beside the new ones (whose
    tokenizer they do not match); files that no meta.json listed are left alone."""
    rows = copy_sentences(3, 4)
    write_split(raw / "test", rows, rows, ("en", "de"))
    assert prepare_cli(tmp_path, capsys, "--vocab-size", "60", "--test", str(raw / "test"), "--separate-vocab")[0] == 0
    (tmp_path / "out" / "notes.txt").write_text("mine\n")
    assert prepare_cli(tmp_path, capsys, "--vocab-size", "60")[0] == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "meta.json", "notes.txt", "spm.model", "spm.vocab", "train.de.bin", "train.de.idx", "train.en.bin",
        "train.en.idx", "valid.de.bin", "valid.de.idx", "valid.en.bin", "valid.en.idx"]


def test_a_failed_check_leaves_no_output_directory(raw: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: an empty --out directory was left behind by input that failed its checks."""
    (raw / "valid.de").write_text("only one line\n", encoding="utf-8")
    code, _, err = prepare_cli(tmp_path, capsys, "--vocab-size", "60")
    assert code == 2 and "line-aligned" in err and not (tmp_path / "out").exists()
