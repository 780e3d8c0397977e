"""Turn raw parallel text into a prepared data directory.

Layout of ``out_dir``::

    meta.json                 written last: its presence means the directory is complete
    spm.model                 joint tokenizer (or spm.LANG.model, one per language)
    SPLIT.LANG.{bin,idx}      subword ids, row i of every language is the same sentence pair

A preparation (and ``add_splits``) builds the whole directory as ``.NAME.new-PID`` beside ``out_dir`` and swaps it
in when it is complete, under an exclusive lock on ``.NAME.lock`` beside it: a crash or ``kill -9`` leaves the
old directory or the new one, never a mix, and the next preparation removes what a killed one left behind.
Files in ``out_dir`` that no preparation wrote are carried into the new directory (as hard links).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import logging
import multiprocessing
import os
import re
import shutil
import stat
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from glob import escape as glob_escape
from dataclasses import asdict
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from .binarize import IndexedDataset, IndexedWriter
from .corpus import CleanConfig, CorpusError, is_blank, iter_parallel, keep_mask
from .locks import LockHeld, lock_file
from .tokenizer import Tokenizer
from .vocab import lang_tag

META_FILE = "meta.json"
FORMAT_VERSION = 1
_META_KEYS = ("langs", "joint", "tokenizers", "splits", "vocab_size")
#: temporary files that earlier versions wrote inside the directory (dropped when it is prepared again)
_TEMPORARY = re.compile(r"\..*\.tmp\d+(\.(model|vocab))?|\..*\.new\.(model|vocab)|.*~new\d+\..*\.(bin|idx)")

log = logging.getLogger(__name__)


class DataDirBusy(ValueError):
    """Another process is preparing the directory; the message names it and that process."""


def _check_name(kind: str, name: str) -> None:
    if not name or any(c.isspace() or c in "/\\<>" for c in name) or name.startswith("."):
        raise ValueError(f"invalid {kind} name {name!r}")


def split_prefix(out_dir: str | Path, split: str, lang: str) -> Path:
    """Path prefix of the binarized ``split`` for ``lang`` (``out_dir/SPLIT.LANG``)."""
    return Path(out_dir) / f"{split}.{lang}"


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _chunks(it, size: int):
    while chunk := list(itertools.islice(it, size)):
        yield chunk


# ---- parallel encoding: worker processes, each with its own tokenizers; chunks come back in input order ----
_WORKER_TOKENIZERS: list[Tokenizer] = []


def _init_worker(model_paths: list[str]) -> None:
    _WORKER_TOKENIZERS[:] = [Tokenizer(p, num_threads=1) for p in model_paths]


def _encode_columns(columns: list[list[str]]) -> list[list[list[int]]]:
    return [tok.encode_batch(col, normalized=True) for tok, col in zip(_WORKER_TOKENIZERS, columns)]


def _ordered_map(submit: Callable[[Any], Future], items: Iterator[Any], window: int) -> Iterator[Any]:
    """``submit(item).result()`` for every item, in order, with at most ``window`` items in flight (bounded memory:
    unlike ``Pool.imap``, the input is read only as fast as results are consumed)."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(submit(item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def prepare(
    data_prefixes: Mapping[str, str | Path],
    langs: Sequence[str],
    out_dir: str | Path,
    vocab_size: int = 8000,
    joint: bool = True,
    clean: CleanConfig | None = None,
    lang_tags: bool = False,
    *,
    train_split: str = "train",
    chunk_size: int = 10_000,
    num_threads: int = 2,
    max_sentences: int = 2_000_000,
    seed: int = 1,
    progress: bool = True,
    workers: int = 1,
    replace_other: bool = True,
    byte_fallback: bool = True,
    tokenizers: Mapping[str, Tokenizer] | None = None,
) -> dict:
    """Validate, tokenize, clean and binarize every split; return the ``meta.json`` dict.

    ``data_prefixes`` maps a split name to a prefix whose ``PREFIX.LANG`` files hold the text.
    The tokenizer(s) are trained on ``train_split`` only: one joint model over all languages
    (``spm.model``) or one per language (``spm.LANG.model``); ``lang_tags`` adds a ``<2xx>``
    piece for every language to each model; with ``byte_fallback`` (the default, recorded in ``meta.json``) 256
    of each model's ``vocab_size`` pieces are bytes that spell any character the training split lacks, instead of
    ``<unk>`` (:meth:`Tokenizer.train`). Only the training split is cleaned (rows failing
    ``clean`` or with an empty side are dropped and counted); an empty line in another split is
    a :class:`CorpusError`.

    Memory stays bounded whatever the corpus size: the text is streamed ``chunk_size`` rows at a time, the
    tokenizer is trained on at most ``max_sentences`` sampled lines, and the binaries are written
    incrementally. ``workers`` > 1 encodes chunks in that many processes (``chunk_size`` rows each, at most
    ``2 * workers`` chunks in flight), written in input order: the output is identical to ``workers=1``.

    The directory is built beside ``out_dir`` and swapped in whole (see the module docstring); a second
    preparation of it meanwhile is a :class:`DataDirBusy`. Preparing it again logs what it replaces; with
    ``replace_other`` False (the command line without ``--force``), data prepared there from other training files
    is an error. Two splits that read the same file get a warning.

    ``tokenizers`` (language → a loaded model, e.g. a checkpoint's: ``prepare --tokenizer-from``) are used as they
    are instead of learning SentencePiece, so the ids are those the model was trained with; ``vocab_size``,
    ``joint`` and ``lang_tags`` then follow from them (joint: one model for every language).
    """
    clean = clean or CleanConfig()
    langs = list(langs)
    if not langs:
        raise ValueError("prepare needs at least one language")
    if len(set(langs)) != len(langs):
        raise ValueError(f"duplicate languages in {langs}")
    for lang in langs:
        _check_name("language", lang)
    if train_split not in data_prefixes:
        raise ValueError(f"data_prefixes has no {train_split!r} split (got {sorted(data_prefixes)})")
    for split in data_prefixes:
        _check_name("split", split)
    if tokenizers is not None:
        missing = [lang for lang in langs if lang not in tokenizers]
        if missing:
            raise ValueError(f"no tokenizer for {', '.join(missing)} (the given ones are for "
                             f"{', '.join(tokenizers) or 'no language'})")
        joint = len({tokenizers[lang].model_proto for lang in langs}) == 1
        lang_tags = all(lang_tag(other) in tokenizers[lang] for lang in langs for other in langs)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    out_dir = Path(out_dir)
    disable = None if progress else True

    files = {split: [Path(f"{prefix}.{lang}") for lang in langs] for split, prefix in data_prefixes.items()}
    for split, paths in files.items():  # --langs that do not match the files: say which languages are there
        for path in paths:
            if not path.exists():
                prefix = Path(data_prefixes[split])
                stem = prefix.name
                have = sorted(p.name[len(stem) + 1:] for p in path.parent.glob(f"{glob_escape(stem)}.*")
                              if p.is_file() and "." not in p.name[len(stem) + 1:])
                if prefix.is_file() and prefix.suffix[1:] in langs:  # --train corpus/train.en for corpus/train
                    raise CorpusError(path, f"file not found: {prefix} is one of the files; a split is given as the "
                                      f"prefix PREFIX of its files PREFIX.LANG, here {prefix.with_suffix('')}")
                raise CorpusError(path, f"file not found (languages {' '.join(langs)} asked for; "
                                  + (f"{stem} has {', '.join(have)})" if have else f"no {stem}.* files there)"))

    real = _out_path(out_dir)
    _warn_shared_files(files)
    with _locked(out_dir, real):
        _remove_leftovers(real)
        previous = _previous_meta(real)
        if previous is not None:
            _check_replace(out_dir, previous, files[train_split], langs, replace_other)
        # 1. validate every split before any expensive work (a failed check changes nothing)
        lines = _check_splits(files, train_split, disable)
        with _staged(out_dir, real) as stage:
            meta = _prepare_into(stage, files, langs, lines, vocab_size=vocab_size, joint=joint, clean=clean,
                                 lang_tags=lang_tags, train_split=train_split, chunk_size=chunk_size,
                                 num_threads=num_threads, max_sentences=max_sentences, seed=seed, disable=disable,
                                 workers=workers, byte_fallback=byte_fallback, given=tokenizers)
            _carry_over(real, stage, _prepared_files(real) if previous is not None else set())
    return meta


