"""Memory-mapped storage of variable-length id sequences.

``PREFIX.bin`` holds all token ids back to back (raw, native little-endian integers).
``PREFIX.idx`` holds a 24-byte header (``b"NMTFIDX1"``, uint64 dtype code, uint64 count)
followed by ``count + 1`` int64 offsets (in elements) into ``PREFIX.bin``; sequence ``i`` is
``bin[offsets[i]:offsets[i + 1]]``.
"""

from __future__ import annotations

import itertools
import os
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"NMTFIDX1"
_HEADER = struct.Struct("<8sQQ")
HEADER_SIZE = _HEADER.size  # 24: keeps the offsets 8-byte aligned

_DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i4"),
    4: np.dtype("<i8"),
    5: np.dtype("<u4"),
}
_CODE_OF = {dt: code for code, dt in _DTYPE_CODES.items()}
_IDS_CHECKED: set[tuple[int, int, int, int, int]] = set()  # (device, inode, size, mtime, vocab) of checked .bin files


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def choose_dtype(max_id: int | None) -> np.dtype:
    """``uint16`` when every id fits (``max_id < 65536``), else ``int32``."""
    if max_id is not None and 0 <= max_id < 65536:
        return np.dtype("<u2")
    return np.dtype("<i4")


def _resolve_dtype(dtype: np.dtype | type | str | None, max_id: int | None) -> np.dtype:
    dt = choose_dtype(max_id) if dtype is None else np.dtype(dtype).newbyteorder("<")
    if dt not in _CODE_OF:
        raise ValueError(f"unsupported dtype {dt}; use one of {sorted(str(d) for d in _CODE_OF)}")
    return dt


class IndexedWriter:
    """Incrementally writes an indexed dataset; files appear atomically on :meth:`close`.

    Use as a context manager; an exception inside the block removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type | str | None = None,
                 *, max_id: int | None = None) -> None:
        self.prefix = Path(prefix)
        self.dtype = _resolve_dtype(dtype, max_id)
        self._info = np.iinfo(self.dtype)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp{os.getpid()}"
        self._tmp_bin = bin_path(self.prefix).with_name(f".{bin_path(self.prefix).name}{tag}")
        self._tmp_idx = idx_path(self.prefix).with_name(f".{idx_path(self.prefix).name}{tag}")
        self._bin = open(self._tmp_bin, "wb")
        self._idx = open(self._tmp_idx, "wb")
        self._idx.write(_HEADER.pack(MAGIC, 0, 0))  # placeholder, rewritten on close
        self._idx.write(np.zeros(1, dtype="<i8").tobytes())
        self.count = 0
        self.num_tokens = 0
        self._closed = False

    def add(self, seq: Sequence[int] | np.ndarray) -> None:
        """Append one sequence."""
        self.add_many([seq])

    def add_many(self, seqs: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append a batch of sequences (lists of ints or 1-D integer arrays)."""
        if self._closed:
            raise ValueError(f"{self.prefix}: writer is closed")
        if not seqs:
            return
        lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        total = int(lens.sum())
        if total == 0:
            flat = np.zeros(0, dtype=np.int64)
        elif isinstance(seqs[0], np.ndarray):
            flat = np.concatenate([np.asarray(s).reshape(-1) for s in seqs])
        else:
            flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
        if flat.size and (flat.min() < self._info.min or flat.max() > self._info.max):
            raise ValueError(
                f"{self.prefix}: ids in [{flat.min()}, {flat.max()}] do not fit dtype {self.dtype}"
            )
        self._bin.write(flat.astype(self.dtype, copy=False).tobytes())
        offsets = self.num_tokens + np.cumsum(lens)
        self._idx.write(offsets.astype("<i8", copy=False).tobytes())
        self.count += len(seqs)
        self.num_tokens += total

    def close(self) -> None:
        """Finish the header and move both files into place."""
        if self._closed:
            return
        self._idx.seek(0)
        self._idx.write(_HEADER.pack(MAGIC, _CODE_OF[self.dtype], self.count))
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self._closed = True
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        """Discard everything written so far."""
        if self._closed:
            return
        self._bin.close()
        self._idx.close()
        self._closed = True
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_indexed(
    prefix: str | Path,
    seqs: Iterable[Sequence[int] | np.ndarray],
    dtype: np.dtype | type | str | None = None,
    *,
    max_id: int | None = None,
    chunk_size: int = 8192,
) -> int:
    """Stream ``seqs`` into ``PREFIX.bin``/``PREFIX.idx``; returns the number of sequences.

    ``dtype`` defaults to ``uint16`` when ``max_id < 65536`` is given, else ``int32``.
    Ids that do not fit the dtype raise ``ValueError``. The files are replaced atomically.
    """
    with IndexedWriter(prefix, dtype, max_id=max_id) as w:
        it = iter(seqs)
        while chunk := list(itertools.islice(it, chunk_size)):
            w.add_many(chunk)
    return w.count


