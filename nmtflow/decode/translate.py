"""Text in, text out: tokenise, batch by length, search, detokenise — for files, stdin and validation."""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import logging
import math
import os
import stat
import sys
import tempfile
from concurrent.futures import as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

import numpy as np
import torch

from nmtflow.checkpoint import CheckpointError, load_checkpoint, model_mismatch, write_failure
from nmtflow.config import Config, DecodeConfig, config_from_dict
from nmtflow.data.batching import collate
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.decode.precision import model_in_precision
from nmtflow.decode.search import (Hypothesis, beam_search, decoder_limit, greedy_search, sample_search,
                                   token_logprobs)
from nmtflow.decode.unknowns import UnknownTally
from nmtflow.decode.workers import DecodePool, close_pool, pool_for
from nmtflow.models.base import EncoderDecoder, Vocabularies, build_model, position_limits
from nmtflow.runtime import new_file_mode

log = logging.getLogger(__name__)


@functools.cache
def _warn_once(message: str) -> None:
    """A warning logged once per process (not at every chunk of a long input)."""
    log.warning("%s", message)


def tokenizer_from_bytes(data: bytes, checkpoint: str | Path, side: str) -> Tokenizer:
    """The Tokenizer of a serialized SentencePiece model stored in ``checkpoint`` as its ``side`` (``src``,
    ``tgt`` or a language), loaded from the bytes (no file is written); errors name the checkpoint."""
    return Tokenizer.from_bytes(data, checkpoint, what=f"its {side} SentencePiece model")


def bytes_tensor(source: str | Path | bytes) -> torch.Tensor:
    """Bytes, or a file's bytes, as a uint8 tensor (safe to store under ``weights_only=True``)."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class _NamedFile(io.FileIO):
    """A file whose failed writes (a full disk) raise an ``OSError`` naming ``name``, where Python's names no file."""

    def __init__(self, file: int | str, name: str | Path, unchanged: bool) -> None:
        super().__init__(file, "w")
        self._name, self._unchanged = name, unchanged

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            raise write_failure(self._name, "the output", exc, unchanged=self._unchanged) from None


def _text_file(file: int | str, name: str | Path, unchanged: bool = False) -> TextIO:
    return io.TextIOWrapper(io.BufferedWriter(_NamedFile(file, name, unchanged)), encoding="utf-8")


