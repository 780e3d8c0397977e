"""Decoding precision (``decode.precision``): the model's forward in fp32, or in a bf16 copy of its weights.

The bf16 copy is made once per model (and made again after its weights change) and kept beside the float32 model,
which stays as it was. Everything but the output layer runs in bf16 (the attention too: without gradients
:func:`nmtflow.nn.attention.sdpa` leaves it to PyTorch's bf16 kernel); the output layer's weight stays float32
(:func:`nmtflow.nn.layers.output_logits`), so the logits, the log-softmax over the vocabulary, the beam scores and
the length normalisation are float32, as in fp32 decoding. On the CPU the LayerNorms' gains and biases stay float32
too (PyTorch's CPU LayerNorm takes a bf16 input with float32 parameters and returns bf16): at no measurable cost,
one more point of outputs identical to fp32's (96.4% → 97.3% of Multi30k val lines, `benchmarks/README.md`).
A copy rather than autocast: autocast casts every weight again at every decoding step, which costs more than bf16
saves at decoding's small batches.
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from nmtflow.models.base import EncoderDecoder
from nmtflow.runtime import warn_if_bf16_emulated

DECODE_DTYPES = {"bf16": torch.bfloat16}  # decode.precision → the copy's dtype (fp32: the model itself)
_copies: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[tuple[int, int], ...], EncoderDecoder]]" = \
    weakref.WeakKeyDictionary()


def _weights_version(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Changes whenever a parameter is replaced or updated in place (an optimizer step, ``load_state_dict``)."""
    return tuple((id(p), p._version) for p in model.parameters())


def cast_copy(model: EncoderDecoder, dtype: torch.dtype) -> EncoderDecoder:
    """A copy of ``model`` in ``dtype`` for inference, its output layers' weights (``output_weight``, untied from
    the embeddings) and, on the CPU, its LayerNorms' parameters left in float32 and shared with ``model``."""
    # requires_grad stays as it is: with weights that require none, PyTorch's matmul of a strided 3-D input runs as a
    # bmm over a copy of the weight per row (the RNN decoder's attention: ×2.5 the decoding time)
    cast = copy.deepcopy(model).to(dtype).eval()
    for (_, mine), (_, theirs) in zip(cast.named_modules(), model.named_modules()):
        kept = ["output_weight"]
        if isinstance(theirs, nn.LayerNorm) and theirs.weight is not None and theirs.weight.device.type == "cpu":
            kept += ["weight", "bias"]  # a bf16 input, float32 parameters: PyTorch's mixed-type CPU LayerNorm
        for name in kept:
            param = getattr(theirs, name, None)
            if isinstance(param, nn.Parameter) and param.dtype == torch.float32:
                setattr(mine, name, nn.Parameter(param.detach(), requires_grad=param.requires_grad))
    return cast


def model_in_precision(model: EncoderDecoder, precision: str) -> EncoderDecoder:
    """``model`` for ``decode.precision``: itself for fp32; for bf16 its bf16 :func:`cast_copy`, made on first use
    (with a warning on a CPU without native bf16, where bf16 is emulated) and again after the weights change."""
    if precision not in DECODE_DTYPES:
        return model
    version = _weights_version(model)
    cached = _copies.get(model)
    if cached is not None and cached[0] == version:
        return cached[1]
    device = next(model.parameters()).device
    warn_if_bf16_emulated("decode.precision", "decodes", device)
    cast = cast_copy(model, DECODE_DTYPES[precision])
    _copies[model] = (version, cast)
    return cast
