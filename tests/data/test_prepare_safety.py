"""Nothing a user or a fault can do corrupts a prepared directory silently: two preparations at once, one killed
mid-way or between its renames, an --add killed before meta.json, a directory prepared from other data, train and
valid from one file, out-of-range ids in a .bin, files in --out that prepare did not write."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import nmtflow.data.prepare as prep
from nmtflow.cli import main
from nmtflow.config import to_dict
from nmtflow.data.bitext import open_bitext
from nmtflow.data.prepare import load_meta, load_split
from tests.conftest import copy_sentences, tiny_config, write_split

REPO = Path(__file__).resolve().parents[2]

# A preparation in another process, stopped at a chosen point: ``pause`` (holding the lock, in the middle of
# binarizing), ``kill-swap`` (SIGKILL between the two renames of the swap where the system has no atomic exchange)
# or ``kill-meta`` (SIGKILL as meta.json is about to be written).
CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
import nmtflow.data.prepare as P

mode, ready, call = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if mode == "pause":
    binarize = P._binarize_split
    def paused(*args, **kwargs):
        result = binarize(*args, **kwargs)
        ready.touch()
        time.sleep(120)
        return result
    P._binarize_split = paused
elif mode == "kill-swap":
    P._exchange = lambda a, b: False
    rename = os.rename
    def dying(src, dst, *args, **kwargs):
        if Path(src).name.startswith(".out.new-"):
            die()
        return rename(src, dst, *args, **kwargs)
    os.rename = dying
elif mode == "kill-meta":
    P._write_json_atomic = lambda path, obj: die()
getattr(P, call.pop("function"))(**call)
"""


