"""Attention maps of phrasal models: recorded weights, phrase shares, heat maps and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nmtflow.analysis.attention_maps import attention_maps, phrase_mass, slot_and_layer
from nmtflow.cli import main
from nmtflow.config import load_config
from nmtflow.data.vocab import BOS, PAD
from nmtflow.models.base import Vocabularies, build_model
from nmtflow.train.trainer import Trainer
from tests.conftest import tiny_config

V = 40
SLOTS = ("encoder.self_attn", "decoder.self_attn", "decoder.cross_attn")


def model(slot: dict | None) -> torch.nn.Module:
    torch.manual_seed(0)
    slots = {k: slot for k in ("encoder_self_attention", "decoder_self_attention", "cross_attention")} if slot else {}
    cfg = load_config(data={"model": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4,
                                      "encoder_layers": 2, "decoder_layers": 2, **slots}})
    return build_model(cfg.model, Vocabularies(V, V))


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    src = torch.randint(4, V, (2, 7), generator=g)
    src[1, 4:] = PAD
    tgt = torch.randint(4, V, (2, 6), generator=g)
    tgt[:, 0] = BOS
    tgt[1, 5:] = PAD
    return src, tgt, tgt.ne(PAD)


def test_every_module_is_recorded_and_splits_into_tokens_and_phrases() -> None:
    m = model({"type": "phrasal", "ngrams": [1, 2, 3]})
    src, tgt, tgt_mask = batch()
    logits = m.eval()(src, tgt)
    maps = attention_maps(m, src, tgt)
    torch.testing.assert_close(m(src, tgt), logits)  # recording leaves the model as it was
    assert sorted((x.slot, x.layer) for x in maps) == sorted((s, i) for s in SLOTS for i in range(2))
    for x in maps:
        parts = x.split()
        assert list(parts) == [1, 2, 3]
        assert [p.size(-1) for p in parts.values()] == [x.key_length - n + 1 for n in (1, 2, 3)]
        queries = src.ne(PAD) if x.slot.startswith("encoder") else tgt_mask
        totals = x.weights.sum(-1).permute(0, 2, 1)[queries]  # (N,H): every real query distributes all its mass
        torch.testing.assert_close(totals, torch.ones_like(totals))
        mass = phrase_mass(x, queries)
        torch.testing.assert_close(mass["phrase"], mass["by_n"][:, 1:].sum(-1))
        assert float(mass["total"].sum()) == pytest.approx(int(queries.sum()) * 4, rel=1e-5)


def test_standard_attention_has_no_phrases() -> None:
    src, tgt, tgt_mask = batch()
    for x in attention_maps(model(None), src, tgt):
        assert x.ngrams == [1] and x.weights.size(-1) == x.key_length
        assert float(phrase_mass(x, src.ne(PAD) if x.slot.startswith("encoder") else tgt_mask)["phrase"].sum()) == 0


def test_slot_names() -> None:
    assert slot_and_layer("decoder.3.cross_attn") == ("decoder.cross_attn", 3)
    assert slot_and_layer("attn") == ("attn", 0)


@pytest.fixture(scope="module")
def phrasal_checkpoint(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("phrasal")
    slot = {"type": "phrasal", "ngrams": [1, 2]}
    cfg = tiny_config(copy_data, save, max_updates=2, valid_bleu=False, validate_every=0, save_every=2)
    cfg.model = load_config(data={"model": {"name": "transformer", "d_model": 16, "ffn_dim": 32, "heads": 2,
                                            "encoder_layers": 1, "decoder_layers": 1,
                                            "encoder_self_attention": slot, "decoder_self_attention": slot,
                                            "cross_attention": slot}}).model
    cfg.data.valid_split = ""
    Trainer(cfg, resume=False).train()
    return save / "checkpoint_last.pt"


def test_cli_heat_maps_and_phrase_share(phrasal_checkpoint: Path, copy_data: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "maps"
    assert main(["analyze", "attention", str(phrasal_checkpoint), "--src", "alpha bravo charlie delta",
                 "--tgt", "alpha bravo charlie delta", "--out", str(out)]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(f"{s}.layer1.head{h}.png" for s in SLOTS for h in (1, 2))
    assert all((out / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    # without --tgt: the model's own translation; with --data: the phrase share per layer
    assert main(["analyze", "attention", str(phrasal_checkpoint), "--src", "echo golf", "--out", str(tmp_path / "b"),
                 "--data", str(copy_data), "--split", "valid", "--max-sentences", "20"]) == 0
    result = json.loads((tmp_path / "b" / "phrase_share.json").read_text(encoding="utf-8"))
    assert result["sentences"] == 20 and set(result["slots"]) == set(SLOTS)
    for layers in result["slots"].values():
        (row,) = layers
        assert row["layer"] == 1 and 0 < row["phrase_share"] < 1 and len(row["heads"]) == 2
        assert sum(row["by_ngram"].values()) == pytest.approx(1.0)
        assert row["phrase_share"] == pytest.approx(row["by_ngram"]["2"])
    assert (tmp_path / "b" / "phrase_share.png").is_file()
    capsys.readouterr()
    assert main(["analyze", "attention", str(phrasal_checkpoint), "--out", str(tmp_path / "c")]) == 2
    assert "--data" in capsys.readouterr().err
