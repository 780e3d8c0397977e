"""Decoding precision (``decode.precision``): the model's forward in fp32, or with its matrix products in bf16.

The bf16 copy is made once per model (and made again after its weights change) and kept beside the float32 model,
which stays as it was. Its matrix modules (``nn.Linear``, ``nn.Conv1d``, ``nn.LSTM``: the projections, feed-forward
layers, convolutions and LSTMs) hold bf16 weights and cast their inputs to bf16, so their outputs (attention's
queries, keys and values among them) are bf16 and attention runs in PyTorch's bf16 kernel (without gradients
:func:`nmtflow.nn.attention.sdpa` leaves it to it). Everything else keeps float32 and shares the model's own
parameters: the embeddings, the residual sums (a bf16 sub-layer output added to a float32 stream is float32),
the LayerNorms and the output layer's ``output_weight`` (:func:`nmtflow.nn.layers.output_logits`; the Transformer
and LSTM models), so their logits, the log-softmax over the vocabulary, the beam scores and the length
normalisation are float32, as in fp32 decoding (ConvS2S and DenseNMT end in an ``nn.Linear``: bf16 logits, the
log-softmax float32). Code that uses a matrix module's weight directly, or multiplies a matrix module's output
with the float32 stream, casts to the matrix side's dtype (:func:`nmtflow.nn.layers.in_dtype_of`). Against a copy
of the whole model in bf16 (the residual stream in bf16, LayerNorms reading bf16), this gave more outputs identical
to fp32's at the same speed within 2% (`benchmarks/README.md`). A copy rather than autocast: autocast casts every
weight again at every decoding step, which costs more than bf16 saves at decoding's small batches.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from nmtflow.models.base import EncoderDecoder
from nmtflow.runtime import warn_if_bf16_emulated

DECODE_DTYPES = {"bf16": torch.bfloat16}  # decode.precision → the copy's dtype (fp32: the model itself)
_copies: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[tuple[int, int], ...], EncoderDecoder]]" = \
    weakref.WeakKeyDictionary()


def _weights_version(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Changes whenever a parameter is replaced or updated in place (an optimizer step, ``load_state_dict``)."""
    return tuple((id(p), p._version) for p in model.parameters())


MATRIX_MODULES = (nn.Linear, nn.Conv1d, nn.LSTM)  # the modules whose weights the copy holds in its dtype


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (in tuples, lists, dicts and packed sequences too) cast to ``dtype``."""
    if isinstance(value, PackedSequence):
        return value.to(dtype)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {key: _cast_floats(v, dtype) for key, v in value.items()}
    return value


class _CastInputs:
    """A forward pre-hook casting a module's floating inputs to ``dtype`` (a class, not a closure: picklable)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return _cast_floats(args, self.dtype)


class _EncodeIn:
    """The copy's ``encode``: its class's own, the output cast to ``dtype`` (an attribute of the copy that pickling
    and ``copy.deepcopy`` carry along with it)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _cast_floats(type(self.model).encode(self.model, *args, **kwargs), self.dtype)


def cast_copy(model: EncoderDecoder, dtype: torch.dtype) -> EncoderDecoder:
    """A copy of ``model`` for inference whose matrix products run in ``dtype``: its ``MATRIX_MODULES`` hold their
    weights in ``dtype`` and cast what they are given to it; everything else (embeddings, residual sums,
    LayerNorms, ``output_weight``) keeps float32 and shares ``model``'s parameters. What the copy's ``encode``
    returns is cast to ``dtype`` too: the decoder reads it through its matrix modules (which would cast it at every
    step), and beam search reorders it as sentences finish (a float32 copy doubled that time)."""
    # requires_grad stays as it is: with weights that require none, PyTorch's matmul of a strided 3-D input runs as a
    # bmm over a copy of the weight per row (the RNN decoder's attention: ×2.5 the decoding time)
    matrices = [m for m in model.modules() if isinstance(m, MATRIX_MODULES)]
    in_matrices = {id(p) for m in matrices for p in m.parameters()}  # weight-norm parametrizations' included
    shared = {id(p): p for p in model.parameters() if id(p) not in in_matrices}  # deepcopy's memo: kept, not copied
    cast = copy.deepcopy(model, shared).eval()
    for module in cast.modules():
        if isinstance(module, MATRIX_MODULES):
            module.to(dtype)
            module.register_forward_pre_hook(_CastInputs(dtype))
    cast.encode = _EncodeIn(cast, dtype)  # type: ignore[method-assign]
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
