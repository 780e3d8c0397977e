"""Data parallelism: two gloo ranks on CPU equal one process that accumulates the same batches (bilingual and
multilingual training, validation included); a DDP run resumes exactly and refuses another number of processes."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from nmtflow.checkpoint import load_checkpoint
from nmtflow.config import ConfigError, load_config, to_dict
from nmtflow.train.distributed import DistInfo, all_reduce, env_info
from nmtflow.train.trainer import Trainer, read_log

from tests.conftest import tiny_config

UPDATES = 6


def small_config(data: Path, save_dir: Path, **train: object):
    config = tiny_config(data, save_dir, max_updates=UPDATES, valid_bleu=False, validate_every=0, save_every=0,
                         lr=1e-3, warmup_updates=1, threads=1, **train)
    model = config.model
    model.d_model, model.ffn_dim, model.dropout = 32, 64, 0.0  # no dropout: both runs are deterministic
    config.data.max_tokens = 300
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cfg_file: Path, *args: str) -> None:
    """``torchrun --nproc-per-node 2 -m nmtflow train CFG ARGS`` on CPU (gloo), one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "nmtflow", "train", str(cfg_file),
           *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def write_config(config, path: Path) -> Path:
    path.write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    return path


def losses(d: Path) -> list[float]:
    return [e["loss"] for e in read_log(d) if e["kind"] == "train"]


def last(d: Path, kind: str) -> dict:
    return [e for e in read_log(d) if e["kind"] == kind][-1]


def test_env_info_defaults_to_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert env_info() == DistInfo(0, 1, 0)
    assert all_reduce([1.0, 2.0], torch.device("cpu")) == [1.0, 2.0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK=5"):
        env_info()


def test_two_gloo_ranks_match_one_process_with_accumulation(copy_data: Path, tmp_path: Path) -> None:
    def config(name: str, update_freq: int):
        c = small_config(copy_data, tmp_path / name, update_freq=update_freq)
        c.train.valid_bleu, c.train.valid_bleu_max_sentences = True, 15  # validated (sharded) at the end
        return c

    threads = torch.get_num_threads()
    try:  # one process, two batches per update: b0+b1, b2+b3, ...
        Trainer(config("single", 2)).train()
    finally:
        torch.set_num_threads(threads)
    # two ranks, one batch each: rank 0 takes b0, b2, ...; rank 1 takes b1, b3, ... (sampler shards)
    torchrun(write_config(config("ddp", 1), tmp_path / "ddp.yaml"))

    single, ddp = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert len(single) == len(ddp) == UPDATES  # rank 1 wrote nothing: one line per update
    assert ddp == pytest.approx(single, rel=1e-5)
    v1, v2 = last(tmp_path / "single", "valid"), last(tmp_path / "ddp", "valid")  # each rank validated half
    assert [e["kind"] for e in read_log(tmp_path / "ddp")].count("valid") == 1
    assert v2["nll"] == pytest.approx(v1["nll"], rel=1e-5) and v2["bleu"] == pytest.approx(v1["bleu"], abs=1e-6)
    a = load_checkpoint(tmp_path / "single" / "checkpoint_last.pt")
    b = load_checkpoint(tmp_path / "ddp" / "checkpoint_last.pt")
    assert a["progress"]["update"] == b["progress"]["update"] == UPDATES
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=1e-5, atol=1e-5)


def test_interrupted_ddp_run_resumes_exactly_and_refuses_another_world_size(copy_data: Path, tmp_path: Path) -> None:
    def config(name: str, updates: int):
        c = small_config(copy_data, tmp_path / name)
        c.model.dropout, c.train.max_updates = 0.1, updates  # dropout: each rank's RNG stream matters
        return c

    torchrun(write_config(config("full", UPDATES), tmp_path / "full.yaml"))
    cut = write_config(config("cut", 3), tmp_path / "cut.yaml")
    torchrun(cut)
    ckpt = load_checkpoint(tmp_path / "cut" / "checkpoint_last.pt")
    ranks = ckpt["rng"]["ranks"]
    assert ckpt["world_size"] == 2 and len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])
    torchrun(cut, "--set", f"train.max_updates={UPDATES}")  # resumes at update 3
    assert len(losses(tmp_path / "full")) == UPDATES
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")  # bit for bit
    with pytest.raises(ConfigError, match=r"checkpoint_last.pt: written by a run of 2 process\(es\) but this run has"):
        Trainer(config("cut", 2 * UPDATES))


@pytest.fixture(scope="module")
def multiway(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus

    root = tmp_path_factory.mktemp("multiway")
    generate_corpus(root / "raw", langs=("en", "de"), n_train=200, n_valid=6, n_test=2, seed=1)
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["en", "de"],
            root / "data", vocab_size=120, byte_fallback=False, progress=False)
    return root / "data"


def test_multilingual_ddp_shards_directions_like_one_process(multiway: Path, tmp_path: Path) -> None:
    from nmtflow.train.multilingual import MultilingualTrainer

    def config(name: str, update_freq: int):
        return load_config(data={
            "model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0,
                      "bridge_heads": 2, "bridge_dim": 8, "input_feeding": False},
            "data": {"path": str(multiway), "max_tokens": 300, "multilingual": {"langs": ["en", "de"]}},
            "train": {"save_dir": str(tmp_path / name), "lr": 5e-3, "warmup_updates": 1, "max_updates": 4,
                      "update_freq": update_freq, "validate_every": 0, "save_every": 0, "log_every": 1,
                      "progress": False, "threads": 1, "valid_bleu_max_sentences": 6},
            "decode": {"beam_size": 1, "max_len_b": 3}})

    threads = torch.get_num_threads()
    try:  # round robin: en-de, de-en, en-de, ...; one process takes both directions in each update
        trainer = MultilingualTrainer(config("single", 2))
        assert [str(trainer.train_data.directions[i]) for i, _ in trainer.epoch_batches(1)[:2]] == ["en-de", "de-en"]
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    torchrun(write_config(config("ddp", 1), tmp_path / "ddp.yaml"))  # rank 0: en-de, rank 1: de-en

    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)
    assert len(losses(tmp_path / "ddp")) == 4
    for kind in ("valid", "valid_directions"):
        a, b = last(tmp_path / "single", kind), last(tmp_path / "ddp", kind)
        assert b.keys() == a.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6) for k in a if k != "kind")
    a = load_checkpoint(tmp_path / "single" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(tmp_path / "ddp" / "checkpoint_last.pt")["model"]
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-5, atol=1e-5)


def test_language_rotating_sampler_shards_interleave_into_the_unsharded_epoch() -> None:
    from nmtflow.data.batching import TokenBatchSampler
    from nmtflow.data.multilingual import LanguageRotatingSampler
    from nmtflow.train.distributed import unshard

    sizes = [np.arange(1, n + 1) % 9 + 1 for n in (40, 25, 33)]
    for schedule in ("round_robin", "weighted"):
        def sampler(**shard: int) -> LanguageRotatingSampler:
            return LanguageRotatingSampler([TokenBatchSampler(s, s, 30, seed=i) for i, s in enumerate(sizes)],
                                           schedule, 3, **shard)

        whole = sampler().batches(2)
        parts = [sampler(num_shards=3, shard_id=r).batches(2) for r in range(3)]
        assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(whole) // 3
        merged = unshard(parts, 3 * len(parts[0]))
        assert [(i, rows.tolist()) for i, rows in merged] == [(i, rows.tolist()) for i, rows in whole[:len(merged)]]
