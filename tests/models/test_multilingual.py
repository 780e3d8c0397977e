"""Multilingual models (SPEC §5): the bridge and language-label models, the language-rotating scheduler,
multilingual training, zero-shot translation, adding a language, sentence embeddings, downstream tasks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nmtflow.checkpoint import load_checkpoint
from nmtflow.cli import main
from nmtflow.config import ConfigError, MultilingualConfig, load_config
from nmtflow.data.batching import TokenBatchSampler
from nmtflow.data.multilingual import Direction, LanguageRotatingSampler, plan_directions
from nmtflow.data.vocab import BOS, PAD
from nmtflow.models.base import Vocabularies, build_model
from nmtflow.models.multilingual import LanguageVocabularies

REPO = Path(__file__).resolve().parents[2]
V = 40
TINY = {"hidden_dim": 32, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0}
TINY_BRIDGE = {"name": "bridge", **TINY, "bridge_heads": 3, "bridge_dim": 16, "input_feeding": False}


def make(model: dict[str, Any], vocabs: Vocabularies | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    vocabs = vocabs or LanguageVocabularies(V, V, True, encoders={"en": V, "de": V - 5}, decoders={"en": V, "de": V - 5})
    return build_model(load_config(data={"model": model}).model, vocabs).eval()


def batch(tgt_vocab: int = V - 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, V - 5, (3, 9), generator=g)
    src[1, 6:] = PAD
    src[2, 4:] = PAD
    tgt = torch.randint(4, tgt_vocab, (3, 7), generator=g)
    tgt[:, 0] = BOS
    return src, tgt


# ---- models ---------------------------------------------------------------------------------------
MODELS: list[dict[str, Any]] = [
    {**TINY_BRIDGE, "input_feeding": True, "encoder_layers": 2, "decoder_layers": 2},
    {**TINY_BRIDGE, "input_feeding": True, "decoder_layers": 2, "decoder_init": "mean",
     "encoder_output_dropout": False},
    TINY_BRIDGE,
    {**TINY_BRIDGE, "encoder": "transformer", "decoder": "transformer", "heads": 4, "ffn_dim": 64},
    {**TINY_BRIDGE, "decoder": "transformer", "heads": 4, "ffn_dim": 64},
    {**TINY_BRIDGE, "encoder": "transformer", "decoder": "transformer", "heads": 4, "ffn_dim": 64, "decoder_layers": 2,
     "encoder_self_attention": {"type": "shortcut", "feature_fusion": True},
     "decoder_self_attention": {"type": "shortcut"}},
    {**TINY_BRIDGE, "encoder": "transformer", "decoder": "transformer", "heads": 4, "ffn_dim": 64, "decoder_layers": 2,
     "encoder_self_attention": {"type": "phrasal", "ngrams": [1, 2]},
     "decoder_self_attention": {"type": "phrasal", "ngrams": [1, 2, 3]}},
    {"name": "language_label", "backbone": {"name": "rnn", **TINY, "decoder_layers": 2}},
]
MODEL_IDS = ["bridge-rnn-feed", "bridge-rnn-feed-paper-code", "bridge-rnn", "bridge-transformer", "bridge-rnn-transformer",
             "bridge-shortcuts", "bridge-phrasal", "language-label-rnn"]


@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_incremental_decoding_equals_full_forward(model: dict[str, Any]) -> None:
    net = make(model).pair("de", "de")
    src, tgt = batch()
    full = net(src, tgt)
    enc, state = net.encode(src), {}
    steps = [net.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert all(v.size(0) == src.size(0) for v in state.values())  # batch-first state


def test_bridge_on_transformer_stacks_takes_their_attention_variants() -> None:
    """Lexical shortcuts and phrasal attention in the bridge's Transformer stacks (SPEC §6) add exactly their
    SPEC §2/§3 parameters per self-attention module: 2 languages × (1 encoder + 1 decoder) layers here."""
    plain = {**TINY_BRIDGE, "encoder": "transformer", "decoder": "transformer", "heads": 4, "ffn_dim": 64}
    d, modules = TINY["hidden_dim"], 4

    def count(**slots: Any) -> int:
        return sum(p.numel() for p in make({**plain, **slots}).parameters())

    base = count()
    both = {"encoder_self_attention": {"type": "shortcut"}, "decoder_self_attention": {"type": "shortcut"}}
    assert count(**both) - base == modules * (2 * d * d + 2 * d)
    fused = {"type": "shortcut", "feature_fusion": True}
    assert count(encoder_self_attention=fused) - base == modules // 2 * (6 * d * d + 2 * d)
    assert count(decoder_self_attention={"type": "phrasal", "ngrams": [1, 2]}) - base == modules // 2 * 2 * 2 * d * d
    with pytest.raises(ConfigError, match=r"model.encoder_self_attention: 'shortcut' needs a Transformer encoder"):
        load_config(data={"model": {**TINY_BRIDGE, "encoder_self_attention": {"type": "shortcut"}}})


def test_bridge_output_penalty_and_direction_checks() -> None:
    model = make(TINY_BRIDGE)
    src, tgt = batch()
    enc = model.encode(src, lang="de")
    assert enc["bridge"].shape == (3, 3, 32) and enc["bridge_attention"].shape == (3, 3, 9)
    assert enc["bridge_attention"][2, :, 4:].abs().max() == 0  # padding gets no weight
    assert model.decode(tgt, enc, lang="en").shape == (3, 7, V)  # any decoder reads any encoder's M
    assert make({**TINY_BRIDGE, "penalty": 0.0}).auxiliary_loss(enc, 12) is None
    # each scale on the scale of the summed token cross-entropy (12 target tokens; 3 sentences of 9 + 6 + 4 tokens)
    a = enc["bridge_attention"]
    gram_off = a @ a.transpose(1, 2) - torch.eye(a.size(1))
    squares = gram_off.pow(2).sum(dim=(1, 2))  # ‖A Aᵀ − I‖²_F per sentence
    expected = {"paper": (squares + 1e-10).sqrt().sum() / 64, "squared_sum": squares.sum(),
                "legacy_mean": squares.mean() * 12, "legacy_per_source_token": squares.sum() / 19 * 12}
    for scale, value in expected.items():
        aux = make({**TINY_BRIDGE, "penalty_scale": scale, "penalty": 0.5}).auxiliary_loss(enc, 12)
        torch.testing.assert_close(aux, 0.5 * value, msg=scale)
    paper_32 = make({**TINY_BRIDGE, "penalty_batch": 32}).auxiliary_loss(enc, 12)
    torch.testing.assert_close(paper_32, expected["paper"] * 2)
    assert model.auxiliary_loss(enc, 12).item() > 0  # the default: the paper's code's weighting
    assert model.config.penalty_scale == "paper"
    with pytest.raises(ValueError, match="no encoder for language 'fr'"):
        model.pair("fr", "en")
    with pytest.raises(ValueError, match="name the language"):
        model.encode(src)
    # plain vocabularies give a bilingual bridge that keeps the plain contract
    bilingual = make(TINY_BRIDGE, Vocabularies(V, V))
    assert bilingual(src, tgt).shape == (3, 7, V)


def test_bridge_decoder_starts_from_the_mean_of_m_as_the_papers_code() -> None:
    """decoder_init: mean: h_0 = c_0 = mean over the k rows of M in every layer, no W_init (the paper's code);
    projected: tanh(W_init mean(M)), c_0 = 0."""
    src, tgt = batch()
    model = make({**TINY_BRIDGE, "decoder_layers": 2, "decoder_init": "mean"})
    enc = model.encode(src, lang="de")
    h, c = model.decoders["en"].initial_state(enc["bridge"], None)
    mean = enc["bridge"].mean(1)  # (B,d_h), computed here from M directly
    for layer in range(2):
        torch.testing.assert_close(h[layer], mean)
        torch.testing.assert_close(c[layer], mean)
    assert not any(".init." in name for name, _ in model.named_parameters())
    projected = make({**TINY_BRIDGE, "decoder_layers": 2})
    h, c = projected.decoders["en"].initial_state(enc["bridge"], None)
    assert c.abs().max() == 0 and h.abs().max() < 1
    assert any(".init." in name for name, _ in projected.named_parameters())
    # the state reaches the output: the first step's logits follow mean(M)
    shifted = {**enc, "bridge": enc["bridge"] + 0.5}
    step = (model.decode(tgt[:, :1], enc, lang="en"), model.decode(tgt[:, :1], shifted, lang="en"))
    assert not torch.allclose(*step)
    for bad, message in [({"decoder_init": "final"}, "model.decoder_init: expected one of projected, mean"),
                         ({"decoder_init": "mean", "decoder": "transformer", "heads": 4, "ffn_dim": 64},
                          "model.decoder_init: 'mean' sets an LSTM decoder's initial state"),
                         ({"encoder_output_dropout": False, "encoder": "transformer", "heads": 4, "ffn_dim": 64},
                          r"model.encoder_output_dropout: only an LSTM encoder \(encoder: rnn\)")]:
        with pytest.raises(ConfigError, match=message):
            load_config(data={"model": {**TINY_BRIDGE, **bad}})


@pytest.mark.parametrize("output_dropout", [True, False])
def test_bridge_input_dropout_follows_encoder_output_dropout(output_dropout: bool) -> None:
    """In training, dropout zeroes about a `dropout` share of H's entries, which the bridge reads, unless
    encoder_output_dropout is false (the paper's code); an LSTM's own outputs are never exactly 0."""
    model = make({**TINY_BRIDGE, "dropout": 0.5, "encoder_output_dropout": output_dropout}).train()
    src, _ = batch()
    torch.manual_seed(3)
    enc = model.encode(src, lang="de")
    zeros = (enc["out"][~enc["padding_mask"]] == 0).float().mean().item()
    assert (0.35 < zeros < 0.65) if output_dropout else zeros == 0


def test_rnn_baseline_ignores_source_padding() -> None:
    model = make({"name": "rnn", **TINY}, Vocabularies(V, V))
    src, tgt = batch()
    padded = torch.cat([src, torch.full((3, 4), PAD)], dim=1)
    torch.testing.assert_close(model(padded, tgt), model(src, tgt), atol=1e-6, rtol=1e-6)


# ---- directions and the scheduler -------------------------------------------------------------------
def test_plan_directions() -> None:
    train, zero = plan_directions(["en", "de", "fr"], MultilingualConfig(zero_shot=["de-fr", "fr-de"], copy_pairs=True))
    assert [str(d) for d in train] == ["en-de", "en-fr", "de-en", "fr-en", "en-en", "de-de", "fr-fr"]
    assert zero == [Direction("de", "fr"), Direction("fr", "de")]
    train, _ = plan_directions(["en", "de", "fr"], MultilingualConfig(langs=["en", "de"], new_langs=["fr"],
                                                                       init_checkpoint="x.pt"))
    assert [str(d) for d in train] == ["en-fr", "de-fr", "fr-en", "fr-de"]  # only directions with the new one
    with pytest.raises(ConfigError, match="'cs' is not prepared"):
        plan_directions(["en", "de"], MultilingualConfig(pairs=["en-cs"]))
    with pytest.raises(ConfigError, match="SRC-TGT"):
        Direction.parse("en")


def samplers(sizes: list[int]) -> list[TokenBatchSampler]:
    rng = np.random.default_rng(0)
    return [TokenBatchSampler(rng.integers(3, 9, n), rng.integers(3, 9, n), 40, seed=i) for i, n in enumerate(sizes)]


def test_round_robin_visits_every_pair_in_turn() -> None:
    per = samplers([50, 80, 30])
    sampler = LanguageRotatingSampler(per, "round_robin", seed=1)
    entries = sampler.batches(1)
    rounds = max(len(s.batches(1)) for s in per)
    assert [i for i, _ in entries] == [0, 1, 2] * rounds
    for i, s in enumerate(per):  # every batch of every direction, in its own order (shorter ones start over)
        mine = [rows for j, rows in entries if j == i]
        own = s.batches(1)
        assert all(np.array_equal(a, own[n % len(own)]) for n, a in enumerate(mine))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(entries, sampler.batches(1)))  # deterministic


def test_random_schedules_are_deterministic_and_weighted_by_size() -> None:
    per = samplers([40, 400])
    uniform = LanguageRotatingSampler(per, "uniform", seed=3)
    weighted = LanguageRotatingSampler(per, "weighted", seed=3)
    picks = [i for i, _ in weighted.batches(1)]
    assert picks == [i for i, _ in LanguageRotatingSampler(per, "weighted", seed=3).batches(1)]
    assert picks != [i for i, _ in weighted.batches(2)]
    assert len(picks) == sum(len(s.batches(1)) for s in per)
    assert 0.8 < np.mean(picks) < 0.97  # ∝ sentence pairs: 400 / 440 ≈ 0.91
    assert 0.3 < np.mean([i for i, _ in uniform.batches(1)]) < 0.7


# ---- training, translation, embeddings --------------------------------------------------------------
@pytest.fixture(scope="module")
def multiway(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny en/de/fr multi-way corpus, joint vocabulary with <2xx> tags."""
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus

    root = tmp_path_factory.mktemp("multiway")
    generate_corpus(root / "raw", langs=("en", "de", "fr"), n_train=300, n_valid=8, n_test=8, seed=1)
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["en", "de", "fr"],
            root / "data", vocab_size=200, byte_fallback=False, lang_tags=True, progress=False)
    return root / "data"


def test_directions_of_a_prepared_directory(multiway: Path) -> None:
    from nmtflow.data.multilingual import open_directions

    dirs = [Direction("en", "de"), Direction("de", "en")]
    data = open_directions(multiway, "train", dirs, {dirs[0]: 7}, max_sentences={"en-de": 50})
    assert data.limits == [50, len(data.bitexts[1])] and len(data) == 50 + data.limits[1]
    b = data.batch((0, np.array([3, 4]))).to("cpu")
    assert (b.src_lang, b.tgt_lang) == ("en", "de") and b.src[:, 0].tolist() == [7, 7]
    assert data.batch((1, np.array([3]))).src_lang == "de"
    with pytest.raises(ConfigError, match="fr-de"):
        open_directions(multiway, "train", dirs, max_sentences={"fr-de": 5})


def bridge_config(data: Path, save_dir: Path, updates: int, **multilingual: Any) -> Any:
    return load_config(data={
        "model": TINY_BRIDGE,
        "data": {"path": str(data), "max_tokens": 600, "multilingual": multilingual},
        "train": {"save_dir": str(save_dir), "lr": 5e-3, "warmup_updates": 5, "max_updates": updates,
                  "validate_every": updates, "save_every": updates, "log_every": 1, "progress": False,
                  "valid_bleu": False},
        "decode": {"beam_size": 2}})


@pytest.fixture(scope="module")
def base_model(multiway: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bridge model trained on en↔de (+ copies): fr is added later."""
    from nmtflow.train.multilingual import MultilingualTrainer

    save = tmp_path_factory.mktemp("base")
    MultilingualTrainer(bridge_config(multiway, save, 6, langs=["en", "de"], copy_pairs=True)).train()
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def extended(multiway: Path, base_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """fr added to the base model (fr↔en trained; de↔fr held out, validated zero-shot)."""
    from nmtflow.train.multilingual import MultilingualTrainer

    save = tmp_path_factory.mktemp("extended")
    config = bridge_config(multiway, save, 4, langs=["en", "de"], new_langs=["fr"], pairs=["en-fr", "fr-en"],
                           zero_shot=["de-fr", "fr-de"], init_checkpoint=str(base_model))
    trainer = MultilingualTrainer(config)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    first = [trainer.train_data.directions[i] for i, _ in trainer.epoch_batches(1)[:4]]
    result = trainer.train()
    return {"ckpt": save / "checkpoint_last.pt", "before": before, "first": first, "history": result.history}


def test_training_batches_rotate_and_carry_their_direction(extended: dict[str, Any]) -> None:
    assert [str(d) for d in extended["first"]] == ["en-fr", "fr-en", "en-fr", "fr-en"]
    valid = [e for e in extended["history"] if e["kind"] == "valid_directions"]
    assert valid and {"nll.en-fr", "nll.fr-en", "nll.de-fr", "nll.fr-de"} <= set(valid[-1])


def test_adding_a_language_leaves_the_bridge_and_other_languages_unchanged(
        base_model: Path, extended: dict[str, Any]) -> None:
    base = load_checkpoint(base_model)["model"]
    after = load_checkpoint(extended["ckpt"])
    trained = after["model"]
    assert after["vocab"]["encoders"].keys() == {"en", "de", "fr"}
    for key, value in base.items():  # bridge, en and de encoders/decoders: bit for bit
        assert torch.equal(trained[key], value), key
    assert any(k.startswith("bridge.") for k in base)
    new = [k for k in trained if k not in base]
    assert new and all(".fr." in k for k in new)
    assert any(not torch.equal(trained[k], extended["before"][k]) for k in new)  # fr was trained


def test_cli_translates_trained_and_zero_shot_directions(extended: dict[str, Any], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.de"
    src.write_text("der Hund schläft .\ndie Frau liest ein Buch .\n", encoding="utf-8")
    ckpt = str(extended["ckpt"])
    for direction in (["de", "fr"], ["en", "fr"], ["fr", "de"]):
        out = tmp_path / f"out.{'-'.join(direction)}"
        code = main(["translate", ckpt, "-i", str(src), "-o", str(out), "--src-lang", direction[0],
                     "--tgt-lang", direction[1], "--beam", "2", "--max-len-b", "5"])
        assert code == 0 and len(out.read_text(encoding="utf-8").split("\n")) == 3
    capsys.readouterr()
    assert main(["translate", ckpt, "-i", str(src)]) == 2
    assert "--src-lang" in capsys.readouterr().err
    assert main(["translate", ckpt, "-i", str(src), "--src-lang", "cs", "--tgt-lang", "en"]) == 2
    err = capsys.readouterr().err
    assert "'cs'" in err and err.startswith(f"nmtflow translate: error: {ckpt}: ") and len(err.splitlines()) == 1


def test_embeddings_have_the_documented_shape_and_ignore_batching(extended: dict[str, Any], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from nmtflow.analysis.embeddings import sentence_embeddings
    from nmtflow.decode.multilingual import load_multilingual

    lines = ["der Hund schläft .", "die Frau liest ein sehr langes Buch im Garten .", "ja"]
    src = tmp_path / "in.de"
    src.write_text("".join(s + "\n" for s in lines), encoding="utf-8")
    for pooling, dim in (("mean", 32), ("flat", 3 * 32)):  # d_h, k·d_h
        out = tmp_path / f"{pooling}.npy"
        assert main(["embed", str(extended["ckpt"]), "--lang", "de", "-i", str(src), "-o", str(out),
                     "--pooling", pooling]) == 0
        assert np.load(out).shape == (3, dim) and np.load(out).dtype == np.float32
    ckpt = load_multilingual(extended["ckpt"])
    together = sentence_embeddings(ckpt, "de", lines)
    for i, line in enumerate(lines):
        np.testing.assert_allclose(sentence_embeddings(ckpt, "de", [line])[0], together[i], atol=1e-6, rtol=1e-5)
    capsys.readouterr()


def test_downstream_classification_and_similarity(extended: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    train = tmp_path / "train.tsv"
    train.write_text("der Hund schläft .\tanimal\ndie Katze schläft .\tanimal\ndie Frau liest .\tperson\n"
                     "der Mann liest .\tperson\n", encoding="utf-8")
    test = tmp_path / "test.tsv"
    test.write_text("le chien dort .\tanimal\nla femme lit .\tperson\n", encoding="utf-8")
    ckpt = str(extended["ckpt"])
    assert main(["downstream", "classify", ckpt, "--train", str(train), "--lang", "de", "--test", str(test),
                 "--test-lang", "fr", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["train_accuracy"] == 1.0 and 0.0 <= result["accuracy"] <= 1.0 and result["dim"] == 32
    pairs = tmp_path / "sts.tsv"
    pairs.write_text("der Hund schläft .\tle chien dort .\t5\nder Hund schläft .\tla femme lit .\t1\n"
                     "die Frau liest .\tla femme lit .\t4.5\n", encoding="utf-8")
    assert main(["downstream", "similarity", ckpt, "--data", str(pairs), "--lang", "de", "--lang2", "fr",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["examples"] == 3 and -1.0 <= result["pearson"] <= 1.0 and -1.0 <= result["spearman"] <= 1.0


QUICK = ["data.max_tokens=600", "data.max_sentences=null", "train.max_updates=3", "train.progress=false",
         "train.valid_bleu=false", "train.warmup_updates=2"]


def train_and_translate(preset: str, sets: list[str], data: Path, save: Path, direction: tuple[str, str],
                        line: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Train ``preset`` for 3 updates with ``sets``, translate ``line`` in ``direction``; the checkpoint."""
    code = main(["train", str(REPO / "configs" / f"{preset}.yaml"), "--data", str(data), "--save-dir", str(save),
                 *[a for s in sets + QUICK for a in ("--set", s)]])
    assert code == 0
    src = save / "in.txt"
    src.write_text(line + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(save / "checkpoint_last.pt"), "-i", str(src), "--src-lang", direction[0],
                 "--tgt-lang", direction[1], "--beam", "2", "--max-len-b", "5"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    return load_checkpoint(save / "checkpoint_last.pt")


def test_language_label_preset_trains_and_translates_zero_shot(multiway: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["model.backbone.hidden_dim=32", "model.backbone.encoder_layers=1", "model.backbone.decoder_layers=1",
            "model.backbone.input_feeding=false", "data.multilingual.zero_shot=[de-fr]"]
    ckpt = train_and_translate("language-label", sets, multiway, tmp_path / "ll", ("de", "fr"),
                               "der Hund schläft .", capsys)
    assert ckpt["multilingual"] and ckpt["langs"]["zero_shot"] == ["de-fr"]


def test_a_bridge_with_shortcut_transformer_encoders_trains_and_translates(multiway: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sets = ["model.hidden_dim=32", "model.encoder=transformer", "model.decoder=transformer", "model.heads=4",
            "model.ffn_dim=64", "model.encoder_layers=2", "model.decoder_layers=1",
            "model.encoder_self_attention={type: shortcut, feature_fusion: true}"]
    ckpt = train_and_translate("bridge-k10", sets, multiway, tmp_path / "b", ("en", "de"), "the dog sleeps .", capsys)
    assert any(k.endswith("self_attn.kv_fusion.weight") for k in ckpt["model"])


@pytest.mark.parametrize("preset", ["bridge-k1", "bridge-k10", "bridge-k25", "bridge-k50", "language-label"])
def test_presets_load(preset: str) -> None:
    config = load_config(REPO / "configs" / f"{preset}.yaml")
    assert config.data.multilingual is not None
    if preset.startswith("bridge"):
        assert config.model.bridge_heads == int(preset.removeprefix("bridge-k")) and config.model.bridge_dim == 1024
