"""Checkpoints: written atomically, loaded with ``weights_only=True``, averaged.

A checkpoint is a plain dict of tensors and primitive values (no pickled classes), so loading never runs
code: ``format``, ``config`` (the whole experiment as a dict), ``model`` (state dict), ``vocab``
(sizes), ``langs``, ``tokenizers`` (the SentencePiece models as uint8 tensors: a checkpoint is
self-contained), and for resuming ``optimizer``, ``scheduler``, ``progress``, ``rng``.
"""
from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from nmtflow.data.tokenizer import same_model
from nmtflow.runtime import new_file_mode

FORMAT = "nmtflow-1"
LOCK_NAME = ".lock"  # in a save dir: held by the process that trains there

log = logging.getLogger(__name__)
_held_locks: dict[str, int] = {}  # save dir (real path) → descriptor of its locked .lock file


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file."""


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None], what: str, mode: int | None = None) -> None:
    """``write(file)`` to a temporary file in ``path``'s directory, fsync, then rename it over ``path``.

    The file gets ``mode``, by default the permissions of any new file (``0o666`` less the umask), not the
    temporary file's 0600. A failed write (a full disk, say) leaves ``path`` as it was and raises an ``OSError``
    naming it and ``what`` it holds.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise OSError(f"{path}: could not write {what} ({reason[:200]}); it is unchanged") from None
        raise


def save_atomic(obj: dict[str, Any], path: str | Path) -> None:
    """torch.save ``obj`` to ``path`` through :func:`write_atomic`."""
    write_atomic(path, lambda handle: torch.save(obj, handle), "the checkpoint")


def write_text_atomic(path: Path, text: str, what: str) -> None:
    """``text`` (UTF-8) to ``path`` through :func:`write_atomic`, keeping an existing file's permissions."""
    mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else None
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")), what, mode)


class SaveDirBusy(ValueError):
    """Another process is training in the save dir; the message names it and that process."""


def lock_save_dir(save_dir: str | Path) -> None:
    """Hold an exclusive lock on ``save_dir/.lock`` for this process, until :func:`unlock_save_dir` or exit.

    A second training in the same directory (the same job launched twice) then stops with an error naming the
    directory and the first one's pid, instead of overwriting its checkpoints. The operating system drops the
    lock when the process ends, however it ends (``kill -9`` included), so a stale lock never blocks a resume.
    Taking it again in the same process is a no-op; on a file system without ``flock`` there is no lock.
    """
    import fcntl

    key = os.path.realpath(save_dir)
    if key in _held_locks:
        return
    lock = Path(save_dir) / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, new_file_mode())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise SaveDirBusy(f"{save_dir}: another training is running in this directory (pid {owner}); wait for "
                          "it to end, or give this one another save dir") from None
    except OSError as exc:  # e.g. a network file system without flock
        os.close(fd)
        log.debug("%s: not locked (%s)", lock, exc)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held_locks[key] = fd


def unlock_save_dir(save_dir: str | Path) -> None:
    """Release the lock of :func:`lock_save_dir` (the ``.lock`` file stays: removing it would race a waiter)."""
    fd = _held_locks.pop(os.path.realpath(save_dir), None)
    if fd is not None:
        os.close(fd)


def remove_interrupted_saves(save_dir: str | Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes (and of log.jsonl or config.yaml rewrites) that never finished
    (a ``kill -9`` or power loss during :func:`write_atomic`); call it only under
    :func:`lock_save_dir`, when no save can be in progress."""
    leftovers = [p for pattern in (".checkpoint_*.tmp", ".log.jsonl.*.tmp", ".config.yaml.*.tmp")
                 for p in Path(save_dir).glob(pattern) if p.is_file()]
    for path in leftovers:
        path.unlink(missing_ok=True)
    if leftovers:
        log.warning("%s: removed %d unfinished write(s) of an earlier, killed run: %s", save_dir,
                    len(leftovers), ", ".join(p.name for p in leftovers))
    return leftovers


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load safely (``weights_only=True``); any failure becomes a one-line CheckpointError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: a directory, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({exc.strerror or exc})") from None
    if magic != b"PK\x03\x04":  # torch.save writes a zip archive
        what = "an empty file" if not magic else "not a PyTorch checkpoint file"
        raise CheckpointError(f"{path}: not an nmtflow checkpoint ({what})")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated, corrupted
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.split(". This is an internal miniz error")[0]  # the rest is PyTorch's advice
        raise CheckpointError(f"{path}: not a readable nmtflow checkpoint, truncated or corrupted "
                              f"({reason[:200]})") from None
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
    first: dict[str, Any] = {}
    for p in paths:
        ckpt = load_checkpoint(p)
        model = ckpt.get("model")
        if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
            raise CheckpointError(f"{p}: holds no model parameters to average")
        if not first:
            first = ckpt
        else:
            _check_same_model(first, ckpt, paths[0], p)
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


def _check_same_model(first: dict[str, Any], other: dict[str, Any], first_path: Path, path: Path) -> None:
    """Checkpoints can be averaged only if they hold the same model: parameters, shapes, config and vocabulary."""
    a, b = first["model"], other["model"]
    problem = None
    if a.keys() != b.keys():
        problem = "parameters differ"
    elif (k := next((k for k in a if a[k].shape != b[k].shape), None)) is not None:
        problem = f"{k} has shape {tuple(b[k].shape)}, not {tuple(a[k].shape)}"
    elif (first.get("config") or {}).get("model") != (other.get("config") or {}).get("model"):
        problem = "the model config differs"
    elif first.get("vocab") != other.get("vocab") or first.get("langs") != other.get("langs"):
        problem = "the vocabulary or languages differ"
    else:
        ta, tb = first.get("tokenizers") or {}, other.get("tokenizers") or {}
        if ta.keys() != tb.keys() or any(not same_model(ta[k].numpy().tobytes(), tb[k].numpy().tobytes()) for k in ta):
            problem = "the SentencePiece models differ"
    if problem:
        raise CheckpointError(f"{path}: {problem} from {first_path}; only checkpoints of one model can be averaged")
