"""Fine-tuning (train.init_from, --init-from; prepare --tokenizer-from): a new run from a trained model's weights on
data of another domain, its fresh optimiser and schedule, its checks, its resume, and a multilingual model
fine-tuned on some of its directions."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from nmtflow.checkpoint import load_checkpoint, save_atomic
from nmtflow.cli import main
from nmtflow.config import ConfigError, to_dict
from nmtflow.data.prepare import load_meta, prepare
from nmtflow.data.tokenizer import same_model
from nmtflow.evaluate.perplexity import checkpoint_perplexity
from nmtflow.train.finetune import may_change
from nmtflow.train.multilingual import MultilingualTrainer
from nmtflow.train.optim import build_optimizer, build_scheduler
from nmtflow.train.trainer import Trainer

from tests.conftest import copy_sentences, write_split
from tests.train.test_resume import small_config
from tests.train.test_robustness import losses, train_in_process
from tests.train.test_train_review import bridge_run

pytestmark = pytest.mark.usefixtures("one_thread")


def reversed_words(lines: list[str]) -> list[str]:
    return [" ".join(reversed(line.split())) for line in lines]


@pytest.fixture(scope="module")
def base(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Transformer trained on the copy task (domain A): its checkpoint_last.pt."""
    save_dir = tmp_path_factory.mktemp("base") / "run"
    train_in_process(small_config(copy_data, save_dir, max_updates=40))
    return save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def reversal(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Domain B, the same words with the target's word order reversed, prepared with the base model's tokenizer
    (``nmtflow prepare --tokenizer-from``): a small training split and a held-out one."""
    root = tmp_path_factory.mktemp("reversal")
    train, valid = copy_sentences(400, 11), copy_sentences(60, 12)
    write_split(root / "raw" / "train", train, reversed_words(train))
    write_split(root / "raw" / "valid", valid, reversed_words(valid))
    assert main(["prepare", "--train", str(root / "raw" / "train"), "--valid", str(root / "raw" / "valid"),
                 "--tokenizer-from", str(base), "--out", str(root / "data")]) == 0
    return root / "data"


def finetune_config(data: Path, save_dir: Path, init: Path | None, **train: object):
    config = small_config(data, save_dir, **{"lr": 2e-3, "warmup_updates": 1, **train})
    config.train.init_from = None if init is None else str(init)
    return config


def test_fine_tuning_on_another_domain_lowers_its_held_out_nll(base: Path, reversal: Path, tmp_path: Path) -> None:
    config = finetune_config(reversal, tmp_path / "ft", None, max_updates=30)
    config_file = tmp_path / "ft.yaml"
    config_file.write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    assert main(["train", str(config_file), "--init-from", str(base)]) == 0
    before = checkpoint_perplexity(base, reversal, "valid")["nll"]
    after = checkpoint_perplexity(tmp_path / "ft" / "checkpoint_last.pt", reversal, "valid")["nll"]
    # the copy model reads the reversed order badly; 30 updates on 400 pairs of it make it likelier
    assert after < before - 0.3, (before, after)


def test_a_fine_tuning_run_starts_afresh_from_the_weights(base: Path, reversal: Path, tmp_path: Path) -> None:
    source = load_checkpoint(base)
    assert source["progress"]["update"] == 40 and source["optimizer"]["state"]
    trainer = Trainer(finetune_config(reversal, tmp_path / "ft", base, max_updates=3, warmup_updates=10))
    mine = trainer.model.state_dict()
    assert mine.keys() == source["model"].keys() and all(torch.equal(mine[k], v) for k, v in source["model"].items())
    assert vars(trainer.progress) == vars(type(trainer.progress)())  # update 0, epoch 1, position 0, no best
    assert not trainer.optimizer.state_dict()["state"]  # no Adam moments
    fresh = build_optimizer([torch.nn.Parameter(torch.zeros(1))], trainer.config.train)  # the warm-up starts again
    build_scheduler(fresh, trainer.config.train)
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert trainer.scheduler.last_epoch == 0 and lr == fresh.param_groups[0]["lr"] < source["scheduler"]["_last_lr"][0]
    assert trainer.run_id != source["run_id"]
    trainer.train()
    ckpt = load_checkpoint(tmp_path / "ft" / "checkpoint_last.pt")
    assert ckpt["progress"]["update"] == 3 and ckpt["run_id"] == trainer.run_id
    assert ckpt["init_from"] == {"path": str(base), "run_id": source["run_id"], "update": 40,
                                 "sha256": hashlib.sha256(base.read_bytes()).hexdigest()}
    assert [u for u, _ in losses(tmp_path / "ft")] == [1, 2, 3]


def test_which_settings_may_change() -> None:
    assert may_change("train.lr") and may_change("data.path") and may_change("decode.beam_size")
    assert may_change("model.dropout") and may_change("model.backbone.attention_dropout")
    assert not may_change("model") and not may_change("model.d_model")
    assert not may_change("model.encoder_self_attention.type")


def test_another_architecture_is_refused_naming_the_settings(base: Path, reversal: Path, tmp_path: Path) -> None:
    config = finetune_config(reversal, tmp_path / "ft", base)
    config.model.d_model, config.model.decoder_layers = 48, 1
    with pytest.raises(ConfigError, match=r"fine-tuning keeps the checkpoint's architecture, but the config's model "
                                          r"differs \(model\.d_model: 32 → 48; model\.decoder_layers: 2 → 1\)"):
        Trainer(config)
    assert not (tmp_path / "ft" / "checkpoint_last.pt").exists()
    config = finetune_config(reversal, tmp_path / "ft", base)
    config.model.dropout, config.train.label_smoothing, config.train.optimizer = 0.3, 0.0, "adamw"
    Trainer(config)  # regularisation and every train setting may change


def test_tensors_that_do_not_fit_are_named(base: Path, reversal: Path, tmp_path: Path) -> None:
    edited = load_checkpoint(base)
    name = next(k for k in edited["model"] if k.startswith("decoder."))
    del edited["model"][name]
    first = next(iter(edited["model"]))
    edited["model"][first] = edited["model"][first][:-1]
    save_atomic(edited, tmp_path / "edited.pt")  # a consistent file: its integrity code is its own
    with pytest.raises(ConfigError, match=rf"edited\.pt: its tensors do not fit this model \(missing {name}; shape: "
                                          rf"{first} is \("):
        Trainer(finetune_config(reversal, tmp_path / "ft", tmp_path / "edited.pt"))


def test_data_of_another_vocabulary_is_refused(base: Path, reversal: Path, tmp_path: Path) -> None:
    raw = reversal.parent / "raw"
    prepare({"train": str(raw / "train"), "valid": str(raw / "valid")}, ["src", "tgt"], tmp_path / "own",
            vocab_size=50, progress=False, byte_fallback=False)  # its own SentencePiece model
    with pytest.raises(ConfigError, match=r"own: prepared with another vocabulary than .*checkpoint_last\.pt \(its src "
                                          r"SentencePiece model differs\); prepare the data to fine-tune on with "
                                          r"nmtflow prepare --tokenizer-from"):
        Trainer(finetune_config(tmp_path / "own", tmp_path / "ft", base))


def test_a_separate_vocabulary_model_fed_its_reverse_direction_is_told_so(tmp_path: Path) -> None:
    """Data of the reverse direction of a separate-vocabulary model holds the checkpoint's two SentencePiece models
    swapped: the refusal says that (not "prepare with --tokenizer-from", which the user has done)."""
    from nmtflow.data.tokenizer import Tokenizer
    from nmtflow.decode.translate import bytes_tensor
    from nmtflow.train.finetune import check_tokenizers

    write_split(tmp_path / "raw" / "train", copy_sentences(400, 3), [s.upper() for s in copy_sentences(400, 3)])
    meta = prepare({"train": str(tmp_path / "raw" / "train")}, ["src", "tgt"], tmp_path / "sep", vocab_size=40,
                   joint=False, progress=False, byte_fallback=False)
    toks = {lang: Tokenizer(tmp_path / "sep" / meta["tokenizers"][lang]) for lang in ("src", "tgt")}
    assert not same_model(toks["src"].model_proto, toks["tgt"].model_proto)
    ckpt = {"tokenizers": {side: bytes_tensor(tok.model_proto) for side, tok in toks.items()}}
    check_tokenizers(ckpt, "m.pt", "data", toks)  # its own direction: fine
    with pytest.raises(ConfigError, match=r"^rev: its source and target vocabularies are m\.pt's swapped: this data "
                                          r"runs the other way than the checkpoint"):
        check_tokenizers(ckpt, "m.pt", "rev", {"src": toks["tgt"], "tgt": toks["src"]})
    with pytest.raises(ConfigError, match=r"prepared with another vocabulary than m\.pt \(its tgt"):
        check_tokenizers(ckpt, "m.pt", "other", {"src": toks["src"], "tgt": toks["src"]})


def test_prepare_tokenizer_from_gives_the_checkpoints_token_ids(copy_data: Path, base: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    raw = copy_data.parent / "raw"
    assert main(["prepare", "--train", str(raw / "train"), "--valid", str(raw / "valid"), "--tokenizer-from",
                 str(base), "--langs", "src", "tgt", "--out", str(tmp_path / "again")]) == 0
    meta, original = load_meta(tmp_path / "again"), load_meta(copy_data)
    assert meta["joint"] and meta["tokenizers"] == original["tokenizers"] == {"src": "spm.model", "tgt": "spm.model"}
    assert same_model((tmp_path / "again" / "spm.model").read_bytes(), (copy_data / "spm.model").read_bytes())
    for split in ("train", "valid"):
        for lang in ("src", "tgt"):
            for ext in ("bin", "idx"):
                name = f"{split}.{lang}.{ext}"
                assert (tmp_path / "again" / name).read_bytes() == (copy_data / name).read_bytes(), name
    assert (tmp_path / "again" / "spm.vocab").read_text(encoding="utf-8").splitlines()[:2] == ["<pad>\t0", "<unk>\t0"]
    capsys.readouterr()
    assert main(["prepare", "--train", str(raw / "train"), "--tokenizer-from", str(base), "--langs", "src", "de",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--langs de: " in capsys.readouterr().err
    assert main(["prepare", "--train", str(raw / "train"), "--tokenizer-from", str(base), "--vocab-size", "90",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--tokenizer-from uses the checkpoint's SentencePiece models as they are; --vocab-size" in \
        capsys.readouterr().err


def test_a_fine_tuning_run_resumes_from_its_own_checkpoint(base: Path, reversal: Path, tmp_path: Path) -> None:
    init = tmp_path / "init.pt"
    init.write_bytes(base.read_bytes())
    full = train_in_process(finetune_config(reversal, tmp_path / "full", init, max_updates=6))
    train_in_process(finetune_config(reversal, tmp_path / "cut", init, max_updates=3))
    recorded = load_checkpoint(tmp_path / "cut" / "checkpoint_last.pt")["init_from"]
    init.unlink()  # resuming never reads it again
    resumed = train_in_process(finetune_config(reversal, tmp_path / "cut", init, max_updates=6))
    assert losses(tmp_path / "cut") == losses(tmp_path / "full") and len(losses(tmp_path / "full")) == 6
    assert resumed.run_id == load_checkpoint(tmp_path / "cut" / "checkpoint_last.pt")["run_id"] != full.run_id
    assert load_checkpoint(tmp_path / "cut" / "checkpoint_last.pt")["init_from"] == recorded
    # resumed with another checkpoint to start from: refused; the same file moved elsewhere is the same start
    with pytest.raises(ConfigError, match=r"cut/checkpoint_last\.pt: this run was fine-tuned from .*init\.pt "
                                          r"\(sha256 [0-9a-f]{12}…\), not from .*full/checkpoint_last\.pt"):
        Trainer(finetune_config(reversal, tmp_path / "cut", tmp_path / "full" / "checkpoint_last.pt"))
    moved = tmp_path / "moved.pt"
    moved.write_bytes(base.read_bytes())
    assert Trainer(finetune_config(reversal, tmp_path / "cut", moved)).progress.update == 6
    # the trained checkpoint copied into a new save dir: not taken for the fine-tuning run's own
    (tmp_path / "copied").mkdir()
    (tmp_path / "copied" / "checkpoint_last.pt").write_bytes(base.read_bytes())
    with pytest.raises(ConfigError, match=r"copied/checkpoint_last\.pt: a run trained from scratch, not one "
                                          r"fine-tuned from"):
        Trainer(finetune_config(reversal, tmp_path / "copied", base))
    # a fresh start of the same fine-tuning needs its checkpoint
    with pytest.raises(ValueError, match=r"init\.pt: checkpoint not found"):
        Trainer(finetune_config(reversal, tmp_path / "cut", init), resume=False)


def bridge_config(data: Path, save_dir: Path, updates: int, init: Path | None = None, **multilingual: object):
    """tests.train.test_train_review's tiny attention bridge, fine-tuned from ``init``."""
    config = bridge_run(data, save_dir, updates, **multilingual)
    config.train.init_from = None if init is None else str(init)
    return config


def test_a_multilingual_model_fine_tuned_on_one_direction_keeps_all_its_languages(tmp_path: Path) -> None:
    from nmtflow.data.synthetic import generate_corpus

    generate_corpus(tmp_path / "raw", langs=("en", "de", "fr"), n_train=120, n_valid=4, n_test=2, seed=1)
    prepare({"train": str(tmp_path / "raw" / "train"), "valid": str(tmp_path / "raw" / "valid")}, ["en", "de", "fr"],
            tmp_path / "data", vocab_size=120, joint=False, progress=False, byte_fallback=False)
    train_in_process(bridge_config(tmp_path / "data", tmp_path / "base", 3), MultilingualTrainer)
    init = tmp_path / "base" / "checkpoint_last.pt"
    source = load_checkpoint(init)
    # in-domain en→de only (another seed), prepared with the model's en and de tokenizers
    generate_corpus(tmp_path / "in", langs=("en", "de"), n_train=60, n_valid=4, n_test=2, seed=7)
    assert main(["prepare", "--train", str(tmp_path / "in" / "train"), "--valid", str(tmp_path / "in" / "valid"),
                 "--tokenizer-from", str(init), "--langs", "en", "de", "--out", str(tmp_path / "in-data")]) == 0
    assert load_meta(tmp_path / "in-data")["tokenizers"] == {"en": "spm.en.model", "de": "spm.de.model"}
    trainer = MultilingualTrainer(bridge_config(tmp_path / "in-data", tmp_path / "ft", 3, init, pairs=["en-de"]))
    assert [str(d) for d in trainer.directions] == ["en-de"]
    trainer.train()
    ckpt = load_checkpoint(tmp_path / "ft" / "checkpoint_last.pt")
    assert ckpt["vocab"] == source["vocab"] and ckpt["model"].keys() == source["model"].keys()
    assert set(ckpt["langs"]["directions"]) == set(source["langs"]["directions"])  # it still translates them all
    assert ckpt["tokenizers"].keys() == source["tokenizers"].keys()
    assert all(same_model(ckpt["tokenizers"][k].numpy().tobytes(), v.numpy().tobytes())
               for k, v in source["tokenizers"].items())
    changed = {k for k, v in source["model"].items() if not torch.equal(v, ckpt["model"][k])}
    assert any(".en." in k for k in changed) and any(".de." in k for k in changed)
    assert not any(".fr." in k for k in changed)  # no fr batch: its modules are as trained
    assert load_checkpoint(tmp_path / "ft" / "checkpoint_last.pt")["init_from"]["path"] == str(init)
    # a bilingual config is refused for it, naming the kinds
    with pytest.raises(ConfigError, match=r"holds a multilingual model but the config trains a bilingual one"):
        Trainer(small_config(tmp_path / "in-data", tmp_path / "bi", init_from=str(init)))



def test_a_comparison_fine_tunes_with_train_init_from(base: Path, reversal: Path, tmp_path: Path) -> None:
    """nmtflow compare: a run whose overrides set train.init_from fine-tunes (on a directory prepared with
    --tokenizer-from); the same config without it trains from scratch."""
    from nmtflow.evaluate.compare import run_comparison

    model = load_checkpoint(base)["config"]["model"]
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"model": model}), encoding="utf-8")
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({
        "name": "finetune", "data": {"path": str(reversal), "directions": ["src-tgt"],
                                     "splits": {"train": "train", "valid": "valid"}},
        "overrides": ["train.lr=2e-3", "train.warmup_updates=1", "train.valid_bleu=false", "train.log_every=1",
                      "train.progress=false", "train.validate_every=0", "data.max_tokens=300"],
        "runs": [{"name": "scratch", "config": "model.yaml"},
                 {"name": "finetuned", "config": "model.yaml", "overrides": [f"train.init_from={base}"]}],
        "budget": {"updates": 5}, "seeds": [1], "test_sets": ["valid"], "threads": 1, "bootstrap_samples": 0,
        "isolate": False, "decode": {"beam_size": 1, "max_len_a": 1.2, "max_len_b": 4}}), encoding="utf-8")
    run_comparison(tmp_path / "exp.yaml", out=tmp_path / "out")
    ckpts = {name: load_checkpoint(next((tmp_path / "out" / "runs" / name).rglob("checkpoint_last.pt")))
             for name in ("scratch", "finetuned")}
    assert "init_from" not in ckpts["scratch"] and ckpts["finetuned"]["init_from"]["path"] == str(base)
    assert ckpts["finetuned"]["progress"]["update"] == ckpts["scratch"]["progress"]["update"] == 5