@contextlib.contextmanager
def output_file(path: str | Path | None) -> Iterator[TextIO]:
    """A text file that replaces ``path`` only when the block succeeds (stdout for None).

    It is written beside ``path`` under a temporary name, renamed over it at the end and removed on failure, so a
    failed run leaves an existing ``path`` as it was. A ``path`` that is not a regular file (``/dev/stdout``, a
    FIFO) is written directly. A failed write (a full disk) is an ``OSError`` naming ``path``.
    """
    if path is None:
        yield sys.stdout
        return
    target = Path(os.path.realpath(path))  # through a symbolic link: replace what it points to
    if target.is_dir():
        raise IsADirectoryError(f"{path}: is a directory")
    if target.exists() and not target.is_file():
        try:
            out = _text_file(str(target), path)
        except OSError as exc:
            raise write_failure(path, "the output", exc) from None
        with out:
            yield out
        return
    try:
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(f"{path}: cannot write ({exc.strerror or exc})") from None
    if mode is None:  # a new file: the permissions open() would give it
        mode = new_file_mode()
    try:
        with _text_file(fd, path, unchanged=True) as out:
            yield out
        try:
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except OSError as exc:
            raise write_failure(path, "the output", exc, unchanged=True) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def batches_by_length(lengths: list[int], max_tokens: int) -> Iterator[list[int]]:
    """Indices sorted by length, cut so that (longest + 2) · rows ≤ max_tokens (at least one row)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    for i in order:
        if batch and (lengths[i] + 2) * (len(batch) + 1) > max_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def source_positions(model: EncoderDecoder) -> int | None:
    """Positions a source may take (EOS and any prefix tag included); None where positions do not bound it."""
    return position_limits(model.config)[0]


FLAGS = {"len_penalty": "--lenpen", "max_len_a": "--max-len-a", "max_len_b": "--max-len-b", "min_len": "--min-len", "sampling": "--sampling",
         "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
         "workers": "--workers"}  # decode keys → translate's options


def check_search(d: DecodeConfig) -> None:
    """A ValueError naming the option for search settings that cannot give what they ask for: an n-best list holds
    at most ``beam_size`` hypotheses, greedy search finds one, sampling does not search (and no greedy with it)."""
    for name, flag, value in (("beam_size", "--beam", d.beam_size), ("nbest", "--nbest", d.nbest),
                              ("max_tokens", "--batch-tokens", d.max_tokens), ("workers", "--workers", d.workers)):
        if value < 1:
            raise ValueError(f"{flag} {value} (decode.{name}): must be >= 1")
    for name, problem in d.search_problems():
        raise ValueError(f"{FLAGS[name]} (decode.{name}): {problem}")
    if d.sampling:
        return
    if d.nbest > 1 and d.greedy:
        raise ValueError(f"--nbest {d.nbest} (decode.nbest) with --greedy (decode.greedy): greedy search finds one "
                         f"translation; an n-best list needs beam search with --beam >= {d.nbest} (or samples: "
                         "--sampling)")
    if d.nbest > d.beam_size:
        raise ValueError(f"--nbest {d.nbest} (decode.nbest) is more than --beam {d.beam_size} (decode.beam_size): "
                         f"beam search keeps at most beam-size hypotheses; give --beam {d.nbest} or more")


def refuse_str(sentences: Any, where: str) -> None:
    """A TypeError where ``sentences`` is a bare ``str`` (or ``bytes``): iterated, it would be one sentence per
    character."""
    if isinstance(sentences, (str, bytes)):
        raise TypeError(f"{where}: expected a list of sentences, got a {type(sentences).__name__} (pass [sentence]; "
                        "or use nmtflow.load(...), whose translate and score take one str)")


def sampling_generator(d: DecodeConfig, device: torch.device, first_line: int = 1) -> torch.Generator | None:
    """The random stream sampling draws from (None without ``d.sampling``): seeded by ``d.seed`` and
    ``first_line`` (so the chunks of one input draw differently, and the same input and settings the same),
    or by a fresh random seed where ``d.seed`` is None."""
    if not d.sampling:
        return None
    generator = torch.Generator(device=device)
    if d.seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(np.random.SeedSequence([d.seed, first_line]).generate_state(1, np.uint64)[0]))
    return generator


def _aligned(lines: Iterable[str], prefixes: Iterable[str], name: str,
             prefix_name: str) -> Iterator[tuple[str, str]]:
    """(line, prefix) pairs; a line without a prefix, or a prefix without a line, is a ValueError naming both."""
    sentinel = object()
    for n, (line, prefix) in enumerate(itertools.zip_longest(lines, prefixes, fillvalue=sentinel), 1):
        if line is sentinel or prefix is sentinel:
            raise ValueError(f"{prefix_name}: {n - 1 if prefix is sentinel else 'more than ' + str(n - 1)} "
                             f"prefixes for {'more than ' + str(n - 1) if prefix is sentinel else n - 1} input "
                             f"lines of {name} (one per input line, an empty one for none)")
        yield line, prefix  # type: ignore[misc]


def search_model(model: EncoderDecoder, d: DecodeConfig, src: torch.Tensor, *,
                 prefixes: list[list[int]] | None = None,
                 generator: torch.Generator | None = None) -> list[list[Hypothesis]]:
    """src (B,S) → each sentence's ``d.nbest`` hypotheses, best first: exactly that many wherever that many
    distinct outputs fit its length limit (fewer only where they do not, e.g. a vocabulary of a few pieces).
    With ``d.sampling``, ``nbest`` samples each, in the order drawn from ``generator``. ``prefixes``: a
    forced target prefix (ids) per sentence, [] for none."""
    check_search(d)
    model = model_in_precision(model, d.precision)
    limits = dict(max_len_a=d.max_len_a, max_len_b=d.max_len_b, min_len=d.min_len, prefixes=prefixes)
    if d.sampling:
        return sample_search(model, src, nbest=d.nbest, temperature=d.temperature, top_k=d.top_k,
                             top_p=d.top_p, generator=generator, **limits)
    if d.greedy or (d.beam_size == 1 and d.nbest == 1):
        return [[h] for h in greedy_search(model, src, len_penalty=d.len_penalty, **limits)]
    return beam_search(model, src, beam_size=d.beam_size, len_penalty=d.len_penalty, nbest=d.nbest, **limits)


def search_batch(model: EncoderDecoder, d: DecodeConfig, sources: list[list[int]],
                 prefixes: list[list[int]] | None, src_prefix: int | None, device: torch.device,
                 generator: torch.Generator | None = None) -> list[list[Hypothesis]]:
    """One batch of source ids (no EOS; ``src_prefix``: a tag put before each) → :func:`search_model`: what
    :meth:`Translator.translate_ids` does per batch, here in a worker process (``nmtflow.decode.workers``)."""
    src = collate(sources, [[]] * len(sources), src_prefix=src_prefix).src
    return search_model(model, d, src.to(device), prefixes=prefixes, generator=generator)


@dataclass
class Translator:
    """A model with its tokenizers and search settings."""

    model: EncoderDecoder
    src_tokenizer: Tokenizer
    tgt_tokenizer: Tokenizer
    decode: DecodeConfig
    config: Config | None = None
    src_prefix: int | None = None
    progress: Callable[[int], Any] | None = field(default=None, repr=False)  # told how many sentences are done
    unknowns: UnknownTally | None = field(default=None, repr=False)  # set: encode_source counts <unk> into it

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu",
                        decode: DecodeConfig | None = None, *, ckpt: dict | None = None) -> "Translator":
        """The model of checkpoint ``path`` (``ckpt``: its contents, when already loaded)."""
        ckpt = load_checkpoint(path) if ckpt is None else ckpt
        if ckpt.get("multilingual"):  # see nmtflow.decode.multilingual
            langs = ckpt["langs"]
            zero_shot = f"; zero-shot: {', '.join(langs['zero_shot'])}" if langs.get("zero_shot") else ""
            raise CheckpointError(f"{path}: a multilingual checkpoint (trained: {', '.join(langs['directions'])}"
                                  f"{zero_shot}): name the direction with --src-lang and --tgt-lang")
        try:
            config = config_from_dict(ckpt["config"])
            vocab = Vocabularies(**ckpt["vocab"])
            model = build_model(config.model, vocab)
            model.load_state_dict(ckpt["model"])
            src_tok = tokenizer_from_bytes(ckpt["tokenizers"]["src"].numpy().tobytes(), path, "src")
            tgt_tok = tokenizer_from_bytes(ckpt["tokenizers"]["tgt"].numpy().tobytes(), path, "tgt")
        except (KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"{path}: checkpoint does not match its model ({model_mismatch(exc)})") from None
        model.to(device).eval()
        return cls(model, src_tok, tgt_tok, decode or config.decode, config)

    @property
    def model_source_tokens(self) -> int | None:
        """Pieces of a source the model's positions hold (less EOS and any ``src_prefix`` tag); None: no bound."""
        positions = source_positions(self.model)
        return None if positions is None else max(0, positions - 1 - (self.src_prefix is not None))

    @property
    def max_source_tokens(self) -> int:
        """Pieces of a source a translation reads: ``decode.max_input_tokens``, fewer where the model's positions
        (EOS and any ``src_prefix`` tag included) hold fewer."""
        room = self.model_source_tokens
        return self.decode.max_input_tokens if room is None else min(self.decode.max_input_tokens, room)

    def encode_source(self, lines: list[str], *, first_line: int = 1, name: str | None = None) -> list[list[int]]:
        """Sentences → source ids, each cut to :attr:`max_source_tokens` with a warning naming its line
        (``first_line``: the line number of ``lines[0]`` in its input, ``name``: the input's file, if any).

        Pieces unknown to the source vocabulary (``<unk>``) get one warning with their count, for the whole call, or,
        while :attr:`unknowns` is set (:meth:`translate_stream`), counted into it."""
        ids = self.src_tokenizer.encode_batch(lines)
        tally = self.unknowns or UnknownTally()
        tally.add(self.src_tokenizer, lines, ids)
        if self.unknowns is None:
            tally.warn(name)
        limit = self.max_source_tokens
        reason = ("decode.max_input_tokens" if limit == self.decode.max_input_tokens
                  else f"the model's max_positions={source_positions(self.model)}")
        for n, seq in enumerate(ids):
            if len(seq) > limit:
                line = first_line + n
                where = f"{name}:{line}: input line {line}" if name else f"input line {line}"
                log.warning("%s has %d tokens; truncated to %d (%s)", where, len(seq), limit, reason)
                ids[n] = seq[:limit]
        return ids

    def search(self, src: torch.Tensor, *, prefixes: list[list[int]] | None = None,
               generator: torch.Generator | None = None) -> list[list[Hypothesis]]:
        """src (B,S) → each sentence's ``decode.nbest`` hypotheses, best first (:func:`search_model`)."""
        return search_model(self.model, self.decode, src, prefixes=prefixes, generator=generator)

    @torch.no_grad()
    def translate_ids(self, sources: list[list[int]], *, prefixes: list[list[int]] | None = None,
                      first_line: int = 1) -> list[list[Hypothesis]]:
        """Id sequences (no EOS) → n-best hypotheses, in input order, at least one each: an empty input gets the empty
        output (score 0; with a prefix, just the prefix), and so does an input the model scores NaN (diverged, or
        overflowing), with score NaN. ``prefixes``: a forced target prefix (ids) per input, [] for none;
        ``first_line`` seeds sampling's random stream with ``decode.seed`` (:func:`sampling_generator`)."""
        check_search(self.decode)  # before any work, even where every input is empty
        if prefixes is not None and len(prefixes) != len(sources):
            raise ValueError(f"{len(prefixes)} prefixes for {len(sources)} inputs (one per input, [] for none)")
        forced = prefixes or [[] for _ in sources]
        results: list[list[Hypothesis]] = [[Hypothesis(list(p), 0.0, 0.0)] for p in forced]
        nonempty = [i for i, s in enumerate(sources) if s]
        lengths = [len(sources[i]) for i in nonempty]
        if self.progress and len(nonempty) < len(sources):
            self.progress(len(sources) - len(nonempty))
        max_tokens, workers = self.decode.max_tokens, self.decode.workers
        if workers > 1 and self.device.type != "cpu":
            _warn_once(f"decode.workers: {workers} worker processes decode on the CPU; this model is on "
                       f"{self.device}, which decodes in this process")
            workers = 1
        if workers > 1:  # about four batches per worker, handed out as they come free: they finish together
            max_tokens = min(max_tokens, max(1, -(-sum(lengths) // (4 * workers))))
        batches = [[nonempty[b] for b in batch] for batch in batches_by_length(lengths, max_tokens)]

        def place(rows: list[int], found: list[list[Hypothesis]]) -> None:
            for r, hyps in zip(rows, found):
                results[r] = hyps or [Hypothesis([], math.nan, math.nan)]  # beam search keeps no NaN-scored one
            if self.progress:
                self.progress(len(rows))

        if workers > 1 and len(batches) > 1:  # shared out over worker processes
            pool = self.decode_pool()
            futures = {pool.submit([sources[r] for r in rows], [forced[r] for r in rows] if prefixes else None,
                                   self.decode, self.src_prefix): rows for rows in batches}
            try:
                for future in as_completed(futures):
                    place(futures[future], future.result())
            except BrokenProcessPool:
                self.close()
                raise RuntimeError("decode.workers: a worker process stopped (killed, or out of memory?); the next "
                                   "call starts new ones") from None
            finally:
                for future in futures:
                    future.cancel()
            return results
        generator = sampling_generator(self.decode, self.device, first_line)
        for rows in batches:
            src = collate([sources[r] for r in rows], [[]] * len(rows), src_prefix=self.src_prefix).src
            place(rows, self.search(src.to(self.device), prefixes=[forced[r] for r in rows] if prefixes else None,
                                    generator=generator))
        return results

    def decode_pool(self) -> DecodePool:
        """The worker processes of ``decode.workers`` for this model (:func:`~nmtflow.decode.workers.pool_for`:
        started at the first call, shared by every translator of the model, started again after its weights
        change), with the CPU threads of this process shared out among them."""
        workers = self.decode.workers
        if self.device.type != "cpu":
            raise ValueError(f"decode.workers: {workers} worker processes decode on the CPU; this model is on "
                             f"{self.device} (use decode.workers: 1 there)")
        return pool_for(self.model, search_batch, workers, max(1, torch.get_num_threads() // workers))

    def close(self) -> None:
        """Stop the worker processes of ``decode.workers`` for this model, if any were started (also done at exit)."""
        close_pool(self.model)

    def encode_prefixes(self, prefixes: list[str], *, first_line: int = 1,
                        name: str | None = None) -> list[list[int]]:
        """Target prefixes (text; "" for none) → target ids; one longer than the model writes is a ValueError
        naming its line (``name``: the prefixes' file, if any)."""
        ids = self.tgt_tokenizer.encode_batch(prefixes)
        limit = decoder_limit(self.model)
        for n, seq in enumerate(ids):
            if len(seq) > limit:
                line = first_line + n
                raise ValueError(f"{f'{name}:{line}: ' if name else ''}prefix line {line} has {len(seq)} tokens; "
                                 f"the model writes at most {limit}")
        return ids

    def translate(self, lines: list[str], *, first_line: int = 1, name: str | None = None,
                  prefixes: list[str] | None = None, prefix_name: str | None = None) -> list[list[tuple[str, float]]]:
        """Sentences → n-best (detokenised text, score) lists, in input order (``first_line``, ``name``: where
        ``lines`` come from, for truncation warnings and the ValueError for a line the model scores NaN).
        ``prefixes``: one target prefix per line ("" for none) each translation starts with (``prefix_name``: their
        file, for errors); a count other than the lines' is a ValueError. A bare ``str`` is a TypeError."""
        refuse_str(lines, "Translator.translate")
        forced = None
        if prefixes is not None:
            if len(prefixes) != len(lines):
                raise ValueError(f"{f'{prefix_name}: ' if prefix_name else ''}{len(prefixes)} prefixes for "
                                 f"{len(lines)} input lines{f' of {name}' if name else ''} (one per input line, "
                                 "an empty one for none)")
            forced = self.encode_prefixes(prefixes, first_line=first_line, name=prefix_name)
        hyps = self.translate_ids(self.encode_source(lines, first_line=first_line, name=name), prefixes=forced,
                                  first_line=first_line)
        for n, nbest in enumerate(hyps):
            if math.isnan(nbest[0].logprob):
                line = first_line + n
                raise ValueError(f"{f'{name}:{line}: ' if name else ''}input line {line}: the model's scores are NaN, "
                                 "no translation (a diverged checkpoint, or one overflowing at this precision?)")
        return [[(self.tgt_tokenizer.decode(h.tokens), h.score) for h in nbest] for nbest in hyps]

    def translate_stream(self, lines: Iterable[str], chunk: int = 1000, *, name: str | None = None,
                         prefixes: Iterable[str] | None = None,
                         prefix_name: str | None = None) -> Iterator[list[tuple[str, float]]]:
        """Translate an iterable chunk by chunk (``chunk=1`` answers each line as it arrives); warnings name
        the line of the whole input (and ``name``, the input's file). ``prefixes``: one target prefix per line
        ("" for none; ``prefix_name``: their file); running out of either before the other is a ValueError. Pieces
        unknown to the source vocabulary get one warning for the whole input, when it ends."""
        refuse_str(lines, "Translator.translate_stream")
        pairs: Iterable[tuple[str, str | None]]
        if prefixes is None:
            pairs = ((line, None) for line in lines)
        else:
            pairs = _aligned(lines, prefixes, name or "the input", prefix_name or "the prefixes")
        buf: list[str] = []
        forced: list[str] = []
        first_line = 1
        tally, outer = UnknownTally(), self.unknowns
        self.unknowns = outer or tally
        try:
            for line, prefix in pairs:
                buf.append(line.rstrip("\r\n"))
                forced.append((prefix or "").rstrip("\r\n"))
                if len(buf) >= chunk:
                    yield from self.translate(buf, first_line=first_line, name=name,
                                              prefixes=None if prefixes is None else forced, prefix_name=prefix_name)
                    first_line += len(buf)
                    buf, forced = [], []
            if buf:
                yield from self.translate(buf, first_line=first_line, name=name,
                                          prefixes=None if prefixes is None else forced, prefix_name=prefix_name)
        finally:
            self.unknowns = outer
            tally.warn(name)  # nothing counted in it where an outer tally was set

    def score(self, sources: list[str], targets: list[str], files: tuple[str, str] | None = None, *,
              where: Callable[[int, str], str] | None = None) -> list[float]:
        """log P(target | source) per pair (natural log, EOS included): the sums of :meth:`token_scores`."""
        return [total for total, _ in self.token_scores(sources, targets, files, where=where)]

    @torch.no_grad()
    def token_scores(self, sources: list[str], targets: list[str], files: tuple[str, str] | None = None, *,
                     where: Callable[[int, str], str] | None = None) -> list[tuple[float, list[float]]]:
        """(log P(target | source), [log p(y_t | y_<t, x) per target token, EOS last]) per pair (natural log).

        Sources are cut at ``decode.max_input_tokens`` (with a warning); a target, or a source, that does not fit
        the model's positions is a ValueError naming it: ``where(pair, side)`` (side ``source`` | ``target``)
        says where pair ``pair`` comes from, e.g. ``FILE:LINE: target line LINE``; ``files`` (source, target)
        name line-aligned files that way. A bare ``str`` is a TypeError, lists of different lengths a ValueError.
        """
        refuse_str(sources, "Translator.score")
        refuse_str(targets, "Translator.score")
        if len(sources) != len(targets):
            raise ValueError(f"Translator.score: {len(sources)} sources but {len(targets)} targets")
        locate = where or (lambda n, side: (f"{files[side == 'target']}:{n + 1}: " if files else "")
                           + f"{side} line {n + 1}")
        src_ids, warned = self.src_tokenizer.encode_batch(sources, lambda n: locate(n, "source")), set()
        for n, seq in enumerate(src_ids):
            if len(seq) > self.decode.max_input_tokens:
                if (origin := locate(n, "source")) not in warned:  # (a source scored with many targets: once)
                    warned.add(origin)
                    log.warning("%s has %d tokens; truncated to %d (decode.max_input_tokens)", origin, len(seq),
                                self.decode.max_input_tokens)
                src_ids[n] = seq[:self.decode.max_input_tokens]
        tgt_ids = self.tgt_tokenizer.encode_batch(targets, lambda n: locate(n, "target"))
        src_limit = self.model_source_tokens
        if src_limit is not None:
            for n, seq in enumerate(src_ids):
                if len(seq) > src_limit:
                    raise ValueError(f"{locate(n, 'source')} has {len(seq)} tokens; the model reads at most "
                                     f"{src_limit} (max_positions={source_positions(self.model)})")
        tgt_positions = position_limits(self.model.config)[1]  # None: an LSTM decoder scores any length
        for n, seq in enumerate(tgt_ids):
            if tgt_positions is not None and len(seq) > tgt_positions - 1:  # BOS and the pieces fill them
                raise ValueError(f"{locate(n, 'target')} has {len(seq)} tokens; the model scores at most "
                                 f"{tgt_positions - 1} (a target is never truncated)")
        out: list[tuple[float, list[float]]] = [(0.0, [])] * len(sources)
        model = model_in_precision(self.model, self.decode.precision)
        lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
        for batch in batches_by_length(lengths, self.decode.max_tokens):
            b = collate([src_ids[i] for i in batch], [tgt_ids[i] for i in batch], src_prefix=self.src_prefix)
            b = b.to(self.device)
            token_lp = token_logprobs(model, b.src, b.tgt_in, b.tgt_out)  # (B,T), 0 at padding
            for i, total, lps in zip(batch, token_lp.sum(1).tolist(), token_lp.tolist()):
                out[i] = (total, lps[:len(tgt_ids[i]) + 1])  # the pieces, then EOS
        return out
