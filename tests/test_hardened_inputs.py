"""Bad inputs give a one-line ``nmtflow CMD: error: ...`` naming the file and exit status 2."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmtflow.cli import main
from nmtflow.config import to_dict
from nmtflow.train.checkpoint import FORMAT, save_atomic

from tests.conftest import copy_sentences, tiny_config, write_split


def one_line_error(args: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"nmtflow {args[0]}: error: ") and name in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("content", ["truncated", "empty", "garbage", "not_nmtflow"])
def test_translate_rejects_bad_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str) -> None:
    path = tmp_path / f"{content}.pt"
    if content == "truncated":
        save_atomic({"format": FORMAT, "model": {"w": torch.randn(1000)}}, path)
        path.write_bytes(path.read_bytes()[:700])
    elif content == "empty":
        path.write_bytes(b"")
    elif content == "garbage":
        path.write_bytes(bytes(range(256)) * 40)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    one_line_error(["translate", str(path), "--device", "cpu"], path.name, capsys)


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary \x80 garbage", b"model: [unclosed\n",
                                     b"model: {name: no-such-model}\n", b"- a list\n- not a mapping\n"])
def test_bad_config_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    one_line_error(["info", str(path)], "bad.yaml", capsys)
    one_line_error(["train", str(path)], "bad.yaml", capsys)


# ---- a trained run, then inputs that do not fit it -------------------------------------------------------------
PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-update tiny Transformer run on the copy task (``src`` → ``tgt``), with its config as ``run.yaml``."""
    from nmtflow.train.trainer import Trainer

    save = tmp_path_factory.mktemp("run")
    config = tiny_config(copy_data, save, max_updates=1, valid_bleu=False, validate_every=0, save_every=0, threads=1)
    config.model.d_model, config.model.ffn_dim, config.decode.beam_size = 32, 64, 2
    (save / "run.yaml").write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        Trainer(config).train()
    finally:
        torch.set_num_threads(threads)
    return save


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same languages prepared with another vocabulary."""
    from nmtflow.data.prepare import prepare

    root = tmp_path_factory.mktemp("other")
    lines = copy_sentences(300, 7)
    write_split(root / "raw" / "train", lines, lines)
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "train")}, ["src", "tgt"],
            root / "data", vocab_size=45, progress=False)
    return root / "data"


def test_resuming_with_another_vocabulary_model_or_direction(run_dir: Path, copy_data: Path, other_data: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    train = ["train", str(run_dir / "run.yaml")]
    err = one_line_error([*train, "--data", str(other_data)], "checkpoint_last.pt", capsys)
    assert "vocabulary" in err and str(other_data) in err
    err = one_line_error(["train", str(REPO / "configs" / "convs2s-4l.yaml"), "--save-dir", str(run_dir),
                          "--data", str(copy_data), "--set", "data.src_lang=src", "--set", "data.tgt_lang=tgt"],
                         "checkpoint_last.pt", capsys)
    assert "'transformer'" in err and "'convs2s'" in err
    err = one_line_error([*train, "--set", "model.d_model=64"], "checkpoint_last.pt", capsys)
    assert "trained with other settings (model.d_model: 32 → 64)" in err
    err = one_line_error([*train, "--set", "data.src_lang=tgt", "--set", "data.tgt_lang=src"], "checkpoint_last.pt",
                         capsys)
    assert "data.src_lang: 'src' → 'tgt'; data.tgt_lang: 'tgt' → 'src'" in err
    assert main([*train, "--set", "train.max_updates=1"]) == 0  # the run itself still resumes (and is done)


def test_scoring_a_data_directory_of_another_vocabulary(run_dir: Path, other_data: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(run_dir / "checkpoint_last.pt")
    err = one_line_error(["evaluate", ckpt, "--perplexity", "--data", str(other_data), "--device", "cpu"],
                         str(other_data), capsys)
    assert ckpt in err and "vocabulary" in err


def test_language_codes_the_model_or_the_files_lack(run_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(run_dir / "checkpoint_last.pt")
    src = tmp_path / "in.txt"
    src.write_text("alpha bravo\n", encoding="utf-8")
    err = one_line_error(["translate", ckpt, "-i", str(src), "--src-lang", "de", "--tgt-lang", "en"], ckpt, capsys)
    assert "src→tgt" in err and "de→en" in err
    assert main(["translate", ckpt, "-i", str(src), "--src-lang", "src", "--tgt-lang", "tgt", "--device", "cpu"]) == 0
    capsys.readouterr()
    lines = copy_sentences(20, 3)
    write_split(tmp_path / "raw" / "train", lines, lines, ("en", "de"))
    err = one_line_error(["prepare", "--train", str(tmp_path / "raw" / "train"), "--langs", "en", "fr",
                          "--out", str(tmp_path / "prepared")], "train.fr", capsys)
    assert "train has de, en" in err


GARBAGE = {"all_bytes": bytes(range(256)) * 8, "latin1": "Grüße\n".encode("latin-1"), "cut_utf8": b"ok\n\xe2\x82",
           "random": bytes(random.Random(5).getrandbits(8) for _ in range(4000)), "utf16": "hello\n".encode("utf-16")}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_translate_and_score_reject_binary_garbage(run_dir: Path, tmp_path: Path, name: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, bad, good = str(run_dir / "checkpoint_last.pt"), tmp_path / f"{name}.txt", tmp_path / "good.txt"
    bad.write_bytes(GARBAGE[name])
    good.write_text("alpha\n" * (GARBAGE[name].count(b"\n") + 1), encoding="utf-8")
    assert "invalid UTF-8" in one_line_error(["translate", ckpt, "-i", str(bad), "--device", "cpu"], bad.name, capsys)
    one_line_error(["score", ckpt, "--src", str(bad), "--tgt", str(good), "--device", "cpu"], bad.name, capsys)
    one_line_error(["score", ckpt, "--src", str(good), "--tgt", str(bad), "--device", "cpu"], bad.name, capsys)


def test_control_characters_and_extremely_long_lines(run_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(run_dir / "checkpoint_last.pt")
    text = tmp_path / "odd.txt"  # valid UTF-8 but no sentence: NUL, controls, BOM, separators, 50k words, 200k chars
    text.write_text("\x00\x01 alpha \x7f\u200b\ufeff\u2028 bravo\x0c\r\n\n   \n" + "alpha bravo " * 25_000 + "\n"
                    + "x" * 200_000 + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert main(["translate", ckpt, "-i", str(text), "-o", str(out), "--device", "cpu", "--max-len-b", "3"]) == 0
    assert len(out.read_text(encoding="utf-8").split("\n")) == 6  # long inputs are truncated (with a warning)
    capsys.readouterr()
    short = tmp_path / "short.txt"
    short.write_text("alpha\n" * 5, encoding="utf-8")
    err = one_line_error(["score", ckpt, "--src", str(short), "--tgt", str(text), "--device", "cpu"], "odd.txt:4:",
                         capsys)
    assert "never truncated" in err


@PROPERTY
@given(text=st.text(max_size=120))
def test_translate_and_score_files_of_random_unicode(run_dir: Path, tmp_path: Path, text: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, src, out = str(run_dir / "checkpoint_last.pt"), tmp_path / "random.txt", tmp_path / "out.txt"
    src.write_bytes(text.encode("utf-8", errors="surrogatepass"))  # lone surrogates make invalid UTF-8
    capsys.readouterr()
    lines = text.split("\n")
    n = len(lines) - (lines[-1] == "")
    for args in (["translate", ckpt, "-i", str(src), "-o", str(out), "--max-len-b", "3"],
                 ["score", ckpt, "--src", str(src), "--tgt", str(src)]):
        code = main([*args, "--device", "cpu"])
        err = capsys.readouterr().err
        if code == 2:  # only ever a one-line error naming the file
            assert err.startswith(f"nmtflow {args[0]}: error: ") and src.name in err, err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1
            continue
        assert code == 0, err
        if args[0] == "translate":
            assert len(out.read_text(encoding="utf-8").split("\n")) == n + 1


def test_a_sentence_longer_than_the_model_stops_training_before_it_starts(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from nmtflow.data.prepare import prepare

    train, valid = copy_sentences(300, 3), copy_sentences(10, 4)
    valid[6] = " ".join(copy_sentences(60, 5))  # line 7: hundreds of pieces
    write_split(tmp_path / "raw" / "train", train, train)
    write_split(tmp_path / "raw" / "valid", valid, valid)
    prepare({"train": str(tmp_path / "raw" / "train"), "valid": str(tmp_path / "raw" / "valid")}, ["src", "tgt"],
            tmp_path / "data", vocab_size=60, progress=False)
    config = tiny_config(tmp_path / "data", tmp_path / "run", max_updates=1, threads=1)
    config.model.max_positions = 128
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    err = one_line_error(["train", str(tmp_path / "run.yaml")], "valid.src:7: a sentence of ", capsys)
    assert "max_positions=128" in err and not (tmp_path / "run" / "checkpoint_last.pt").exists()
    # a training row: named by its row (prepare filters the training text, so rows are not lines)
    err = one_line_error(["train", str(tmp_path / "run.yaml"), "--set", "data.train_split=valid",
                          "--set", "data.valid_split=''"], "valid.src row 7", capsys)
    assert "--max-len" in err


@pytest.mark.parametrize("args, message", [
    (["corpus", "OUT", "--train", "-5"], "--train: the number of train sentences must be >= 1"),
    (["prepare", "--train", "corpus/train", "--langs", "en", "de", "--out", "OUT", "--split", "test"],
     "--split 'test': expected NAME=PREFIX"),
    (["prepare", "--train", "corpus/train", "--valid", "v", "--langs", "en", "de", "--out", "OUT", "--split",
      "valid=x"], "the valid split is already given"),
    (["info", str(REPO / "configs" / "transformer-small.yaml"), "--set", "data.max_tokens=0"], "max_tokens"),
])
def test_bad_counts_and_split_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                      message: str) -> None:
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    err = one_line_error(args, message.split(":")[0], capsys)
    assert message in err and not (tmp_path / "out").exists()


def test_a_byte_order_mark_is_not_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = copy_sentences(20, 9)
    (tmp_path / "hyp.txt").write_text("".join(s + "\n" for s in lines), encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\ufeff" + "".join(s + "\r\n" for s in lines), encoding="utf-8")
    assert main(["evaluate", "--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.txt")]) == 0
    assert "BLEU = 100.00" in capsys.readouterr().out
