"""Decoding in worker processes (``decode.workers``, ``nmtflow translate --workers N``).

The batches of a translation are shared out over N processes with ``threads ÷ N`` CPU threads each, instead of one
process running every operator on all the threads. A decoding step of a small model is many small operators, which
gain little from a second thread; separate processes each keep their core busy. On the 2-core AMX Xeon
(``benchmarks/bf16_cpu.py --decode-workers 2``, ``benchmarks/README.md``) two one-thread workers decoded the val
set faster than one two-thread process, in fp32 (×1.08–1.17) and more so in bf16 (×1.30–1.34).

Each worker is a spawned process (safe with OpenMP, unlike a fork) that receives the model once, when the pool
starts, through shared memory (``torch.multiprocessing``), and then one batch of source ids per task, searched by
the same function as in one process (:func:`nmtflow.decode.translate.search_batch`). The batches are cut smaller
than one process's (about four per worker, :meth:`~nmtflow.decode.translate.Translator.translate_ids`), and a
batch's padding, like fewer threads per process, can change a near-tie in the search; with the batches of one
process and its thread count the outputs are that process's (``tests/decode/test_workers.py``).
"""
from __future__ import annotations

import atexit
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable

import torch
import torch.multiprocessing

from nmtflow.config import DecodeConfig

SearchBatch = Callable[..., list[Any]]  # (model, decode, sources, prefixes, src_prefix, device) → n-best lists
_worker: tuple[torch.nn.Module, SearchBatch] | None = None  # in a worker: its model and search function


def _start(model: torch.nn.Module, search: SearchBatch, threads: int) -> None:
    """A worker's initialiser: its thread count, its model (in eval mode, as the parent's) and search function."""
    global _worker
    torch.set_num_threads(threads)
    _worker = (model.eval(), search)


def _search(sources: list[list[int]], prefixes: list[list[int]] | None, decode: DecodeConfig,
            src_prefix: int | None) -> list[Any]:
    """One batch in a worker: the pool's search function on its model."""
    assert _worker is not None, "the worker was not started by DecodePool"
    model, search = _worker
    with torch.no_grad():
        return search(model, decode, sources, prefixes, src_prefix, torch.device("cpu"))


class DecodePool:
    """``workers`` spawned processes decoding batches of one model with ``search`` (a module-level function, e.g.
    :func:`nmtflow.decode.translate.search_batch`, sent by reference), ``threads`` CPU threads each."""

    def __init__(self, model: torch.nn.Module, search: SearchBatch, workers: int, threads: int) -> None:
        if workers < 2:
            raise ValueError(f"a decoding pool needs at least 2 workers, got {workers}")
        self.workers, self.threads = workers, threads
        context = torch.multiprocessing.get_context("spawn")
        self._executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                             initargs=(model, search, threads))
        # shut the processes down with the pool, or at exit if it is still open then
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=True, cancel_futures=True)
        atexit.register(self._finalizer)

    def submit(self, sources: list[list[int]], prefixes: list[list[int]] | None, decode: DecodeConfig,
               src_prefix: int | None) -> Future:
        """Search one batch (source ids without EOS, optional forced target prefixes) in a worker."""
        return self._executor.submit(_search, sources, prefixes, decode, src_prefix)

    def close(self) -> None:
        """Stop the workers (pending batches are cancelled)."""
        self._finalizer()
        atexit.unregister(self._finalizer)
