"""The serving engine's command-line flags (`ling-jax batch`, `ling-jax serve`) and the Engine they build.

    add_engine_flags(parser)              # --max-slots --page-size --cache-memory --prefill-chunk --prefill-rows
                                          # --prefill-row-tokens --prefill-row-buckets (default: the platform's
                                          # policy, serve/prefill_policy.py)
                                          # --max-seq-len --warmup/--no-warmup --prefix-cache-memory
                                          # --no-prefix-cache --speculative
    engine = engine_from_args(args, model)  # checks, defaults, start-up report on stderr, warm-up

Default cache memory (no `--cache-memory`), per device (the pools are replicated on every device
of the mesh):
  * GPU / TPU: ACCEL_FREE_FRACTION (half) of what the fullest local device has free once the
    parameters are loaded (`memory_stats()`: bytes_limit - bytes_in_use); the other half is left
    for the step programs' activations and workspace.
  * CPU (no memory_stats): min(CPU_CACHE_CAP_GIB = 4 GiB, CPU_HOST_FRACTION (a quarter) of the
    host's physical memory minus the parameters), so a default run never takes a large share of a
    shared machine.
  Either way no more pages than `--max-slots` sequences of `--max-seq-len` tokens can hold (the
  default max_seq_len: the model's context, cut to what the budget holds), since more could never
  be used. An explicit `--cache-memory` is taken as given.

Every refusal is an ArgumentValueError naming the flag and what was expected, raised before the
pools are allocated.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ling_jax.accounting import fmt_bytes
from ling_jax.commands.common import ArgumentValueError, check_context_length, finite_float, positive_int
from ling_jax.exec_config import ExecConfig
from ling_jax.kv_quant import KV_CACHE_DTYPES
from ling_jax.rope import context_limit
from ling_jax.serve import Engine
from ling_jax.serve.pools import GIB, plan_pools, stored_kpe_values
from ling_jax.serve.prefill_policy import PrefillPolicy, resolve_prefill_policy
from ling_jax.speculation import MAX_SPECULATIVE

ACCEL_FREE_FRACTION = 0.5
CPU_CACHE_CAP_GIB = 4.0
CPU_HOST_FRACTION = 0.25
WARMUP_MODES = ("full", "lazy", "off")


def gib(text: str) -> float:
    """argparse type: a finite size in GiB > 0."""
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a size in GiB > 0, got {text!r}")
    return v


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving engine")
    g.add_argument("--max-slots", type=positive_int, default=8, metavar="N", help="sequences in flight at once")
    g.add_argument("--page-size", type=positive_int, default=16, metavar="N", help="tokens per latent-cache page")
    g.add_argument("--cache-memory", type=gib, default=None, metavar="GIB",
                   help="bytes for the KV pages and KDA state slots, per device (default: from the device's free "
                        "memory, on CPU at most 4 GiB; see `describe` in the start-up report)")
    g.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="prompt tokens fed per engine step at most (a running decode waits at most one chunk). "
                        "With none of the four --prefill-* flags: the platform's policy (CPU: 8 rows x 64 "
                        "tokens, chunk 512, row buckets 1,2,4,8, rows at most --max-slots; TPU/GPU: 64 tokens "
                        "over 2 rows); with any of them the others default to 64 tokens over 2 rows")
    g.add_argument("--prefill-rows", type=positive_int, default=None, metavar="N",
                   help="prompts fed side by side in one prefill step at most (each gets its share of "
                        "--prefill-chunk, at most --prefill-row-tokens)")
    g.add_argument("--prefill-row-tokens", type=positive_int, default=None, metavar="N",
                   help="prompt tokens one prompt is fed per step at most (default: --prefill-chunk): a lone "
                        "prompt is fed in chunks this short, a backlog of prompts in steps of up to "
                        "--prefill-chunk tokens over --prefill-rows rows")
    g.add_argument("--prefill-row-buckets", type=positive_int_list, default=None, metavar="N,N,...",
                   help="prefill row counts compiled, ascending, ending at --prefill-rows (default: just "
                        "--prefill-rows): a step of m prompts runs the smallest that holds them")
    g.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="prompt + new tokens of one request (default: the model's context, cut to the pool)")
    g.add_argument("--allow-long-context", action="store_true",
                   help="--max-seq-len may exceed max_position_embeddings, up to the config's scaled length "
                        "(YaRN: factor x original_max_position_embeddings) and never beyond")
    g.add_argument("--warmup", nargs="?", const="full", default="full", choices=WARMUP_MODES,
                   help="full (default; also a bare --warmup): compile every step shape before serving, one "
                        "progress line each; lazy (serve): serve at once, compile the shapes in the background "
                        "between steps (/health says \"starting\" until done; a request whose shape is not "
                        "compiled yet compiles it); off: compile each shape when first needed")
    g.add_argument("--no-warmup", dest="warmup", action="store_const", const="off", help="= --warmup off")
    g.add_argument("--prefix-cache-memory", type=gib, default=None, metavar="GIB",
                   help="byte budget of the prefix cache (default: the engine's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="switch the prefix cache off")
    g.add_argument("--snapshot-interval", type=positive_int, default=None, metavar="N",
                   help="tokens between the prefix cache's KDA snapshots inside a prefill chunk, a multiple of "
                        "--page-size (default: lcm(page size, KDA chunk)); larger saves snapshot memory, smaller "
                        "makes hits deeper")
    g.add_argument("--speculative", type=int, default=0, metavar="K",
                   help=f"MTP draft tokens per decode step, 0..{MAX_SPECULATIVE} (0 = off)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the MLA latent pages: auto (the model dtype) or fp8 (float8_e4m3fn + two float32 "
                        "scales per token: ~1.97x the tokens of bfloat16 in the same memory)")


# ---- default cache memory ---------------------------------------------------------------------
def default_cache_budget(platform: str, free_bytes: Optional[int], host_bytes: Optional[int],
                         param_bytes: int) -> tuple[int, str]:
    """(bytes, how they were derived) for the pools without --cache-memory (module docstring).
    free_bytes: the fullest local accelerator's bytes_limit - bytes_in_use (None on CPU)."""
    if platform != "cpu" and free_bytes is not None:
        budget = int(ACCEL_FREE_FRACTION * max(free_bytes, 0))
        return budget, (f"{ACCEL_FREE_FRACTION:.0%} of the {fmt_bytes(free_bytes)} free per {platform} device "
                        "after loading the parameters")
    if host_bytes is None:
        return int(CPU_CACHE_CAP_GIB * GIB), f"the CPU cap of {CPU_CACHE_CAP_GIB:g} GiB (host memory unknown)"
    share = int(CPU_HOST_FRACTION * host_bytes) - param_bytes
    budget = max(0, min(int(CPU_CACHE_CAP_GIB * GIB), share))
    return budget, (f"min({CPU_CACHE_CAP_GIB:g} GiB, {CPU_HOST_FRACTION:.0%} of {fmt_bytes(host_bytes)} host "
                    f"memory - {fmt_bytes(param_bytes)} parameters)")


