"""The decoder-only language model: causality, incremental state, training on monolingual text, perplexity."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import load_config
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode.search import greedy_search
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.train.trainer import Trainer, read_log
from tests.conftest import copy_sentences

V = 30
PHRASAL = {"type": "phrasal", "ngrams": [1, 2]}


def lm_config(**model: object) -> dict:
    return {"name": "lm", "d_model": 32, "ffn_dim": 64, "heads": 4, "layers": 2, **model}


def make(seed: int = 0, **model: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(load_config(data={"model": lm_config(**model)}).model, Vocabularies(V, V)).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    tgt = torch.randint(4, V, (2, 8), generator=torch.Generator().manual_seed(seed))
    tgt[:, 0] = BOS
    tgt[1, 6:] = PAD
    return tgt


@pytest.mark.parametrize("attention", [{}, PHRASAL])
def test_no_future_leakage_and_source_is_ignored(attention: dict) -> None:
    model = make(self_attention=attention) if attention else make()
    tgt = tokens()
    ref = model(torch.full((2, 3), EOS), tgt)
    torch.testing.assert_close(model(torch.randint(4, V, (2, 5)), tgt), ref)
    for t in range(1, tgt.size(1)):
        changed = tgt.clone()
        changed[:, t:] = torch.randint(4, V, changed[:, t:].shape)
        torch.testing.assert_close(model(tgt[:, :1], changed)[:, :t], ref[:, :t], atol=1e-5, rtol=1e-5)


def test_incremental_equals_full_and_greedy_search_runs() -> None:
    model = make(self_attention={"type": "phrasal", "ngrams": [1, 2, 3]})
    tgt = tokens()
    src = torch.full((2, 1), EOS)
    full = model(src, tgt)
    enc, state = model.encode(src), {}
    steps = [model.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert not any("cross" in k for k in state)
    assert len(greedy_search(model, src, max_len_b=5)) == 2


def test_parameters_are_the_decoder_without_cross_attention() -> None:
    d, f, L = 32, 64, 2
    layer = 4 * d * d + 2 * d * f + f + d + 2 * 2 * d  # self-attention, FFN, two LayerNorms
    assert count_parameters(make()) == V * d + L * layer + 2 * d
    assert count_parameters(make(self_attention=PHRASAL)) - count_parameters(make()) == L * 2 * (3 - 1) * d * d


@pytest.fixture(scope="module")
def mono_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny prepared monolingual corpus (one language: ``en``)."""
    from nmtflow.data.prepare import prepare

    root = tmp_path_factory.mktemp("mono")
    for split, n, seed in (("train", 600, 5), ("valid", 40, 6)):
        (root / f"{split}.en").write_text("".join(s + "\n" for s in copy_sentences(n, seed)), encoding="utf-8")
    prepare({"train": str(root / "train"), "valid": str(root / "valid")}, ["en"], root / "data", vocab_size=40,
            byte_fallback=False, progress=False)
    return root / "data"


def test_trains_on_monolingual_text_and_perplexity_evaluates(mono_data: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(data={
        "model": lm_config(self_attention=PHRASAL, dropout=0.0),
        "data": {"path": str(mono_data), "src_lang": "en", "tgt_lang": "en", "max_tokens": 400},
        "train": {"save_dir": str(tmp_path / "lm"), "lr": 3e-3, "warmup_updates": 5, "max_updates": 12,
                  "validate_every": 12, "save_every": 12, "log_every": 1, "progress": False,
                  "valid_bleu": False, "early_stop_metric": "loss", "label_smoothing": 0.0}})
    result = Trainer(cfg, resume=False).train()
    losses = [e["loss"] for e in result.history if e["kind"] == "train"]
    assert losses[-1] < losses[0]
    valid_nll = [e["nll"] for e in result.history if e["kind"] == "valid"][-1]
    ckpt = tmp_path / "lm" / "checkpoint_last.pt"
    assert main(["evaluate", "--perplexity", str(ckpt), "--data", str(mono_data), "--split", "valid", "--json"]) == 0
    ppl = json.loads(capsys.readouterr().out)
    assert ppl["tokens"] > 0 and ppl["sentences"] == 40
    assert ppl["ppl"] == pytest.approx(math.exp(valid_nll), rel=1e-4)  # the trainer's validation, same numbers
    assert ppl["ppl"] < V  # better than uniform after a few updates
    assert main(["evaluate", str(ckpt), "--perplexity", "--data", str(mono_data)]) == 0
    assert "perplexity = " in capsys.readouterr().out
    assert read_log(tmp_path / "lm")  # the ordinary training log


def test_lm_presets_load() -> None:
    repo = Path(__file__).resolve().parents[2]
    for name in ("lm-base.yaml", "lm-phrasal-12-base.yaml"):
        cfg = load_config(repo / "configs" / name)
        assert cfg.model.name == "lm" and cfg.model.d_model == 512 and not cfg.train.valid_bleu
    assert load_config(repo / "configs" / "lm-phrasal-12-base.yaml").model.self_attention.ngrams == [1, 2]
