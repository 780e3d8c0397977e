"""Attention-bridge analyses (SPEC §5): BLEU by source length, bridge heat maps, head entropy, and their CLI."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nmtflow.analysis.bridge import (Bucket, EntropyStats, assign_buckets, bleu_by_bucket, bridge_attention,
                                     _pick_direction, head_entropy, parse_buckets, path_labels, unpadded)
from nmtflow.cli import main
from nmtflow.config import load_config
from nmtflow.data.vocab import PAD
from nmtflow.evaluate.metrics import bleu
from nmtflow.models.base import build_model
from nmtflow.models.multilingual import LanguageVocabularies

PNG = b"\x89PNG\r\n\x1a\n"
TINY = {"hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0, "input_feeding": False}
TINY_BRIDGE = {"name": "bridge", **TINY, "bridge_heads": 4, "bridge_dim": 8}


# ---- buckets and per-bucket BLEU ------------------------------------------------------------------------
def test_buckets_parse_and_assign() -> None:
    default = parse_buckets()
    assert [b.name for b in default] == ["1-10", "11-15", "16-20", "21-25", "26+"]
    assert assign_buckets([0, 1, 10, 11, 25, 26, 300], default) == [None, 0, 0, 1, 3, 4, 4]
    assert parse_buckets(["1-5,6+"]) == [Bucket(1, 5), Bucket(6, None)]
    assert assign_buckets([3, 7, 9], parse_buckets(["1-3", "8-9"])) == [0, None, 1]  # gaps are allowed
    for bad, message in ((["5-1"], "below"), (["1-10", "10-20"], "overlaps"), (["1+", "5-6"], "overlaps"),
                         (["ten"], "LOW-HIGH")):
        with pytest.raises(ValueError, match=message):
            parse_buckets(bad)


def test_bleu_is_computed_per_bucket() -> None:
    refs = ["a b c d e", "the cat sat on the mat today", "x y", "one two three four five six seven eight"]
    hyps = ["a b c d e", "the cat sat on the mat today", "q r", "nothing like it at all here"]
    lengths = [5, 7, 2, 12]
    result = bleu_by_bucket(hyps, refs, lengths, parse_buckets(["1-4", "5-9", "10-11", "12+"]))
    rows = result["buckets"]
    assert [r["sentences"] for r in rows] == [1, 2, 0, 1] and result["outside_buckets"] == 0
    assert rows[1]["bleu"] == pytest.approx(100.0) and rows[2]["bleu"] is None
    assert rows[0]["bleu"] == pytest.approx(bleu(["q r"], ["x y"]).score)
    assert rows[3]["bleu"] < 10
    assert result["bleu"] == pytest.approx(bleu(hyps, refs).score)


# ---- bridge attention and entropy ------------------------------------------------------------------------
def test_bridge_attention_is_k_by_n_and_ignores_padding() -> None:
    torch.manual_seed(0)
    vocabs = LanguageVocabularies(30, 30, True, encoders={"en": 30}, decoders={"de": 30})
    model = build_model(load_config(data={"model": TINY_BRIDGE}).model, vocabs).eval().pair("en", "de")
    src = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, PAD, PAD, PAD]])
    with torch.no_grad():
        full = bridge_attention(model, src)
        alone = bridge_attention(model, src[1:, :3])
    assert full.shape == (2, 4, 6)
    assert torch.all(full[1, :, 3:] == 0)  # padding gets no weight
    short = unpadded(full, src)
    assert [a.shape for a in short] == [(4, 6), (4, 3)]
    for a in short:
        torch.testing.assert_close(a.sum(-1), torch.ones(4))
    torch.testing.assert_close(short[1], alone[0])  # the same as without the padded neighbour


def test_entropy_is_split_by_head_index_against_sentence_length() -> None:
    # two sentences, k = 3 heads, S = 4 columns; sentence 0 has n = 2 positions, sentence 1 n = 4 (no head beyond)
    a = torch.zeros(2, 3, 4)
    a[0, 0, :2] = torch.tensor([1.0, 0.0])  # entropy 0
    a[0, 1, :2] = torch.tensor([0.5, 0.5])  # log 2
    a[0, 2, :2] = torch.tensor([0.5, 0.5])  # log 2 (index 2 >= n = 2: beyond the length)
    a[1, 0] = torch.tensor([0.25, 0.25, 0.25, 0.25])  # log 4
    a[1, 1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # 0
    a[1, 2] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # log 2
    entropy = head_entropy(a)
    l2, l4 = math.log(2), math.log(4)
    torch.testing.assert_close(entropy, torch.tensor([[0.0, l2, l2], [l4, 0.0, l2]], dtype=torch.float64))
    stats = EntropyStats(3)
    stats.add(entropy[:1], torch.tensor([2]))  # batches accumulate
    stats.add(entropy[1:], torch.tensor([4]))
    r = stats.result()
    assert r["sentences"] == 2 and r["heads"] == 3
    assert r["all_heads"] == pytest.approx(((2 * l2) / 3 + (l4 + l2) / 3) / 2)
    assert r["within_length"] == pytest.approx((l2 / 2 + (l4 + l2) / 3) / 2)  # heads 0,1 | heads 0,1,2
    assert r["beyond_length"] == pytest.approx(l2)  # only sentence 0 has a head beyond its length
    assert r["sentences_per_group"] == {"all_heads": 2, "within_length": 2, "beyond_length": 1}
    assert r["per_head"] == pytest.approx([l4 / 2, l2 / 2, l2])
    assert r["uniform"] == pytest.approx((l2 + l4) / 2)


def test_default_labels_are_the_shortest_distinct_path_endings() -> None:
    assert path_labels(["out/runs/rnn/seed-1/averaged.pt", "out/runs/bridge/seed-1/averaged.pt"]) == \
        ["rnn/seed-1/averaged", "bridge/seed-1/averaged"]
    assert path_labels(["a/checkpoint_best.pt", "b/checkpoint_best.pt"]) == ["a/checkpoint_best", "b/checkpoint_best"]


# ---- the commands on tiny checkpoints ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny en/de/fr corpus; a bridge (1 update on en↔de, en↔fr; de→fr zero-shot), a bilingual RNN en→de."""
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.train.multilingual import MultilingualTrainer
    from nmtflow.train.trainer import Trainer

    root = tmp_path_factory.mktemp("bridge-analysis")
    generate_corpus(root / "raw", langs=("en", "de", "fr"), n_train=120, n_valid=12, n_test=4, seed=1)
    prepare({"train": str(root / "raw" / "train")}, ["en", "de", "fr"], root / "data", vocab_size=150,
            byte_fallback=False, progress=False)
    train = {"lr": 1e-3, "warmup_updates": 1, "max_updates": 1, "validate_every": 0, "save_every": 1,
             "log_every": 1, "progress": False, "valid_bleu": False}
    data = {"path": str(root / "data"), "max_tokens": 400, "valid_split": ""}
    MultilingualTrainer(load_config(data={
        "model": TINY_BRIDGE, "train": {**train, "save_dir": str(root / "bridge")},
        "data": {**data, "multilingual": {"pairs": ["en-de", "de-en", "en-fr", "fr-en"], "zero_shot": ["de-fr"]}}}
    )).train()
    Trainer(load_config(data={"model": {"name": "rnn", **TINY}, "train": {**train, "save_dir": str(root / "rnn")},
                              "data": {**data, "src_lang": "en", "tgt_lang": "de"}})).train()
    return {"raw": root / "raw", "bridge": str(root / "bridge" / "checkpoint_last.pt"),
            "rnn": str(root / "rnn" / "checkpoint_last.pt")}


