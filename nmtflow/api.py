"""What :func:`nmtflow.load` returns: checkpoints opened as one object that translates and scores sentences.

A thin layer over ``nmtflow.decode``: :func:`~nmtflow.decode.multilingual.open_checkpoint` loads each checkpoint once,
:func:`~nmtflow.decode.multilingual.direction_translator` picks a direction of it, and
:func:`~nmtflow.decode.ensemble.ensemble_translator` joins several into an ensemble, as ``nmtflow translate`` does;
search options are :class:`~nmtflow.config.DecodeConfig` fields, given at load or per call.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import fields, replace
from typing import Any, Sequence, Union

import torch

from nmtflow.config import DecodeConfig, from_dict, to_dict
from nmtflow.data.tokenizer import unicode_problem
from nmtflow.decode.ensemble import ensemble_translator
from nmtflow.decode.multilingual import MultilingualCheckpoint, direction_translator, open_checkpoint
from nmtflow.decode.translate import Translator
from nmtflow.train.distributed import check_device

Checkpoints = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]
# one sentence's result: its text; with return_scores (text, score); with nbest a list of either, best first
Translation = Union[str, tuple[str, float], list[str], list[tuple[str, float]]]


def decode_config(base: DecodeConfig, options: dict[str, Any], where: str) -> DecodeConfig:
    """``base`` with ``options`` (:class:`DecodeConfig` field names) set, typed and validated like a config's
    ``decode`` section (a ConfigError naming the field); an unknown name is a TypeError listing the valid ones."""
    valid = [f.name for f in fields(DecodeConfig)]
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(f"{where}: unknown decode option {name!r} ({hint}valid: {', '.join(valid)})")
    return from_dict(DecodeConfig, {**to_dict(base), **options}, "decode")


def _sentences(value: Any, where: str, what: str = "sentences") -> list[str]:
    """A str → [it]; any other iterable of strs → a list; anything else a TypeError naming what is wrong, and a
    str that is no UTF-8 text (a lone surrogate) a ValueError."""
    if isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{where}: {what} are bytes; decode them to str first (e.g. .decode('utf-8'))")
    try:
        lines = [value] if isinstance(value, str) else list(value)
    except TypeError:
        raise TypeError(f"{where}: {what}: expected a str or a list of str, got {type(value).__name__}") from None
    for n, line in enumerate(lines):
        if not isinstance(line, str):
            raise TypeError(f"{where}: {what}[{n}] is a {type(line).__name__}, not a str")
        if problem := unicode_problem(line):
            raise ValueError(f"{where}: {what}[{n}] {problem}")
    return lines


class Model:
    """One checkpoint, or an ensemble of several, ready to translate and score sentences; made by
    :func:`nmtflow.load`, whose arguments it takes.

    ``decode`` is the :class:`DecodeConfig` every call starts from (the first checkpoint's ``decode`` section with the
    options given to ``load``); ``translator()`` gives the underlying :class:`Translator` of a direction.
    """

    def __init__(self, path_or_paths: Checkpoints, device: str | torch.device = "auto", *,
                 src_lang: str | None = None, tgt_lang: str | None = None, **decode: Any) -> None:
        if isinstance(path_or_paths, (str, os.PathLike)):
            path_or_paths = [path_or_paths]
        self.paths = [os.fspath(p) for p in _checkpoint_paths(path_or_paths)]
        self.device = check_device(str(device))
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self._opened = [open_checkpoint(p, self.device) for p in self.paths]
        self._load_options = decode
        self.decode = decode_config(self._opened[0].config.decode, decode, "nmtflow.load")
        self._translators: dict[tuple[str | None, str | None], Translator] = {}
        if src_lang or tgt_lang or not self.multilingual:  # the default direction's errors come now, not later
            self.translator()

    @property
    def multilingual(self) -> bool:
        """Whether the checkpoints are multilingual (a direction must then be named)."""
        return isinstance(self._opened[0], MultilingualCheckpoint)

    @property
    def networks(self) -> list[torch.nn.Module]:
        """The checkpoints' models (a multilingual one: all its encoders and decoders), in eval mode."""
        return [o.model for o in self._opened]

    @property
    def directions(self) -> list[str]:
        """The trained directions (``SRC-TGT``) of all the checkpoints."""
        return self._common("directions")

    @property
    def zero_shot(self) -> list[str]:
        """The directions held out of training (multilingual checkpoints), which translate all the same."""
        return self._common("zero_shot")

    def _common(self, attribute: str) -> list[str]:
        """``directions`` or ``zero_shot``: those of every checkpoint (a bilingual one: its own direction, trained)."""
        def of(opened: Translator | MultilingualCheckpoint) -> list[str]:
            if isinstance(opened, MultilingualCheckpoint):
                return getattr(opened, attribute)
            data = opened.config.data
            return [f"{data.src_lang}-{data.tgt_lang}"] if attribute == "directions" else []

        lists = [of(o) for o in self._opened]
        return [d for d in lists[0] if all(d in other for other in lists[1:])]

    def translator(self, src_lang: str | None = None, tgt_lang: str | None = None) -> Translator:
        """The :class:`Translator` of a direction (default: the one given to ``load``), with :attr:`decode`;
        several checkpoints give their ensemble's."""
        src, tgt = src_lang or self.src_lang, tgt_lang or self.tgt_lang
        if bool(src) != bool(tgt):
            raise ValueError(f"{', '.join(map(str, self.paths))}: name both languages of the direction, got "
                             f"src_lang={src!r}, tgt_lang={tgt!r}")
        if (src, tgt) not in self._translators:
            members = [direction_translator(o, p, src, tgt, self.decode) for o, p in zip(self._opened, self.paths)]
            self._translators[src, tgt] = members[0] if len(members) == 1 else ensemble_translator(members,
                                                                                                   self.paths)
        return self._translators[src, tgt]

    def close(self) -> None:
        """Stop the worker processes of ``decode.workers`` of every direction used so far (they also stop at exit);
        the model stays usable and starts them again when needed. ``with nmtflow.load(...) as model:`` does it."""
        for translator in self._translators.values():
            translator.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call_translator(self, where: str, src_lang: str | None, tgt_lang: str | None,
                         options: dict[str, Any]) -> Translator:
        translator = self.translator(src_lang, tgt_lang)
        return replace(translator, decode=decode_config(self.decode, options, where)) if options else translator

    def translate(self, sentences: str | Sequence[str], *, nbest: int | None = None, return_scores: bool = False,
                  src_lang: str | None = None, tgt_lang: str | None = None,
                  prefixes: str | Sequence[str] | None = None, **decode: Any) -> Translation | list[Translation]:
        """Translate a list of sentences (→ a list, in order) or one ``str`` (→ its result).

        A sentence's result is its best translation; with ``nbest=N`` (here or at load; also ``N = 1``) a list of
        ``N`` translations, best first (fewer only where fewer distinct outputs fit the length limit); with
        ``return_scores=True`` each translation is a ``(text, score)`` pair, the score being the search's
        length-normalised log-probability (what ``nmtflow translate --nbest`` prints). ``src_lang``/``tgt_lang``
        pick a direction of a multilingual model; ``prefixes``: a target prefix each translation starts with, one
        per sentence ("" for none; a ``str`` for a ``str`` sentence); further keywords are :class:`DecodeConfig`
        fields for this call (``beam_size=10``, ``greedy=True``, ``sampling=True, top_p=0.9, seed=1``, ...).
        """
        lines = _sentences(sentences, "translate")
        forced = None if prefixes is None else _sentences(prefixes, "translate", "prefixes")
        if nbest is not None:
            decode["nbest"] = nbest
        translator = self._call_translator("translate", src_lang, tgt_lang, decode)
        lists = "nbest" in decode or "nbest" in self._load_options or translator.decode.nbest > 1
        results = []
        for hyps in translator.translate(lines, prefixes=forced):
            items = hyps if return_scores else [text for text, _ in hyps]
            results.append(items if lists else items[0])
        return results[0] if isinstance(sentences, str) else results

    def score(self, sources: str | Sequence[str], targets: str | Sequence[str], *, src_lang: str | None = None,
              tgt_lang: str | None = None, **decode: Any) -> float | list[float]:
        """log P(target | source) of each pair (natural log, EOS included; the values of ``nmtflow score``): a list,
        or one float for two ``str``; keywords as for :meth:`translate` (``max_tokens``, ``max_input_tokens``,
        ``precision``); a search option (``beam_size``, ``greedy``, ...) is a ``TypeError``: nothing is searched."""
        if isinstance(sources, str) != isinstance(targets, str):
            raise TypeError("score: give one source and one target (two str), or two lists of the same length")
        srcs, tgts = _sentences(sources, "score", "sources"), _sentences(targets, "score", "targets")
        if len(srcs) != len(tgts):
            raise ValueError(f"score: {len(srcs)} sources but {len(tgts)} targets")
        searching = [name for name in decode if name in SEARCH_FIELDS]
        if searching:  # as `nmtflow score` refuses --beam etc.: they would be silently ignored
            raise TypeError(f"score: {searching[0]!r} is a search option; score computes log P(target | source) of "
                            "given targets: nothing is searched")
        translator = self._call_translator("score", src_lang, tgt_lang, decode)
        scores = translator.score(srcs, tgts, where=lambda n, side: f"{side}s[{n}]")
        return scores[0] if isinstance(sources, str) else scores

    def __repr__(self) -> str:
        direction = f", src_lang={self.src_lang!r}, tgt_lang={self.tgt_lang!r}" if self.src_lang else ""
        paths = self.paths[0] if len(self.paths) == 1 else self.paths
        return f"nmtflow.load({paths!r}, device={str(self.device)!r}{direction})"


# DecodeConfig fields that only a search (translate) reads: score refuses them
SEARCH_FIELDS = frozenset({"beam_size", "nbest", "len_penalty", "max_len_a", "max_len_b", "min_len", "greedy",
                           "sampling", "temperature", "top_k", "top_p", "seed", "workers"})


def _checkpoint_paths(paths: Any) -> list[Any]:
    try:
        found = list(paths)
    except TypeError:
        raise TypeError(f"nmtflow.load: expected a checkpoint path or a list of them, got {type(paths).__name__}") \
            from None
    if not found:
        raise ValueError("nmtflow.load: no checkpoint given")
    for p in found:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"nmtflow.load: expected checkpoint paths, got {p!r}")
    return found
