"""Data-parallel helpers: process-group set-up from the torchrun environment and small collectives.

``torchrun --nproc-per-node N -m nmtflow train CONFIG.yaml`` sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; with ``WORLD_SIZE > 1`` the trainer joins a process group (gloo on CPU,
nccl on CUDA). With one process every helper here is a cheap no-op, so the trainer has a single code path.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main process writes checkpoints, logs, TensorBoard scalars and progress bars."""
        return self.rank == 0


def env_info() -> DistInfo:
    """Rank and world size from the torchrun environment variables (one process when unset)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"invalid distributed environment: RANK={rank}, WORLD_SIZE={world}")
    return DistInfo(rank, world, local)


def setup(device: torch.device) -> DistInfo:
    """Join the process group when launched with ``WORLD_SIZE > 1`` (idempotent); quiet non-main ranks."""
    info = env_info()
    if not info.enabled:
        return info
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://", rank=info.rank,
                                world_size=info.world_size)
    if not info.is_main:
        logging.getLogger("nmtflow").setLevel(logging.WARNING)
    return info


def check_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` | ``mps`` as a device this machine has; else a one-line ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (use cpu or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}: MPS is not available on this machine (use cpu or auto)")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {name!r}: expected auto, cpu, cuda or cuda:N")
    return device


def device_for(name: str, info: DistInfo) -> torch.device:
    """The device of this rank: ``cuda`` / ``auto`` on a GPU machine become ``cuda:LOCAL_RANK``."""
    device = check_device(name)
    if device.type == "cuda" and device.index is None:  # an explicit index: torch.cuda.set_device needs one
        device = check_device(f"cuda:{info.local_rank if info.enabled else torch.cuda.current_device()}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def all_reduce(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of ``values`` over all ranks; unchanged with one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (pickled; for small things such as RNG states or hypotheses)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shard(items: Sequence[T], info: DistInfo) -> list[T]:
    """This rank's share of ``items``: every ``world_size``-th item from ``rank`` on (all of them with one process)."""
    return list(items[info.rank::info.world_size]) if info.enabled else list(items)


def unshard(parts: list[list[T]], total: int) -> list[T]:
    """Inverse of :func:`shard`: the per-rank lists (in rank order) interleaved back into ``total`` items."""
    out: list[Any] = [None] * total
    for rank, part in enumerate(parts):
        out[rank::len(parts)] = part
    return out


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cleanup() -> None:
    """Leave the process group (after the last collective)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
