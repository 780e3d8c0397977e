"""Loading multilingual checkpoints for inference: any trained or zero-shot direction, sentence embeddings."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nmtflow.checkpoint import CheckpointError, load_checkpoint, model_mismatch
from nmtflow.config import Config, DecodeConfig, config_from_dict
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import lang_tag
from nmtflow.decode.translate import Translator, tokenizer_from_bytes
from nmtflow.models.base import build_model, position_limits
from nmtflow.models.multilingual import LanguageVocabularies, MultilingualModel

log = logging.getLogger(__name__)


@dataclass
class MultilingualCheckpoint:
    """A trained multilingual model (in eval mode) with one tokenizer per language."""

    model: MultilingualModel
    tokenizers: dict[str, Tokenizer]
    config: Config
    directions: list[str]  # trained directions
    zero_shot: list[str]  # directions held out of training

    def tokenizer(self, lang: str) -> Tokenizer:
        if lang not in self.tokenizers:
            raise ValueError(f"language {lang!r} is unknown to this model (languages: {', '.join(self.tokenizers)})")
        return self.tokenizers[lang]

    def source_prefix(self, tgt_lang: str) -> int | None:
        """The ``<2TGT>`` tag id a language-label model expects before each source; None for other models."""
        if not self.model.uses_language_tags:
            return None
        return self.tokenizer(tgt_lang).id(lang_tag(tgt_lang))

    def max_source_tokens(self, tgt_lang: str) -> int | None:
        """Pieces of a source the model reads (positions less EOS and any ``<2TGT>`` tag); None: no limit."""
        limit = position_limits(self.model.config)[0]
        return None if limit is None else max(0, limit - 1 - (self.source_prefix(tgt_lang) is not None))

    @classmethod
    def source_side(cls, translator: Translator, src_lang: str) -> "MultilingualCheckpoint":
        """A bilingual checkpoint's encoder as a one-language checkpoint (``src_lang`` only): what sentence
        embeddings read (a bilingual bridge's M, or any encoder's states)."""
        return cls(_SourceEncoder(translator.model), {src_lang: translator.src_tokenizer},  # type: ignore[arg-type]
                   translator.config, [], [])

    def translator(self, src_lang: str, tgt_lang: str, decode: DecodeConfig | None = None) -> Translator:
        """A :class:`Translator` for ``src_lang → tgt_lang`` (trained or zero-shot)."""
        src_tok, tgt_tok = self.tokenizer(src_lang), self.tokenizer(tgt_lang)
        return Translator(self.model.pair(src_lang, tgt_lang), src_tok, tgt_tok, decode or self.config.decode,
                          self.config, src_prefix=self.source_prefix(tgt_lang))


class _SourceEncoder(torch.nn.Module):
    """A bilingual model under the multilingual ``encode(src, lang=...)`` call (its one source language)."""

    uses_language_tags = False

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def encode(self, src: torch.Tensor, lang: str | None = None) -> Any:
        return self.inner.encode(src)


def is_multilingual(ckpt: dict) -> bool:
    return bool(ckpt.get("multilingual"))


def load_multilingual(path: str | Path, device: str | torch.device = "cpu", *,
                      ckpt: dict | None = None) -> MultilingualCheckpoint:
    """Rebuild a checkpoint written by :class:`~nmtflow.train.multilingual.MultilingualTrainer`."""
    ckpt = load_checkpoint(path) if ckpt is None else ckpt
    if not is_multilingual(ckpt):
        raise CheckpointError(f"{path}: not a multilingual checkpoint (translate it without --src-lang/--tgt-lang)")
    try:
        config = config_from_dict(ckpt["config"])
        model = build_model(config.model, LanguageVocabularies(**ckpt["vocab"]))
        model.load_state_dict(ckpt["model"])
        tokenizers = {lang: tokenizer_from_bytes(t.numpy().tobytes(), path, lang)
                      for lang, t in ckpt["tokenizers"].items()}
    except (KeyError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path}: checkpoint does not match its model ({model_mismatch(exc)})") from None
    model.to(device).eval()
    langs = ckpt.get("langs", {})
    return MultilingualCheckpoint(model, tokenizers, config, list(langs.get("directions", [])),
                                  list(langs.get("zero_shot", [])))


def open_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Translator | MultilingualCheckpoint:
    """A checkpoint loaded once: a bilingual one's :class:`Translator`, or a :class:`MultilingualCheckpoint` (whose
    directions :func:`direction_translator` picks without loading it again)."""
    ckpt = load_checkpoint(path)
    if is_multilingual(ckpt):
        return load_multilingual(path, device, ckpt=ckpt)
    return Translator.from_checkpoint(path, device, ckpt=ckpt)


def direction_translator(opened: Translator | MultilingualCheckpoint, path: str | Path, src_lang: str | None,
                         tgt_lang: str | None, decode: DecodeConfig | None = None) -> Translator:
    """The ``src_lang → tgt_lang`` translator of a checkpoint opened by :func:`open_checkpoint` (``path``).

    A bilingual checkpoint translates its own direction (named, or both languages None); a multilingual one any
    trained or zero-shot direction, which must be named. A language or direction the model lacks is a one-line
    :class:`CheckpointError` naming ``path``.
    """
    if isinstance(opened, Translator):
        data = getattr(opened.config, "data", None)
        own = (getattr(data, "src_lang", None), getattr(data, "tgt_lang", None))
        if (src_lang or tgt_lang) and (src_lang, tgt_lang) != own:
            raise CheckpointError(f"{path}: a bilingual {own[0]}→{own[1]} model cannot translate "
                                  f"{src_lang}→{tgt_lang} (name no languages, or {own[0]} and {own[1]})")
        return opened if decode is None else replace(opened, decode=decode)
    if not (src_lang and tgt_lang):
        zero_shot = f"; zero-shot: {', '.join(opened.zero_shot)}" if opened.zero_shot else ""
        raise CheckpointError(f"{path}: a multilingual checkpoint (trained: {', '.join(opened.directions)}{zero_shot}):"
                              " name the source and the target language")
    try:
        translator = opened.translator(src_lang, tgt_lang, decode)
    except (ValueError, KeyError) as exc:  # a language or direction the model does not have
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise CheckpointError(f"{path}: {message}") from None
    direction = f"{src_lang}-{tgt_lang}"
    if opened.directions and direction not in opened.directions and direction not in opened.zero_shot:
        key = (str(path), direction)
        if key not in _warned_untrained:  # once per checkpoint and direction (serve and the API call this often)
            _warned_untrained.add(key)
            log.warning("%s: %s was neither trained nor held out as zero-shot (trained: %s%s); its modules were "
                        "trained for other directions", path, direction, ", ".join(opened.directions),
                        f"; zero-shot: {', '.join(opened.zero_shot)}" if opened.zero_shot else "")
    return translator


_warned_untrained: set[tuple[str, str]] = set()


def multilingual_translator(path: str | Path, src_lang: str, tgt_lang: str, device: str | torch.device = "cpu",
                            decode: DecodeConfig | None = None) -> Translator:
    """Load ``path`` and return its ``src_lang → tgt_lang`` translator (:func:`direction_translator`)."""
    return direction_translator(open_checkpoint(path, device), path, src_lang, tgt_lang, decode)


def open_translator(path: str | Path, device: str | torch.device = "cpu", src_lang: str | None = None,
                    tgt_lang: str | None = None) -> Translator:
    """A checkpoint's translator: its own direction, or ``src_lang → tgt_lang`` of a multilingual checkpoint
    (both named, or neither)."""
    if not (src_lang or tgt_lang):
        return Translator.from_checkpoint(path, device)
    if not (src_lang and tgt_lang):
        raise ValueError("name both --src-lang and --tgt-lang (a direction of a multilingual model)")
    return multilingual_translator(path, src_lang, tgt_lang, device)