"""Shared fixtures: a tiny prepared copy-task corpus (made in a temp dir, never downloaded)."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Iterator

import pytest
import torch

# the CI machine's 2 cores: 2 intra-op threads, or 1 in each of pytest-xdist's workers (``-n 2``)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, 2 // WORKERS))

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]


def copy_sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(n)]


def write_split(prefix: Path, src: list[str], tgt: list[str], langs: tuple[str, str] = ("src", "tgt")) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for lang, lines in zip(langs, (src, tgt)):
        Path(f"{prefix}.{lang}").write_text("".join(s + "\n" for s in lines), encoding="utf-8")


@pytest.fixture(scope="session")
def copy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared copy task (source = target), joint vocabulary: the smallest thing a model can learn."""
    from nmtflow.data.corpus import CleanConfig
    from nmtflow.data.prepare import prepare

    root = tmp_path_factory.mktemp("copy")
    train, valid = copy_sentences(3000, 1), copy_sentences(100, 2)
    write_split(root / "raw" / "train", train, train)
    write_split(root / "raw" / "valid", valid, valid)
    out = root / "data"
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["src", "tgt"], out,
            vocab_size=60, byte_fallback=False, joint=True, clean=CleanConfig())
    return out


def tiny_config(data: Path, save_dir: Path, **train: object) -> "object":
    """A 2+2-layer d=64 Transformer config for fast CPU tests."""
    from nmtflow.config import load_config

    raw = {
        "model": {"name": "transformer", "d_model": 64, "ffn_dim": 128, "heads": 4, "encoder_layers": 2,
                  "decoder_layers": 2, "dropout": 0.1},
        "data": {"path": str(data), "src_lang": "src", "tgt_lang": "tgt", "max_tokens": 600},
        "train": {"save_dir": str(save_dir), "lr": 3e-3, "warmup_updates": 50, "max_updates": 40,
                  "validate_every": 20, "save_every": 20, "log_every": 1, "progress": False,
                  "valid_bleu_max_sentences": 50, **train},
        "decode": {"beam_size": 4},
    }
    return load_config(data=raw)


def padded_batch(vocab: int, seed: int = 1, pad_from: tuple[int, int] = (6, 4),
                 tgt_len: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (src, tgt) ids for 3 sentences of 9 source tokens; sources 2 and 3 padded after ``pad_from`` tokens,
    targets (``tgt_len``) start with BOS."""
    from nmtflow.data.vocab import BOS, PAD

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (3, 9), generator=g)
    src[1, pad_from[0]:] = PAD
    src[2, pad_from[1]:] = PAD
    tgt = torch.randint(4, vocab, (3, tgt_len), generator=g)
    tgt[:, 0] = BOS
    return src, tgt


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one intra-op thread than on two (and spare a busy machine); a module opts in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