def child(tmp_path: Path, mode: str, **call: object) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, str(tmp_path / "ready"), json.dumps(call)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def prepare_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str,
                train: str = "train") -> tuple[int, str, str]:
    code = main(["prepare", "--train", str(tmp_path / "raw" / train), "--valid", str(tmp_path / "raw" / "valid"),
                 "--langs", "en", "de", "--out", str(tmp_path / "out"), "--vocab-size", "60",
                 "--no-byte-fallback", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob(".out.*") if p.name != ".out.lock")


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    train, other, valid = copy_sentences(40, 1), copy_sentences(40, 5), copy_sentences(5, 2)
    write_split(tmp_path / "raw" / "train", train, train, ("en", "de"))
    write_split(tmp_path / "raw" / "other", other, other, ("en", "de"))
    write_split(tmp_path / "raw" / "valid", valid, valid, ("en", "de"))
    return tmp_path / "raw"


def test_a_second_prepare_meanwhile_is_an_error_and_a_killed_one_changes_nothing(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: both exited 0, leaving meta.json, spm.model and binaries of different runs."""
    out = tmp_path / "out"
    assert prepare_cli(tmp_path, capsys)[0] == 0
    before = snapshot(out)
    proc = child(tmp_path, "pause", function="prepare", data_prefixes={"train": str(raw / "other")},
                 langs=["en", "de"], out_dir=str(out), vocab_size=50, byte_fallback=False, progress=False)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        code, _, err = prepare_cli(tmp_path, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{out}: another nmtflow prepare is writing this directory (pid {proc.pid})" in err
    finally:
        proc.kill()
        proc.wait()
    assert snapshot(out) == before  # kill -9 mid-preparation: the directory as it was
    assert leftovers(tmp_path) == [f".out.new-{proc.pid}"]
    assert prepare_cli(tmp_path, capsys, "--vocab-size", "55")[0] == 0  # cleans up what the killed run left
    assert leftovers(tmp_path) == [] and not [p for p in out.iterdir() if p.name.startswith(".")]
    meta = load_meta(out)
    assert meta["vocab_size"]["en"] == 55 and len(load_split(out, "train", "de")) == meta["splits"]["train"]["rows"]


def test_a_prepare_killed_between_the_renames_of_a_swap_is_undone_by_the_next(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Where the system cannot exchange two directories in one step, --out is moved aside and the new one moved in:
    a kill between the two leaves both complete, and the next preparation puts the old one back first."""
    out = tmp_path / "out"
    assert prepare_cli(tmp_path, capsys)[0] == 0
    (out / "notes.txt").write_text("mine\n")
    proc = child(tmp_path, "kill-swap", function="prepare", data_prefixes={"train": str(raw / "train")},
                 langs=["en", "de"], out_dir=str(out), vocab_size=50, byte_fallback=False, progress=False)
    assert proc.wait(60) == -signal.SIGKILL, proc.stderr.read().decode()
    assert not out.exists() and len(leftovers(tmp_path)) == 2
    with caplog.at_level(logging.WARNING, logger="nmtflow.data.prepare"):
        assert prepare_cli(tmp_path, capsys, "--vocab-size", "55")[0] == 0
    assert any("put back the directory" in r.getMessage() for r in caplog.records)
    assert leftovers(tmp_path) == [] and (out / "notes.txt").read_text() == "mine\n"
    assert load_meta(out)["vocab_size"]["de"] == 55


def test_an_add_killed_before_meta_json_leaves_the_split_it_replaces(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the replaced split's binaries were moved into place before meta.json, so a kill between the two left
    5-row binaries under a meta.json of 4 rows."""
    out = tmp_path / "out"
    write_split(raw / "new", copy_sentences(4, 3), copy_sentences(4, 3), ("en", "de"))
    assert prepare_cli(tmp_path, capsys)[0] == 0
    assert main(["prepare", "--out", str(out), "--add", f"test2={raw / 'new'}"]) == 0
    before = snapshot(out)
    proc = child(tmp_path, "kill-meta", function="add_splits", out_dir=str(out),
                 data_prefixes={"test2": str(raw / "valid")}, progress=False)
    assert proc.wait(60) == -signal.SIGKILL, proc.stderr.read().decode()
    assert snapshot(out) == before and load_meta(out)["splits"]["test2"]["rows"] == len(load_split(out, "test2", "en"))
    assert main(["prepare", "--out", str(out), "--add", f"test2={raw / 'valid'}"]) == 0
    assert len(load_split(out, "test2", "de")) == 5 and leftovers(tmp_path) == []


def test_preparing_over_data_prepared_from_other_files_needs_force(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Before: the directory was silently replaced by data prepared from other files."""
    out = tmp_path / "out"
    assert prepare_cli(tmp_path, capsys)[0] == 0
    before = snapshot(out)
    code, _, err = prepare_cli(tmp_path, capsys, train="other")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"nmtflow prepare: error: {out}: holds data prepared from other training files (from ")
    assert str((raw / "train.en").resolve()) in err and "--force" in err and snapshot(out) == before
    with caplog.at_level(logging.INFO, logger="nmtflow.data.prepare"):
        assert prepare_cli(tmp_path, capsys, "--force", train="other")[0] == 0
        assert load_meta(out)["source_files"]["train"]["en"] == str((raw / "other.en").resolve())
        assert prepare_cli(tmp_path, capsys, "--vocab-size", "55", train="other")[0] == 0  # the same files again
    notes = [r.getMessage() for r in caplog.records if "replacing" in r.getMessage()]
    assert len(notes) == 2 and "from other training files (from " in notes[0] and str(raw / "train.de") in notes[0]
    assert "from the same training files" in notes[1] and "splits train, valid" in notes[1]


def test_splits_that_read_the_same_file_are_a_warning(raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nmtflow.data.prepare"):
        assert main(["prepare", "--train", str(raw / "train"), "--valid", str(raw / "train"), "--langs", "en", "de",
                     "--out", str(tmp_path / "out"), "--vocab-size", "60", "--no-byte-fallback"]) == 0
        assert main(["prepare", "--out", str(tmp_path / "out"), "--add", f"test={raw / 'train'}"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    files = f"{raw / 'train.en'}, {raw / 'train.de'}"
    assert warnings == [f"the train and valid splits read the same files: {files}",
                        f"the test and train splits read the same files: {files}",
                        f"the test and valid splits read the same files: {files}"]


def test_out_of_range_token_ids_are_an_error_naming_the_file(raw: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before: an overwritten block of a .bin (same size) failed training some updates in with an IndexError."""
    write_split(raw / "copy", copy_sentences(40, 1), copy_sentences(40, 1))
    write_split(raw / "copyvalid", copy_sentences(5, 2), copy_sentences(5, 2))
    out = tmp_path / "data"
    assert main(["prepare", "--train", str(raw / "copy"), "--valid", str(raw / "copyvalid"), "--langs", "src", "tgt",
                 "--out", str(out), "--vocab-size", "60", "--no-byte-fallback"]) == 0
    capsys.readouterr()
    target = out / "train.tgt.bin"
    data = bytearray(target.read_bytes())
    data[40:48] = b"\xff" * 8  # ids 65535, in the middle of the file
    target.write_bytes(bytes(data))
    message = f"{target}: row "
    for open_split in (lambda: load_split(out, "train", "tgt"), lambda: open_bitext(out, "train", "src", "tgt")):
        with pytest.raises(ValueError, match="outside the vocabulary of 60 ids") as err:
            open_split()
        assert str(err.value).startswith(message) and "holds token id 65535" in str(err.value)
    config = tiny_config(out, tmp_path / "run", max_updates=1, threads=1)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    code = main(["train", str(tmp_path / "run.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_files_prepare_did_not_write_are_kept_and_earlier_temporary_files_dropped(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "a.txt").write_text("mine\n")
    (out / "link").symlink_to("notes/a.txt")
    (out / ".train.en.bin.tmp4242").write_bytes(b"half")  # a killed earlier version's
    assert prepare_cli(tmp_path, capsys)[0] == 0
    assert (out / "link").read_text() == "mine\n" and (out / "link").is_symlink()
    assert not (out / ".train.en.bin.tmp4242").exists()
    write_split(raw / "new", copy_sentences(4, 3), copy_sentences(4, 3), ("en", "de"))
    assert main(["prepare", "--out", str(out), "--add", f"test={raw / 'new'}"]) == 0
    assert (out / "notes" / "a.txt").read_text() == "mine\n" and len(load_split(out, "test", "en")) == 4


def test_without_an_atomic_exchange_prepare_and_add_still_swap_whole_directories(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    for vocab in ("60", "55"):
        assert prepare_cli(tmp_path, capsys, "--vocab-size", vocab)[0] == 0
    write_split(raw / "new", copy_sentences(4, 3), copy_sentences(4, 3), ("en", "de"))
    assert main(["prepare", "--out", str(out), "--add", f"test={raw / 'new'}"]) == 0
    assert load_meta(out)["vocab_size"]["en"] == 55 and len(load_split(out, "test", "de")) == 4
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("where, message", [
    ("file", "exists and is not a directory"),
    ("cwd", "is (or holds) the current directory"),
])
def test_an_out_that_cannot_be_replaced_whole_is_an_error(raw: Path, tmp_path: Path, where: str, message: str,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    if where == "file":
        out.write_text("not a directory\n")
    else:
        out.mkdir()
        monkeypatch.chdir(out)
    code, _, err = prepare_cli(tmp_path, capsys)
    assert code == 2 and err.strip() == f"nmtflow prepare: error: {out}: {message}" + (
        "" if where == "file" else ", and prepare replaces --out as a whole; run it from outside")


def test_a_meta_json_without_a_languages_vocabulary_size_is_an_error_naming_it(
        raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: load_meta accepted it, and opening the language's data failed later with a bare KeyError."""
    out = tmp_path / "out"
    assert prepare_cli(tmp_path, capsys)[0] == 0
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    del meta["vocab_size"]["de"]
    (out / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{out / 'meta.json'}: no vocabulary size listed for language 'de'"):
        load_meta(out)
