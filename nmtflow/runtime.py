"""Process-wide settings that make training and decoding fast: CPU memory reuse, numeric precision."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
import sys
import threading
import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30
OPT_OUT = "NMTFLOW_SYSTEM_MALLOC"  # set to 1 to leave malloc as it is

_applied: bool | None = None
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # train.precision → autocast dtype
# CPU flags that decide the speed of the kernels nmtflow runs (lscpu / /proc/cpuinfo names)
SPEED_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
               "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # bf16 matrix products in hardware (x86, Arm)
# /proc/cpuinfo's fields that tell one CPU generation from another (x86; Arm's "CPU implementer", "CPU part")
CPU_ID_FIELDS = {"vendor_id": "cpu_vendor", "cpu family": "cpu_family", "model": "cpu_model_number",
                 "stepping": "cpu_stepping", "cpu implementer": "cpu_implementer", "cpu part": "cpu_part",
                 "cpu variant": "cpu_variant", "cpu revision": "cpu_revision"}


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict[str, Any]:
    """The CPU's model name, its vendor, family, model number and stepping (``AMD EPYC`` alone names Zen 4 and
    Zen 5 alike: family 25 and 26), its :data:`SPEED_FLAGS` (from /proc/cpuinfo; ``platform.processor()``
    elsewhere), and ``native_bf16``: whether it multiplies bf16 matrices in hardware (AMX or AVX-512 BF16, Arm BF16)."""
    model, flags = platform.processor() or platform.machine(), set()
    ids: dict[str, str] = {}  # the identifying fields of /proc/cpuinfo, as they are there
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model", "hardware") and value.strip():
                    model = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
                elif key in CPU_ID_FIELDS and value.strip():
                    ids.setdefault(CPU_ID_FIELDS[key], value.strip())
                if key == "" and flags:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return {"cpu_model": model, **ids, "cpu_flags": [f for f in SPEED_FLAGS if f in flags],
            "native_bf16": any(f in flags for f in NATIVE_BF16_FLAGS)}


def warn_if_bf16_emulated(key: str, work: str, device: torch.device) -> None:
    """Warn that ``key: bf16`` on a CPU without native bf16 (:func:`cpu_info`) is emulated: it ``work`` (trains,
    decodes) many times slower than fp32. Other devices and CPUs with AMX or AVX-512 BF16: no warning."""
    if device.type == "cpu" and not cpu_info()["native_bf16"]:
        log.warning("%s: bf16 on a CPU without native bf16 (%s has neither AMX nor AVX-512 BF16): it emulates bf16 "
                    "and %s many times slower than fp32; use fp32 here", key, cpu_info()["cpu_model"], work)


def machine_info(device: str | torch.device | None = None, **extra: Any) -> dict[str, Any]:
    """What a benchmark or comparison ran on, for its JSON: system, CPU model and speed flags, CPU count, Python,
    torch, oneDNN's kernel cache size (``nmtflow/__init__.py``), ``device`` (and its GPU's name where it is one),
    then ``extra`` (threads, GPU counts, ...)."""
    info: dict[str, Any] = {"system": platform.system(), "arch": platform.machine(), "cpus": os.cpu_count(),
                            **cpu_info(), "python": platform.python_version(), "torch": torch.__version__,
                            "onednn_primitive_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    if device is not None:
        info["device"] = str(device)
        resolved = torch.device(device)
        if resolved.type == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(resolved)
    return {**info, **extra}


class RunningClock:
    """Seconds of this process's running time: ``time.perf_counter()`` less the spans the process stood stopped as a
    whole (``kill -STOP``, a terminal's Ctrl-Z, a paused comparison, a suspended machine), which would otherwise count
    as training time in ``train.max_minutes``, in the logged tokens/s and in a run's reported training time.

    A daemon thread wakes every ``tick`` seconds. Every thread of a stopped process stands still, so a wake-up more
    than ``gap`` seconds late is a stop, and the lateness is not counted. Stops shorter than ``gap`` count as running
    time, as would a wake-up kept waiting for more than ``gap`` seconds by code holding the GIL (nothing in training
    holds it that long: torch releases it inside its operations). :meth:`close` ends the thread, as does losing the
    last reference to the clock.
    """

    def __init__(self, tick: float = 0.25, gap: float = 5.0) -> None:
        self.tick, self.gap, self.stopped_seconds = tick, gap, 0.0
        self._last = time.perf_counter()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=RunningClock._watch, args=(weakref.ref(self), self._closed, tick),
                                        name="nmtflow-running-clock", daemon=True)
        self._thread.start()

    def _account(self) -> float:
        """Take a stop that has ended since the last wake-up off the clock; returns the clock's reading."""
        with self._lock:
            now = time.perf_counter()
            late = now - self._last - self.tick
            if late > self.gap:
                self.stopped_seconds += late
            self._last = now
            return now - self.stopped_seconds

    @staticmethod
    def _watch(ref: weakref.ref[RunningClock], closed: threading.Event, tick: float) -> None:
        """The waking thread; it ends with :meth:`close` or once the clock is gone (an exception left it unclosed)."""
        while not closed.wait(tick):
            clock = ref()
            if clock is None:
                return
            clock._account()
            del clock

    def __call__(self) -> float:
        """Running seconds since an arbitrary origin (differences are what count, as with ``perf_counter``); a stop
        that has just ended is taken off first, whether or not the thread has woken since."""
        return self._account()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()


def new_file_mode() -> int:
    """The permissions ``open()`` gives a new file (``0o666`` less the umask), for files written via a temporary
    file, which ``tempfile.mkstemp`` creates 0600."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of unmapping it; True if in effect.

    PyTorch has no caching allocator on the CPU: every activation, gradient and (tokens × vocabulary) logits
    tensor of a step is a fresh ``malloc``, which glibc serves from a new ``mmap`` when it is large and unmaps
    on ``free``, so each step page-faults its whole working set again (on a 2-core machine a third of the
    time of a small Transformer's step; ``benchmarks/README.md``). With mmap off (``M_MMAP_MAX = 0``) and the
    trim threshold at 1 GiB the pages stay mapped and are reused; the price is that the process's resident
    memory stays at its high-water mark. Linux/glibc only, once per process; ``NMTFLOW_SYSTEM_MALLOC=1``
    opts out.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT, "") not in ("", "0"):
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc (e.g. musl): nothing to tune
        return False
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    log.debug("malloc keeps freed memory: %s", _applied)
    return _applied


def hold_heap(headroom_bytes: int) -> bool:
    """For measurements: put the CPU heap in its steady state now; True if in effect.

    Under :func:`keep_freed_memory` a process still page-faults in two cases: when a step needs more than the
    heap's high-water mark so far, and when more than the trim threshold is free at the top of the heap, which
    glibc then returns to the system. A benchmark that holds several models in one process meets both: in
    ``benchmarks/shortcuts.py`` (three 6+6 models, 30 timed 4k-token batches) each system's timed steps took
    82–145 thousand page faults. This stops trimming for good and touches ``headroom_bytes`` above the heap
    top once (one allocation, filled and freed), so that later growth lands on pages that are already mapped,
    as in a long training run. The price is that resident memory never shrinks again. Needs
    :func:`keep_freed_memory` in effect (mmap off).
    """
    mallopt = _libc_function("mallopt") if keep_freed_memory() else None
    if mallopt is None or not mallopt(M_TRIM_THRESHOLD, -1):  # -1: a size_t maximum, never trim
        return False
    if headroom_bytes > 0:  # served from the top of the heap, since mmap is off; stays mapped once freed
        torch.ones(headroom_bytes, dtype=torch.uint8)
    return True


def release_freed_memory() -> bool:
    """Return the freed memory that :func:`keep_freed_memory` keeps to the system (glibc's ``malloc_trim(0)``);
    True if any was returned.

    A training process's heap stays at its high-water mark, and validation, which allocates differently from the
    training steps (decoding), raises that mark by memory the steps do not reuse: the resident memory of a long
    multilingual bridge run on Multi30k grew with most of its validations. The trainer calls this after each
    validation; the next step then faults in what it needs again, once. Nothing happens where
    :func:`keep_freed_memory` is not in effect.
    """
    trim = _libc_function("malloc_trim") if _applied else None
    return trim is not None and bool(trim(0))


@functools.lru_cache(maxsize=None)
def _libc_function(name: str) -> Any:
    """The C library's function ``name``, or None where it has none (looked up once: ``find_library`` runs a
    subprocess)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


FP32_MATMULS = {"tf32": "tf32", "fp32": "ieee"}  # train.precision → CUDA's float32 matmul setting


def use_precision(precision: str) -> None:
    """Process-wide part of ``train.precision``: ``tf32`` lets CUDA float32 matmuls run on TF32 tensor cores.

    Weights, activations and gradients stay float32; only the matmul inner products round their inputs to
    TF32's 10-bit mantissa (Ampere and later; several times the float32 matmul speed). ``fp32`` sets IEEE
    float32 matmuls back, so that a float32 training after a tf32 one in the same process (the Python API, a
    benchmark alternating systems) is float32 again; bf16/fp16 leave the setting as it is (autocast runs their
    matmuls in the low precision).

    bf16/fp16 also turn off cuDNN's attention backend of ``scaled_dot_product_attention`` (the only one that
    takes no float32): it builds an execution plan for every new input shape, and token-based batches change
    shape at almost every step. On an H100 the Transformer-base baseline of ``benchmarks/shortcuts.py``, first
    to meet each shape, took 38.6 s for 100 batches that the systems after it trained in 7.1–7.6 s
    (``benchmarks/README.md``). Flash and memory-efficient attention need no plans.
    """
    if precision in FP32_MATMULS:
        torch.backends.cuda.matmul.fp32_precision = FP32_MATMULS[precision]
    if precision in AUTOCAST_DTYPES:
        torch.backends.cuda.enable_cudnn_sdp(False)


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The per-step mixed-precision context of ``train.precision``: autocast for bf16/fp16, else a no-op."""
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
    return nullcontext()
