"""nmtflow: neural machine translation research on information flow.

``nmtflow.load(path)`` opens a checkpoint (or several: an ensemble) to translate and score sentences from Python;
importing the package itself loads nothing heavy (no torch): ``load`` imports :mod:`nmtflow.api` when called.
"""
from __future__ import annotations

__version__ = "0.1.0"

import os  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

# oneDNN (PyTorch's bf16 matrix products on the CPU) compiles a kernel for every new matrix shape (~1.5 ms each at
# sentence sizes) and caches 1,024 of them; token-based batches of one Multi30k epoch need ~1,200, so at the default
# size the cache never holds an epoch's shapes and every bf16 step compiles anew (``benchmarks/README.md``). Read
# once, at the first bf16 product, so set here, before any; a value the user set is kept.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

from nmtflow import registry as _registry  # noqa: E402  (imports nothing of nmtflow: no torch, no models)

if TYPE_CHECKING:
    import torch

    from nmtflow.api import Checkpoints, Model


def load(path_or_paths: Checkpoints, device: str | torch.device = "auto", *, src_lang: str | None = None,
         tgt_lang: str | None = None, **decode: Any) -> Model:
    """Open a trained checkpoint, or a list of checkpoints (an ensemble), to translate and score sentences.

    ``device``: ``auto`` (a GPU where there is one, else the CPU; the CLI's default), ``cpu``, ``cuda``, ``cuda:N``
    or ``mps``. ``src_lang``, ``tgt_lang``: the default direction of a multilingual model (any trained or
    zero-shot one; each call may name another). Further keywords are search options, the fields of
    :class:`nmtflow.config.DecodeConfig` (``beam_size``, ``nbest``, ``len_penalty``, ``greedy``, ``max_len_a``,
    ``max_len_b``, ...), over the checkpoint's own ``decode`` section; each call may override them too.

    Example::

        model = nmtflow.load("runs/en-de/checkpoint_best.pt")
        model.translate("A man is cleaning windows.")              # one str in, one str out
        model.translate(["A sentence.", "Another."], nbest=3, return_scores=True)
        model.score(["A sentence."], ["Ein Satz."])                # log P(target | source) per pair

    A missing file or one that is not a checkpoint, an unknown option, language or direction is a one-line
    exception naming it (:class:`nmtflow.checkpoint.CheckpointError`, a ``ValueError``; ``TypeError`` for an
    unknown keyword).
    """
    from nmtflow.api import Model

    return Model(path_or_paths, device, src_lang=src_lang, tgt_lang=tgt_lang, **decode)


def _import_builtins() -> None:
    """Import the modules that register nmtflow's own models and attentions; the registry calls this on its first
    lookup. Installed here, above every layer, because every import of an nmtflow module runs this file first."""
    import nmtflow.models  # noqa: F401  (registers on import)
    import nmtflow.nn  # noqa: F401


_registry.set_builtins(_import_builtins)
