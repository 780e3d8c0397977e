"""Turn raw parallel text into a prepared data directory.

Layout of ``out_dir``::

    meta.json                 written last: its presence means the directory is complete
    spm.model                 joint tokenizer (or spm.LANG.model, one per language)
    SPLIT.LANG.{bin,idx}      subword ids, row i of every language is the same sentence pair
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from glob import escape as glob_escape
from dataclasses import asdict
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from .binarize import IndexedDataset, IndexedWriter
from .corpus import CleanConfig, CorpusError, iter_parallel, keep_mask
from .tokenizer import Tokenizer
from .vocab import lang_tag

META_FILE = "meta.json"
FORMAT_VERSION = 1
_META_KEYS = ("langs", "joint", "tokenizers", "splits", "vocab_size")


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
    return [tok.encode_batch(col) for tok, col in zip(_WORKER_TOKENIZERS, columns)]


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
) -> dict:
    """Validate, tokenize, clean and binarize every split; return the ``meta.json`` dict.

    ``data_prefixes`` maps a split name to a prefix whose ``PREFIX.LANG`` files hold the text.
    The tokenizer(s) are trained on ``train_split`` only: one joint model over all languages
    (``spm.model``) or one per language (``spm.LANG.model``); ``lang_tags`` adds a ``<2xx>``
    piece for every language to each model. Only the training split is cleaned (rows failing
    ``clean`` or with an empty side are dropped and counted); an empty line in another split is
    a :class:`CorpusError`.

    Memory stays bounded whatever the corpus size: the text is streamed ``chunk_size`` rows at a time, the
    tokenizer is trained on at most ``max_sentences`` sampled lines, and the binaries are written
    incrementally. ``workers`` > 1 encodes chunks in that many processes (``chunk_size`` rows each, at most
    ``2 * workers`` chunks in flight), written in input order: the output is identical to ``workers=1``.
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
                stem = Path(data_prefixes[split]).name
                have = sorted(p.name[len(stem) + 1:] for p in path.parent.glob(f"{glob_escape(stem)}.*")
                              if p.is_file() and "." not in p.name[len(stem) + 1:])
                raise CorpusError(path, f"file not found (languages {' '.join(langs)} asked for; "
                                  + (f"{stem} has {', '.join(have)})" if have else f"no {stem}.* files there)"))

    # 1. validate every split before any expensive work
    lines = _check_splits(files, train_split, disable)
    # 2. tokenizers, trained on the training split under temporary names (a failed check made no --out directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    symbols = [lang_tag(lang) for lang in langs] if lang_tags else []
    train_kw = dict(user_symbols=symbols, max_sentences=max_sentences, num_threads=num_threads, seed=seed)
    names = {lang: "spm" if joint else f"spm.{lang}" for lang in langs}
    sources = {name: [p for lang, p in zip(langs, files[train_split]) if names[lang] == name]
               for name in dict.fromkeys(names.values())}
    try:
        for name, paths in sources.items():
            Tokenizer.train(paths, out_dir / f".{name}.new", vocab_size, **train_kw)
    except BaseException:
        _remove_new_models(out_dir, sources)
        raise
    # the checks and the tokenizer training passed: from here on the directory is incomplete until meta.json is
    # rewritten (a prepared directory survives a failed check of new input or a failed tokenizer training)
    stale = _prepared_files(out_dir)  # an earlier preparation's files: removed below unless rewritten
    (out_dir / META_FILE).unlink(missing_ok=True)
    for name in sources:
        for ext in (".model", ".vocab"):
            os.replace(out_dir / f".{name}.new{ext}", out_dir / f"{name}{ext}")
    loaded = {name: Tokenizer(out_dir / f"{name}.model", num_threads=num_threads) for name in sources}
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
                split, paths, langs, toks, out_dir, encoded_chunks(paths, split == train_split),
                is_train=split == train_split, clean=clean, total=lines[split], disable=disable)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    meta = {
        "format_version": FORMAT_VERSION,
        "langs": langs,
        "joint": bool(joint),
        "lang_tags": bool(lang_tags),
        "tokenizers": tok_files,
        "vocab_size": {lang: toks[lang].vocab_size for lang in langs},
        "splits": splits_meta,
        "clean": asdict(clean),
        "source_files": {split: {lang: str(p.resolve()) for lang, p in zip(langs, paths)}
                         for split, paths in files.items()},
    }
    _write_json_atomic(out_dir / META_FILE, meta)
    for name in sorted(stale - _prepared_files(out_dir)):  # splits, languages, tokenizers no longer prepared
        (out_dir / name).unlink(missing_ok=True)
    return meta


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
    and line; the new binaries are written under temporary names and moved into place only when all are
    complete, and ``meta.json`` last.
    """
    out_dir = Path(out_dir)
    meta = load_meta(out_dir)
    langs = list(meta["langs"])
    if not data_prefixes:
        raise ValueError("add_splits needs at least one split (NAME=PREFIX)")
    for split in data_prefixes:
        _check_name("split", split)
        if split == train_split:
            raise ValueError(f"{out_dir}: the {train_split!r} split cannot be replaced (its tokenizers were learned "
                             "on it); prepare the corpus again instead")
    files = {split: [Path(f"{prefix}.{lang}") for lang in langs] for split, prefix in data_prefixes.items()}
    disable = None if progress else True
    lines = _check_splits(files, train_split, disable)  # everything, before anything is written
    toks = {lang: load_tokenizer(out_dir, lang, meta) for lang in langs}
    staged: dict[str, str] = {}
    splits_meta: dict[str, dict[str, int]] = {}
    try:
        for split, paths in files.items():
            staged[split] = temporary = f"{split}~new{os.getpid()}"
            chunks = _encoded_chunks(paths, [toks[lang] for lang in langs], False, 10_000)
            splits_meta[split] = _binarize_split(temporary, paths, langs, toks, out_dir, chunks, is_train=False,
                                                 clean=CleanConfig(), total=lines[split], disable=disable)
    except BaseException:
        for temporary in staged.values():
            for lang in langs:
                for ext in (".bin", ".idx"):
                    Path(f"{split_prefix(out_dir, temporary, lang)}{ext}").unlink(missing_ok=True)
        raise
    for split, temporary in staged.items():
        for lang in langs:
            for ext in (".bin", ".idx"):
                os.replace(f"{split_prefix(out_dir, temporary, lang)}{ext}", f"{split_prefix(out_dir, split, lang)}{ext}")
    meta["splits"] = {**meta["splits"], **splits_meta}
    sources = meta.get("source_files", {})
    meta["source_files"] = {**sources, **{split: {lang: str(p.resolve()) for lang, p in zip(langs, paths)}
                                          for split, paths in files.items()}}
    _write_json_atomic(out_dir / META_FILE, meta)
    return meta


def _check_splits(files: dict[str, list[Path]], train_split: str, disable: bool | None) -> dict[str, int]:
    """Lines per split, after reading every file through :func:`iter_parallel` (UTF-8, alignment, and no empty
    lines outside ``train_split``); an empty split is a CorpusError."""
    lines: dict[str, int] = {}
    for split, paths in files.items():
        n = 0
        with tqdm(desc=f"check {split}", unit=" lines", disable=disable, leave=False) as bar:
            for chunk in _chunks(iter_parallel(paths, allow_empty=(split == train_split)), 1 << 16):
                n = chunk[-1][0]
                bar.update(len(chunk))
        if n == 0:
            raise CorpusError(paths[0], f"the {'training' if split == train_split else split} split is empty")
        lines[split] = n
    return lines


def _column_chunks(paths: list[Path], allow_empty: bool, chunk_size: int) -> Iterator[list[list[str]]]:
    """Chunks of ``chunk_size`` aligned rows as one list of lines per file."""
    return ([list(col) for col in zip(*map(itemgetter(1), chunk))]
            for chunk in _chunks(iter_parallel(paths, allow_empty=allow_empty), chunk_size))


def _encoded_chunks(paths: list[Path], toks: list[Tokenizer], allow_empty: bool,
                    chunk_size: int) -> Iterator[list[list[list[int]]]]:
    """:func:`_column_chunks` encoded in this process, file i with ``toks[i]``."""
    return ([tok.encode_batch(col) for tok, col in zip(toks, cols)]
            for cols in _column_chunks(paths, allow_empty, chunk_size))


def _remove_new_models(out_dir: Path, names: Iterable[str]) -> None:
    """Delete the temporary ``.NAME.new.{model,vocab}`` files of tokenizers trained so far."""
    for name in names:
        for ext in (".model", ".vocab"):
            (out_dir / f".{name}.new{ext}").unlink(missing_ok=True)


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
    return meta


def load_tokenizer(out_dir: str | Path, lang: str, meta: dict | None = None) -> Tokenizer:
    """The tokenizer of ``lang`` in a prepared directory."""
    meta = meta or load_meta(out_dir)
    if lang not in meta["tokenizers"]:
        raise ValueError(f"{out_dir}: language {lang!r} not prepared (have {meta['langs']})")
    return Tokenizer(Path(out_dir) / meta["tokenizers"][lang])


def load_split(out_dir: str | Path, split: str, lang: str, meta: dict | None = None) -> IndexedDataset:
    """The binarized ``split`` of ``lang`` in a prepared directory."""
    meta = meta or load_meta(out_dir)
    if split not in meta["splits"]:
        raise ValueError(f"{out_dir}: split {split!r} not prepared (have {sorted(meta['splits'])})")
    if lang not in meta["langs"]:
        raise ValueError(f"{out_dir}: language {lang!r} not prepared (have {meta['langs']})")
    return IndexedDataset(split_prefix(out_dir, split, lang))


__all__ = ["prepare", "add_splits", "load_meta", "load_tokenizer", "load_split", "split_prefix", "META_FILE"]
