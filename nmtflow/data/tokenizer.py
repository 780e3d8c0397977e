"""SentencePiece BPE tokenizer with nmtflow's fixed special ids (PAD=0, UNK=1, BOS=2, EOS=3).

New models use byte fallback: a character that training never saw is encoded as the UTF-8 bytes of it (pieces
``<0x00>``–``<0xFF>``, part of the vocabulary) instead of ``<unk>``, so any text comes back from encode and decode
as it was (after SentencePiece's NFKC normalisation).

Text is encoded after :func:`~nmtflow.data.corpus.normalize_line`, as ``prepare`` reads its corpora, so that training
and inference see the same characters. Decoded text holds no line break or tab: byte pieces can spell one (no training
sentence holds one), and one output must stay one line of a file or field of a TSV.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from .corpus import CorpusError, normalize_line
from .vocab import BOS, BOS_PIECE, EOS, EOS_PIECE, PAD, PAD_PIECE, UNK, UNK_PIECE


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def canonical_model(data: bytes) -> bytes:
    """A serialized SentencePiece model without the trainer's file names (its input files and output prefix).

    Those names are all that differs between two trainings of the same data in different places or processes;
    they play no part in encoding or decoding.
    """
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(data)
    proto.trainer_spec.ClearField("input")
    proto.trainer_spec.ClearField("model_prefix")
    return proto.SerializeToString(deterministic=True)


def same_model(a: bytes, b: bytes) -> bool:
    """Whether two serialized SentencePiece models tokenize alike (:func:`canonical_model` equal)."""
    return a == b or canonical_model(a) == canonical_model(b)


#: SentencePiece's refusal of a vocabulary smaller than its characters and meta pieces ("60 vs 284")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)")
BYTE_PIECES = 256


def _too_small(vocab_size: int, needed: int, user_symbols: int, byte_fallback: bool) -> str:
    """Why ``vocab_size`` is refused: what the ``needed`` pieces are, and the ways out."""
    parts = ["4 special pieces"]
    if user_symbols:
        parts.append(f"{user_symbols} user symbol(s)")
    if byte_fallback:
        parts.append(f"{BYTE_PIECES} byte pieces of byte fallback")
    parts.append(f"{needed - 4 - user_symbols - BYTE_PIECES * byte_fallback} distinct characters of the text")
    message = f"vocabulary size {vocab_size} is too small: the minimum is {needed} ({', '.join(parts)}); ask for " \
              f"{needed} or more"
    if byte_fallback:
        message += f", or turn byte fallback off (--no-byte-fallback, byte_fallback=False), which needs " \
                   f"{needed - BYTE_PIECES}"
    return message


def _utf8_width(lead: int) -> int:
    """Bytes of the UTF-8 sequence that starts with byte ``lead`` (1 for a byte that starts none)."""
    return 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 1


#: Line breaks (those of :meth:`str.splitlines`) and tabs: byte pieces can spell them in a translation.
_BREAKS = re.compile("[\t\n\v\f\r\x1c\x1d\x1e\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with its whitespace normalised (:func:`~nmtflow.data.corpus.normalize_line`) if it holds a line
    break or tab; unchanged otherwise."""
    return normalize_line(text) if _BREAKS.search(text) else text


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate, which only a ``str`` built in Python or decoded
    with ``surrogateescape`` holds), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


