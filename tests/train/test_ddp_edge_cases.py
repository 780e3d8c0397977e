"""DDP edge cases under torchrun (two gloo ranks on CPU): a signal that arrives during the update that ends the run
by a budget does not cost the run its final validation (a resumed run then equals the uninterrupted one)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from nmtflow.checkpoint import load_checkpoint
from nmtflow.train.trainer import read_log

from tests.train.test_distributed import free_port, small_config, write_config

# imported by the ranks (--plugin): rank 1 sends itself SIGINT during the update that reaches train.max_updates
SIGNAL_AT_LAST_UPDATE = textwrap.dedent("""
    import os, signal
    from nmtflow.train.trainer import Trainer

    _step = Trainer.train_step

    def train_step(self, batches):
        if self.dist.rank == 1 and self.progress.update == self.config.train.max_updates - 1:
            os.kill(os.getpid(), signal.SIGINT)
        return _step(self, batches)

    Trainer.train_step = train_step
""")


def torchrun(cfg_file: Path, *args: str, plugin_dir: Path | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m nmtflow [--plugin ...] train CFG`` on CPU (gloo), one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plugin: list[str] = []
    if plugin_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), env.get("PYTHONPATH", "")])
        plugin = ["--plugin", "ddp_test_plugin"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "nmtflow", *plugin, "train",
           str(cfg_file), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def valid_updates(d: Path) -> list[int]:
    return [e["update"] for e in read_log(d) if e["kind"] == "valid"]


def test_signal_during_the_last_update_keeps_the_final_validation(copy_data: Path, tmp_path: Path) -> None:
    def config(name: str):
        c = small_config(copy_data, tmp_path / name)
        c.train.max_updates, c.train.validate_every = 6, 4  # validated at 4 and, as the run ends, at 6
        return c

    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "ddp_test_plugin.py").write_text(SIGNAL_AT_LAST_UPDATE, encoding="utf-8")
    full = torchrun(write_config(config("full"), tmp_path / "full.yaml"))
    assert full.returncode == 0, full.stderr[-3000:]
    cut = write_config(config("cut"), tmp_path / "cut.yaml")
    first = torchrun(cut, plugin_dir=tmp_path / "plugin")
    assert "signal 2 received" in first.stderr, first.stderr[-3000:]
    again = torchrun(cut)  # "resume with the same command"
    assert again.returncode == 0, again.stderr[-3000:]

    assert valid_updates(tmp_path / "full") == [4, 6]
    assert valid_updates(tmp_path / "cut") == valid_updates(tmp_path / "full")
    for name in ("full", "cut"):
        assert load_checkpoint(tmp_path / name / "checkpoint_last.pt")["progress"]["stopped"] == "reached max_updates=6"
