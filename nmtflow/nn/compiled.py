"""``train.compile``: regional ``torch.compile`` of the layers a model repeats.

A :class:`CompiledRegion` (each Transformer encoder and decoder layer) runs one compiled graph per class, shared by
every layer of the stack (their parameters are the graph's inputs) and compiled with dynamic shapes, so token-based
batches of any (B, T) reuse it: seconds of compilation instead of the minutes a whole model takes. Inside a region
the compiler fuses what eager mode runs as separate element-wise kernels (LayerNorm, dropout, residual additions,
autocast's casts). Only training passes (``model.train()`` with gradients) take the compiled graph; validation and
decoding run eagerly (incremental caches and beam reordering change shapes and state at every step).
"""
from __future__ import annotations

import shutil
import sys
from importlib.util import find_spec
from typing import Any, Callable

import torch
from torch import nn

_GRAPHS: dict[type, Callable[..., Any]] = {}  # one compiled ``run`` per region class


class CompiledRegion(nn.Module):
    """A module whose training forward pass runs compiled once :func:`compile_regions` marked it.

    Subclasses implement ``run`` (the forward pass) and may narrow :meth:`compilable` (e.g. a decoder layer: only
    without an incremental decoding state).
    """

    compile_in_training: bool = False
    run: Callable[..., Any]

    def forward(self, *args: Any) -> Any:
        if self.compile_in_training and self.training and torch.is_grad_enabled() and self.compilable(*args):
            graph = _GRAPHS.get(type(self))
            if graph is None:
                graph = _GRAPHS[type(self)] = compile_dynamic(type(self).run)
            return graph(self, *args)
        return self.run(*args)

    def compilable(self, *args: Any) -> bool:
        """Whether this call may take the compiled graph (training passes only reach here)."""
        return True


def compile_dynamic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=True)`` without duck sizing, which would tie sizes that happen to be equal in the
    first batch (e.g. its sentences and its source length) and compile again for each later batch that breaks a tie.
    (Duck sizing is switched off for the whole process: a config of the compiler, not of one function.)"""
    import torch.fx.experimental._config as shape_config  # (a private module: imported only when compiling)

    shape_config.use_duck_shape = False
    return torch.compile(fn, dynamic=True)


def compile_regions(model: nn.Module) -> list[str]:
    """Mark every :class:`CompiledRegion` of ``model`` to run compiled in training; returns their class names."""
    names = set()
    for module in model.modules():
        if isinstance(module, CompiledRegion):
            module.compile_in_training = True
            names.add(type(module).__name__)
    return sorted(names)


def compiler_missing(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot generate code for ``device`` here (None when it can)."""
    if sys.platform == "win32" and device.type == "cpu":
        return "torch.compile's CPU code generation is not supported on Windows here"
    if device.type == "cpu":
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return "torch.compile needs a C++ compiler (g++ or clang++) on the PATH to generate CPU code"
        return None
    if device.type == "cuda":
        return None if find_spec("triton") else "torch.compile needs the triton package for CUDA code"
    return f"torch.compile is not set up for {device.type} devices in nmtflow"
