"""The attention bridge's training loss (SPEC §5 as the paper's code weighs it): every sentence adds its penalty once
against its own summed token cross-entropy, and the update divides the whole by its target tokens, so the ratio
between a sentence's penalty and its cross-entropy does not depend on the rest of its batch or on update_freq (the
DDP equivalence of the same loss is tested in test_distributed.py)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from nmtflow.config import load_config
from nmtflow.data.batching import Batch
from nmtflow.data.multilingual import PairBatch
from nmtflow.data.vocab import PAD
from nmtflow.nn.bridge import bridge_penalty
from nmtflow.train.loss import label_smoothed_nll

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA, EPSILON = 0.7, 0.1


@pytest.fixture(scope="module")
def en_de(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus

    root = tmp_path_factory.mktemp("bridge-loss")
    generate_corpus(root / "raw", langs=("en", "de"), n_train=60, n_valid=4, n_test=2, seed=3)
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["en", "de"],
            root / "data", vocab_size=100, byte_fallback=False, joint=False, progress=False)
    return root / "data"


def trainer_for(data: Path, save_dir: Path, scale: str):
    from nmtflow.train.multilingual import MultilingualTrainer

    return MultilingualTrainer(load_config(data={
        "model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0,
                  "bridge_heads": 3, "bridge_dim": 8, "input_feeding": True, "bridge_bias": True,
                  "penalty": LAMBDA, "penalty_scale": scale},
        "data": {"path": str(data), "max_tokens": 240, "multilingual": {"pairs": ["en-de"]}},
        "train": {"save_dir": str(save_dir), "lr": 1e-3, "warmup_updates": 0, "clip_norm": 0.0,
                  "label_smoothing": EPSILON, "validate_every": 0, "save_every": 0, "progress": False,
                  "threads": 1}}))


def sentence(b: Batch, i: int) -> Batch:
    """Row ``i`` of ``b`` alone, its padding trimmed."""
    src, tgt_in, tgt_out = b.src[i:i + 1], b.tgt_in[i:i + 1], b.tgt_out[i:i + 1]
    s, t = int(src.ne(PAD).sum()), int(tgt_out.ne(PAD).sum())
    return PairBatch(src[:, :s], tgt_in[:, :t], tgt_out[:, :t], b.indices[i:i + 1], b.src_lang, b.tgt_lang)


def sentence_terms(model: torch.nn.Module, one: Batch, squared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed smoothed token cross-entropy, penalty ‖AAᵀ − I‖_F or its square) of one sentence, computed here."""
    enc = model.encode(one.src)
    ce, _ = label_smoothed_nll(model.decode(one.tgt_in, enc), one.tgt_out, EPSILON)
    return ce, bridge_penalty(enc["bridge_attention"], squared=squared)[0]


def per_sentence_gradient(trainer, batches: list[Batch], weight: float, squared: bool) -> list[torch.Tensor]:
    """∇ (Σ_sentences CE_s + weight·P_s) / T, every sentence computed alone: what the update's gradient must be."""
    model = copy.deepcopy(trainer.model).train()
    tokens = sum(b.num_tgt_tokens for b in batches)
    total = torch.zeros(())
    for b in batches:
        pair = model.pair(b.src_lang, b.tgt_lang)
        for i in range(b.size):
            ce, penalty = sentence_terms(pair, sentence(b, i), squared)
            total = total + ce + weight * penalty
    (total / tokens).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def update_gradient(trainer, batches: list[Batch]) -> list[torch.Tensor]:
    """The gradient that ``train_step`` applied (clipping off; gradients stay in ``.grad`` after the step)."""
    before = copy.deepcopy(trainer.model.state_dict())
    trainer.train_step(batches)
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.model.parameters()]
    trainer.model.load_state_dict(before)
    return grads


@pytest.mark.parametrize(("scale", "weight", "squared"), [("paper", LAMBDA / 64, False),
                                                          ("squared_sum", LAMBDA, True)])
def test_each_sentence_adds_its_penalty_once_against_its_summed_token_losses(en_de: Path, tmp_path: Path, scale: str,
                                                                           weight: float, squared: bool) -> None:
    trainer = trainer_for(en_de, tmp_path / scale, scale)
    b1, b2 = [b for b in map(trainer.train_data.batch, trainer.epoch_batches(1)) if b.size > 1][:2]
    # one batch, two batches in one update (update_freq 2), and each batch's sentences alone: one formula
    for batches in ([b1], [b2], [b1, b2]):
        for got, want in zip(update_gradient(trainer, batches), per_sentence_gradient(trainer, batches, weight,
                                                                                      squared)):
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-6)


def test_the_paper_weighting_is_weak_against_the_cross_entropy_and_the_legacy_one_is_not(en_de: Path,
                                                                                         tmp_path: Path) -> None:
    """The paper's code weighs a sentence's penalty ~1/64 of its unsquared norm; the earlier SPEC weighed the mean
    squared penalty against the per-token mean cross-entropy: about one sentence length (T/B) more per sentence."""
    trainer = trainer_for(en_de, tmp_path / "legacy", "legacy_mean")
    b = trainer.train_data.batch(trainer.epoch_batches(1)[0])
    pair = trainer.model.pair(b.src_lang, b.tgt_lang)
    enc = pair.encode(b.src)
    squares = bridge_penalty(enc["bridge_attention"])
    legacy = pair.auxiliary_loss(enc, b.num_tgt_tokens)
    torch.testing.assert_close(legacy, LAMBDA * squares.mean() * b.num_tgt_tokens)
    pair.config.penalty_scale = "paper"
    paper = pair.auxiliary_loss(enc, b.num_tgt_tokens)
    torch.testing.assert_close(paper, LAMBDA * squares.add(1e-10).sqrt().sum() / 64)
    assert legacy > 10 * paper


def test_earlier_names_of_the_legacy_weightings_still_load() -> None:
    """Checkpoints of earlier versions hold penalty_scale sentence/token: they keep meaning what they meant."""
    for old, new in (("sentence", "legacy_mean"), ("token", "legacy_per_source_token")):
        assert load_config(data={"model": {"name": "bridge", "penalty_scale": old}}).model.penalty_scale == new
    from nmtflow.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.penalty_scale: expected one of paper, squared_sum"):
        load_config(data={"model": {"name": "bridge", "penalty_scale": "batch"}})
    with pytest.raises(ConfigError, match=r"model.penalty_batch: must be >= 1"):
        load_config(data={"model": {"name": "bridge", "penalty_batch": 0}})
