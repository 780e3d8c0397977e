"""Robustness: graceful SIGTERM + exact resume, crash-safe checkpoints, mixed precision, NaN updates,
and property-based checks that bad input only ever raises a ValueError subclass naming the file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nmtflow.checkpoint import FORMAT, load_checkpoint, save_atomic
from nmtflow.config import ConfigError, load_config, to_dict
from nmtflow.data.corpus import CorpusError, iter_parallel
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.decode.translate import Translator
from nmtflow.train import trainer as trainer_module
from nmtflow.train.trainer import Trainer, read_log

from tests.conftest import WORDS, tiny_config

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def small_config(data: Path, save_dir: Path, **train: object):
    config = tiny_config(data, save_dir, valid_bleu=False, validate_every=0, save_every=0, threads=1, **train)
    config.model.d_model, config.model.ffn_dim = 32, 64
    config.data.max_tokens = 300
    return config


def train_in_process(config, trainer_cls: type[Trainer] = Trainer) -> Trainer:
    threads = torch.get_num_threads()
    try:
        trainer = trainer_cls(config)
        trainer.train()
        return trainer
    finally:
        torch.set_num_threads(threads)


def losses(save_dir: Path) -> list[tuple[int, float]]:
    return [(e["update"], e["loss"]) for e in read_log(save_dir) if e["kind"] == "train"]


def test_sigterm_then_resume_reproduces_the_uninterrupted_losses(copy_data: Path, tmp_path: Path) -> None:
    updates = 40
    cut = small_config(copy_data, tmp_path / "cut", max_updates=updates)
    cfg_file = tmp_path / "cut.yaml"
    cfg_file.write_text(yaml.safe_dump(to_dict(cut)), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "nmtflow", "train", str(cfg_file)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(losses(tmp_path / "cut")) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]  # interrupted: not the exit status of a finished run
    stopped = load_checkpoint(tmp_path / "cut" / "checkpoint_last.pt")["progress"]
    assert 3 <= stopped["update"] < updates and stopped["stopped"].startswith("interrupted")

    train_in_process(cut)  # resumes from checkpoint_last.pt
    train_in_process(small_config(copy_data, tmp_path / "full", max_updates=updates))
    assert len(losses(tmp_path / "full")) == updates
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")


def test_kill_9_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_last.pt"
    save_atomic({"format": FORMAT, "step": 0, "w": torch.zeros(3)}, path)
    script = textwrap.dedent(f"""
        import torch
        from nmtflow.checkpoint import FORMAT, save_atomic
        big = {{"format": FORMAT, "w": torch.randn(8_000_000)}}
        for step in range(1, 1000):
            big["step"] = step
            save_atomic(big, {str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(tmp_path.glob(".*.tmp")), "the writer never started a checkpoint"
        time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no clean-up code runs
        proc.wait()
    ckpt = load_checkpoint(path)  # the last complete checkpoint, never a torn one
    assert ckpt["format"] == FORMAT and ckpt["w"].numel() in (3, 8_000_000)


def test_bf16_autocast_trains_on_cpu(copy_data: Path, tmp_path: Path) -> None:
    trainer = train_in_process(small_config(copy_data, tmp_path / "bf16", max_updates=3, precision="bf16"))
    assert trainer.progress.update == 3
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in losses(tmp_path / "bf16"))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_bf16_autocast_trains_an_lstm_model_on_cpu(copy_data: Path, tmp_path: Path) -> None:
    # oneDNN has no bf16 LSTM on most CPUs: the LSTMs run in float32 inside the autocast region
    config = small_config(copy_data, tmp_path / "rnn", max_updates=2, precision="bf16")
    config.model = load_config(data={"model": {"name": "rnn", "hidden_dim": 32, "encoder_layers": 1,
                                               "decoder_layers": 1}}).model
    trainer = train_in_process(config)
    assert trainer.progress.update == 2
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in losses(tmp_path / "rnn"))


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_gpu_precisions_on_cpu_and_unknown_precision_are_config_errors(copy_data: Path, tmp_path: Path,
                                                                       precision: str) -> None:
    with pytest.raises(ConfigError, match=f"{precision} needs a CUDA device"):
        Trainer(small_config(copy_data, tmp_path / precision, precision=precision, device="cpu"))
    with pytest.raises(ConfigError, match="train.precision"):
        tiny_config(copy_data, tmp_path / "x", precision="fp8")


