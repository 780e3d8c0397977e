"""Decoding in worker processes (``decode.workers``, ``nmtflow translate --workers N``).

The batches of a translation are shared out over N processes with ``threads ÷ N`` CPU threads each, instead of one
process running every operator on all the threads. A decoding step of a small model is many small operators, which
gain little from a second thread; separate processes each keep their core busy. On the 2-core AMX Xeon
(``benchmarks/bf16_cpu.py --decode-workers 2``, ``benchmarks/README.md``) two one-thread workers decoded the val
set faster than one two-thread process, in fp32 (×1.08–1.24 over three runs) and more so in bf16 (×1.30–1.34).

Each worker is a spawned process (safe with OpenMP, unlike a fork), so a script that decodes with workers needs
the usual ``if __name__ == "__main__":`` guard (a spawned process imports the script again). It receives its own
copy of the model once, when the pool starts (pickled, so the parent's tensors stay as they are and no shared-memory
handle is held per tensor), and then one batch of source ids per task, searched by the same function as in one
process (:func:`nmtflow.decode.translate.search_batch`). The pool of a model is shared by every translator of that
model (:func:`pool_for`) and started again when its weights have changed in place since (a fine-tuning step,
``load_state_dict``), when a worker has died, or when the worker or thread count differs. Workers ignore Ctrl-C,
which goes to the parent process alone.

The batches are cut smaller than one process's (about four per worker,
:meth:`~nmtflow.decode.translate.Translator.translate_ids`), and a batch's padding, like fewer threads per process,
can change a near-tie in the search; with the batches of one process and its thread count the outputs are that
process's (``tests/decode/test_workers.py``).
"""
from __future__ import annotations

import copy
import pickle
import signal
import threading
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing
from torch.nn.utils import parametrize

from nmtflow.config import DecodeConfig

SearchBatch = Callable[..., list[Any]]  # (model, decode, sources, prefixes, src_prefix, device) → n-best lists
_worker: tuple[torch.nn.Module, SearchBatch] | None = None  # in a worker: its model and search function
_POOLS: weakref.WeakKeyDictionary[torch.nn.Module, DecodePool] = weakref.WeakKeyDictionary()  # in the parent


def picklable(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or, where it has parametrized weights (ConvS2S's weight normalisation, which PyTorch does not
    pickle), a copy with each such weight computed once and stored as a plain parameter: the same values for
    inference, and no recomputation in the worker."""
    if not any(parametrize.is_parametrized(m) for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            module._load_state_dict_pre_hooks.clear()  # weight_norm's hook for old checkpoints: a local function
    return model


def _start(model: bytes, search: SearchBatch, threads: int) -> None:
    """A worker's initialiser: Ctrl-C left to the parent, its thread count, its model (unpickled from the parent's
    bytes, in eval mode) and search function."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    _worker = (pickle.loads(model).eval(), search)


def _search(sources: list[list[int]], prefixes: list[list[int]] | None, decode: DecodeConfig,
            src_prefix: int | None) -> list[Any]:
    """One batch in a worker: the pool's search function on its model."""
    assert _worker is not None, "the worker was not started by DecodePool"
    model, search = _worker
    with torch.no_grad():
        return search(model, decode, sources, prefixes, src_prefix, torch.device("cpu"))


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process meanwhile (in the main thread; elsewhere signals cannot be changed), so that
    the processes it starts inherit the ignored disposition, which Python keeps at startup."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def weights_version(model: torch.nn.Module) -> tuple[int, ...]:
    """The in-place version counters of ``model``'s parameters and buffers: they change with its weights."""
    return tuple(t._version for t in (*model.parameters(), *model.buffers()))


class DecodePool:
    """``workers`` spawned processes decoding batches of one model with ``search`` (a module-level function, e.g.
    :func:`nmtflow.decode.translate.search_batch`, sent by reference), ``threads`` CPU threads each."""

    def __init__(self, model: torch.nn.Module, search: SearchBatch, workers: int, threads: int) -> None:
        if workers < 2:
            raise ValueError(f"a decoding pool needs at least 2 workers, got {workers}")
        self.workers, self.threads, self.version = workers, threads, weights_version(model)
        context = torch.multiprocessing.get_context("spawn")
        self._executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                             initargs=(pickle.dumps(picklable(model), protocol=pickle.HIGHEST_PROTOCOL),
                                                       search, threads))
        # the processes stop with the pool, or at exit if it is still open then
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=True, cancel_futures=True)
        with _sigint_ignored():  # start them all now, inheriting it: Ctrl-C never reaches one, even while it starts
            for _ in range(workers):
                self._executor.submit(int)  # each submit starts a process while none is idle

    @property
    def broken(self) -> bool:
        """A worker died (e.g. killed): the pool takes no more work."""
        return bool(getattr(self._executor, "_broken", False))

    def submit(self, sources: list[list[int]], prefixes: list[list[int]] | None, decode: DecodeConfig,
               src_prefix: int | None) -> Future:
        """Search one batch (source ids without EOS, optional forced target prefixes) in a worker."""
        return self._executor.submit(_search, sources, prefixes, decode, src_prefix)

    def close(self) -> None:
        """Stop the workers (pending batches are cancelled)."""
        self._finalizer()


def pool_for(model: torch.nn.Module, search: SearchBatch, workers: int, threads: int) -> DecodePool:
    """The running pool of ``model`` with these counts, started (again) where there is none, a worker has died or
    the model's weights have changed since it started."""
    pool = _POOLS.get(model)
    if pool is not None and (pool.broken or pool.workers != workers or pool.threads != threads
                             or pool.version != weights_version(model)):
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[model] = DecodePool(model, search, workers, threads)
    return pool


def close_pool(model: torch.nn.Module) -> None:
    """Stop the pool of ``model``, if it has one."""
    pool = _POOLS.pop(model, None)
    if pool is not None:
        pool.close()