class IndexedDataset:
    """Read-only, memory-mapped view of a dataset written by :func:`write_indexed`.

    With ``vocab_size``, opening it checks once (one min/max pass over the map) that every id is below it: an
    overwritten block would otherwise fail training with an ``IndexError`` some updates later.
    """

    def __init__(self, prefix: str | Path, vocab_size: int | None = None) -> None:
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self._open()
        if vocab_size is not None:
            self._check_ids(vocab_size)

    def _check_ids(self, vocab_size: int) -> None:
        """A ValueError naming ``PREFIX.bin`` and the first row that holds an id outside ``[0, vocab_size)``."""
        data = self._data
        st = bin_path(self.prefix).stat()
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, vocab_size)
        if not data.size or key in _IDS_CHECKED:  # e.g. a language's file opened for each of its directions
            return
        low = int(data.min()) if self.dtype.kind == "i" else 0
        high = int(data.max())
        if low >= 0 and high < vocab_size:
            _IDS_CHECKED.add(key)
            return
        pos = int(np.argmax((data < 0) | (data >= vocab_size)))
        row = int(np.searchsorted(self._offsets, pos, side="right")) - 1
        raise ValueError(f"{bin_path(self.prefix)}: row {row + 1} holds token id {int(data[pos])}, outside the "
                         f"vocabulary of {vocab_size} ids (ids {low}..{high} in the file): corrupt, or not of this "
                         "data directory; prepare the data again")

    def _open(self) -> None:
        ip, bp = idx_path(self.prefix), bin_path(self.prefix)
        for p in (ip, bp):
            if not p.is_file():
                raise ValueError(f"{p}: file not found")
        idx_size = ip.stat().st_size
        if idx_size < HEADER_SIZE:
            raise ValueError(f"{ip}: truncated index ({idx_size} bytes, header needs {HEADER_SIZE})")
        with open(ip, "rb") as f:
            magic, code, count = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            raise ValueError(f"{ip}: not an nmtflow index file (bad magic {magic!r})")
        if code not in _DTYPE_CODES:
            raise ValueError(f"{ip}: unknown dtype code {code}")
        expected = HEADER_SIZE + 8 * (count + 1)
        if idx_size != expected:
            raise ValueError(
                f"{ip}: index has {idx_size} bytes but {count} sequences need {expected} (truncated or corrupt)"
            )
        self.dtype = _DTYPE_CODES[code]
        # plain ndarray views of the maps (cheaper to slice than np.memmap objects)
        self._offsets = np.asarray(
            np.memmap(ip, dtype="<i8", mode="r", offset=HEADER_SIZE, shape=(count + 1,))
        )
        offsets = self._offsets
        if offsets[0] != 0 or (count and np.any(offsets[1:] < offsets[:-1])):
            raise ValueError(f"{ip}: offsets are not monotonically increasing from 0 (corrupt)")
        self.num_tokens = int(offsets[-1])
        bin_size = bp.stat().st_size
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise ValueError(
                f"{bp}: data has {bin_size} bytes but {ip} expects "
                f"{self.num_tokens * self.dtype.itemsize} (truncated or mismatched)"
            )
        if self.num_tokens:
            self._data = np.asarray(np.memmap(bp, dtype=self.dtype, mode="r", shape=(self.num_tokens,)))
        else:
            self._data = np.zeros(0, dtype=self.dtype)
        self._count = int(count)
        self._sizes: np.ndarray | None = None

    def __len__(self) -> int:
        return self._count

    @property
    def sizes(self) -> np.ndarray:
        """Length of every sequence (int64 array)."""
        if self._sizes is None:
            self._sizes = np.diff(self._offsets).astype(np.int64, copy=False)
        return self._sizes

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i`` as a read-only view into the mapped data."""
        i = int(i)
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"index {i} out of range for {self._count} sequences in {self.prefix}")
        return self._data[self._offsets[i]:self._offsets[i + 1]]

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lengths (int64) and the concatenated ids of sequences ``indices`` (negative counts from the end), in
        one vectorised gather from the mapped data; ``IndexError`` names a row outside the dataset."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self._count
        if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"index {bad} out of range for {n} sequences in {self.prefix}")
        idx = np.where(idx < 0, idx + n, idx)
        starts = self._offsets[idx]
        lens = self._offsets[idx + 1] - starts
        ends = np.cumsum(lens)
        # output position k of a row is data[start of the row + (k − the row's first output position)]
        pos = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + np.repeat(starts - (ends - lens), lens)
        return lens, self._data[pos]

    def __iter__(self):
        for i in range(self._count):
            yield self[i]

    def __getstate__(self) -> dict:  # re-map in the receiving process instead of copying data
        return {"prefix": str(self.prefix), "vocab_size": self.vocab_size}

    def __setstate__(self, state: dict) -> None:  # the ids were checked where the dataset was opened
        self.prefix = Path(state["prefix"])
        self.vocab_size = state.get("vocab_size")
        self._open()

    def __repr__(self) -> str:
        return f"IndexedDataset({str(self.prefix)!r}, len={self._count}, dtype={self.dtype})"


__all__ = ["write_indexed", "IndexedWriter", "IndexedDataset", "choose_dtype", "MAGIC"]
