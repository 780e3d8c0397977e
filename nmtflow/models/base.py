"""The contract every sequence-to-sequence model keeps, and its typed config base.

Incremental decoding: ``decode(tgt_in, enc, state)`` with a ``state`` dict receives only the new target
token(s) and extends the caches inside ``state``. Every tensor in ``state`` and in the encoder output is
batch-first, so beam search reorders both with one ``index_select`` per tensor (:func:`reorder`), written
once for every architecture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.nn.attention import ROWS
from nmtflow.registry import MODELS

EncoderOut = dict[str, Tensor]
State = dict[str, Tensor]


@dataclass
class ModelConfig:
    """Base of all model configs; ``name`` selects the registered model (and its config class)."""

    name: str = "transformer"
    preset: str | None = None

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def resolve(cls, data: dict[str, Any], where: str) -> tuple[type, dict[str, Any]]:
        """Pick the registered config class by ``name`` and fill in its ``preset`` values."""
        name = data.get("name", "transformer")
        try:
            config_cls = MODELS.get(name).config_cls
        except KeyError as exc:
            raise ConfigError(f"{where}.name: {exc.args[0]}") from None
        preset = data.get("preset")
        if preset is not None:
            if not isinstance(preset, str) or preset not in config_cls.PRESETS:
                raise ConfigError(f"{where}.preset: unknown preset {preset!r} for {name} "
                                  f"(known: {', '.join(config_cls.PRESETS) or 'none'})")
            data = {**config_cls.PRESETS[preset], **data}
        return config_cls, data


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
