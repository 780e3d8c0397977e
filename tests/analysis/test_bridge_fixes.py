"""Multilingual commands after review: the bridge analyses' encoder, up-front length checks of multilingual
training, adding a language, embeddings of long lines, downstream TSV checks, --plugin, analyze attention on a
multilingual checkpoint, UTF-8 offsets, embed's output and duplicate languages."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nmtflow.checkpoint import load_checkpoint
from nmtflow.cli import main
from nmtflow.config import ConfigError, MultilingualConfig, load_config
from nmtflow.data.multilingual import plan_directions

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0, "input_feeding": False}
BRIDGE = {"name": "bridge", **TINY, "bridge_heads": 3, "bridge_dim": 8}
TRANSFORMER_BRIDGE = {**BRIDGE, "encoder": "transformer", "decoder": "transformer", "heads": 2, "ffn_dim": 32,
                      "max_positions": 128}
TRAIN = {"lr": 1e-3, "warmup_updates": 1, "max_updates": 1, "validate_every": 0, "save_every": 1, "log_every": 1,
         "progress": False, "valid_bleu": False}


def config(model: dict[str, Any], data: Path, save_dir: Path, **multilingual: Any) -> Any:
    return load_config(data={"model": model, "train": {**TRAIN, "save_dir": str(save_dir)},
                             "data": {"path": str(data), "max_tokens": 400, "multilingual": multilingual}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tiny en/de/fr data (joint with tags; per-language vocabularies), a 3-encoder Transformer bridge, a base
    bridge on en↔de (per-language vocabularies) extended with fr, a bridge on a joint vocabulary, an RNN."""
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.train.multilingual import MultilingualTrainer
    from nmtflow.train.trainer import Trainer

    root = tmp_path_factory.mktemp("bridge-fixes")
    generate_corpus(root / "raw", langs=("en", "de", "fr"), n_train=120, n_valid=6, n_test=4, seed=1)
    splits = {"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}
    prepare(splits, ["en", "de", "fr"], root / "joint", vocab_size=150, byte_fallback=False, lang_tags=True,
            progress=False)
    prepare(splits, ["en", "de", "fr"], root / "sep", vocab_size=100, byte_fallback=False, joint=False, progress=False)
    MultilingualTrainer(config(TRANSFORMER_BRIDGE, root / "joint", root / "bridge3")).train()
    MultilingualTrainer(config(BRIDGE, root / "sep", root / "base", langs=["en", "de"])).train()
    MultilingualTrainer(config(BRIDGE, root / "sep", root / "added", langs=["en", "de"], new_langs=["fr"],
                               pairs=["en-fr", "fr-en"], init_checkpoint=str(root / "base" / "checkpoint_last.pt"))
                        ).train()
    MultilingualTrainer(config(BRIDGE, root / "joint", root / "joint-base", langs=["en", "de"])).train()
    Trainer(load_config(data={"model": {"name": "rnn", **TINY}, "train": {**TRAIN, "save_dir": str(root / "rnn")},
                              "data": {"path": str(root / "joint"), "max_tokens": 400, "src_lang": "en",
                                       "tgt_lang": "de"}})).train()
    return {"root": root, "raw": root / "raw", "joint": root / "joint", "sep": root / "sep",
            **{name: str(root / name / "checkpoint_last.pt")
               for name in ("bridge3", "base", "added", "joint-base", "rnn")}}


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


# ---- 1: the encoder of the bridge analyses -----------------------------------------------------------------
def test_bridge_analyses_need_src_lang_with_several_encoders(runs: dict[str, Any], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.de"
    src.write_text("der Hund schläft .\n", encoding="utf-8")
    assert main(["analyze", "bridge-attention", runs["bridge3"], "--sentence", "der Hund", "--out",
                 str(tmp_path / "a")]) == 2
    assert "encoders en, de, fr: name --src-lang" in one_line_error(capsys)
    assert main(["analyze", "bridge-entropy", runs["bridge3"], "--src", str(src), "--out", str(tmp_path / "b")]) == 2
    assert "name --src-lang" in one_line_error(capsys)
    assert main(["analyze", "bridge-attention", runs["bridge3"], "--src-lang", "de", "--sentence", "der Hund",
                 "--out", str(tmp_path / "c")]) == 0
    result = json.loads((tmp_path / "c" / "bridge_attention.json").read_text(encoding="utf-8"))
    assert next(iter(result["models"].values()))["lang"] == "de"


def test_an_added_language_keeps_the_earlier_directions_and_encoders(runs: dict[str, Any], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = load_checkpoint(runs["added"])
    assert ckpt["langs"]["directions"] == ["en-de", "de-en", "en-fr", "fr-en"]
    assert main(["analyze", "bridge-attention", runs["added"], "--src-lang", "de", "--sentence", "der Hund",
                 "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    src = tmp_path / "in.de"
    src.write_text("der Hund\n", encoding="utf-8")
    assert main(["translate", runs["added"], "-i", str(src)]) == 2
    assert "en-de, de-en, en-fr, fr-en" in one_line_error(capsys)


# ---- 2: lengths of multilingual training, before update 1 --------------------------------------------------
def test_multilingual_training_checks_lengths_before_training(runs: dict[str, Any], tmp_path: Path) -> None:
    from nmtflow.train.multilingual import MultilingualTrainer

    with pytest.raises(ConfigError, match=r"train\.(en|de|fr) row \d+: a sentence of \d+ positions \(with EOS\)"
                                          r".*max_positions=6"):
        MultilingualTrainer(config({**TRANSFORMER_BRIDGE, "max_positions": 6}, runs["joint"], tmp_path / "b"))
    assert not (tmp_path / "b" / "checkpoint_last.pt").exists()
    backbone = {"name": "transformer", "d_model": 16, "heads": 2, "ffn_dim": 32, "encoder_layers": 1,
                "decoder_layers": 1, "max_positions": 6}
    with pytest.raises(ConfigError, match=r"row \d+: a sentence of \d+ positions \(with EOS and the <2\w+> tag\)"):
        MultilingualTrainer(config({"name": "language_label", "backbone": backbone}, runs["joint"], tmp_path / "l"))
    MultilingualTrainer(config({**BRIDGE, "max_positions": 6}, runs["joint"], tmp_path / "rnn"))  # LSTMs: no bound


# ---- 3: adding a language needs per-language vocabularies ----------------------------------------------------
def test_adding_a_language_to_a_joint_vocabulary_model_asks_for_separate_vocab(runs: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    from nmtflow.train.multilingual import MultilingualTrainer

    with pytest.raises(ConfigError, match="joint vocabulary.*per-language vocabularies.*--separate-vocab"):
        MultilingualTrainer(config(BRIDGE, runs["sep"], tmp_path / "x", langs=["en", "de"], new_langs=["fr"],
                                   init_checkpoint=runs["joint-base"]))
    guide = (REPO / "docs" / "guide" / "multilingual.md").read_text(encoding="utf-8")
    example = guide[guide.index("Adding a language trains"):]
    example = example[:example.index("```\n", example.index("```bash") + 7)]
    prepares = [line for line in example.splitlines() if line.startswith("nmtflow prepare")]
    assert prepares and all("--separate-vocab" in line and "--lang-tags" not in line for line in prepares)


# ---- 4 and 9: embed -----------------------------------------------------------------------------------------
def test_embed_cuts_long_lines_to_the_models_positions(runs: dict[str, Any], tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "long.de"
    src.write_text("der Hund\n" + " ".join(["der Hund schläft und die Frau liest"] * 40) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        assert main(["embed", runs["bridge3"], "--lang", "de", "-i", str(src), "-o", str(tmp_path / "e")]) == 0
    assert f"{src}:2: " in caplog.text and "first 127" in caplog.text  # 128 positions less EOS
    assert f"wrote {tmp_path / 'e.npy'}:" in capsys.readouterr().out
    assert np.load(tmp_path / "e.npy").shape == (2, 16)
    pairs = tmp_path / "sts.tsv"
    long = " ".join(["der Hund schläft"] * 80)
    pairs.write_text(f"der Hund\tder Hund\t5\n{long}\tdie Frau\t1\ndie Frau\tder Mann\t2\n", encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["downstream", "similarity", runs["bridge3"], "--lang", "de", "--data", str(pairs)]) == 0
    assert f"{pairs}:2: " in caplog.text


def test_embed_errors_name_the_file_and_the_checkpoint_kind(runs: dict[str, Any], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.de"
    empty.write_text("", encoding="utf-8")
    assert main(["embed", runs["bridge3"], "--lang", "de", "-i", str(empty), "-o", str(tmp_path / "e.npy")]) == 2
    assert f"{empty}: no sentences to embed" in one_line_error(capsys)
    src = tmp_path / "in.en"
    src.write_text("the dog\n", encoding="utf-8")
    # a bilingual checkpoint embeds its source language (its encoder's mean states), and only that
    assert main(["embed", runs["rnn"], "--lang", "en", "-i", str(src), "-o", str(tmp_path / "e.npy")]) == 0
    capsys.readouterr()
    assert main(["embed", runs["rnn"], "--lang", "de", "-i", str(src), "-o", str(tmp_path / "d.npy")]) == 2
    err = one_line_error(capsys)
    assert "--lang de:" in err and "(its languages: en)" in err and "--src-lang" not in err


# ---- 5: downstream TSVs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("task,files,message", [
    ("similarity", {"data": "der Hund\tle chien\t5\nder Hund\tla femme\tnan\n"}, "data:2: the gold score must be"),
    ("similarity", {"data": "der Hund\tle chien\t5\nder Hund\tla femme\tinf\n"}, "data:2: the gold score must be"),
    ("similarity", {"data": "a\tb\t5\nc\td\tfive\n"}, "data:2: the third column must be a number"),
    ("similarity", {"data": "a\tb\t5\n\tla femme\t4\n"}, "data:2: field 1 of 3 is empty"),
    ("classify", {"train": "der Hund\tanimal\ndie Frau\tperson\n", "test": "le chien\tanimal\nla femme\tplant\n"},
     "test:2: label 'plant' does not occur in"),
    ("classify", {"train": "der Hund\tanimal\ndie Frau\t \n", "test": "le chien\tanimal\n"},
     "train:2: field 2 of 2 is empty"),
    ("classify", {"train": "der Hund\tx\ndie Frau\tx\n", "test": "le chien\tx\n"},
     "train: every example has the label"),
], ids=["nan", "inf", "not-a-number", "empty-field", "unseen-label", "empty-label", "one-class"])
def test_downstream_rejects_bad_tsv_lines(runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          task: str, files: dict[str, str], message: str) -> None:
    args = ["downstream", task, runs["bridge3"], "--lang", "de"]
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        args += [f"--{name}", str(tmp_path / name)]
    assert main(args) == 2
    assert f"{tmp_path / message}" in one_line_error(capsys)


# ---- 6: --plugin --------------------------------------------------------------------------------------------
def test_a_plugin_that_cannot_be_imported_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--plugin", "no_such_plugin_module", "embed", "x.pt", "--lang", "de", "-i", "x", "-o", "y"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("nmtflow: error: --plugin no_such_plugin_module: No module named")
    assert "PYTHONPATH" in err


# ---- 7: analyze attention on a multilingual checkpoint -----------------------------------------------------
def test_analyze_attention_takes_the_direction_of_a_multilingual_checkpoint(
        runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "maps"
    assert main(["analyze", "attention", runs["bridge3"], "--src", "der Hund", "--src-lang", "de", "--tgt-lang",
                 "en", "--out", str(out), "--data", str(runs["joint"]), "--max-sentences", "3"]) == 0
    assert (out / "encoder.self_attn.layer1.head1.png").is_file() and (out / "phrase_share.json").is_file()
    assert (out / "decoder.cross_attn.layer1.head1.png").is_file()  # over the bridge's k rows
    capsys.readouterr()
    assert main(["analyze", "attention", runs["bridge3"], "--src", "der Hund", "--src-lang", "de",
                 "--out", str(out)]) == 2
    assert "--src-lang and --tgt-lang" in one_line_error(capsys)


# ---- 8: invalid UTF-8 ---------------------------------------------------------------------------------------
def test_bridge_analyses_report_the_byte_offset_within_the_line(runs: dict[str, Any], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "bad.de"
    src.write_bytes(b"der Hund schl\xc3\xa4ft .\nthe dog \xff sleeps\n")
    assert main(["analyze", "bridge-entropy", runs["bridge3"], "--src-lang", "de", "--src", str(src),
                 "--out", str(tmp_path / "x")]) == 2
    assert f"{src}:2: invalid UTF-8 at byte offset 8 of the line" in one_line_error(capsys)


# ---- 10: duplicate languages ------------------------------------------------------------------------------
def test_duplicate_languages_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"data\.multilingual\.langs: 'en' is listed more than once"):
        plan_directions(["en", "de", "fr"], MultilingualConfig(langs=["en", "en", "de"]))
    with pytest.raises(ConfigError, match=r"data\.multilingual\.new_langs: 'fr'"):
        plan_directions(["en", "de", "fr"], MultilingualConfig(langs=["en", "de"], new_langs=["fr", "fr"]))
    train, _ = plan_directions(["en", "de", "fr"], MultilingualConfig(langs=["en", "de"]))
    assert [str(d) for d in train] == ["en-de", "de-en"]
