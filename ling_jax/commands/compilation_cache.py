"""JAX's persistent compilation cache, on for every `ling-jax` command.

Why: a program compiled once (the engine's step shapes, `generate`'s buckets) is written to disk,
so the next process that needs it loads it instead of compiling again (a second `ling-jax demo`
or `ling-jax serve` start-up skips its compiles).

Where (first that applies):
  1. `--no-compilation-cache`: off;
  2. `--compilation-cache DIR`;
  3. the environment variable LING_JAX_COMPILATION_CACHE: a directory, or one of
     "", "0", "off", "none", "false" (any case) for off;
  4. `$XDG_CACHE_HOME/ling-jax/jax-cache`, else `~/.cache/ling-jax/jax-cache`.

Every program is cached, however fast it compiled and however small it is (JAX's defaults skip
programs compiling in under a second, which is most of them on CPU):
`jax_persistent_cache_min_compile_time_secs = 0`, `jax_persistent_cache_min_entry_size_bytes = -1`.
The cache key covers the program, the devices and the JAX/XLA versions, so a stale entry is never
used; the folder can be deleted at any time.
"""
from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional

import jax

ENV = "LING_JAX_COMPILATION_CACHE"
OFF_VALUES = ("", "0", "off", "none", "false")
MIN_COMPILE_TIME_SECS = 0.0  # cache every program (JAX's default, 1 s, skips most CPU programs)
MIN_ENTRY_SIZE_BYTES = -1    # no size threshold, and no filesystem-specific override of it


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """`$XDG_CACHE_HOME/ling-jax/jax-cache`, or `~/.cache/ling-jax/jax-cache` without XDG_CACHE_HOME."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ling-jax", "jax-cache")


def resolve_cache_dir(flag_dir: Optional[str], disabled: bool,
                      environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The cache folder the flags and the environment ask for (module docstring), None = off."""
    if disabled:
        return None
    if flag_dir is not None:
        if not flag_dir.strip():
            raise ValueError("--compilation-cache: empty directory (use --no-compilation-cache to turn it off)")
        return flag_dir
    if ENV in environ:
        v = environ[ENV]
        return None if v.strip().lower() in OFF_VALUES else v
    return default_cache_dir(environ)


def add_compilation_cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help=f"JAX persistent compilation cache folder (default: ${ENV}, else "
                        "$XDG_CACHE_HOME/ling-jax/jax-cache or ~/.cache/ling-jax/jax-cache)")
    g.add_argument("--no-compilation-cache", action="store_true",
                   help="do not read or write the persistent compilation cache")


def enable_compilation_cache(path: str) -> str:
    """Point JAX's persistent compilation cache at `path` (created if missing). Call it before the
    process compiles anything: JAX decides once per process whether the cache is in use."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compilation-cache: cannot create {path}: {e.strerror or e}") from None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def apply_compilation_cache_args(args, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Enable the cache a command's flags ask for; returns its folder, or None when off."""
    path = resolve_cache_dir(getattr(args, "compilation_cache", None),
                             getattr(args, "no_compilation_cache", False), environ)
    return None if path is None else enable_compilation_cache(path)
