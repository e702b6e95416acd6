"""Native CPU kernels (XLA FFI custom calls): build a C++ source on first use, load it, register it.

Why one module: every native kernel is compiled the same way — the system C++ compiler (`$CXX`, else
g++ / c++; `-O3 -march=native`, against `jax.ffi.include_dir()`) — and cached under
`$LING_JAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ling-jax/kernels/` (else `~/.cache/...`), keyed by the
source, the flags and the jax version, written atomically (concurrent first uses are safe).
`NativeKernel.available()` tells whether it could be built and loaded; callers fall back to their
XLA reference when not.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading

import jax

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w")


def cache_dir() -> str:
    if os.environ.get("LING_JAX_KERNEL_CACHE"):
        return os.environ["LING_JAX_KERNEL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ling-jax", "kernels")


def compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++"):
        if c and shutil.which(c):
            return c
    return None


def local_headers(source: str) -> list[str]:
    """The files `source` includes by a quoted path (`#include "../native_tiles.h"`), resolved beside it,
    recursively: part of the build's cache key, so a changed shared header rebuilds every kernel using it."""
    out, todo = [], [source]
    while todo:
        f = todo.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(f).read(), re.M):
            h = os.path.normpath(os.path.join(os.path.dirname(f), name))
            if os.path.exists(h) and h not in out:
                out.append(h)
                todo.append(h)
    return out


def build(source: str) -> str:
    """Path of the compiled library of `source` (built now if not cached). Raises RuntimeError on failure."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    src = open(source, "rb").read() + b"".join(open(h, "rb").read() for h in local_headers(source))
    key = hashlib.sha256(src + " ".join((cxx,) + FLAGS).encode() + jax.__version__.encode()).hexdigest()[:16]
    out_dir = cache_dir()
    stem = os.path.splitext(os.path.basename(source))[0]
    lib = os.path.join(out_dir, f"{stem}-{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", "-o", tmp, source, "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {source} failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's identical file is replaced, never half-read
    return lib


def register(source: str, symbol: str, target: str):
    """Build `source`, register its FFI handler `symbol` as the CPU custom-call target `target`;
    returns the loaded library (keep it referenced)."""
    lib = ctypes.cdll.LoadLibrary(build(source))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class NativeKernel:
    """One C++ source's FFI handler, built and registered at most once per process."""

    def __init__(self, source: str, symbol: str, target: str):
        self.source, self.symbol, self.target = source, symbol, target
        self._lock = threading.Lock()
        self._state: dict = {}

    def available(self) -> bool:
        """True when the kernel is built, loaded and registered (the error is kept in `load_error()`
        otherwise)."""
        with self._lock:
            if "ok" not in self._state:
                try:
                    self._state.update(ok=True, lib=register(self.source, self.symbol, self.target))
                except Exception as e:  # no compiler, a failed build, an old jaxlib without FFI
                    self._state.update(ok=False, error=f"{type(e).__name__}: {e}")
            return self._state["ok"]

    def load_error(self) -> str | None:
        return self._state.get("error")