def _device_free_bytes() -> tuple[str, Optional[int]]:
    """(platform, min over local devices of bytes_limit - bytes_in_use), None where not reported."""
    devs = jax.local_devices()
    free = []
    for d in devs:
        stats = d.memory_stats() if d.platform != "cpu" else None
        if not stats or not stats.get("bytes_limit"):
            return devs[0].platform, None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return devs[0].platform, min(free)


def local_default_budget(model) -> tuple[int, str]:
    """default_cache_budget for this process's devices and host."""
    platform, free = _device_free_bytes()
    return default_cache_budget(platform, free, _host_bytes(), _param_bytes(model))


def agreed_default_budget(model) -> tuple[int, str]:
    """The default budget every process of a multi-host run uses: the smallest of theirs (each
    process must build the same pools, and the tightest device bounds them all)."""
    budget, how = local_default_budget(model)
    if jax.process_count() == 1:
        return budget, how
    kib = multihost_utils.process_allgather(np.int32(min(budget // 1024, 2 ** 31 - 1)))  # int32: x64 is off
    return int(np.min(kib)) * 1024, f"{how}, the smallest of {jax.process_count()} processes"


def _host_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _param_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "nbytes"))


# ---- the engine -------------------------------------------------------------------------------
def positive_int_list(text: str) -> tuple[int, ...]:
    """argparse type: a comma list of positive integers, ascending."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1 or list(out) != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"expected ascending positive integers separated by commas, got {text!r}")
    return out


def prefill_policy(args, platform: Optional[str] = None) -> PrefillPolicy:
    """The prefill policy of the four --prefill-* flags (serve/prefill_policy.py: the platform's
    default when none is given), written back into `args` so every later reader sees the resolved
    values (idempotent). platform: where the engine runs (default jax's default backend; `aot`
    passes its target's)."""
    pol = resolve_prefill_policy(platform or jax.default_backend(), args.max_slots, args.prefill_chunk,
                                 args.prefill_rows, args.prefill_row_tokens, args.prefill_row_buckets)
    args.prefill_chunk, args.prefill_rows = pol.chunk, pol.rows
    args.prefill_row_tokens, args.prefill_row_buckets = pol.row_tokens, pol.row_buckets
    return pol


def check_engine_flags(args) -> None:
    """Refusals that need no model (call it before loading one): --speculative's range, flags that
    contradict each other."""
    rb, rows = getattr(args, "prefill_row_buckets", None), getattr(args, "prefill_rows", None)
    if rb and rows is not None and rb[-1] != rows:
        raise ArgumentValueError(f"--prefill-row-buckets: {','.join(map(str, rb))} must end at --prefill-rows {rows}")
    k = args.speculative
    if not 0 <= k <= MAX_SPECULATIVE:
        raise ArgumentValueError(f"--speculative: expected 0..{MAX_SPECULATIVE} MTP draft tokens, got {k}")
    if args.no_prefix_cache and args.prefix_cache_memory is not None:
        raise ArgumentValueError("--prefix-cache-memory and --no-prefix-cache contradict each other")
    interval = args.snapshot_interval
    if interval is not None and args.no_prefix_cache:
        raise ArgumentValueError("--snapshot-interval and --no-prefix-cache contradict each other")
    if interval is not None and interval % args.page_size:
        raise ArgumentValueError(f"--snapshot-interval: {interval} is not a multiple of --page-size "
                                 f"{args.page_size} (snapshots are taken on page boundaries)")


def check_engine_args(args, model) -> None:
    """check_engine_flags, and the refusals that depend on the model (naming the flag)."""
    if 0 < args.speculative <= MAX_SPECULATIVE and model.mtp is None:
        raise ArgumentValueError("--speculative: the model has no MTP layer (load it with its MTP weights)")
    check_engine_flags(args)
    limit = model.cfg.max_position_embeddings
    if args.max_seq_len is not None:
        if args.max_seq_len < 2:
            raise ArgumentValueError(f"--max-seq-len: expected >= 2 tokens, got {args.max_seq_len}")
        if args.max_seq_len > limit:
            if not args.allow_long_context:
                raise ArgumentValueError(f"--max-seq-len: {args.max_seq_len} exceeds the model's "
                                         f"max_position_embeddings={limit} (pass --allow-long-context to go up to "
                                         f"the scaled length {context_limit(model.cfg)})")
            check_context_length(args.max_seq_len, model.cfg, True, "--max-seq-len")


def plan_engine_memory(args, model, budget: Optional[tuple[int, str]] = None) -> tuple[dict, str]:
    """(Engine keywords num_pages / max_seq_len, a line saying how the memory was sized).
    budget: (bytes, how) instead of reading the devices (tests)."""
    cfg, slots, P = model.cfg, args.max_slots, args.page_size
    kv = getattr(args, "kv_cache_dtype", None)
    unit = plan_pools(cfg, model.dtype, max_slots=slots, page_size=P, num_pages=1, max_seq_len=2,
                      with_mtp=model.mtp is not None, kv_cache_dtype=kv,
                      kpe_stored=stored_kpe_values(cfg, model.exec, model.dtype, kv))
    page, slot = unit.page_bytes, unit.slot_bytes
    if args.cache_memory is not None:
        total, how = int(args.cache_memory * GIB), f"--cache-memory {args.cache_memory:g} GiB"
    else:
        total, how = agreed_default_budget(model) if budget is None else budget
        how = f"default: {how}"
    pages = (total - slots * slot) // page
    if pages < 1:
        raise ArgumentValueError(
            f"--cache-memory: {fmt_bytes(total)} ({how}) does not cover {slots} slots x {fmt_bytes(slot)} + one "
            f"page of {fmt_bytes(page)}; pass a larger --cache-memory or fewer --max-slots")
    seq = args.max_seq_len
    if seq is not None and pages * P < seq:
        raise ArgumentValueError(f"--max-seq-len: {seq} tokens do not fit the page pool ({pages} pages x {P} tokens "
                                 f"from {how}); pass a larger --cache-memory or a smaller --max-seq-len")
    seq_default = min(cfg.max_position_embeddings, pages * P) if seq is None else seq
    useful = slots * -(-seq_default // P)  # every slot at its longest: more pages could never be used
    note = ""
    if args.cache_memory is None and pages > useful:
        pages, note = useful, f", capped at {slots} slots x {-(-seq_default // P)} pages of {seq_default} tokens"
    line = (f"engine memory: {pages} pages x {P} tokens ({fmt_bytes(pages * page)}) + {slots} slots "
            f"({fmt_bytes(slots * slot)}) from {how}{note}")
    return {"num_pages": int(pages), "max_seq_len": seq_default}, line


def engine_options(args, platform: Optional[str] = None) -> dict:
    """The Engine keywords of the prefill (`prefill_policy`, for `platform`), prefix-cache, speculative
    and cache-dtype flags (the sizes are the caller's, the memory `plan_engine_memory`'s): prefill_chunk,
    prefill_rows, prefill_row_tokens, prefill_row_buckets, prefix_cache, prefix_cache_memory_gib,
    snapshot_interval, speculative, kv_cache_dtype."""
    return {**prefill_policy(args, platform).engine_kwargs(),
            "prefix_cache": not args.no_prefix_cache,
            "prefix_cache_memory_gib": args.prefix_cache_memory,
            "snapshot_interval": args.snapshot_interval, "speculative": args.speculative,
            "kv_cache_dtype": args.kv_cache_dtype}


def engine_from_args(args, model, report=sys.stderr, budget: Optional[tuple[int, str]] = None,
                     exec: Optional[ExecConfig] = None) -> Engine:
    """The Engine the flags describe (running with `exec`, default `model.exec`: the command's
    ExecConfig, `common.exec_for_args`), warmed up unless --no-warmup. Prints the start-up report
    (memory sizing, `Engine.describe()`, warm-up time) to `report` on process 0. Every process of
    a multi-host run calls it; processes > 0 then call `engine.follow()` (their warm-up runs there)."""
    given = any(getattr(args, f) is not None for f in ("prefill_chunk", "prefill_rows", "prefill_row_tokens",
                                                       "prefill_row_buckets"))
    policy = prefill_policy(args)
    check_engine_args(args, model)
    memory, line = plan_engine_memory(args, model, budget)
    engine = Engine(model, max_slots=args.max_slots, page_size=args.page_size, exec=exec, **memory,
                    **engine_options(args))
    primary = jax.process_index() == 0
    if primary and report is not None:
        print(line, file=report)
        print(f"{policy.describe()} ({'the flags' if given else jax.default_backend() + ' default'})", file=report)
        print(engine.describe(), file=report, flush=True)
    if args.warmup == "full":
        t = time.perf_counter()
        engine.warmup(progress=warmup_reporter(report if primary else None))
        if primary and report is not None:
            print(f"warm-up: {time.perf_counter() - t:.1f} s (step-program cache entries: {engine.compiled_shapes()})",
                  file=report, flush=True)
    return engine


def warmup_reporter(report=sys.stderr, prefix: str = "warm-up"):
    """A `progress(done, total, label, seconds)` printing one line per warm-up item to `report`
    (None: nothing), e.g. `warm-up 3/12: decode 2 row(s) x 4 page(s) 1.9 s (9 left)`."""
    if report is None:
        return None

    def progress(done, total, label, seconds):
        print(f"{prefix} {done}/{total}: {label} {seconds:.1f} s ({total - done} left)", file=report, flush=True)
    return progress

