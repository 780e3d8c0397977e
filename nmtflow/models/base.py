"""The contract every sequence-to-sequence model keeps, and its typed config base.

Incremental decoding: ``decode(tgt_in, enc, state)`` with a ``state`` dict receives only the new target
token(s) and extends the caches inside ``state``. Every tensor in ``state`` and in the encoder output is
batch-first, so beam search reorders both with one ``index_select`` per tensor (:func:`reorder`), written
once for every architecture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from nmtflow.config import ModelConfig  # typed with the other config sections; model configs subclass it
from nmtflow.nn.attention import ROWS
from nmtflow.registry import MODELS

EncoderOut = dict[str, Tensor]
State = dict[str, Tensor]


@dataclass(frozen=True)
class Vocabularies:
    """What a model needs to know about its vocabularies to build its embeddings."""

    src_size: int
    tgt_size: int
    joint: bool = True


def reorder(tensors: dict[str, Tensor], order: Tensor) -> dict[str, Tensor]:
    """Select batch rows ``order`` of every tensor (beam reordering, finished-sentence pruning).

    A cache whose beam order is still pending (``NAME.rows`` beside ``NAME.k``/``NAME.v``, left by beam search:
    :func:`nmtflow.nn.attention.defer_cache_reorder`) keeps its rows; its pending order is reordered instead.
    """
    pending = {k[: -len(ROWS)] + kv for k in tensors if k.endswith(ROWS) for kv in (".k", ".v")}
    return {k: v if k in pending else v.index_select(0, order) for k, v in tensors.items()}


class EncoderDecoder(nn.Module):
    """Base class: ``encode`` once, ``decode`` fully or incrementally, same logits either way."""

    config: ModelConfig

    @classmethod
    def build(cls, config: ModelConfig, vocabs: Vocabularies) -> "EncoderDecoder":
        return cls(config, vocabs)  # type: ignore[call-arg]

    def encode(self, src: Tensor) -> EncoderOut:
        """src (B,S) → a dict of batch-first tensors; must contain ``padding_mask`` (B,S), True = pad."""
        raise NotImplementedError

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        """tgt_in (B,T) → logits (B,T,V). With ``state``, tgt_in holds only the new positions."""
        raise NotImplementedError

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src))

    def auxiliary_loss(self, enc: EncoderOut, num_tgt_tokens: int) -> Tensor | None:
        """An extra training loss term from the encoder output (e.g. a penalty), on the scale of the batch's summed
        token cross-entropy: the trainer adds the two and divides them by the update's target tokens together, so a
        sentence's term keeps its weight against its own token losses whatever else the update holds.
        ``num_tgt_tokens`` (this batch's target tokens) lets a term meant per target token be scaled up to a sum.
        None if the model has none."""
        return None


def build_model(config: ModelConfig, vocabs: Vocabularies) -> EncoderDecoder:
    """Instantiate the registered model named by ``config.name``."""
    model_cls = MODELS.get(config.name).cls
    return model_cls.build(config, vocabs)


def position_limits(cfg: Any) -> tuple[int | None, int | None]:
    """Positions a source and a target (EOS and any tag included) may take in a model of config ``cfg``; None
    where positions do not bound that side (LSTMs: ``POSITIONS_BOUND_LENGTH = False``)."""
    members = getattr(cfg, "members", None)
    if isinstance(members, list):  # an ensemble (nmtflow.decode.ensemble): the tightest bound on each side
        limits = [position_limits(member) for member in members]
        return tuple(min((lim[side] for lim in limits if lim[side] is not None), default=None)  # type: ignore[return-value]
                     for side in (0, 1))
    sides = (getattr(cfg, "encoder", None), getattr(cfg, "decoder", None))
    if all(isinstance(side, str) for side in sides):  # the bridge: a stack per side, rnn or transformer
        limit = int(cfg.max_positions)
        return tuple(limit if side == "transformer" else None for side in sides)  # type: ignore[return-value]
    cfg = getattr(cfg, "backbone", cfg)  # a language-label model: its backbone's
    limit = getattr(cfg, "max_positions", None)
    if not isinstance(limit, int) or not getattr(cfg, "POSITIONS_BOUND_LENGTH", True):
        return None, None
    return limit, limit


def count_parameters(module: nn.Module) -> int:
    """Distinct trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def parameters_by_module(model: nn.Module) -> dict[str, int]:
    """Parameters per top-level child module; tied weights count under the first module that owns them."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, child in model.named_children():
        n = 0
        for p in child.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                n += p.numel()
        out[name] = n
    direct = sum(p.numel() for n_, p in model.named_parameters(recurse=False) if id(p) not in seen)
    if direct:
        out["(own)"] = direct
    return out


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
