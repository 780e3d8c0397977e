"""Checkpoints: written atomically, loaded with ``weights_only=True``, averaged.

A checkpoint is a plain dict of tensors and primitive values (no pickled classes), so loading never runs
code: ``format``, ``config`` (the whole experiment as a dict), ``model`` (state dict), ``vocab``
(sizes), ``langs``, ``tokenizers`` (the SentencePiece models as uint8 tensors: a checkpoint is
self-contained), ``run_id`` (the training run that wrote it: checkpoints of different runs are not averaged by
mistake), ``integrity`` (a SHA-256 code of every tensor, checked on loading: a bit flipped on a disk or in a copy
is an error, not a different model), and for resuming ``optimizer``, ``scheduler``, ``progress``, ``rng``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch

from nmtflow.config import architecture_changes
from nmtflow.data.locks import LockHeld, lock_file
from nmtflow.data.tokenizer import same_model
from nmtflow.runtime import new_file_mode

FORMAT = "nmtflow-1"
TORCH_MAGIC = b"PK\x03\x04"  # the first bytes of what torch.save writes (a zip archive)
INTEGRITY = "integrity"  # the checkpoint's key of its integrity code (see integrity_code)
LOCK_NAME = ".lock"  # in a save dir: held by the process that trains there

log = logging.getLogger(__name__)
_held_locks: dict[str, int] = {}  # save dir (real path) → descriptor of its locked .lock file


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file."""


def write_failure(path: str | Path, what: str, exc: BaseException, *, unchanged: bool = False) -> OSError:
    """An ``OSError`` naming ``path`` and ``what`` could not be written to it, with the system's reason (a full disk:
    "No space left on device"), and that the file is ``unchanged``; it keeps ``exc``'s errno (``errno.ENOSPC``)."""
    reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    error = OSError(f"{path}: could not write {what} ({reason[:200]})" + ("; it is unchanged" if unchanged else ""))
    error.errno = getattr(exc, "errno", None)
    return error


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None], what: str, mode: int | None = None) -> None:
    """``write(file)`` to a temporary file in ``path``'s directory, fsync, then rename it over ``path``.

    The file gets ``mode``, by default the permissions of any new file (``0o666`` less the umask), not the
    temporary file's 0600. A failed write (a full disk, say) leaves ``path`` as it was and raises an ``OSError``
    naming it and ``what`` it holds, also where the temporary file cannot be made.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # a full disk or inode table, a read-only directory: the target named, not the temporary
        raise write_failure(path, what, exc, unchanged=os.path.exists(path)) from None
    handle: _RecordingWriter | None = None
    try:
        os.fchmod(fd, new_file_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as file:
            handle = _RecordingWriter(file)
            write(handle)  # type: ignore[arg-type]
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            cause = handle.error if handle is not None and handle.error is not None else exc
            raise write_failure(path, what, cause, unchanged=True) from None
        raise


class _RecordingWriter:
    """A binary file that keeps the ``OSError`` its ``write`` raised: ``torch.save`` swallows it and reports
    only "unexpected pos N vs M", where the system's reason ("File too large", "No space left on device") matters."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:  # flush, tell, fileno, ...
        return getattr(self._file, name)


def integrity_code(obj: dict[str, Any]) -> dict[str, Any]:
    """The integrity code of checkpoint ``obj``: the SHA-256 of each tensor's dtype, shape and bytes, by its place
    in ``obj`` (``model/encoder.embed.weight``), and of each top-level entry's other values (``config``, ``langs``,
    ``progress``, ...: :func:`_settings_digest`); ``obj``'s own code, if any, is left out.

    Each tensor is read once, where it lies (a tensor on an accelerator is copied to the host for it), and a tensor
    held under two names (tied embeddings) is hashed once.
    """
    seen: dict[tuple, str] = {}
    digests: dict[str, str] = {}
    for name, tensor in _tensors({k: v for k, v in obj.items() if k != INTEGRITY}):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype, tensor.device) if tensor.numel() else None
        if key is None or key not in seen:
            digest = _tensor_digest(tensor)
            if key is not None:
                seen[key] = digest
        digests[name] = digest if key is None else seen[key]
    settings = {str(key): _settings_digest(value) for key, value in obj.items() if key != INTEGRITY}
    return {"algorithm": "sha256", "tensors": digests, "settings": settings}