def _prepare_into(stage: Path, files: dict[str, list[Path]], langs: list[str], lines: dict[str, int], *,
                  vocab_size: int, joint: bool, clean: CleanConfig, lang_tags: bool, train_split: str,
                  chunk_size: int, num_threads: int, max_sentences: int, seed: int, disable: bool | None,
                  workers: int, byte_fallback: bool, given: Mapping[str, Tokenizer] | None = None) -> dict:
    """Tokenizers, binaries and ``meta.json`` of checked ``files`` written into the empty directory ``stage``
    (the ``given`` tokenizers, or ones trained on the training split)."""
    # 2. tokenizers: given, or trained on the training split
    symbols = [lang_tag(lang) for lang in langs] if lang_tags else []
    train_kw = dict(user_symbols=symbols, max_sentences=max_sentences, num_threads=num_threads, seed=seed,
                    byte_fallback=byte_fallback)
    names = {lang: "spm" if joint else f"spm.{lang}" for lang in langs}
    sources = {name: [p for lang, p in zip(langs, files[train_split]) if names[lang] == name]
               for name in dict.fromkeys(names.values())}
    if given is None:
        for name, paths in sources.items():
            Tokenizer.train(paths, stage / name, vocab_size, **train_kw)
        loaded = {name: Tokenizer(stage / f"{name}.model", num_threads=num_threads) for name in sources}
    else:
        loaded = {name: given[next(lang for lang in langs if names[lang] == name)].save(stage / name)
                  for name in sources}
    toks: dict[str, Tokenizer] = {lang: loaded[names[lang]] for lang in langs}
    tok_files: dict[str, str] = {lang: f"{names[lang]}.model" for lang in langs}

    # 3. encode (in worker processes when workers > 1), clean (train only), binarize
    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=([str(toks[lang].path) for lang in langs],))

    def encoded_chunks(paths: list[Path], allow_empty: bool) -> Iterator[list[list[list[int]]]]:
        if pool is None:
            return _encoded_chunks(paths, [toks[lang] for lang in langs], allow_empty, chunk_size)
        columns = _column_chunks(paths, allow_empty, chunk_size)
        return _ordered_map(lambda cols: pool.submit(_encode_columns, cols), columns, 2 * workers)

    splits_meta: dict[str, dict[str, int]] = {}
    try:
        for split, paths in files.items():
            splits_meta[split] = _binarize_split(
                split, paths, langs, toks, stage, encoded_chunks(paths, split == train_split),
                is_train=split == train_split, clean=clean, total=lines[split], disable=disable)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    meta = {
        "format_version": FORMAT_VERSION,
        "langs": langs,
        "joint": bool(joint),
        "lang_tags": bool(lang_tags),
        "byte_fallback": all(tok.byte_fallback for tok in toks.values()),
        "tokenizers": tok_files,
        "vocab_size": {lang: toks[lang].vocab_size for lang in langs},
        "splits": splits_meta,
        "clean": asdict(clean),
        "source_files": {split: {lang: str(p.resolve()) for lang, p in zip(langs, paths)}
                         for split, paths in files.items()},
    }
    for name in sources:  # the binaries and meta.json are synced as they are written
        for ext in (".model", ".vocab"):
            _fsync(stage / f"{name}{ext}")
    _write_json_atomic(stage / META_FILE, meta)
    return meta


