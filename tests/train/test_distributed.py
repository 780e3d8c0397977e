"""Data parallelism: two gloo ranks on CPU equal one process that accumulates the same batches."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from nmtflow.config import to_dict
from nmtflow.train.checkpoint import load_checkpoint
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
    threads = torch.get_num_threads()
    try:  # one process, two batches per update: b0+b1, b2+b3, ...
        Trainer(small_config(copy_data, tmp_path / "single", update_freq=2)).train()
    finally:
        torch.set_num_threads(threads)
    # two ranks, one batch each: rank 0 takes b0, b2, ...; rank 1 takes b1, b3, ... (sampler shards)
    config = small_config(copy_data, tmp_path / "ddp", update_freq=1)
    cfg_file = tmp_path / "ddp.yaml"
    cfg_file.write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "nmtflow", "train", str(cfg_file)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    def losses(d: Path) -> list[float]:
        return [e["loss"] for e in read_log(d) if e["kind"] == "train"]

    single, ddp = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert len(single) == len(ddp) == UPDATES  # rank 1 wrote nothing: one line per update
    assert ddp == pytest.approx(single, rel=1e-5)
    a = load_checkpoint(tmp_path / "single" / "checkpoint_last.pt")
    b = load_checkpoint(tmp_path / "ddp" / "checkpoint_last.pt")
    assert a["progress"]["update"] == b["progress"]["update"] == UPDATES
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=1e-5, atol=1e-5)
