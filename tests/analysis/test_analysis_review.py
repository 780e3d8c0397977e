"""The analysis commands after review: models without attention modules, --max-sentences checks, splits and
targets longer than the model's positions, undefined correlations, the probe's L2 weight, embed's output folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nmtflow.analysis import downstream
from nmtflow.cli import main
from nmtflow.config import load_config
from nmtflow.data.corpus import CorpusError
from tests.conftest import WORDS, copy_sentences, write_split

TRAIN = {"lr": 1e-3, "warmup_updates": 1, "max_updates": 1, "validate_every": 0, "save_every": 1, "log_every": 1,
         "progress": False, "valid_bleu": False}
LONG = " ".join(WORDS * 5)  # 100 words: more pieces than max_positions=64


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy task with a split ``long`` whose line 2 does not fit max_positions=64; a Transformer, a ConvS2S
    and an attention bridge on it, each trained one update."""
    from nmtflow.data.prepare import prepare
    from nmtflow.train.multilingual import MultilingualTrainer
    from nmtflow.train.trainer import Trainer

    root = tmp_path_factory.mktemp("review")
    train, valid = copy_sentences(300, 1), copy_sentences(12, 2)
    write_split(root / "raw" / "train", train, train)
    write_split(root / "raw" / "valid", valid, valid)
    write_split(root / "raw" / "long", ["alpha bravo", LONG], ["alpha bravo", LONG])
    prefixes = {name: str(root / "raw" / name) for name in ("train", "valid", "long")}
    prepare(prefixes, ["src", "tgt"], root / "data", vocab_size=60, byte_fallback=False, progress=False)
    data = {"path": str(root / "data"), "src_lang": "src", "tgt_lang": "tgt", "max_tokens": 400}
    models = {"transformer": {"name": "transformer", "d_model": 16, "ffn_dim": 32, "heads": 2, "encoder_layers": 1,
                              "decoder_layers": 1, "max_positions": 64},
              "convs2s": {"name": "convs2s", "embed_dim": 16, "hidden": 16, "encoder_layers": 1, "decoder_layers": 1,
                          "max_positions": 64}}
    for name, model in models.items():
        Trainer(load_config(data={"model": model, "data": data,
                                  "train": {**TRAIN, "save_dir": str(root / name)}})).train()
    bridge = {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "bridge_heads": 3,
              "bridge_dim": 8, "input_feeding": False}
    MultilingualTrainer(load_config(data={"model": bridge, "train": {**TRAIN, "save_dir": str(root / "bridge")},
                                          "data": {"path": str(root / "data"), "max_tokens": 400,
                                                   "multilingual": {}}})).train()
    return {"root": root, "data": str(root / "data"), "raw": root / "raw",
            **{name: str(root / name / "checkpoint_last.pt") for name in ("transformer", "convs2s", "bridge")}}


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_attention_of_a_model_without_attention_modules_is_an_error(runs: dict[str, Any], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 0, an empty phrase_share.json, a blank plot and no heat maps for ConvS2S/DenseNMT/RNN."""
    code = main(["analyze", "attention", runs["convs2s"], "--src", "alpha bravo", "--data", runs["data"],
                 "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert code == 2
    assert "no attention modules" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sentence", [["--src", " "], ["--src", "alpha", "--tgt", ""]])
def test_attention_of_an_empty_sentence_is_an_error(sentence: list[str], runs: dict[str, Any], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before: heat maps of EOS (or BOS) alone."""
    code = main(["analyze", "attention", runs["transformer"], *sentence, "--out", str(tmp_path / "out"),
                 "--device", "cpu"])
    assert code == 2
    assert f"{sentence[-2]} is empty" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("kind", ["attention", "length-bleu", "bridge-entropy"])
def test_max_sentences_below_one_is_an_error(kind: str, value: str, runs: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before: -1 silently dropped the last sentence (attention reported ``"sentences": -1``); 0 wrote empty results."""
    src = str(runs["raw"] / "valid.src")
    args = {"attention": [runs["transformer"], "--data", runs["data"]],
            "length-bleu": [runs["transformer"], "--src", src, "--ref", str(runs["raw"] / "valid.tgt"), "--greedy"],
            "bridge-entropy": [runs["bridge"], "--src-lang", "src", "--src", src]}[kind]
    assert main(["analyze", kind, *args, "--max-sentences", value, "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert f"--max-sentences: must be >= 1, got {value}" in one_line_error(capsys)


@pytest.mark.parametrize("kind", ["probe", "similarity", "attention"])
def test_a_split_longer_than_the_positions_names_its_line(kind: str, runs: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``error: sequence of length N exceeds max_positions=64`` without the file, the line or a way out."""
    assert main(["analyze", kind, runs["transformer"], "--data", runs["data"], "--split", "long", "--out",
                 str(tmp_path), "--device", "cpu"]) == 2
    err = one_line_error(capsys)
    assert "long.src:2" in err and "max_positions=64" in err


def test_attention_target_longer_than_the_positions_is_named(runs: dict[str, Any], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "attention", runs["transformer"], "--src", "alpha", "--tgt", LONG, "--out",
                 str(tmp_path), "--device", "cpu"]) == 2
    err = one_line_error(capsys)
    assert "--tgt" in err and "max_positions=64" in err


def fake_embed(lines: list[str], lang: str, **where: Any) -> np.ndarray:
    """Two-dimensional embeddings that depend on the sentence."""
    return np.array([[len(s), 1.0 + s.count("a")] for s in lines], dtype=np.float32)


@pytest.mark.parametrize("rows", [["a b\tb c\t3", "a a\tc\t3", "b\ta\t3"], ["a b\tb c\t3"],
                                  ["a b\ta b\t1", "c\tc\t2"]])  # the last: every cosine is 1
def test_downstream_similarity_without_a_defined_correlation_is_an_error(rows: list[str], tmp_path: Path) -> None:
    """Before: ``pearson nan | spearman nan``, and ``--json`` printed NaN, which is not JSON."""
    path = tmp_path / "sts.tsv"
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(CorpusError, match="correlation"):
        downstream.similarity(fake_embed, path, "en")


@pytest.mark.parametrize("l2", [-1.0, float("nan")])
def test_downstream_classification_checks_l2(l2: float, tmp_path: Path) -> None:
    """Before: a negative or NaN --l2 trained a meaningless probe and reported its accuracy."""
    path = tmp_path / "cls.tsv"
    path.write_text("a b\tx\nc\ty\na a a\tx\nb\ty\n", encoding="utf-8")
    with pytest.raises(ValueError, match="--l2"):
        downstream.classification(fake_embed, path, "en", path, l2=l2)


def test_embed_creates_the_output_folder(runs: dict[str, Any], tmp_path: Path) -> None:
    """Before: ``error: [Errno 2] No such file or directory`` where every analyze command creates its --out."""
    out = tmp_path / "new" / "dir" / "vectors.npy"
    assert main(["embed", runs["bridge"], "--lang", "src", "-i", str(runs["raw"] / "valid.src"), "-o", str(out),
                 "--device", "cpu"]) == 0
    assert np.load(out).shape[0] == 12


def test_similarity_matches_a_direct_computation(runs: dict[str, Any], tmp_path: Path) -> None:
    """cos(E, layer 1) of one sentence, from the model's own embedder and encoder layer, equals the report."""
    import torch
    import torch.nn.functional as F

    from nmtflow.analysis.states import load_models, sentence_rows
    from nmtflow.data.vocab import PAD

    assert main(["analyze", "similarity", runs["transformer"], "--data", runs["data"], "--max-sentences", "1",
                 "--seed", "3", "--out", str(tmp_path), "--device", "cpu"]) == 0
    reported = next(iter(json.loads((tmp_path / "similarity.json").read_text())["models"].values()))
    m = load_models([runs["transformer"]], runs["data"], "valid")[0]
    b = m.data.batch(sentence_rows(len(m.data), 1, 3))
    model, outputs = m.model.eval(), []
    hook = model.encoder.layers[0].register_forward_hook(lambda mod, args, out: outputs.append(out))
    with torch.no_grad():
        emb = model.encoder.embedder
        e = emb.embedding(b.src) * emb.scale + emb.positions(b.src.size(1), 0)
        model(b.src, b.tgt_in)
    hook.remove()
    layer = outputs[0][0] if isinstance(outputs[0], tuple) else outputs[0]
    keep = b.src.ne(PAD)
    assert reported["encoder"][1] == pytest.approx(float(F.cosine_similarity(e[keep], layer[keep], dim=-1).mean()),
                                                   abs=1e-6)


@pytest.mark.parametrize("where", ["out", "out/inside"])
def test_analyze_out_onto_a_file_is_a_named_error(where: str, runs: dict[str, Any], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``[Errno 17] File exists`` (or ``[Errno 20] Not a directory``) after the models had loaded."""
    (tmp_path / "out").write_text("a file\n")
    target = str(tmp_path / where)
    code = main(["analyze", "similarity", runs["transformer"], "--data", runs["data"], "--split", "valid",
                 "--out", target, "--device", "cpu"])
    assert code == 2
    err = one_line_error(capsys)
    assert f"--out {target}" in err and "not a directory" in err and "Errno" not in err
    assert (tmp_path / "out").read_text() == "a file\n"


def test_downstream_unknown_language_is_an_error_before_embedding(runs: dict[str, Any], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the whole training file was embedded before ``--test-lang xx`` was reported."""
    import nmtflow.analysis.embeddings as embeddings

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("embedded before the languages were checked")

    monkeypatch.setattr(embeddings, "sentence_embeddings", never)
    tsv = tmp_path / "labels.tsv"
    tsv.write_text("alpha bravo\ta\ncharlie delta\tb\n")
    code = main(["downstream", "classify", runs["bridge"], "--lang", "src", "--train", str(tsv), "--test", str(tsv),
                 "--test-lang", "xx", "--device", "cpu"])
    assert code == 2
    err = one_line_error(capsys)
    assert "--test-lang xx" in err and runs["bridge"] in err and "src" in err


def test_a_bilingual_checkpoint_embeds_its_source_language(runs: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "a bilingual checkpoint; sentence embeddings need a multilingual checkpoint", though a bilingual
    bridge's M is the paper's sentence embedding too (Vázquez et al. 2020 compare bilingual and multilingual M)."""
    import torch

    from nmtflow.data.batching import collate
    from nmtflow.decode.translate import Translator
    from nmtflow.models.rnn import masked_mean
    from nmtflow.nn.bridge import pool_bridge
    from nmtflow.train.trainer import Trainer

    bridge = {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "bridge_heads": 3,
              "bridge_dim": 8, "input_feeding": False}
    data = {"path": runs["data"], "src_lang": "src", "tgt_lang": "tgt", "max_tokens": 400}
    Trainer(load_config(data={"model": bridge, "data": data,
                              "train": {**TRAIN, "save_dir": str(tmp_path / "bilingual-bridge")}})).train()
    lines = (runs["raw"] / "valid.src").read_text(encoding="utf-8").splitlines()
    for name, ckpt in (("transformer", runs["transformer"]), ("bridge", str(tmp_path / "bilingual-bridge" /
                                                                             "checkpoint_last.pt"))):
        out = tmp_path / f"{name}.npy"
        assert main(["embed", ckpt, "--lang", "src", "-i", str(runs["raw"] / "valid.src"), "-o", str(out),
                     "--device", "cpu"]) == 0
        translator = Translator.from_checkpoint(ckpt)
        src = collate([translator.src_tokenizer.encode(line) for line in lines], [[]] * len(lines)).src
        with torch.no_grad():
            enc = translator.model.encode(src)
        expected = pool_bridge(enc["bridge"], "mean") if "bridge" in enc else masked_mean(enc["out"],
                                                                                         enc["padding_mask"])
        np.testing.assert_allclose(np.load(out), expected.numpy(), atol=1e-5)
    capsys.readouterr()
    assert main(["embed", runs["transformer"], "--lang", "tgt", "-i", str(runs["raw"] / "valid.src"), "-o",
                 str(tmp_path / "x.npy"), "--device", "cpu"]) == 2
    assert "--lang tgt" in one_line_error(capsys) and not (tmp_path / "x.npy").exists()
    assert main(["embed", runs["transformer"], "--lang", "src", "--pooling", "flat", "-i",
                 str(runs["raw"] / "valid.src"), "-o", str(tmp_path / "x.npy"), "--device", "cpu"]) == 2
    assert "pooling 'flat' needs an attention bridge" in one_line_error(capsys)
