"""Minimal streaming safetensors reader/writer (own implementation; handles F8_E4M3 and BF16).

File format: 8-byte little-endian header length N, N bytes of UTF-8 JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`
(space-padded to a multiple of 8), then the raw little-endian tensor bytes; offsets are relative
to the start of the byte buffer, and the tensors tile the buffer exactly (no gaps, no overlap).

Reading parses only the header and memory-maps the file read-only, so `read(name, index)` touches
only the pages of the requested tensor (or of the requested rows/columns of it).

A "header-only" file (written for parameter accounting of huge configs) carries
`__metadata__["ling_jax.header_only"] = "true"` and is truncated right after the header; it can be
inspected but not read.
"""
from __future__ import annotations

import json
import shutil
import math
import os
import struct
from typing import Iterable, NamedTuple, Optional

import ml_dtypes
import numpy as np

from ling_jax.checkpoint.atomic import clean_stale_temps, temp_path

HEADER_ONLY_KEY = "ling_jax.header_only"
MAX_HEADER_BYTES = 256 * 1024 * 1024  # sanity bound on the JSON header length

DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # MXFP4 scales (read; we write U8, see checkpoint.mxfp4)
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed, or disagrees with its config."""


def dtype_name(dt) -> str:
    """safetensors dtype string of a numpy dtype."""
    dt = np.dtype(dt)
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"no safetensors dtype for numpy dtype {dt}")


ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}


def nbytes(dtype: str, shape) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


class TensorInfo(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset within the data buffer
    end: int
    file: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def build_header(entries: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: Optional[dict] = None) -> tuple[bytes, int]:
    """(8-byte length + padded JSON header, data size) for tensors stored in the given order."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}}
    off = 0
    for name, dt, shape in entries:
        if dt not in DTYPES:
            raise ValueError(f"{name}: unknown dtype {dt!r}")
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        n = nbytes(dt, shape)
        header[name] = {"dtype": dt, "shape": [int(s) for s in shape], "data_offsets": [off, off + n]}
        off += n
    js = json.dumps(header, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, off


class ShardWriter:
    """Writes one safetensors file sequentially: header first, then each tensor in header order.

    `write(name, chunk)` may be called several times per tensor (row chunks, in order); the
    writer checks names, dtypes and byte counts so a file can never silently mismatch its header.
    """

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: Optional[dict] = None, header_only: bool = False):
        meta = dict(metadata or {"format": "pt"})
        if header_only:
            meta[HEADER_ONLY_KEY] = "true"
        self.path = path
        self.entries = list(entries)
        head, self.data_size = build_header(self.entries, meta)
        self._f = open(path, "wb")
        self._f.write(head)
        self.header_only = header_only
        self._i = 0          # index of the tensor being written
        self._done = 0       # bytes of it written so far

    def _current(self):
        if self._i >= len(self.entries):
            raise ValueError(f"{self.path}: all tensors already written")
        return self.entries[self._i]

    def write(self, name: str, chunk: np.ndarray) -> None:
        if self.header_only:
            raise ValueError(f"{self.path}: header-only file takes no tensor data")
        cur, dt, shape = self._current()
        if name != cur:
            raise ValueError(f"{self.path}: expected data for {cur!r}, got {name!r}")
        chunk = np.ascontiguousarray(chunk)
        if chunk.dtype != DTYPES[dt]:
            raise ValueError(f"{self.path}: {name}: chunk dtype {chunk.dtype} != {dt}")
        total = nbytes(dt, shape)
        if self._done + chunk.nbytes > total:
            raise ValueError(f"{self.path}: {name}: more data than its shape {shape}")
        if chunk.nbytes:
            self._f.write(memoryview(chunk.reshape(-1).view(np.uint8)))
        self._done += chunk.nbytes
        if self._done == total:
            self._i += 1
            self._done = 0
            # zero-size tensors that follow are complete by definition
            while self._i < len(self.entries) and nbytes(self.entries[self._i][1], self.entries[self._i][2]) == 0:
                self._i += 1

    def close(self) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        f.close()
        if not self.header_only:
            while self._i < len(self.entries) and nbytes(self.entries[self._i][1], self.entries[self._i][2]) == 0:
                self._i += 1
            if self._i != len(self.entries):
                raise ValueError(f"{self.path}: closed before {self.entries[self._i][0]!r} was written")

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            self.close()
        else:
            self.abort()


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: Optional[dict] = None) -> None:
    """Write a dict of numpy arrays as one safetensors file (small files, tests)."""
    entries = [(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with ShardWriter(path, entries, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _normalize_index(index, shape) -> tuple:
    """Expand a basic index (ints, slices, Ellipsis) to one entry per dimension."""
    if index is None:
        return tuple(slice(None) for _ in shape)
    if not isinstance(index, tuple):
        index = (index,)
    if sum(1 for x in index if x is Ellipsis) > 1:
        raise IndexError("at most one Ellipsis")
    if Ellipsis in index:
        k = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:k] + (slice(None),) * fill + index[k + 1:]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for shape {tuple(shape)}")
    out = []
    for x, n in zip(index, shape):
        if isinstance(x, slice):
            out.append(x)
        elif isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            x = int(x)
            if not -n <= x < n:
                raise IndexError(f"index {x} out of range for dimension of size {n}")
            out.append(x % n)
        else:
            raise IndexError(f"only ints, slices and Ellipsis are supported, got {x!r}")
    out += [slice(None)] * (len(shape) - len(out))
    return tuple(out)


class SafetensorsFile:
    """Parsed header of one safetensors file, with memory-mapped, read-only tensor access.

    All structural checks happen at open: header length, JSON, dtypes, shapes vs byte counts,
    offsets tiling the data buffer exactly, file size. Errors are `CheckpointError` naming the file.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: shard file not found") from None
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: absurd header length {n} bytes (corrupt file?)")
            if n > size - 8:
                raise CheckpointError(f"{path}: header length {n} exceeds the file size {size} "
                                      f"(truncated or corrupt file)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: __metadata__ is not an object")
        self.metadata: dict = meta
        self.header_only = str(meta.get(HEADER_ONLY_KEY, "")).lower() == "true"
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        tensors: dict[str, TensorInfo] = {}
        for name, e in header.items():
            try:
                dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            except (TypeError, KeyError):
                raise CheckpointError(f"{path}: tensor {name!r}: header entry needs dtype, shape and "
                                      f"data_offsets") from None
            isz = ITEMSIZE.get(dt) if type(dt) is str else None
            if isz is None:
                raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dt!r}")
            if type(shape) is not list:
                raise CheckpointError(f"{path}: tensor {name!r}: bad shape {shape!r}")
            size = isz
            for d in shape:
                if type(d) is not int or d < 0:
                    raise CheckpointError(f"{path}: tensor {name!r}: bad shape {shape!r}")
                size *= d
            if (type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int
                    or type(offs[1]) is not int or offs[0] < 0 or offs[1] < offs[0]):
                raise CheckpointError(f"{path}: tensor {name!r}: bad data_offsets {offs!r}")
            if offs[1] - offs[0] != size:
                raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offs} span {offs[1] - offs[0]} "
                                      f"bytes but {dt}{shape} needs {size}")
            tensors[name] = TensorInfo(name, dt, tuple(shape), offs[0], offs[1], path)
        # offsets must tile [0, end) exactly
        pos, prev = 0, None
        for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
            if t.begin < pos:
                raise CheckpointError(f"{path}: tensor {t.name!r} data_offsets [{t.begin}, {t.end}] overlap "
                                      f"{prev!r} (ends at {pos})")
            if t.begin > pos:
                raise CheckpointError(f"{path}: gap of {t.begin - pos} bytes before tensor {t.name!r} "
                                      f"(data_offsets start at {t.begin}, previous data ends at {pos})")
            pos, prev = t.end, t.name
        self.expected_data_size = pos
        if self.header_only:
            if self.data_size != 0:
                raise CheckpointError(f"{path}: marked header-only but has {self.data_size} data bytes")
        elif self.data_size < pos:
            last = max(tensors.values(), key=lambda t: t.end).name
            raise CheckpointError(f"{path}: truncated: header says {pos} data bytes (up to tensor {last!r}) "
                                  f"but the file holds {self.data_size}")
        elif self.data_size > pos:
            raise CheckpointError(f"{path}: {self.data_size - pos} trailing bytes after the last tensor {prev!r} "
                                  f"(corrupt file or header offsets that do not cover the data)")
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def _pread(self, offset: int, n: int) -> bytearray:
        buf = bytearray(n)
        mv = memoryview(buf)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            got = 0
            while got < n:
                k = f.readinto(mv[got:])
                if not k:
                    raise CheckpointError(f"{self.path}: unexpected end of file while reading {n} bytes at "
                                          f"offset {offset} (file changed or truncated?)")
                got += k
        return buf

    def read(self, name: str, index=None) -> np.ndarray:
        """The tensor (stored dtype) or a basic-index sub-block of it, as a new in-memory array.

        Reads only what is needed: a selection that restricts just the first axis (a row range,
        the common case for sharded loading) is one contiguous read of exactly those rows; any
        other selection goes through a temporary read-only memory map, so only the touched pages
        are read. Nothing is kept mapped afterwards.
        """
        try:
            t = self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r}") from None
        if self.header_only:
            raise CheckpointError(f"{self.path}: tensor {name!r}: header-only checkpoint has no tensor data")
        dt = DTYPES[t.dtype]
        shape = t.shape
        idx = _normalize_index(index, shape)
        if t.nbytes == 0 or not shape:
            buf = self._pread(self.data_start + t.begin, t.nbytes)
            return np.frombuffer(buf, dt).reshape(shape)[idx]
        if all(isinstance(s, slice) and s.indices(n) == (0, n, 1) for s, n in zip(idx[1:], shape[1:])):
            i0, n0 = idx[0], shape[0]
            row_bytes = t.nbytes // n0 if n0 else 0
            if isinstance(i0, int):
                r0, r1, sub = i0, i0 + 1, 0
            else:
                rows = range(*i0.indices(n0))
                if len(rows) == 0:
                    return np.zeros((0,) + shape[1:], dt)
                r0, r1 = min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1
                sub = slice(None) if rows.step == 1 else np.asarray(rows) - r0
            buf = self._pread(self.data_start + t.begin + r0 * row_bytes, (r1 - r0) * row_bytes)
            out = np.frombuffer(buf, dt).reshape((r1 - r0,) + shape[1:])[sub]
            return out  # owns (via its base) a fresh, writable buffer
        mm = np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + t.begin, shape=shape)
        try:
            return np.array(mm[idx], copy=True)
        finally:
            del mm

    def close(self) -> None:
        """Nothing is held open between reads; kept for context-manager symmetry."""

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def load_file(path: str) -> dict[str, np.ndarray]:
    """Read every tensor of one safetensors file (small files, tests)."""
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.names()}


def replace_dir(tmp: str, out_dir: str) -> None:
    """Move a finished directory `tmp` to `out_dir`, replacing any existing one only once `tmp` is
    complete (renames within one parent directory; a reader never sees a half-written checkpoint).
    The replaced directory is parked under a `.ling-tmp-*` name (see `atomic`) and then deleted."""
    if os.path.exists(out_dir):
        old = temp_path(out_dir)
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def prepare_out_dir(out_dir: str, overwrite: bool, flag: str = "overwrite") -> tuple[str, str]:
    """(absolute out_dir, its parent): refuses a file or a non-empty directory unless `overwrite`;
    removes stale temporaries of earlier, killed runs from the parent (`atomic.clean_stale_temps`)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ValueError(f"{out_dir}: exists and is not a directory")
        if os.listdir(out_dir) and not overwrite:
            raise ValueError(f"{out_dir}: directory exists and is not empty (use {flag})")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    clean_stale_temps(parent)
    return out_dir, parent


def read_index(index_path: str, error=None) -> tuple[dict, dict]:
    """(weight_map, metadata) of a `model.safetensors.index.json`; `error` is the exception class raised."""
    error = error or CheckpointError
    try:
        with open(index_path, "rb") as f:
            # size first: `f.read(n)` allocates n bytes up front (256 MiB for every index read)
            if os.fstat(f.fileno()).st_size > MAX_HEADER_BYTES:
                raise error(f"{index_path}: larger than {MAX_HEADER_BYTES} bytes (not an index file)")
            raw = f.read()
    except OSError as e:
        raise error(f"{index_path}: cannot read ({e.strerror or e})") from None
    try:
        idx = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{index_path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise error(f"{index_path}: no 'weight_map' object")
    bad = next((n for n, f in wm.items() if not isinstance(f, str)), None)
    if bad is not None:
        raise error(f"{index_path}: tensor {bad!r} maps to {wm[bad]!r}, not a shard file name")
    meta = idx.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise error(f"{index_path}: 'metadata' must be an object, got {type(meta).__name__}")
    return wm, meta or {}
