"""Bad inputs give a one-line ``nmtflow CMD: error: ...`` naming the file and exit status 2."""
from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmtflow.checkpoint import FORMAT, load_checkpoint, save_atomic
from nmtflow.cli import main
from nmtflow.config import to_dict

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
            root / "data", vocab_size=45, byte_fallback=False, progress=False)
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
    err = one_line_error(["prepare", "--train", str(tmp_path / "raw" / "train.en"), "--langs", "en", "de",
                          "--out", str(tmp_path / "prepared")], "train.en.en", capsys)  # a file for a prefix
    assert (f"file not found: {tmp_path / 'raw' / 'train.en'} is one of the files; a split is given as the prefix "
            f"PREFIX of its files PREFIX.LANG, here {tmp_path / 'raw' / 'train'}") in err


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
            tmp_path / "data", vocab_size=60, byte_fallback=False, progress=False)
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
    (["info", "transformer-small", "--vocab-size", "0"], "--vocab-size 0: must be > 4"),  # before: IndexError
    (["score", "missing.pt", "--src", "s", "--tgt", "t", "--batch-tokens", "0"],
     "--batch-tokens 0 (decode.max_tokens): must be >= 1"),  # before: accepted (translate refused it)
    (["info", "transformer-small", "--vocab-size", "-3"], "--vocab-size -3: must be > 4"),  # before: RuntimeError
    # the cleaning and worker flags are named as the user typed them (not CleanConfig's fields)
    (["prepare", "--train", "corpus/train", "--langs", "en", "de", "--out", "OUT", "--max-len", "0"],
     "--max-len must be >= 1, got 0"),
    (["prepare", "--train", "corpus/train", "--langs", "en", "de", "--out", "OUT", "--max-ratio", "0.5"],
     "--max-ratio must be >= 1, got 0.5"),
    (["prepare", "--train", "corpus/train", "--langs", "en", "de", "--out", "OUT", "--max-ratio", "nan"],
     "--max-ratio must be >= 1, got nan"),
    (["prepare", "--train", "corpus/train", "--langs", "en", "de", "--out", "OUT", "--workers", "0"],
     "--workers must be >= 1, got 0"),
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


# ---- faults that must not pass silently: a flipped bit, a corrupt model inside, other runs, a full disk ---------
def source_file(tmp_path: Path) -> str:
    src = tmp_path / "in.txt"
    src.write_text("alpha bravo charlie\n", encoding="utf-8")
    return str(src)