def test_a_nan_batch_is_skipped_and_too_many_stop_training(copy_data: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = trainer_module.label_smoothed_nll
    calls = {"n": 0, "bad": {3}}

    def flaky(logits, target, eps, **options):
        calls["n"] += 1
        loss, nll = real(logits, target, eps, **options)
        return (loss * float("nan"), nll) if calls["n"] in calls["bad"] else (loss, nll)

    monkeypatch.setattr(trainer_module, "label_smoothed_nll", flaky)
    trainer = train_in_process(small_config(copy_data, tmp_path / "nan", max_updates=5))
    log = read_log(tmp_path / "nan")
    assert [e["kind"] for e in log].count("skip") == 1
    assert trainer.progress.update == 5 and len(losses(tmp_path / "nan")) == 5
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    calls.update(n=0, bad=set(range(1, 100)))
    trainer = train_in_process(small_config(copy_data, tmp_path / "nan2", max_updates=50, max_bad_updates=3))
    assert trainer.progress.update == 0
    assert "3 consecutive non-finite losses" in trainer.progress.stopped


def test_an_fp16_overflow_lowers_the_scale_and_does_not_count_as_an_update(copy_data: Path, tmp_path: Path) -> None:
    """Gradients that overflow at the fp16 loss scale (the loss finite): the scale is halved and the batch
    dropped; the update count and the learning-rate schedule do not advance, the parameters do not change.
    A loss scale that falls below MIN_LOSS_SCALE stops training. (A GradScaler on the CPU stands in for CUDA's.)"""
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(small_config(copy_data, tmp_path / "fp16", max_updates=4))
    finally:
        torch.set_num_threads(threads)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    weight = next(trainer.model.parameters())
    overflows = {"left": 2}

    def overflow_once(grad: torch.Tensor) -> torch.Tensor:
        if overflows["left"] > 0:
            overflows["left"] -= 1
            return grad * float("inf")
        return grad

    weight.register_hook(overflow_once)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    batch = next(trainer.batches())[2]
    stats = trainer.train_step([batch])
    assert stats["skipped"] == 1.0 and stats["overflow"] == 1.0 and trainer.scaler.get_scale() == 512.0
    assert trainer.scheduler.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    result = trainer.train()  # the second overflow comes in the loop
    assert result.progress.update == 4 and trainer.scheduler.last_epoch == 4 and trainer.scaler.get_scale() == 256.0
    kinds = [e["kind"] for e in read_log(tmp_path / "fp16")]
    assert kinds.count("overflow") == 1 and "skip" not in kinds and len(losses(tmp_path / "fp16")) == 4

    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1e-4)  # one more overflow takes it below the minimum
    overflows["left"] = 1
    trainer.config.train.max_updates = 10
    trainer.progress.stopped = ""
    result = trainer.train()
    assert result.progress.update == 4 and "stopped after the fp16 loss scale fell below 0.0001" in result.progress.stopped


# ---- property-based: bad input is a ValueError naming the file, never a crash ----------------------------


@pytest.fixture(scope="module")
def tiny_translator(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Translator:
    save = tmp_path_factory.mktemp("tiny")
    config = small_config(copy_data, save, max_updates=2)
    config.decode.beam_size = 2
    train_in_process(config)
    return Translator.from_checkpoint(save / "checkpoint_last.pt")


@PROPERTY
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_corpus_reader_on_random_bytes(tmp_path: Path, a: bytes, b: bytes) -> None:
    files = [tmp_path / "x.src", tmp_path / "x.tgt"]
    files[0].write_bytes(a)
    files[1].write_bytes(b)
    try:
        rows = list(iter_parallel(files))
    except CorpusError as exc:
        assert str(exc).startswith(str(tmp_path)) and "\n" not in str(exc)
    else:
        assert all(isinstance(t, str) for _, row in rows for t in row)


@PROPERTY
@given(text=st.text(max_size=200))
def test_corpus_reader_on_random_unicode(tmp_path: Path, text: str) -> None:
    files = [tmp_path / "u.src", tmp_path / "u.tgt"]
    for f in files:
        f.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        rows = list(iter_parallel(files))
    except CorpusError as exc:  # lone surrogates are not valid UTF-8
        assert str(files[0]) in str(exc)
    else:
        assert all(src == tgt for _, (src, tgt) in rows)


@PROPERTY
@given(words=st.lists(st.sampled_from(WORDS), max_size=12), noise=st.text(max_size=50))
def test_tokenizer_round_trip(copy_data: Path, words: list[str], noise: str) -> None:
    tok = Tokenizer(copy_data / "spm.model")
    text = " ".join(words)
    assert tok.decode(tok.encode(text)) == text  # in-vocabulary text round-trips exactly
    try:
        tok.decode(tok.encode(noise))  # anything else may lose characters, but never crashes
    except ValueError as exc:
        assert str(tok.path) in str(exc)


@PROPERTY
@given(lines=st.lists(st.text(max_size=40), min_size=1, max_size=3))
def test_translate_and_score_on_random_unicode(tiny_translator: Translator, lines: list[str]) -> None:
    translator = tiny_translator
    try:
        out = translator.translate(lines)
        scores = translator.score(lines, lines)
    except ValueError:
        return
    assert len(out) == len(scores) == len(lines)


def test_one_training_per_save_dir_and_killed_saves_are_cleaned(copy_data: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A second training in a save dir in use stops with an error naming it; a finished one releases the dir;
    the temporary file of a checkpoint write cut short by ``kill -9`` is removed when training starts there."""
    import fcntl

    from nmtflow.cli import main

    save = tmp_path / "run"
    save.mkdir()
    config = small_config(copy_data, save, max_updates=2)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    other = os.open(save / ".lock", os.O_RDWR | os.O_CREAT)  # another process's training holds the directory
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(other, b"4242\n")
        threads = torch.get_num_threads()
        try:
            code = main(["train", str(cfg_file)])
        finally:
            torch.set_num_threads(threads)
        err = capsys.readouterr().err
        assert code == 2 and f"{save}: another training is running in this directory (pid 4242)" in err
        assert not (save / "checkpoint_last.pt").exists()
    finally:
        os.close(other)  # that process ends: its lock goes with it
    torn = save / ".checkpoint_last.pt.k9x2ab.tmp"
    torn.write_bytes(b"\x80\x02 half a checkpoint")
    train_in_process(config)
    assert not torn.exists() and (save / "checkpoint_last.pt").is_file()
    probe = os.open(save / ".lock", os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when train() returned
    finally:
        os.close(probe)