# ---- one preparation at a time, built beside the directory and swapped in whole -----------------------------
def _out_path(out_dir: Path) -> Path:
    """The real path that ``out_dir`` names (a symlinked directory is replaced where it lies); an ``out_dir``
    that cannot be swapped whole (a file, the current directory or one holding it, a mount point) is an error."""
    real = Path(os.path.realpath(out_dir))
    if real.exists() and not real.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory")
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd or real in cwd.parents:
        raise ValueError(f"{out_dir}: is (or holds) the current directory, and prepare replaces --out as a whole; "
                         "run it from outside")
    if real.is_dir() and os.path.ismount(real):
        raise ValueError(f"{out_dir}: a mount point; prepare builds the new directory beside --out and swaps it "
                         "in, so give it a directory inside the mount")
    return real


@contextlib.contextmanager
def _locked(out_dir: Path, real: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.NAME.lock`` beside ``out_dir`` (released when the process ends, however it
    ends); a second preparation of the same directory meanwhile is a :class:`DataDirBusy` naming the first one's
    pid. On a file system without ``flock`` there is no lock."""
    real.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = lock_file(real.with_name(f".{real.name}.lock"), 0o666)
    except LockHeld as held:
        raise DataDirBusy(f"{out_dir}: another nmtflow prepare is writing this directory (pid {held.owner}); wait "
                          "for it to end, or give this one another --out") from None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _stage_name(real: Path, kind: str, pid: int | str) -> Path:
    return real.with_name(f".{real.name}.{kind}-{pid}")


def _remove_leftovers(real: Path) -> None:
    """Under the lock: remove what killed preparations left beside ``real`` (half-built or swapped-out directories),
    first putting back a replaced directory that a kill between the two renames of :func:`_swap_in` left aside."""
    found = {kind: sorted((p for p in real.parent.glob(glob_escape(f".{real.name}.{kind}-") + "*")
                           if p.name.rpartition("-")[2].isdigit()), key=os.path.getmtime)
             for kind in ("new", "old")}
    if not real.exists() and found["old"]:
        os.rename(found["old"].pop(), real)
        log.warning("%s: put back the directory that a killed preparation had moved aside", real)
    leftovers = [p for paths in found.values() for p in paths if p.is_dir() and not p.is_symlink()]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        log.warning("%s: removed %d unfinished preparation(s) of killed runs: %s", real, len(leftovers),
                    ", ".join(p.name for p in leftovers))


@contextlib.contextmanager
def _staged(out_dir: Path, real: Path) -> Iterator[Path]:
    """An empty directory beside ``real`` to build into; swapped in for ``real`` when the block ends without an
    error, removed when it raises."""
    stage = _stage_name(real, "new", os.getpid())
    try:
        stage.mkdir()
    except OSError as exc:
        raise OSError(f"{stage}: cannot create it ({exc.strerror}); prepare builds the new data beside --out "
                      f"{out_dir} and swaps it in, so {real.parent} must be writable") from None
    try:
        if real.is_dir():
            os.chmod(stage, stat.S_IMODE(real.stat().st_mode))
        yield stage
        _fsync(stage)
        old = _swap_in(stage, real)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _fsync(real.parent)
    if old is not None:
        _carry_over(old, real, _prepared_files(old))  # files put into --out while this preparation ran
        shutil.rmtree(old, ignore_errors=True)


def _swap_in(stage: Path, real: Path) -> Path | None:
    """Put the complete directory ``stage`` at ``real`` in one step where the system allows; return where the
    directory it replaced now is (None if there was none)."""
    if not real.exists():
        os.rename(stage, real)
        return None
    if _exchange(stage, real):
        return stage
    old = _stage_name(real, "old", os.getpid())
    os.rename(real, old)
    try:
        os.rename(stage, real)  # killed before this: the next preparation puts ``old`` back
    except BaseException:
        os.rename(old, real)
        raise
    return old


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an old kernel, or a file system without it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _carry_over(src: Path, dst: Path, written: set[str]) -> None:
    """Hard-link (or copy) into ``dst`` what ``src`` holds that no preparation wrote: not ``written``, not an
    earlier version's temporary file, and not in ``dst`` already."""
    if not src.is_dir():
        return
    for entry in os.scandir(src):
        target = dst / entry.name
        if entry.name in written or _TEMPORARY.fullmatch(entry.name) or os.path.lexists(target):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            shutil.copytree(entry.path, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, target)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links, or a file this user may not link
        shutil.copy2(src, dst)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _previous_meta(real: Path) -> dict | None:
    try:
        return load_meta(real)
    except ValueError:
        return None


def _check_replace(out_dir: Path, previous: dict, train_files: list[Path], langs: list[str],
                   replace_other: bool) -> None:
    """Say what preparing ``out_dir`` again replaces; with ``replace_other`` False, data prepared there from other
    training files (or from files it did not record) is an error naming them."""
    recorded: dict[str, str] = (previous.get("source_files") or {}).get("train") or {}
    new = {lang: str(p.resolve()) for lang, p in zip(langs, train_files)}
    common = set(recorded) & set(new)
    same = bool(common) and all(recorded[lang] == new[lang] for lang in common)
    was = (f"from {' '.join(recorded.values())}" if recorded else "from files it does not record") \
        + f": {', '.join(previous['langs'])}, splits {', '.join(previous['splits'])}"
    if same:
        log.info("%s: replacing the data prepared there from the same training files (%s)", out_dir, was)
    elif not replace_other:
        raise ValueError(f"{out_dir}: holds data prepared from other training files ({was}); give another --out, "
                         "or --force to replace it")
    else:
        log.warning("%s: replacing the data prepared there from other training files (%s)", out_dir, was)


def _warn_shared_files(files: dict[str, list[Path]], recorded: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """A warning for every two splits that read the same file (e.g. validation on the training data); ``recorded``:
    the source files of splits prepared earlier (``meta["source_files"]``)."""
    named = {split: list(paths) for split, paths in files.items()}
    named |= {split: [Path(p) for p in per_lang.values()] for split, per_lang in (recorded or {}).items()
              if split not in files}
    splits = list(named)
    for i, split in enumerate(splits):
        for other in splits[:i]:  # ``other`` first: the new splits come before the recorded ones
            shared = [q for p in named[split] for q in named[other] if _same_file(p, q)]
            if shared and other in files:
                log.warning("the %s and %s splits read the same file%s: %s", other, split,
                            "s" if len(shared) > 1 else "", ", ".join(map(str, shared)))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # a recorded file that is gone
        return os.path.realpath(a) == os.path.realpath(b)


def _prepared_files(out_dir: Path) -> set[str]:
    """Names of the files that ``out_dir/meta.json`` lists (binaries of each split and language, tokenizers);
    empty when there is no readable meta.json."""
    try:
        meta = load_meta(out_dir)
    except ValueError:
        return set()
    names = {f"{split}.{lang}.{ext}" for split in meta["splits"] for lang in meta["langs"] for ext in ("bin", "idx")}
    for model in set(meta["tokenizers"].values()):
        names |= {model, model.removesuffix(".model") + ".vocab"}
    return names


def add_splits(out_dir: str | Path, data_prefixes: Mapping[str, str | Path], *, train_split: str = "train",
               progress: bool = True) -> dict:
    """Binarize further splits (e.g. a new test set) into a prepared directory with its own tokenizers; return
    the updated ``meta.json`` dict.

    Nothing else changes: the tokenizers, the training split and the other splits stay as they are, so models
    trained on the directory can score the new split. A split of the same name is replaced (not the training
    split). Every file is checked first (UTF-8, equal line counts, no empty lines), errors naming the file
    and line; the new directory (hard links to the old one's files, the new binaries and ``meta.json``) is built
    beside it and swapped in when complete, under the lock that :func:`prepare` takes.
    """
    out_dir = Path(out_dir)
    load_meta(out_dir)  # not a prepared directory: an error before anything is written beside it
    if not data_prefixes:
        raise ValueError("add_splits needs at least one split (NAME=PREFIX)")
    for split in data_prefixes:
        _check_name("split", split)
        if split == train_split:
            raise ValueError(f"{out_dir}: the {train_split!r} split cannot be replaced (its tokenizers were learned "
                             "on it); prepare the corpus again instead")
    real = _out_path(out_dir)
    disable = None if progress else True
    with _locked(out_dir, real):
        _remove_leftovers(real)
        meta = load_meta(real)  # as it is now, under the lock
        langs = list(meta["langs"])
        files = {split: [Path(f"{prefix}.{lang}") for lang in langs] for split, prefix in data_prefixes.items()}
        sources = meta.get("source_files") or {}
        _warn_shared_files(files, sources)
        lines = _check_splits(files, train_split, disable)  # everything, before anything is written
        for split in files:
            if split in meta["splits"]:
                was = " ".join((sources.get(split) or {}).values()) or "files it does not record"
                log.warning("%s: replacing its %s split (prepared from %s)", out_dir, split, was)
        with _staged(out_dir, real) as stage:
            _carry_over(real, stage, set())  # everything (hard links), new binaries written over them below
            toks = {lang: load_tokenizer(stage, lang, meta) for lang in langs}
            splits_meta: dict[str, dict[str, int]] = {}
            for split, paths in files.items():
                chunks = _encoded_chunks(paths, [toks[lang] for lang in langs], False, 10_000)
                splits_meta[split] = _binarize_split(split, paths, langs, toks, stage, chunks, is_train=False,
                                                     clean=CleanConfig(), total=lines[split], disable=disable)
            meta["splits"] = {**meta["splits"], **splits_meta}
            meta["source_files"] = {**sources, **{split: {lang: str(p.resolve()) for lang, p in zip(langs, paths)}
                                                  for split, paths in files.items()}}
            _write_json_atomic(stage / META_FILE, meta)
    return meta


def _check_splits(files: dict[str, list[Path]], train_split: str, disable: bool | None) -> dict[str, int]:
    """Lines per split, after reading every file through :func:`iter_parallel` (UTF-8, alignment, and no empty
    lines outside ``train_split``); an empty split is a CorpusError."""
    lines: dict[str, int] = {}
    for split, paths in files.items():
        n, full = 0, split != train_split  # full: a row with text on every side (other splits have no blank line)
        with tqdm(desc=f"check {split}", unit=" lines", disable=disable, leave=False) as bar:
            for chunk in _chunks(iter_parallel(paths, allow_empty=(split == train_split)), 1 << 16):
                n = chunk[-1][0]
                full = full or any(all(t and not is_blank(t) for t in texts) for _, texts in chunk)
                bar.update(len(chunk))
        if n == 0:
            raise CorpusError(paths[0], f"the {'training' if split == train_split else split} split is empty")
        if not full:  # SentencePiece would fail on it with an internal error, else cleaning would drop every row
            blank = [0] * len(paths)
            for _, texts in iter_parallel(paths):
                blank = [b + (not t or is_blank(t)) for b, t in zip(blank, texts)]
            side = int(np.argmax(blank))  # the file to blame: the one with the most blank lines
            raise CorpusError(paths[side], f"the training split has no row with text in every file: {blank[side]} of "
                                           f"its {n} lines are blank")
        lines[split] = n
    return lines


def _column_chunks(paths: list[Path], allow_empty: bool, chunk_size: int) -> Iterator[list[list[str]]]:
    """Chunks of ``chunk_size`` aligned rows as one list of lines per file."""
    return ([list(col) for col in zip(*map(itemgetter(1), chunk))]
            for chunk in _chunks(iter_parallel(paths, allow_empty=allow_empty), chunk_size))


def _encoded_chunks(paths: list[Path], toks: list[Tokenizer], allow_empty: bool,
                    chunk_size: int) -> Iterator[list[list[list[int]]]]:
    """:func:`_column_chunks` encoded in this process, file i with ``toks[i]``."""
    return ([tok.encode_batch(col, normalized=True) for tok, col in zip(toks, cols)]
            for cols in _column_chunks(paths, allow_empty, chunk_size))


def _binarize_split(split: str, paths: list[Path], langs: list[str], toks: dict[str, Tokenizer], out_dir: Path,
                    chunks: Iterator[list[list[list[int]]]], *, is_train: bool, clean: CleanConfig, total: int,
                    disable: bool | None) -> dict[str, int]:
    """Write ``SPLIT.LANG.{bin,idx}`` from encoded chunks (id lists per language and row); clean the training split."""
    writers = [IndexedWriter(split_prefix(out_dir, split, lang), max_id=toks[lang].vocab_size - 1) for lang in langs]
    rows = dropped = 0
    empty = np.zeros(len(langs), dtype=np.int64)  # training lines per language that encode to no tokens
    try:
        with tqdm(total=total, desc=f"encode {split}", unit=" lines", disable=disable) as bar:
            for encoded in chunks:
                n = len(encoded[0])
                if is_train:
                    lengths = np.stack(
                        [np.fromiter(map(len, e), dtype=np.int64, count=len(e)) for e in encoded], axis=1
                    )
                    empty += (lengths == 0).sum(axis=0)
                    keep = keep_mask(lengths, clean)
                    if not keep.all():
                        dropped += int((~keep).sum())
                        encoded = [list(itertools.compress(e, keep)) for e in encoded]
                for w, e in zip(writers, encoded):
                    w.add_many(e)
                rows += len(encoded[0])
                bar.update(n)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for w in writers:
        w.close()
    if is_train and rows == 0:
        side = int(np.argmax(empty))  # the file to blame: the one with the most empty lines, if any
        blank = f"; {empty[side]} of its lines are empty" if empty[side] else ""
        raise ValueError(f"{paths[side]}: cleaning dropped all {dropped} training rows{blank} "
                         f"(check CleanConfig {clean})")
    return {"rows": rows, "dropped": dropped, "lines": total}


def load_meta(out_dir: str | Path) -> dict:
    """Read ``out_dir/meta.json``; ``ValueError`` if the directory was not (fully) prepared."""
    out_dir = Path(out_dir)
    path = out_dir / META_FILE
    if not out_dir.is_dir():
        raise ValueError(f"{out_dir}: data directory not found (run prepare first)")
    if not path.is_file():
        raise ValueError(f"{out_dir}: not a prepared data directory ({META_FILE} missing; run prepare first)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read prepared-data metadata ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    for lang in meta["langs"]:
        if lang not in meta["tokenizers"]:
            raise ValueError(f"{path}: no tokenizer listed for language {lang!r}")
        if not (out_dir / meta["tokenizers"][lang]).is_file():
            raise ValueError(f"{out_dir / meta['tokenizers'][lang]}: tokenizer file listed in {path} is missing")
        size = meta["vocab_size"].get(lang) if isinstance(meta["vocab_size"], dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{path}: no vocabulary size listed for language {lang!r} (corrupt)")
    return meta


def load_tokenizer(out_dir: str | Path, lang: str, meta: dict | None = None) -> Tokenizer:
    """The tokenizer of ``lang`` in a prepared directory."""
    meta = meta or load_meta(out_dir)
    if lang not in meta["tokenizers"]:
        raise ValueError(f"{out_dir}: language {lang!r} not prepared (have {meta['langs']})")
    return Tokenizer(Path(out_dir) / meta["tokenizers"][lang])


def load_split(out_dir: str | Path, split: str, lang: str, meta: dict | None = None) -> IndexedDataset:
    """The binarized ``split`` of ``lang`` in a prepared directory (ids checked against its vocabulary)."""
    meta = meta or load_meta(out_dir)
    if split not in meta["splits"]:
        raise ValueError(f"{out_dir}: split {split!r} not prepared (have {sorted(meta['splits'])})")
    if lang not in meta["langs"]:
        raise ValueError(f"{out_dir}: language {lang!r} not prepared (have {meta['langs']})")
    return IndexedDataset(split_prefix(out_dir, split, lang), vocab_size=meta["vocab_size"][lang])


__all__ = ["prepare", "add_splits", "load_meta", "load_tokenizer", "load_split", "split_prefix", "META_FILE",
           "DataDirBusy"]
