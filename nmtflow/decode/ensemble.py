"""Ensembles: several checkpoints translate, score and measure perplexity as one model.

The ensemble's next-token distribution is the mean of its members' (as in fairseq and Marian)::

    p(y_t | y_<t, x) = 1/n · Σ_i p_i(y_t | y_<t, x)        computed as  logsumexp_i log p_i − log n

Members may be of any architectures (a Transformer, a feature-fusion model and a phrasal-attention model, a
ConvS2S, one direction of a multilingual model, ...) as long as they share their SentencePiece models, i.e.
were trained on the same prepared data, and read the same source (a language-label model's ``<2xx>`` tag and
an untagged model do not mix). An :class:`Ensemble` keeps the :class:`EncoderDecoder` contract, so beam search
decodes it incrementally: each member's encoder output and decoder caches sit in the one state dict under the
member's prefix (``"0/"``, ``"1/"``, ...) and are reordered with everything else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.checkpoint import CheckpointError
from nmtflow.data.tokenizer import same_model
from nmtflow.data.vocab import PAD
from nmtflow.decode.multilingual import open_translator
from nmtflow.decode.translate import Translator
from nmtflow.models.base import EncoderDecoder, EncoderOut, State


@dataclass
class EnsembleConfig:
    """The members' model configs; what searches and translators read of a config, the tightest of theirs."""

    members: list[Any]
    name: str = "ensemble"

    @property
    def max_positions(self) -> int:
        return min(int(getattr(c, "max_positions", 1024)) for c in self.members)


def _member(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


class Ensemble(EncoderDecoder):
    """Models sharing vocabularies as one: log of the mean of their next-token probabilities (returned as logits)."""

    def __init__(self, members: list[EncoderDecoder]) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least two models, got {len(members)}")
        self.members = nn.ModuleList(members)
        self.config = EnsembleConfig([m.config for m in members])
        self.prefixes = [f"{i}/" for i in range(len(members))]
        # a direction of multilingual models (read by translator_direction); None for bilingual members
        self.src_lang = getattr(members[0], "src_lang", None)
        self.tgt_lang = getattr(members[0], "tgt_lang", None)

    def encode(self, src: Tensor) -> EncoderOut:
        enc = {"padding_mask": src.eq(PAD)}
        for prefix, member in zip(self.prefixes, self.members):
            enc.update({prefix + k: v for k, v in member.encode(src).items()})
        return enc

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        """tgt_in (B,T) → log (1/n Σ_i p_i) (B,T,V), float32; with ``state``, each member's caches under its prefix."""
        lprobs = []
        for prefix, member in zip(self.prefixes, self.members):
            if state is None:
                logits = member.decode(tgt_in, _member(enc, prefix))
            else:
                own = _member(state, prefix)
                logits = member.decode(tgt_in, _member(enc, prefix), own)
                for key in [k for k in state if k.startswith(prefix)]:
                    del state[key]
                state.update({prefix + k: v for k, v in own.items()})
            lprobs.append(F.log_softmax(logits.float(), dim=-1))
        return torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))

    def extra_repr(self) -> str:
        return f"{len(self.members)} members: " + ", ".join(getattr(c, "name", "?") for c in self.config.members)


def _direction(translator: Translator) -> tuple[str, str]:
    """(source, target) language a translator reads and writes: its direction of a multilingual model, else its
    checkpoint config's (``?`` where unknown)."""
    src, tgt = getattr(translator.model, "src_lang", None), getattr(translator.model, "tgt_lang", None)
    if src and tgt:
        return src, tgt
    data = getattr(translator.config, "data", None)
    return str(getattr(data, "src_lang", "?")), str(getattr(data, "tgt_lang", "?"))


def ensemble_translator(translators: list[Translator], names: list[str]) -> Translator:
    """One :class:`Translator` for several (from checkpoints ``names``): the first one's tokenizers and settings.

    Members whose SentencePiece models differ from the first's, that translate another direction (a joint
    vocabulary does not tell a de→en model from an en→de one), or that read another source prefix (a
    language-label tag), are a :class:`CheckpointError` naming the checkpoint.
    """
    first = translators[0]
    for translator, name in zip(translators[1:], names[1:]):
        for side in ("src", "tgt"):
            mine, theirs = getattr(translator, f"{side}_tokenizer"), getattr(first, f"{side}_tokenizer")
            if not same_model(mine.model_proto, theirs.model_proto):
                raise CheckpointError(f"{name}: its {'source' if side == 'src' else 'target'} vocabulary is not "
                                      f"that of {names[0]}; the models of an ensemble must share their "
                                      "vocabularies (be trained on the same prepared data)")
        if _direction(translator) != _direction(first):
            raise CheckpointError(f"{name}: translates {'→'.join(_direction(translator))}, unlike {names[0]} "
                                  f"({'→'.join(_direction(first))}); the models of an ensemble must translate "
                                  "the same direction")
        if translator.src_prefix != first.src_prefix:
            raise CheckpointError(f"{name}: reads {'no' if translator.src_prefix is None else 'a'} target-language "
                                  f"tag before the source, unlike {names[0]}; a language-label model ensembles only "
                                  "with language-label models")
    model = Ensemble([t.model for t in translators])
    return Translator(model, first.src_tokenizer, first.tgt_tokenizer, first.decode, first.config,
                      src_prefix=first.src_prefix)


def open_translators(paths: list[str | Path], device: str | torch.device = "cpu", src_lang: str | None = None,
                     tgt_lang: str | None = None) -> Translator:
    """The translator of one checkpoint, or of an ensemble of several (each opened by :func:`open_translator`)."""
    if not paths:
        raise ValueError("no checkpoint given")
    translators = [open_translator(p, device, src_lang, tgt_lang) for p in paths]
    if len(translators) == 1:
        return translators[0]
    return ensemble_translator(translators, [str(p) for p in paths])