def _settings_digest(value: Any) -> str:
    """SHA-256 of ``value``'s structure and values other than tensors (whose bytes the tensor digests cover): the
    config, languages, progress and the like, which a flipped bit would otherwise change unnoticed."""
    digest = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            digest.update(b"T;")
        elif isinstance(item, dict):
            digest.update(b"{")
            for key, inner in item.items():
                feed(key)
                feed(inner)
            digest.update(b"}")
        elif isinstance(item, (list, tuple)):
            digest.update(b"[" if isinstance(item, list) else b"(")
            for inner in item:
                feed(inner)
            digest.update(b"]")
        else:  # str, int, float, bool, None, dtype: what weights_only loading lets a checkpoint hold
            digest.update(f"{type(item).__name__}:{item!r};".encode("utf-8", "surrogatepass"))

    feed(value)
    return digest.hexdigest()


def _tensors(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(place, tensor) for every tensor in ``obj``'s dicts, lists and tuples, in their order."""
    if isinstance(obj, torch.Tensor):
        yield "/".join(path), obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, (*path, str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, (*path, str(i)))


def _tensor_digest(tensor: torch.Tensor) -> str:
    digest = hashlib.sha256(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
    if tensor.numel():
        data = tensor.detach().cpu().reshape(-1)  # no copy for a contiguous tensor on the host
        digest.update(data.view(torch.uint8).numpy())
    return digest.hexdigest()


def check_integrity(ckpt: dict[str, Any], path: str | Path) -> None:
    """A :class:`CheckpointError` naming ``path`` and the first tensor whose bytes, or top-level entry whose other
    values (config, languages, progress), differ from the integrity code saved with them; a checkpoint without a
    code (written before nmtflow stored one) cannot be checked, one without settings digests only by its tensors."""
    saved = ckpt.get(INTEGRITY)
    if saved is None:
        return
    advice = ("the file changed after it was written (a disk, copy or transfer fault, or an edit not saved with "
              "nmtflow); use an intact copy")
    if not (isinstance(saved, dict) and saved.get("algorithm") == "sha256" and isinstance(saved.get("tensors"), dict)):
        raise CheckpointError(f"{path}: corrupted: its integrity code is unreadable; {advice}")
    expected: dict[str, Any] = saved["tensors"]
    found = integrity_code(ckpt)["tensors"]
    for name, digest in found.items():
        if name not in expected:
            raise CheckpointError(f"{path}: corrupted: it holds a tensor {name} that was not there when it was "
                                  f"saved; {advice}")
        if digest != expected[name]:
            raise CheckpointError(f"{path}: corrupted: the bytes of {name} differ from those it was saved with "
                                  f"(integrity code); {advice}")
    missing = next((name for name in expected if name not in found), None)
    if missing is not None:
        raise CheckpointError(f"{path}: corrupted: the tensor {missing} it was saved with is missing; {advice}")
    settings = saved.get("settings")  # none in checkpoints written before nmtflow covered them
    if isinstance(settings, dict):
        for key, value in ckpt.items():
            if key != INTEGRITY and settings.get(str(key)) != _settings_digest(value):
                what = "was not there when it was saved" if str(key) not in settings else \
                    "differs from what it was saved with (integrity code)"
                raise CheckpointError(f"{path}: corrupted: its {key!r} entry {what}; {advice}")
        present = {str(k) for k in ckpt}
        gone = next((key for key in settings if key not in present), None)
        if gone is not None:
            raise CheckpointError(f"{path}: corrupted: its {gone!r} entry it was saved with is missing; {advice}")


def new_run_id() -> str:
    """A new training run's id, stored in every checkpoint it writes (see :func:`average_checkpoints`)."""
    return uuid.uuid4().hex


def save_atomic(obj: dict[str, Any], path: str | Path, code: dict[str, Any] | None = None) -> None:
    """torch.save ``obj`` with its :func:`integrity_code` to ``path`` through :func:`write_atomic`.

    ``code``: ``integrity_code(obj)`` when the caller has it already (one dict saved to several files is hashed
    once); a code that ``obj`` holds is replaced.
    """
    sealed = {**obj, INTEGRITY: integrity_code(obj) if code is None else code}
    write_atomic(path, lambda handle: torch.save(sealed, handle), "the checkpoint")


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
    key = os.path.realpath(save_dir)
    if key in _held_locks:
        return
    try:
        fd = lock_file(Path(save_dir) / LOCK_NAME, new_file_mode())
    except LockHeld as held:
        raise SaveDirBusy(f"{save_dir}: another training is running in this directory (pid {held.owner}); wait for "
                          "it to end, or give this one another save dir") from None
    if fd is not None:
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
    """Load safely (``weights_only=True``) and check the integrity code; any failure becomes a one-line
    CheckpointError naming the file."""
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
    if magic != TORCH_MAGIC:
        what = "an empty file" if not magic else "not a PyTorch checkpoint file"
        raise CheckpointError(f"{path}: not an nmtflow checkpoint ({what})")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated, corrupted, or objects that only running code could rebuild
        refused = _weights_only_refusal(str(exc))
        if refused is not None:
            raise CheckpointError(f"{path}: not an nmtflow checkpoint: it holds objects that loading without running "
                                  f"code (weights_only=True, the only way nmtflow loads) cannot rebuild; PyTorch "
                                  f"says: {refused}") from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.split(". This is an internal miniz error")[0]  # the rest is PyTorch's advice
        raise CheckpointError(f"{path}: not a readable nmtflow checkpoint, truncated or corrupted "
                              f"({reason[:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an nmtflow checkpoint (format {FORMAT!r} expected)")
    check_integrity(ckpt, path)
    return ckpt


def _weights_only_refusal(message: str) -> str | None:
    """PyTorch's reason, whole and on one line, for refusing a file under ``weights_only=True`` (None: another
    failure). Its advice to load with ``weights_only=False`` around the reason is left out."""
    if "Weights only load failed" not in message:
        return None
    message = re.sub(r"\x1b\[[0-9;]*m", "", message)  # terminal bold
    marker = "WeightsUnpickler error:"
    if marker in message:
        reason = message.split(marker, 1)[1].split("\n\n")[0]
    else:  # another wording: all of it
        reason = message
    return " ".join(reason.split())


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of the file's bytes (what ``sha256sum`` prints), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_tokenizers(ckpt: dict[str, Any], path: str | Path) -> dict[str, bytes]:
    """Language → the serialized SentencePiece model a checkpoint embeds: a multilingual one's per language, a
    bilingual one's ``src`` and ``tgt`` models under its languages (``langs``)."""
    saved = ckpt.get("tokenizers")
    if not isinstance(saved, dict) or not saved:
        raise CheckpointError(f"{path}: holds no SentencePiece models (written by an early nmtflow version)")
    if ckpt.get("multilingual"):
        return {str(lang): data.cpu().numpy().tobytes() for lang, data in saved.items()}
    langs = ckpt.get("langs") or {}
    if not {"src", "tgt"} <= saved.keys() or not {"src", "tgt"} <= langs.keys():
        raise CheckpointError(f"{path}: its SentencePiece models are not named by language (src and tgt expected)")
    models = {str(langs[side]): saved[side].cpu().numpy().tobytes() for side in ("tgt", "src")}  # src's if one lang
    return {lang: models[lang] for lang in dict.fromkeys((str(langs["src"]), str(langs["tgt"])))}


def model_mismatch(exc: BaseException, limit: int = 300) -> str:
    """The informative line of an error rebuilding a checkpoint's model: for ``load_state_dict``, the first
    mismatch (``size mismatch for ...``, ``Missing key(s) ...``), not its "Error(s) in loading state_dict" header."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    return lines[0][:limit]


PERIODIC_NAME = re.compile(r"checkpoint_(\d+)\.pt")  # checkpoint_UPDATE.pt, every train.save_every updates


def is_training_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is one training gives the checkpoints of its save dir (last, best, periodic)."""
    return name in ("checkpoint_last.pt", "checkpoint_best.pt") or PERIODIC_NAME.fullmatch(name) is not None


def periodic_checkpoints(save_dir: str | Path) -> list[Path]:
    """``checkpoint_UPDATE.pt`` files in ``save_dir``, oldest first."""
    found = []
    for p in Path(save_dir).glob("checkpoint_*.pt"):
        m = PERIODIC_NAME.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def average_checkpoints(paths: list[Path], *, allow_different_runs: bool = False) -> dict[str, Any]:
    """Element-wise mean of the model parameters of ``paths``; the rest is taken from the last one.

    The checkpoints must hold one model (:func:`_check_same_model`) and come from one training run (their
    ``run_id``; checkpoints written before runs had ids pass): the mean of independently trained models is far
    worse than either, so averaging several runs (a model soup) takes ``allow_different_runs``, and the result gets
    a run id of its own.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    first: dict[str, Any] = {}
    runs: dict[str, list[Path]] = {}
    last: dict[str, Any] = {}
    for p in paths:
        ckpt = load_checkpoint(p)
        model = ckpt.get("model")
        if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
            raise CheckpointError(f"{p}: holds no model parameters to average")
        if not first:
            first = ckpt
        else:
            _check_same_model(first, ckpt, paths[0], p)
        if ckpt.get("run_id") is not None:
            runs.setdefault(str(ckpt["run_id"]), []).append(p)
        for k, v in model.items():
            v = v.double() if v.is_floating_point() else v
            total[k] = total[k] + v if k in total and v.is_floating_point() else v
        last = ckpt
    if len(runs) > 1 and not allow_different_runs:
        listed = "; ".join(f"run {run[:8]}: {', '.join(str(p) for p in group)}" for run, group in runs.items())
        raise CheckpointError(f"checkpoints of {len(runs)} different training runs ({listed}); the average of "
                              "independently trained models is far worse than each, so only checkpoints of one "
                              "run are averaged (to average several runs, a model soup, add --allow-different-runs)")
    ref = last["model"]
    averaged = {k: (v / len(paths)).to(ref[k].dtype) if v.is_floating_point() else v for k, v in total.items()}
    keep = {k: v for k, v in last.items() if k not in ("optimizer", "scheduler", "rng", "progress", INTEGRITY)}
    keep["model"] = averaged
    keep["averaged_from"] = [str(p) for p in paths]
    if len(runs) > 1:  # a model of its own
        keep["run_id"] = new_run_id()
    return keep


def _check_same_model(first: dict[str, Any], other: dict[str, Any], first_path: Path, path: Path) -> None:
    """Checkpoints can be averaged only if they hold the same model: parameters, shapes, architecture (the model
    config but its regularisation: a fine-tuned model with another dropout is the same model) and vocabulary."""
    a, b = first["model"], other["model"]
    problem = None
    if a.keys() != b.keys():
        problem = "parameters differ"
    elif (k := next((k for k in a if a[k].shape != b[k].shape), None)) is not None:
        problem = f"{k} has shape {tuple(b[k].shape)}, not {tuple(a[k].shape)}"
    elif changed := architecture_changes((first.get("config") or {}).get("model"),
                                         (other.get("config") or {}).get("model")):
        shown = "; ".join(f"{key}: {in_this!r}, not {in_first!r}" for key, in_first, in_this in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        problem = f"the model differs ({shown}{more})"
    elif first.get("vocab") != other.get("vocab") or first.get("langs") != other.get("langs"):
        problem = "the vocabulary or languages differ"
    else:
        ta, tb = first.get("tokenizers") or {}, other.get("tokenizers") or {}
        if ta.keys() != tb.keys() or any(not same_model(ta[k].numpy().tobytes(), tb[k].numpy().tobytes()) for k in ta):
            problem = "the SentencePiece models differ"
    if problem:
        raise CheckpointError(f"{path}: {problem} from {first_path}; only checkpoints of one model can be averaged")