class Tokenizer:
    """A loaded SentencePiece model.

    ``encode`` returns plain subword ids (no BOS/EOS: batching adds those); ``decode`` stops at
    the first EOS and skips PAD/BOS, so it accepts raw model output. ``path`` is the model's file (None for a
    model loaded from bytes, such as one inside a checkpoint), ``name`` the file that messages name, and
    ``model_proto`` the serialized model.
    """

    def __init__(self, model_path: str | Path, *, num_threads: int | None = None) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise CorpusError(path, "SentencePiece model not found")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CorpusError(path, f"cannot read SentencePiece model ({e.strerror or e})") from None
        self._load(data, path, str(path), "SentencePiece model", num_threads)

    @classmethod
    def from_bytes(cls, data: bytes, name: str | Path, *, what: str = "SentencePiece model",
                   num_threads: int | None = None) -> "Tokenizer":
        """The serialized model ``data`` (no file is written); errors name ``name``, the file that holds it, and
        ``what`` it is there (e.g. ``its src SentencePiece model`` for a checkpoint's)."""
        tok = cls.__new__(cls)
        tok._load(bytes(data), None, str(name), what, num_threads)
        return tok

    def _load(self, data: bytes, path: Path | None, name: str, what: str, num_threads: int | None) -> None:
        self.path, self.name, self.what, self.model_proto = path, name, what, data
        self.num_threads = num_threads or _default_threads()
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(data)
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            if "ParseFromArray" in reason:  # SentencePiece's only word on it is a place in its C++ source
                reason = "not a SentencePiece model, or a corrupted one"
            raise CorpusError(name, f"cannot load {what} ({reason})") from None
        got = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
        if got != (PAD, UNK, BOS, EOS):
            raise CorpusError(
                name,
                f"special ids{'' if path is not None else ' of ' + what} are (pad, unk, bos, eos)={got}, expected "
                f"{(PAD, UNK, BOS, EOS)}; train the model with Tokenizer.train",
            )
        self._sp = sp
        self._size = int(sp.GetPieceSize())
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(data)
        self._byte_fallback = proto.trainer_spec.byte_fallback

    # -- training -----------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        text_files: Sequence[str | Path],
        model_prefix: str | Path,
        vocab_size: int,
        user_symbols: Sequence[str] = (),
        max_sentences: int = 2_000_000,
        num_threads: int = 2,
        seed: int = 1,
        byte_fallback: bool = True,
    ) -> "Tokenizer":
        """Train a BPE model on ``text_files`` and write ``MODEL_PREFIX.model``/``.vocab``.

        Uses ``character_coverage=1.0`` and, for inputs longer than ``max_sentences`` lines, a
        seeded random sample of that many sentences. ``user_symbols`` (e.g. language tags) become
        single pieces that are never split. With ``byte_fallback`` (the default) 256 of the ``vocab_size``
        pieces are bytes, which spell any character the training text lacks; a vocabulary too small to hold
        the special pieces, the user symbols, the bytes and every character of the text is a ValueError naming
        the smallest size that is. If ``vocab_size`` exceeds what the data can provide,
        training is retried once with ``hard_vocab_limit=False``: the model then has fewer pieces
        than requested; check :attr:`vocab_size`. The files are written atomically.
        """
        files = [Path(f) for f in text_files]
        if not files:
            raise ValueError("Tokenizer.train needs at least one text file")
        for f in files:
            if not f.is_file():
                raise CorpusError(f, "file not found")
        if vocab_size < 4 + len(user_symbols):
            raise ValueError(f"vocabulary size {vocab_size} is too small: the minimum is {4 + len(user_symbols)} "
                             f"(4 special pieces, {len(user_symbols)} user symbols) before any piece of the text")
        if vocab_size > 2**31 - 1:  # SentencePiece reads it as a 32-bit int ("cannot parse ... as int")
            raise ValueError(f"vocabulary size {vocab_size} is too large: SentencePiece takes at most {2**31 - 1:,}")
        for s in user_symbols:
            if not s or any(c.isspace() for c in s):
                raise ValueError(f"invalid user symbol {s!r}")
            if s in (PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE):  # the model would lose that special id
                raise ValueError(f"user symbol {s!r} is one of the special pieces "
                                 f"({', '.join((PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE))})")
        if len(set(user_symbols)) != len(user_symbols):
            raise ValueError(f"duplicate user symbols: {list(user_symbols)}")
        model_prefix = Path(model_prefix)
        model_prefix.parent.mkdir(parents=True, exist_ok=True)
        tmp_prefix = model_prefix.with_name(f".{model_prefix.name}.tmp{os.getpid()}")
        opts: dict[str, Any] = dict(
            input=[str(f) for f in files],
            model_prefix=str(tmp_prefix),
            vocab_size=int(vocab_size),
            model_type="bpe",
            character_coverage=1.0,
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            pad_piece=PAD_PIECE, unk_piece=UNK_PIECE, bos_piece=BOS_PIECE, eos_piece=EOS_PIECE,
            input_sentence_size=int(max_sentences),
            shuffle_input_sentence=True,
            num_threads=int(num_threads),
            byte_fallback=bool(byte_fallback),
            minloglevel=2,  # silence SentencePiece's INFO/WARNING logging
        )
        if user_symbols:
            opts["user_defined_symbols"] = list(user_symbols)
        spm.set_random_generator_seed(int(seed))
        try:
            try:
                spm.SentencePieceTrainer.Train(**opts)
            except RuntimeError as e:
                if "Vocabulary size too high" not in str(e):
                    raise
                spm.set_random_generator_seed(int(seed))
                spm.SentencePieceTrainer.Train(hard_vocab_limit=False, **opts)
        except RuntimeError as e:
            for ext in (".model", ".vocab"):
                Path(f"{tmp_prefix}{ext}").unlink(missing_ok=True)
            names = ", ".join(str(f) for f in files)
            if small := _TOO_SMALL.search(str(e)):
                raise ValueError(f"SentencePiece training on {names}: "
                                 + _too_small(vocab_size, int(small[1]), len(user_symbols), byte_fallback)) from None
            raise ValueError(f"SentencePiece training on {names} failed: {e}") from None
        model = Path(f"{tmp_prefix}.model")  # without the temporary name: preparing again gives the same bytes
        model.write_bytes(canonical_model(model.read_bytes()))
        for ext in (".vocab", ".model"):
            os.replace(f"{tmp_prefix}{ext}", f"{model_prefix}{ext}")
        return cls(f"{model_prefix}.model", num_threads=num_threads)

    def save(self, model_prefix: str | Path) -> "Tokenizer":
        """Write this model as ``MODEL_PREFIX.model`` (its bytes unchanged, so it encodes exactly alike) and
        ``MODEL_PREFIX.vocab`` (``piece<TAB>score`` per id, as SentencePiece's trainer writes it); return the
        tokenizer of the written file."""
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_proto)
        Path(f"{model_prefix}.model").write_bytes(self.model_proto)
        Path(f"{model_prefix}.vocab").write_text("".join(f"{p.piece}\t{p.score:g}\n" for p in proto.pieces),
                                                  encoding="utf-8")
        return type(self)(f"{model_prefix}.model", num_threads=self.num_threads)

    # -- encoding -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of pieces, special ids included."""
        return self._size

    def __len__(self) -> int:
        return self._size

    def encode(self, text: str) -> list[int]:
        """Subword ids of ``text`` (no BOS/EOS), its whitespace normalised as ``prepare`` normalises it."""
        try:
            return self._sp.Encode(normalize_line(text), out_type=int)
        except (TypeError, AttributeError, RuntimeError):  # SentencePiece's words for a str that is no UTF-8 text
            raise ValueError(f"text {unicode_problem(text) or 'is not a str'}") from None

    def encode_batch(self, texts: list[str], where: Callable[[int], str] | None = None, *,
                     normalized: bool = False) -> list[list[int]]:
        """Encode many strings at once with SentencePiece's multithreaded C++ batch encoder; a text that is no
        UTF-8 (a lone surrogate) is a ValueError naming it by ``where(index)`` (default: its 0-based index).
        ``normalized``: the texts come from ``prepare``'s reader, already normalised (not normalised again)."""
        if not isinstance(texts, list):
            texts = list(texts)
        if not texts:
            return []
        try:
            return self._sp.Encode(texts if normalized else [normalize_line(t) for t in texts], out_type=int,
                                   num_threads=self.num_threads)
        except (TypeError, AttributeError, RuntimeError):  # AttributeError: a text that is no str
            for n, text in enumerate(texts):
                problem = unicode_problem(text) if isinstance(text, str) else f"is a {type(text).__name__}, not a str"
                if problem:
                    raise ValueError(f"{where(n) if where else f'sentence {n} (0-based)'} {problem}") from None
            raise

    def _clean_ids(self, ids: Any) -> list[int]:
        if hasattr(ids, "detach"):  # torch tensor, possibly on an accelerator
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        eos = np.flatnonzero(arr == EOS)
        if eos.size:
            arr = arr[: eos[0]]
        arr = arr[(arr != PAD) & (arr != BOS)]
        if arr.size and (arr.min() < 0 or arr.max() >= self._size):
            bad = int(arr[(arr < 0) | (arr >= self._size)][0])
            raise ValueError(f"{self.name}: id {bad} is outside the vocabulary (size {self._size})")
        return arr.tolist()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``: stops at the first EOS, skips PAD and BOS; one line (:func:`one_line`)."""
        return one_line(self._sp.Decode(self._clean_ids(ids)))

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """:meth:`decode` for many sequences (rows of a 2-D array work too)."""
        cleaned = [self._clean_ids(ids) for ids in batch]
        if not cleaned:
            return []
        return [one_line(text) for text in self._sp.Decode(cleaned, num_threads=self.num_threads)]

    # -- pieces -------------------------------------------------------------------------------
    def piece(self, i: int) -> str:
        """The piece string of id ``i``."""
        i = int(i)
        if not 0 <= i < self._size:
            raise IndexError(f"id {i} is outside the vocabulary (size {self._size})")
        return self._sp.IdToPiece(i)

    def id(self, piece: str) -> int:
        """The id of ``piece``; raises ``KeyError`` for a piece that is not in the vocabulary."""
        i = int(self._sp.PieceToId(piece))
        if i == UNK and piece != UNK_PIECE:
            raise KeyError(f"{piece!r} is not in the vocabulary of {self.name}")
        return i

    def labels(self, ids: Sequence[int]) -> list[str]:
        """Readable labels of ``ids``, one per id (e.g. for the axes of a plot): the pieces, except that a run of
        byte pieces shows the characters its UTF-8 bytes spell: ``ë`` spelled by two bytes is ``ë[1/2]``,
        ``ë[2/2]``; a byte that spells no character stays ``<0xC3>``."""
        ids = [int(i) for i in ids]
        out = [self.piece(i) for i in ids]
        byte = [int(piece[3:5], 16) if self._sp.IsByte(i) else None for i, piece in zip(ids, out)]  # "<0xC3>"
        k = 0
        while k < len(ids):
            width = 0 if byte[k] is None else _utf8_width(byte[k])
            span = byte[k:k + width]
            try:
                char = bytes(span).decode("utf-8") if width and len(span) == width and None not in span else ""
            except UnicodeDecodeError:
                char = ""
            if not char:  # not a byte piece, or one that starts no whole character: its piece
                k += 1
                continue
            out[k:k + width] = [char] if width == 1 else [f"{char}[{j + 1}/{width}]" for j in range(width)]
            k += width
        return out

    def unknown_surfaces(self, text: str) -> list[str]:
        """The text of each piece of ``text`` that encodes to ``<unk>`` (none with byte fallback)."""
        try:
            pieces = self._sp.Encode(text, out_type="proto").pieces
        except (TypeError, RuntimeError):
            raise ValueError(f"text {unicode_problem(text) or 'is not a str'}") from None
        return [p.surface for p in pieces if p.id == UNK]

    @property
    def byte_fallback(self) -> bool:
        """Whether the model spells characters outside its vocabulary as bytes (False: they become ``<unk>``)."""
        return bool(self._byte_fallback)

    def __contains__(self, piece: str) -> bool:
        return int(self._sp.PieceToId(piece)) != UNK or piece == UNK_PIECE

    # -- pickling (e.g. for data-loader worker processes): the model's bytes, so no file is read again ----------
    def __getstate__(self) -> dict:
        return {"path": None if self.path is None else str(self.path), "name": self.name, "what": self.what,
                "model_proto": self.model_proto, "num_threads": self.num_threads}

    def __setstate__(self, state: dict) -> None:
        path = None if state["path"] is None else Path(state["path"])
        self._load(state["model_proto"], path, state["name"], state["what"], state["num_threads"])

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self._size})"


__all__ = ["Tokenizer"]