def test_length_bleu_command(tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "length"
    src, ref = tiny["raw"] / "valid.en", tiny["raw"] / "valid.de"
    assert main(["analyze", "length-bleu", tiny["rnn"], tiny["bridge"], "--src", str(src), "--ref", str(ref),
                 "--src-lang", "en", "--tgt-lang", "de", "--buckets", "1-6", "7+", "--labels", "rnn", "bridge",
                 "--beam", "2", "--out", str(out), "--device", "cpu"]) == 0
    assert "rnn" in capsys.readouterr().out
    result = json.loads((out / "length_bleu.json").read_text(encoding="utf-8"))
    assert (out / "length_bleu.png").read_bytes()[:8] == PNG
    lengths = [len(s.split()) for s in src.read_text(encoding="utf-8").splitlines()]
    counts = [sum(n <= 6 for n in lengths), sum(n >= 7 for n in lengths)]
    assert [b["sentences"] for b in result["buckets"]] == counts and result["sentences"] == 12
    assert list(result["models"]) == ["rnn", "bridge"]
    for m in result["models"].values():
        assert m["direction"] == "en-de" and m["beam_size"] == 2
        assert [b["sentences"] for b in m["buckets"]] == counts
        assert all(b["bleu"] is None or 0 <= b["bleu"] <= 100 for b in m["buckets"])
    # a multilingual model needs its direction; a bilingual one cannot translate another
    assert main(["analyze", "length-bleu", tiny["bridge"], "--src", str(src), "--ref", str(ref),
                 "--out", str(tmp_path / "x")]) == 2
    assert "(trained: en-de, de-en, en-fr, fr-en; zero-shot: de-fr): name --src-lang and --tgt-lang" in \
        capsys.readouterr().err
    # copy directions are listed as translate lists them, but only named ones are picked
    with pytest.raises(ValueError, match=r"no direction en-\* \(trained: de-en, en-en; zero-shot: de-fr\)"):
        _pick_direction("m.pt", ["de-en", "en-en"], ["de-fr"], "en", None)
    assert _pick_direction("m.pt", ["de-en", "en-en"], [], None, "en") == ("de", "en")
    assert main(["analyze", "length-bleu", tiny["rnn"], "--src", str(src), "--ref", str(ref), "--src-lang", "fr",
                 "--tgt-lang", "de", "--out", str(tmp_path / "x")]) == 2
    assert "en-de model cannot translate fr-de" in capsys.readouterr().err
    assert main(["analyze", "length-bleu", tiny["rnn"], "--src", str(src), "--ref", str(tiny["raw"] / "test.de"),
                 "--out", str(tmp_path / "x")]) == 2
    assert "has 12 lines but" in capsys.readouterr().err
    assert main(["analyze", "length-bleu", tiny["rnn"], "--src", str(src), "--ref", str(ref), "--buckets", "9-3",
                 "--out", str(tmp_path / "x")]) == 2
    assert "'9-3'" in capsys.readouterr().err


def test_bridge_attention_command(tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "maps"
    sentence = "the dog sleeps ."
    assert main(["analyze", "bridge-attention", tiny["bridge"], tiny["bridge"], "--labels", "a", "b",
                 "--src-lang", "fr", "--sentence", sentence, "--out", str(out), "--device", "cpu"]) == 0
    assert "4 heads" in capsys.readouterr().out
    assert (out / "bridge_attention.png").read_bytes()[:8] == PNG
    result = json.loads((out / "bridge_attention.json").read_text(encoding="utf-8"))
    m = result["models"]["a"]
    attention = torch.tensor(m["attention"])
    assert m["lang"] == "fr" and m["tokens"][-1] == "</s>"
    assert attention.shape == (4, len(m["tokens"]))  # k rows, one column per source position
    torch.testing.assert_close(attention.sum(-1), torch.ones(4))
    assert m["entropy"] == pytest.approx(head_entropy(attention[None])[0].tolist(), abs=1e-5)
    # a language the model has no encoder for; a model without a bridge
    assert main(["analyze", "bridge-attention", tiny["bridge"], "--src-lang", "cs", "--sentence", sentence,
                 "--out", str(tmp_path / "x")]) == 2
    assert "no cs encoder (the model has en, de, fr)" in capsys.readouterr().err
    assert main(["analyze", "bridge-attention", tiny["rnn"], "--sentence", sentence, "--out", str(tmp_path / "x")]) == 2
    assert "no attention bridge" in capsys.readouterr().err


def test_bridge_entropy_command(tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "entropy"
    src = tiny["raw"] / "valid.de"
    assert main(["analyze", "bridge-entropy", tiny["bridge"], tiny["bridge"], "--labels", "penalty", "no-penalty",
                 "--src-lang", "de", "--src", str(src), "--max-sentences", "10", "--batch-tokens", "60",
                 "--out", str(out), "--device", "cpu"]) == 0
    assert "within_length" in capsys.readouterr().out
    assert (out / "bridge_entropy.png").read_bytes()[:8] == PNG
    result = json.loads((out / "bridge_entropy.json").read_text(encoding="utf-8"))
    assert result["sentences"] == 10
    m = result["models"]["penalty"]
    assert m["sentences"] == 10 and m["heads"] == 4 and len(m["per_head"]) == 4
    assert 0 < m["all_heads"] <= m["uniform"] + 1e-9  # a head's entropy is at most log n
    assert m["sentences_per_group"]["within_length"] == 10
    assert m["beyond_length"] is None and m["sentences_per_group"]["beyond_length"] == 0  # every n > k = 4
    assert m["all_heads"] == pytest.approx(sum(m["per_head"]) / 4)
    assert m["all_heads"] == pytest.approx(m["within_length"])  # each sentence has all 4 heads within its length
    empty = tmp_path / "empty.de"
    empty.write_text("\n", encoding="utf-8")
    assert main(["analyze", "bridge-entropy", tiny["bridge"], "--src-lang", "de", "--src", str(empty),
                 "--out", str(tmp_path / "x")]) == 2
    assert "empty.de: no sentences" in capsys.readouterr().err
