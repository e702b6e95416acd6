"""CLI glue shared by the commands: checks of command-line input (token ids, numbers, context
length, memory, output paths) and loading the model a command's flags ask for (`load_for_args`).

Every refusal here is a `ValueError` subclass whose message names the argument and what was expected;
`ling_jax.cli.main` prints it as the one `error: ...` line. All checks run before a model is loaded
or anything is allocated or written (e.g. `--max-new-tokens` is refused with the cache bytes it
would need, computed by `ling_jax.accounting` arithmetic, before the cache exists).

The checks are self-contained (no state); `load_for_args` is the one place a command loads a model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Iterable, Optional

import sharding as S
from ling_jax import accounting as A
from ling_jax.checkpoint.reader import SKIP_VALUE_CHECKS_ENV
from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.loader import load_model

ID_LIMIT = 2**31  # token ids are int32 on device
_INT_RE = re.compile(r"[+-]?\d+")


class ArgumentValueError(ValueError):
    """A command-line value that parses but is not acceptable (out of range, contradictory, unsafe)."""


# ---- argparse types -----------------------------------------------------------------------------
def finite_float(text: str) -> float:
    """argparse type: a finite float (refuses inf, nan)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def non_negative_float(text: str) -> float:
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    if not _INT_RE.fullmatch(text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not _INT_RE.fullmatch(text.strip()) or int(text) < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


# ---- token ids ----------------------------------------------------------------------------------
def parse_ids(text: str, what: str = "--input-ids") -> list[int]:
    """`"1,2,3"` -> [1, 2, 3]. Refuses empty items (`1,,2`), non-integers and ids outside [0, 2^31)."""
    if text is None or not text.strip():
        raise ArgumentValueError(f"{what}: empty prompt (need at least one token id)")
    items = text.split(",")
    out = []
    for k, item in enumerate(items):
        t = item.strip()
        if not t:
            raise ArgumentValueError(f"{what}: empty item at position {k + 1} in {text[:60]!r} "
                                     f"(expected comma-separated integers like 1,2,3)")
        if not _INT_RE.fullmatch(t):
            raise ArgumentValueError(f"{what}: {t[:30]!r} is not an integer (expected comma-separated integers "
                                     f"like 1,2,3)")
        v = int(t)
        if not 0 <= v < ID_LIMIT:
            raise ArgumentValueError(f"{what}: token id {t[:30]} is out of range (ids are 0 <= id < 2^31 and "
                                     f"below the vocabulary size)")
        out.append(v)
    return out


def check_ids(ids, cfg: LingConfig, what: str = "--input-ids") -> None:
    """Every id an int inside [0, cfg.vocab_size); at least one."""
    if len(ids) == 0:
        raise ArgumentValueError(f"{what}: empty prompt (need at least one token id)")
    for i in ids:
        if isinstance(i, bool) or int(i) != i or not 0 <= int(i) < cfg.vocab_size:
            raise ArgumentValueError(f"{what}: token id {i} is outside the vocabulary [0, {cfg.vocab_size})")


# ---- context length and memory ------------------------------------------------------------------
LONG_CONTEXT_HELP = ("accept more positions than the config's max_position_embeddings, up to its scaled "
                     "length (YaRN: factor x original_max_position_embeddings; quality beyond the trained "
                     "length is unvalidated) and never beyond")


def add_long_context_flag(p) -> None:
    p.add_argument("--allow-long-context", action="store_true", help=LONG_CONTEXT_HELP)


def check_context_length(n_positions: int, cfg: LingConfig, allow_long: bool, what: str) -> None:
    """Refuse more positions than max_position_embeddings unless `allow_long` (then warn on stderr),
    and more than the scaled length (`rope.context_limit`) always."""
    from ling_jax.rope import context_limit

    limit = cfg.max_position_embeddings
    if n_positions <= limit:
        return
    if not allow_long:
        raise ArgumentValueError(f"{what}: {n_positions} positions exceed the config's max_position_embeddings="
                                 f"{limit} (pass --allow-long-context to run anyway; quality beyond it is "
                                 f"unvalidated)")
    hard = context_limit(cfg)
    if n_positions > hard:
        raise ArgumentValueError(f"{what}: {n_positions} positions exceed the scaled context length {hard} "
                                 f"({scaled_context_how(cfg)}); --allow-long-context goes no further")
    print(f"warning: {what}: {n_positions} positions exceed max_position_embeddings={limit}; quality beyond it "
          f"is unvalidated", file=sys.stderr)


def scaled_context_how(cfg: LingConfig) -> str:
    """Where `rope.context_limit` comes from, in words (for refusals)."""
    rs = cfg.rope_scaling
    if rs is None:
        return "no rope_scaling: the exact rotary range"
    return f"YaRN factor {rs.factor:g} x original_max_position_embeddings {rs.original_max_position_embeddings}"


def generate_cache_bytes(cfg: LingConfig, batch: int, max_len: int, dtype_bytes: int, with_mtp: bool,
                         kv_cache_dtype: str = "auto") -> int:
    """Bytes `ling_jax.generate` allocates for its cache (`model.init_cache`): the MLA latent + rope key
    per position per MLA layer (MTP layer's too when speculating) in the model dtype (kv_cache_dtype
    "fp8": 1 byte each + two float32 per-token scales), and per KDA layer the float32 recurrent state
    and the conv states, times the batch."""
    c = A.cache_bytes(cfg, cache_dtype_bytes=dtype_bytes, state_dtype_bytes=4, conv_dtype_bytes=dtype_bytes,
                      kv_cache_dtype=kv_cache_dtype)
    per_token = c["mla_bytes_per_token_with_mtp" if with_mtp else "mla_bytes_per_token"]
    per_seq = c["kda_state_bytes_per_sequence"] + c["kda_conv_state_bytes_per_sequence"]
    return batch * (max_len * per_token + per_seq)


def available_memory_bytes() -> Optional[int]:
    """Memory one device can hold: the accelerator's bytes_limit, or the host's physical memory on CPU."""
    try:
        import jax
        dev = jax.devices()[0]
        if dev.platform != "cpu":
            stats = dev.memory_stats() or {}
            if stats.get("bytes_limit"):
                return int(stats["bytes_limit"])
    except Exception:  # no backend information: fall back to the host
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(need: int, what: str, available: Optional[int] = None) -> None:
    """Refuse a cache larger than the device (or host) memory, with the number."""
    avail = available_memory_bytes() if available is None else available
    if avail is not None and need > avail:
        raise ArgumentValueError(f"{what}: the generation cache would need {need:,} bytes "
                                 f"({A.fmt_bytes(need)}), more than the {A.fmt_bytes(avail)} this device has")


def checkpoint_config(path: str, what: str = "--checkpoint") -> LingConfig:
    """The validated config.json of a checkpoint directory (HF or converted), read before loading it."""
    if not os.path.isdir(path):
        raise ArgumentValueError(f"{what}: {path}: checkpoint directory not found")
    p = os.path.join(path, "config.json")
    if not os.path.isfile(p):
        raise ArgumentValueError(f"{what}: {p}: missing config.json")
    return LingConfig.from_json(p)  # ConfigError names the file and the field


# ---- value checks -------------------------------------------------------------------------------
def add_value_check_flag(p) -> None:
    p.add_argument("--skip-value-checks", action="store_true",
                   help="do not check loaded weights for NaN/Inf and block scales for positivity (faster load "
                        "of a trusted checkpoint)")


def apply_value_check_flag(args) -> None:
    """Turn the loader's value checks off for this process if `--skip-value-checks` was given."""
    if getattr(args, "skip_value_checks", False):
        os.environ[SKIP_VALUE_CHECKS_ENV] = "1"


# ---- output paths -------------------------------------------------------------------------------
def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_output_path(out: str, inputs: Iterable[Optional[str]], what: str = "--out") -> str:
    """Refuse an output path that is, lies inside, or contains one of the inputs (symlinks resolved).

    An input directory (a checkpoint) may not receive the output anywhere inside it; an input file
    (e.g. a config) may not be the output or lie inside the output directory. Applies with --force /
    --overwrite too: replacing the output would destroy the input. Returns the resolved output path.
    """
    o = os.path.realpath(out)
    for inp in inputs:
        if inp is None:
            continue
        i = os.path.realpath(inp)
        if o == i:
            raise ArgumentValueError(f"{what}: {out} is the input {inp} itself; choose another output path")
        if os.path.isdir(i) and _within(o, i):
            raise ArgumentValueError(f"{what}: {out} lies inside the input {inp} (an output must not be written "
                                     f"into an input checkpoint)")
        if _within(i, o):
            raise ArgumentValueError(f"{what}: {out} contains the input {inp} (writing or replacing it would "
                                     f"destroy the input)")
    return o


# ---- loading ------------------------------------------------------------------------------------
def load_for_args(args, with_mtp: bool):
    """Model for a CLI command: on `--mesh` (or over every process of a multi-host run) when asked,
    else on one device; `--checkpoint` may be an HF or a converted directory.

    Returns (model, mesh or None, ExecConfig): the one ExecConfig the command runs with, built here
    the same way for every command (`exec_for_args`); commands pass it to their calls and never
    change `model.exec`. Multi-host: `jax.distributed` is initialised from the flags or the
    JAX_* environment variables before anything else touches the devices.
    """
    multi = S.init_from_args(args)
    keep = True if getattr(args, "keep_quantized", False) else None  # None: the loader's default
    mesh = S.parse_mesh(args.mesh) if (getattr(args, "mesh", None) or multi) else None
    model = load_model(args.checkpoint, args.dtype, mesh=mesh, with_mtp=with_mtp, keep_quantized=keep,
                       progress=False)
    return model, mesh, exec_for_args(args, model)


def exec_for_args(args, model) -> ExecConfig:
    """The ExecConfig of a command's flags: the loaded model's (this backend's defaults, its mesh and
    stored layer loop) with `--impl` as the kernel choice when given."""
    impl = getattr(args, "impl", None)
    return model.exec.replace(kernels=impl) if impl else model.exec


def print_report(report: dict, as_json: bool, format_text) -> int:
    """A command's report on stdout: JSON (`--json`) or the command's text table. Returns 0."""
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_text(report))
    return 0


def add_kernel_flags(p: argparse.ArgumentParser) -> None:
    """`--impl` (ExecConfig.kernels) and `--keep-quantized` (alias `--keep-fp8`), shared by logits,
    generate, batch and serve."""
    p.add_argument("--impl", choices=["xla", "pallas"], default=None, help="kernel implementation")
    p.add_argument("--keep-quantized", "--keep-fp8", dest="keep_quantized", action="store_true",
                   help="keep quantised weights on device as stored: FP8 matrices as float8 + block scales "
                        "(the Pallas FP8 kernel with --impl pallas), MXFP4 routed experts as packed codes + E8M0 "
                        "scales; each is dequantised inside its matmul (--keep-fp8: an alias)")
