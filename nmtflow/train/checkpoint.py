"""Checkpoints: written atomically, loaded with ``weights_only=True``, averaged.

A checkpoint is a plain dict of tensors and primitive values (no pickled classes), so loading never runs
code: ``format``, ``config`` (the whole experiment as a dict), ``model`` (state dict), ``vocab``
(sizes), ``langs``, ``tokenizers`` (the SentencePiece models as uint8 tensors: a checkpoint is
self-contained), and for resuming ``optimizer``, ``scheduler``, ``progress``, ``rng``.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "nmtflow-1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file."""


def save_atomic(obj: dict[str, Any], path: str | Path) -> None:
    """torch.save to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load safely (``weights_only=True``); any failure becomes a one-line CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated, corrupted, not a checkpoint at all
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable nmtflow checkpoint ({reason[:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an nmtflow checkpoint (format {FORMAT!r} expected)")
    return ckpt


def periodic_checkpoints(save_dir: str | Path) -> list[Path]:
    """``checkpoint_UPDATE.pt`` files in ``save_dir``, oldest first."""
    found = []
    for p in Path(save_dir).glob("checkpoint_*.pt"):
        m = re.fullmatch(r"checkpoint_(\d+)\.pt", p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def average_checkpoints(paths: list[Path]) -> dict[str, Any]:
    """Element-wise mean of the model parameters of ``paths``; the rest is taken from the last one."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for p in paths:
        model = load_checkpoint(p)["model"]
        if total and model.keys() != total.keys():
            raise CheckpointError(f"{p}: parameters differ from {paths[0]}; cannot average different models")
        for k, v in model.items():
            v = v.double() if v.is_floating_point() else v
            total[k] = total[k] + v if k in total and v.is_floating_point() else v
    last = load_checkpoint(paths[-1])
    ref = last["model"]
    averaged = {k: (v / len(paths)).to(ref[k].dtype) if v.is_floating_point() else v for k, v in total.items()}
    keep = {k: v for k, v in last.items() if k not in ("optimizer", "scheduler", "rng", "progress")}
    keep["model"] = averaged
    keep["averaged_from"] = [str(p) for p in paths]
    return keep
