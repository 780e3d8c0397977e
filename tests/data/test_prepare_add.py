"""`nmtflow prepare --add`: further splits (a new test set) binarized with a prepared directory's tokenizers."""
from __future__ import annotations

from pathlib import Path

import pytest

from nmtflow.cli import main
from nmtflow.data.prepare import load_meta, load_split, load_tokenizer
from tests.conftest import copy_sentences, write_split


@pytest.fixture
def prepared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    train, valid, test = copy_sentences(40, 1), copy_sentences(5, 2), copy_sentences(4, 3)
    for name, rows in (("train", train), ("valid", valid), ("new", test)):
        write_split(tmp_path / "raw" / name, rows, rows, ("en", "de"))
    assert main(["prepare", "--train", str(tmp_path / "raw" / "train"), "--valid", str(tmp_path / "raw" / "valid"),
                 "--langs", "en", "de", "--out", str(tmp_path / "out"), "--vocab-size", "60",
                 "--no-byte-fallback"]) == 0
    capsys.readouterr()
    return tmp_path / "out"


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "meta.json"}


def test_add_binarizes_a_new_split_and_changes_nothing_else(prepared: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    before, meta_before = snapshot(prepared), load_meta(prepared)
    assert main(["prepare", "--out", str(prepared), "--add", f"test2={tmp_path / 'raw' / 'new'}"]) == 0
    assert "test2: 4 rows" in capsys.readouterr().out
    meta = load_meta(prepared)
    assert meta["splits"] == {**meta_before["splits"], "test2": {"rows": 4, "dropped": 0, "lines": 4}}
    assert meta["source_files"]["test2"]["de"] == str((tmp_path / "raw" / "new.de").resolve())
    after = snapshot(prepared)
    assert {name: after[name] for name in before} == before  # tokenizer, train and valid untouched
    assert sorted(set(after) - set(before)) == ["test2.de.bin", "test2.de.idx", "test2.en.bin", "test2.en.idx"]
    tok = load_tokenizer(prepared, "en")
    lines = (tmp_path / "raw" / "new.en").read_text(encoding="utf-8").splitlines()
    assert [list(load_split(prepared, "test2", "en")[i]) for i in range(4)] == tok.encode_batch(lines)
    # a split of the same name is replaced
    assert main(["prepare", "--out", str(prepared), "--add", f"test2={tmp_path / 'raw' / 'valid'}"]) == 0
    assert load_meta(prepared)["splits"]["test2"]["rows"] == 5 and len(load_split(prepared, "test2", "de")) == 5


@pytest.mark.parametrize("args, message", [
    (["--add", "train=RAW/new"], "the 'train' split cannot be replaced"),
    (["--add", "test2=RAW/new", "--langs", "en"], "--langs belong to a new preparation"),
    (["--add", "test2=RAW/new", "--add", "test2=RAW/valid"], "the test2 split is already given (another --add)"),
    (["--add", "test2"], "expected NAME=PREFIX"),
    (["--add", "test2=RAW/missing"], "missing.en: file not found"),
    (["--add", "test2=RAW/blank"], "blank.de:2: empty line"),
    ([], "--train and --langs are required"),
])
def test_add_errors_name_the_cause_and_leave_the_directory_as_it_was(args: list[str], message: str, prepared: Path,
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "raw"
    (raw / "blank.en").write_text("alpha\nbravo\n", encoding="utf-8")
    (raw / "blank.de").write_text("alpha\n\n", encoding="utf-8")
    before, meta = snapshot(prepared), (prepared / "meta.json").read_bytes()
    code = main(["prepare", "--out", str(prepared), *[a.replace("RAW", str(raw)) for a in args]])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert snapshot(prepared) == before and (prepared / "meta.json").read_bytes() == meta


def test_add_to_a_directory_that_was_not_prepared_is_an_error(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["prepare", "--out", str(tmp_path / "nothing"), "--add", f"test={tmp_path / 'x'}"])
    assert code == 2 and "data directory not found (run prepare first)" in capsys.readouterr().err
