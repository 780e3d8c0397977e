"""Review of the multilingual models (SPEC §5): edge cases of the bridge, the directions and multilingual decoding."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nmtflow.config import ConfigError, MultilingualConfig, load_config
from nmtflow.data.multilingual import Direction, open_directions, plan_directions
from nmtflow.data.vocab import BOS, PAD
from nmtflow.nn.bridge import AttentionBridge, bridge_penalty
from tests.models.test_multilingual import multiway  # noqa: F401  (the tiny en/de/fr fixture)


def test_an_all_padding_row_gets_zero_attention_not_nan() -> None:
    """Eq. 8 masks padding; a sentence that is all padding has no position to attend to: A = 0 and M = 0 (the
    -inf fill made its softmax NaN), and neither the other sentences nor any gradient turn NaN."""
    torch.manual_seed(0)
    bridge = AttentionBridge(8, heads=3, attention_dim=5)
    h = torch.randn(2, 4, 8, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1] = True
    memory, attention = bridge(h, mask)
    assert torch.isfinite(memory).all() and torch.isfinite(attention).all()
    assert attention[1].abs().max() == 0 and memory[1].abs().max() == 0
    torch.testing.assert_close(attention[0].sum(-1), torch.ones(3))
    assert attention[0, :, 3:].abs().max() == 0
    alone, _ = bridge(h[:1, :3])
    torch.testing.assert_close(memory[0], alone[0])
    (memory.sum() + bridge_penalty(attention).sum() + bridge_penalty(attention, squared=False).sum()).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(bridge.w1.weight.grad).all()


@pytest.mark.parametrize("stacks", [{}, {"encoder": "transformer", "decoder": "transformer", "heads": 2, "ffn_dim": 32},
                                    {"penalty_scale": "squared_sum"}, {"penalty_scale": "legacy_per_source_token"}],
                         ids=["rnn", "transformer", "squared-penalty", "legacy-source-token-penalty"])
def test_a_bridge_model_with_an_all_padding_source_row_stays_finite(stacks: dict[str, Any]) -> None:
    from nmtflow.models.base import build_model
    from nmtflow.models.multilingual import LanguageVocabularies

    torch.manual_seed(0)
    vocabs = LanguageVocabularies(30, 30, True, encoders={"en": 30}, decoders={"de": 30})
    model = build_model(load_config(data={"model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1,
                                                    "decoder_layers": 1, "bridge_heads": 2, "bridge_dim": 8,
                                                    "dropout": 0.0, **stacks}}).model, vocabs).pair("en", "de")
    src = torch.randint(4, 30, (2, 5))
    src[1] = PAD
    tgt = torch.randint(4, 30, (2, 4))
    tgt[:, 0] = BOS
    enc = model.encode(src)
    logits, aux = model.decode(tgt, enc), model.auxiliary_loss(enc, 8)
    assert torch.isfinite(logits).all() and aux is not None and torch.isfinite(aux)
    (logits.sum() + aux).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---- directions and configs -----------------------------------------------------------------------------
def test_malformed_directions_name_their_option() -> None:
    for option in ("pairs", "zero_shot"):
        with pytest.raises(ConfigError, match=rf"^data\.multilingual\.{option}: direction 'en'"):
            plan_directions(["en", "de"], MultilingualConfig(**{option: ["en"]}))
    with pytest.raises(ConfigError, match=r"^data\.multilingual\.max_sentences: direction 'en_de'"):
        open_directions("unused", "train", [Direction("en", "de")], max_sentences={"en_de": 3})
    with pytest.raises(ConfigError, match="copy_pairs: true trains en-en"):
        plan_directions(["en", "de"], MultilingualConfig(langs=["en"]))
    with pytest.raises(ConfigError, match="en-de is in both pairs .trained. and zero_shot"):  # was held out silently
        plan_directions(["en", "de"], MultilingualConfig(pairs=["de-en", "en-de"], zero_shot=["en-de"]))


def test_a_language_label_model_needs_a_backbone_that_reads_the_source() -> None:
    """The ``<2xx>`` tag is in the source: a decoder-only language model never sees it."""
    with pytest.raises(ConfigError, match=r"model\.backbone\.name: 'lm' ignores the source"):
        load_config(data={"model": {"name": "language_label", "backbone": {"name": "lm"}}})


@pytest.mark.parametrize("penalty", [float("nan"), float("inf"), -1.0])
def test_the_bridge_penalty_must_be_finite_and_non_negative(penalty: float) -> None:
    """λ of Eq. 10: a NaN λ used to pass and make every training loss NaN."""
    with pytest.raises(ConfigError, match=r"model\.penalty: must be a finite number >= 0"):
        load_config(data={"model": {"name": "bridge", "penalty": penalty}})


def test_a_too_long_sentence_names_the_language_label_backbones_option(multiway: Path, tmp_path: Path) -> None:
    from nmtflow.train.multilingual import MultilingualTrainer

    config = load_config(data={
        "model": {"name": "language_label", "backbone": {"name": "transformer", "d_model": 16, "ffn_dim": 32,
                                                         "heads": 2, "encoder_layers": 1, "decoder_layers": 1,
                                                         "max_positions": 8}},
        "data": {"path": str(multiway), "max_tokens": 600, "multilingual": {"langs": ["en", "de"]}},
        "train": {"save_dir": str(tmp_path / "run"), "progress": False}})
    with pytest.raises(ConfigError, match=r"raise model\.backbone\.max_positions$"):
        MultilingualTrainer(config)


def test_every_row_a_direction_trains_on_is_length_checked(multiway: Path, tmp_path: Path) -> None:
    """``max_sentences`` gives en-de fewer en rows than en-fr: the en rows only en-fr reads are checked too (they
    used to be skipped as "en already checked", and training failed later without naming the row)."""
    from nmtflow.data.bitext import open_bitext
    from nmtflow.train.multilingual import MultilingualTrainer

    en = open_bitext(multiway, "train", "en", "fr").src.sizes
    limit = int(en[0]) + 1  # row 1 of en (with EOS) fits, a later one does not
    assert (en[1:] + 1 > limit).any()
    config = load_config(data={
        "model": {"name": "bridge", "encoder": "transformer", "decoder": "rnn", "hidden_dim": 16, "heads": 2,
                  "ffn_dim": 32, "encoder_layers": 1, "decoder_layers": 1, "bridge_heads": 2, "bridge_dim": 8,
                  "max_positions": limit},
        "data": {"path": str(multiway), "max_tokens": 600, "valid_split": "",
                 "multilingual": {"pairs": ["en-de", "en-fr"], "max_sentences": {"en-de": 1}}},
        "train": {"save_dir": str(tmp_path / "run"), "progress": False}})
    with pytest.raises(ConfigError, match=r"train\.en row \d+: a sentence of"):
        MultilingualTrainer(config)


def test_a_run_of_copy_directions_only_selects_on_them(multiway: Path, tmp_path: Path) -> None:
    """Copy directions are left out of validation, but when they are all a run trains on, leaving them out left
    nothing to select the model on (it logged nll 0, ppl 1): they are validated as the supervised directions."""
    from nmtflow.train.multilingual import MultilingualTrainer

    config = load_config(data={
        "model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "bridge_heads": 2,
                  "bridge_dim": 8, "input_feeding": False},
        "data": {"path": str(multiway), "max_tokens": 600,
                 "multilingual": {"pairs": ["en-en", "de-de"], "zero_shot": ["en-de"]}},
        "train": {"save_dir": str(tmp_path / "run"), "progress": False, "max_updates": 2, "validate_every": 2,
                  "warmup_updates": 1, "valid_bleu": False}})
    history = MultilingualTrainer(config).train().history
    valid = [e for e in history if e["kind"] == "valid"][-1]
    per = [e for e in history if e["kind"] == "valid_directions"][-1]
    assert {"nll.en-en", "nll.de-de", "nll.en-de"} <= set(per)
    assert valid["nll"] == pytest.approx((per["nll.en-en"] + per["nll.de-de"]) / 2, rel=0.05) and valid["nll"] > 1


def test_resuming_on_data_prepared_with_other_languages_names_the_directions(tmp_path: Path) -> None:
    """``langs`` defaults to every prepared language: data prepared again with one more language changes the run's
    directions under an unchanged config, which used to surface only as a vocabulary of a language never trained."""
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.train.multilingual import MultilingualTrainer

    generate_corpus(tmp_path / "raw", langs=("en", "de", "fr"), n_train=60, n_valid=4, n_test=4, seed=3)
    splits = {"train": str(tmp_path / "raw" / "train"), "valid": str(tmp_path / "raw" / "valid")}

    def config(data: Path, updates: int) -> Any:
        return load_config(data={
            "model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1,
                      "bridge_heads": 2, "bridge_dim": 8, "input_feeding": False},
            "data": {"path": str(data), "max_tokens": 600, "multilingual": {}},
            "train": {"save_dir": str(tmp_path / "run"), "progress": False, "max_updates": updates,
                      "validate_every": 0, "save_every": 1, "warmup_updates": 1, "valid_bleu": False}})

    prepare(splits, ["en", "de"], tmp_path / "two", vocab_size=80, byte_fallback=False, joint=False, progress=False)
    MultilingualTrainer(config(tmp_path / "two", 1)).train()
    prepare(splits, ["en", "de", "fr"], tmp_path / "three", vocab_size=80, byte_fallback=False, joint=False,
            progress=False)
    with pytest.raises(ConfigError, match=r"checkpoint_last\.pt: \S*three adds en-fr, de-fr, fr-en, fr-de \(the "):
        MultilingualTrainer(config(tmp_path / "three", 2))