def test_a_bit_flipped_checkpoint_is_refused(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: it loaded and translated into something else, with exit status 0."""
    ckpt = load_checkpoint(run_dir / "checkpoint_last.pt")
    name = max(ckpt["model"], key=lambda k: ckpt["model"][k].numel())
    data = bytearray((run_dir / "checkpoint_last.pt").read_bytes())
    at = data.find(ckpt["model"][name].numpy().tobytes()[:64])
    assert at > 0
    data[at + 3] ^= 0x80  # the sign of the tensor's first float: a finite model, another translation
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(bytes(data))
    err = one_line_error(["translate", str(flipped), "-i", source_file(tmp_path), "--device", "cpu"], str(flipped),
                         capsys)
    assert "corrupted: the bytes of model/" in err and "differ from those it was saved with (integrity code)" in err
    older = {k: v for k, v in ckpt.items() if k not in ("integrity", "run_id")}  # written before codes and run ids
    torch.save(older, tmp_path / "older.pt")
    assert main(["translate", str(tmp_path / "older.pt"), "-i", source_file(tmp_path), "--device", "cpu"]) == 0
    tensors_only = {**ckpt, "integrity": {k: v for k, v in ckpt["integrity"].items() if k != "settings"}}
    tensors_only["config"]["decode"]["max_len_b"] += 64  # codes before they covered the config: tensors checked only
    torch.save(tensors_only, tmp_path / "tensors_only.pt")
    assert main(["translate", str(tmp_path / "tensors_only.pt"), "-i", source_file(tmp_path), "--device", "cpu"]) == 0


@pytest.mark.parametrize("edit", ["flip", "added", "removed"])
def test_a_checkpoint_whose_config_changed_after_it_was_written_is_refused(
        edit: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the integrity code covered the tensors only, so one flipped bit in the pickled config (decode.max_len_b
    10 → 74, or relu → gelu) loaded and translated with another model, exit 0."""
    path = tmp_path / "edited.pt"
    if edit == "flip":
        data = bytearray((run_dir / "checkpoint_last.pt").read_bytes())
        at = data.find(b"K\n", data.find(b"max_len_b"))  # the pickled int 10 that follows the key
        assert at > 0
        data[at + 1] ^= 0x40
        path.write_bytes(bytes(data))
        said = "its 'config' entry differs from what it was saved with (integrity code)"
    else:  # an edit written with torch.save, not nmtflow (which seals a new code)
        ckpt = load_checkpoint(run_dir / "checkpoint_last.pt")
        if edit == "added":
            ckpt["multilingual"] = True
            said = "its 'multilingual' entry was not there when it was saved"
        else:
            del ckpt["progress"]
            said = "entry it was saved with is missing"
        torch.save(ckpt, path)
    err = one_line_error(["translate", str(path), "-i", source_file(tmp_path), "--device", "cpu"], str(path), capsys)
    assert f"{path}: corrupted: " in err and said in err


def test_a_corrupt_sentencepiece_model_inside_a_checkpoint_names_the_checkpoint(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the error named a temporary file (/tmp/nmtflow-spm-....model) that the user never saw."""
    ckpt = load_checkpoint(run_dir / "checkpoint_last.pt")
    model = ckpt["tokenizers"]["src"]
    ckpt["tokenizers"] = {"src": model[: model.numel() // 2].clone(), "tgt": ckpt["tokenizers"]["tgt"]}
    bad = tmp_path / "bad_spm.pt"
    save_atomic(ckpt, bad)  # broken before it was saved: its integrity code is right
    err = one_line_error(["translate", str(bad), "-i", source_file(tmp_path), "--device", "cpu"], str(bad), capsys)
    assert f"{bad}: cannot load its src SentencePiece model" in err and "nmtflow-spm" not in err


def test_a_checkpoint_whose_weights_do_not_fit_its_model_says_which(run_dir: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Before: only PyTorch's header line, "Error(s) in loading state_dict for Transformer:", without the mismatch."""
    ckpt = load_checkpoint(run_dir / "checkpoint_last.pt")
    name = next(k for k, v in ckpt["model"].items() if v.dim() == 2)
    ckpt["model"][name] = torch.cat([ckpt["model"][name]] * 2)
    wrong = tmp_path / "wrong.pt"
    save_atomic(ckpt, wrong)
    err = one_line_error(["translate", str(wrong), "-i", source_file(tmp_path), "--device", "cpu"], str(wrong), capsys)
    assert f"checkpoint does not match its model (size mismatch for {name}: " in err


def test_checkpoints_hold_the_tokenizers_the_run_started_with(run_dir: Path, copy_data: Path, tmp_path: Path) -> None:
    """Before: each save read the SentencePiece files again, so a data dir prepared again during training put
    another vocabulary into the checkpoints of a model trained with the first one."""
    import shutil

    from nmtflow.config import load_config
    from nmtflow.train.trainer import Trainer

    data = tmp_path / "data"
    shutil.copytree(copy_data, data)
    config = yaml.safe_load((run_dir / "run.yaml").read_text(encoding="utf-8"))
    config["data"]["path"], config["train"]["save_dir"] = str(data), str(tmp_path / "run")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(load_config(tmp_path / "run.yaml"))
        model = trainer.src_tok.path
        started_with = model.read_bytes()
        model.write_bytes(started_with[: len(started_with) // 2])  # the files change under the running training
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    saved = load_checkpoint(tmp_path / "run" / "checkpoint_last.pt")["tokenizers"]
    assert all(t.numpy().tobytes() == started_with for t in saved.values())


class Unsafe:
    """An object that only running code rebuilds: ``weights_only`` loading refuses it."""


def test_a_checkpoint_that_weights_only_loading_refuses_keeps_pytorchs_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: PyTorch's first line only ("Weights only load failed. This file can still be loaded, ..."), cut at
    200 characters with terminal escapes in it, and called "truncated or corrupted"; the reason was lost."""
    path = tmp_path / "pickled.pt"
    torch.save({"format": FORMAT, "model": {}, "extra": Unsafe()}, path)
    with pytest.raises(Exception) as caught:
        torch.load(path, weights_only=True)
    reason = str(caught.value).split("WeightsUnpickler error: ")[1].splitlines()[0].strip()
    assert "Unsupported global" in reason and len(reason) > 200
    err = one_line_error(["translate", str(path), "--device", "cpu"], str(path), capsys)
    assert "weights_only=True" in err and reason in err and "\x1b" not in err and "truncated" not in err


def test_averaging_checkpoints_of_different_runs_needs_asking(run_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before: two runs of the same config with other seeds were averaged into a model far worse than either."""
    other = tmp_path / "other"
    train = ["train", str(run_dir / "run.yaml"), "--save-dir", str(other), "--set", "train.seed=2",
             "--set", "train.save_every=1"]
    threads = torch.get_num_threads()
    try:
        assert main(train) == 0
        assert main([*train, "--set", "train.max_updates=2"]) == 0  # resumed: the same run
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    a, b = run_dir / "checkpoint_last.pt", other / "checkpoint_last.pt"  # same base name: the full paths tell them
    err = one_line_error(["average", str(a), str(b), "-o", str(tmp_path / "avg.pt")], str(a), capsys)
    assert str(b) in err and "2 different training runs" in err and "--allow-different-runs" in err
    assert not (tmp_path / "avg.pt").exists()
    err = one_line_error(["average", str(a), str(b), "-o", str(b), "--allow-different-runs"], str(b), capsys)
    assert "is the checkpoint" in err and "would replace it" in err
    assert main(["average", str(a), str(b), "--allow-different-runs", "-o", str(tmp_path / "soup.pt")]) == 0
    soup = load_checkpoint(tmp_path / "soup.pt")  # its own integrity code, and a run id of its own
    assert soup["run_id"] not in (load_checkpoint(a)["run_id"], load_checkpoint(b)["run_id"])
    first, second = (load_checkpoint(other / f"checkpoint_{n}.pt")["run_id"] for n in (1, 2))
    assert first == second and main(["average", str(other), "-o", str(tmp_path / "one_run.pt")]) == 0
    older = [tmp_path / "older_a.pt", tmp_path / "older_b.pt"]  # versions without run ids: averaged as before
    for path, copy in zip((a, b), older):
        save_atomic({k: v for k, v in load_checkpoint(path).items() if k != "run_id"}, copy)
    assert main(["average", *map(str, older), "-o", str(tmp_path / "older_avg.pt")]) == 0


def test_an_output_file_that_is_an_input_is_refused(run_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``-o`` naming the source (or the reference) replaced it with the translations, exit 0."""
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("a b c\n", encoding="utf-8")
    ref.write_text("a b c\n", encoding="utf-8")
    link = tmp_path / "link.txt"
    link.symlink_to(src)
    ckpt = str(run_dir / "checkpoint_last.pt")
    for args, option in ((["translate", ckpt, "-i", str(src), "-o", str(tmp_path / "." / "src.txt")], "-i"),
                         (["translate", ckpt, "-i", str(src), "-o", str(link)], "-i"),
                         (["translate", ckpt, "-i", str(ref), "--prefix", str(src), "-o", str(src)], "--prefix"),
                         (["evaluate", ckpt, "--src", str(src), "--ref", str(ref), "-o", str(src)], "--src"),
                         (["evaluate", ckpt, "--src", str(src), "--ref", str(ref), "-o", str(ref)], "--ref")):
        assert f"is the {option}" in one_line_error(args, "would replace it", capsys)
    assert src.read_text(encoding="utf-8") == ref.read_text(encoding="utf-8") == "a b c\n"
    other = tmp_path / "other.pt"  # before: the checkpoint itself, or another run's, became 6 bytes of text, exit 0
    shutil.copyfile(ckpt, other)
    before = other.read_bytes()
    for args, said in ((["translate", ckpt, "-i", str(src), "-o", ckpt], f"is the checkpoint {ckpt} file"),
                       (["evaluate", ckpt, "--src", str(src), "--ref", str(ref), "-o", ckpt], "is the checkpoint"),
                       (["translate", ckpt, "-i", str(src), "-o", str(other)], "holds a PyTorch checkpoint"),
                       (["evaluate", ckpt, "--src", str(src), "--ref", str(ref), "-o", str(other)],
                        "holds a PyTorch checkpoint")):
        assert said in one_line_error(args, "-o ", capsys)
    assert other.read_bytes() == before and load_checkpoint(ckpt)["model"]


def test_negative_length_limits_and_non_finite_length_penalties_are_refused(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src.txt"
    src.write_text("a b c\n", encoding="utf-8")
    ckpt = str(run_dir / "checkpoint_last.pt")
    assert "--max-len-a (decode.max_len_a): must be >= 0" in one_line_error(
        ["translate", ckpt, "-i", str(src), "--max-len-a", "-1"], "max_len_a", capsys)
    assert "--max-len-b (decode.max_len_b): must be >= 0, got -5" in one_line_error(
        ["translate", ckpt, "-i", str(src), "--max-len-b", "-5"], "max_len_b", capsys)
    for value in ("nan", "inf", "-inf"):  # every score came out nan (or -0.0) and the run exited 0
        for command in (["translate", ckpt, "-i", str(src)], ["evaluate", ckpt, "--src", str(src), "--ref", str(src)]):
            assert f"--lenpen (decode.len_penalty): must be a finite number, got {float(value)}" in one_line_error(
                [*command, f"--lenpen={value}"], "len_penalty", capsys)
    for value in ("1000", "-21"):  # before: 1000 was an OverflowError traceback (and HTTP 500 from the server)
        assert f"--lenpen (decode.len_penalty): must be between -20 and 20 (GNMT's α; 0: none, usually 0.6-2), got " \
               f"{float(value)}" in one_line_error(["translate", ckpt, "-i", str(src), f"--lenpen={value}"],
                                                   "len_penalty", capsys)


FULL_DISK_CASES = ["translate_to_a_device", "translate_to_a_file", "checkpoint", "training_log", "analysis_results"]


@pytest.mark.parametrize("case", FULL_DISK_CASES)
def test_a_full_disk_names_the_file_it_could_not_write(case: str, run_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "[Errno 28] No space left on device" alone (translate -o, the training log, analysis results), or
    naming a temporary file (a checkpoint whose temporary file could not be made). /dev/full fails every write
    with ENOSPC."""
    ckpt, src = str(run_dir / "checkpoint_last.pt"), source_file(tmp_path)
    if case == "translate_to_a_device":
        err = one_line_error(["translate", ckpt, "-i", src, "-o", "/dev/full", "--device", "cpu"], "/dev/full", capsys)
        assert "/dev/full: could not write the output (No space left on device)" in err
    elif case == "translate_to_a_file":
        out = tmp_path / "out.txt"
        out.write_text("earlier\n", encoding="utf-8")
        make_temp = tempfile.mkstemp

        def onto_a_full_disk(**kwargs: str) -> tuple[int, str]:
            fd, tmp = make_temp(**kwargs)
            os.close(fd)
            return os.open("/dev/full", os.O_WRONLY), tmp

        monkeypatch.setattr(tempfile, "mkstemp", onto_a_full_disk)
        err = one_line_error(["translate", ckpt, "-i", src, "-o", str(out), "--device", "cpu"], str(out), capsys)
        assert f"{out}: could not write the output (No space left on device); it is unchanged" in err
        assert out.read_text(encoding="utf-8") == "earlier\n" and not list(tmp_path.glob(".*.tmp"))
    elif case == "checkpoint":
        def no_room(**kwargs: str) -> tuple[int, str]:
            raise OSError(errno.ENOSPC, "No space left on device", f"{kwargs['dir']}/{kwargs['prefix']}x.tmp")

        target = tmp_path / "checkpoint_last.pt"
        monkeypatch.setattr(tempfile, "mkstemp", no_room)
        with pytest.raises(OSError) as caught:
            save_atomic({"format": FORMAT}, target)
        assert str(caught.value) == f"{target}: could not write the checkpoint (No space left on device)"
        assert caught.value.errno == errno.ENOSPC
    elif case == "training_log":
        from nmtflow.train.trainer import Trainer

        log = tmp_path / "log.jsonl"
        log.symlink_to("/dev/full")
        trainer = SimpleNamespace(dist=SimpleNamespace(is_main=True), progress=SimpleNamespace(update=3),
                                  save_dir=tmp_path, writer=False)
        with pytest.raises(OSError, match=f"^{log}: could not write the log \\(No space left on device\\)$"):
            Trainer.record(trainer, "train", {"loss": 1.0})  # type: ignore[arg-type]
    else:
        from nmtflow.analysis.report import write_json

        results = tmp_path / "probes.json"
        results.symlink_to("/dev/full")
        with pytest.raises(OSError, match=f"^{results}: could not write the results \\(No space left on device\\)$"):
            write_json({"a": 1}, results)


def test_a_checkpoint_write_that_runs_out_of_room_partway_gives_the_reason(tmp_path: Path) -> None:
    """The disk (here the file size limit) fills after the first records: torch.save swallowed the OSError and the
    error was PyTorch's "[enforce fail at inline_container.cc:672] . unexpected pos N vs M"."""
    import subprocess
    import sys

    target = tmp_path / "checkpoint_last.pt"
    target.write_bytes(b"earlier")
    script = ("import resource, sys, torch\n"
              "from nmtflow.checkpoint import save_atomic\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))\n"
              "try:\n"
              f"    save_atomic({{'w': torch.zeros(300_000)}}, {str(target)!r})\n"
              "except OSError as exc:\n"
              "    print(exc, exc.errno)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() == (f"{target}: could not write the checkpoint (File too large); it is unchanged "
                                   f"{errno.EFBIG}"), done.stderr
    assert target.read_bytes() == b"earlier" and not list(tmp_path.glob(".*.tmp"))
