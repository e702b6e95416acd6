"""Engine flags shared by the commands that build a serving `Engine` (`ling-jax serve`).

Stand-in written on the `server` branch with the names agreed in the fifth session's plan
(`add_engine_flags(parser)`, `engine_from_args(args, model)`); the `multihost` branch owns the
full version (defaults from device memory, the persistent compilation cache). Keywords the
engine of this build does not take yet (prefix cache, speculation) are refused when asked for,
never silently dropped.
"""
from __future__ import annotations

import argparse
import inspect

from ling_jax.commands.common import ArgumentValueError, non_negative_int, positive_int


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (continuous batching, ling_jax/serve/README.md)")
    g.add_argument("--max-slots", type=positive_int, default=8, help="sequences in flight at once")
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per latent-cache page")
    g.add_argument("--cache-memory", type=positive_float, default=1.0, metavar="GIB",
                   help="GiB for KDA state slots plus latent pages")
    g.add_argument("--prefill-chunk", type=positive_int, default=64, help="prompt tokens fed per step at most")
    g.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="prompt + new tokens of one request (default: the model's context or the pool)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every step shape before serving")
    g.add_argument("--prefix-cache-memory", type=positive_float, default=None, metavar="GIB")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    g.add_argument("--speculative", type=non_negative_int, default=0, metavar="K",
                   help="MTP draft tokens per step (0 = off)")


def engine_from_args(args, model):
    """The `Engine` the flags describe, warmed up unless --no-warmup."""
    from ling_jax.serve import Engine

    kw = dict(max_slots=args.max_slots, page_size=args.page_size, cache_memory_gib=args.cache_memory,
              prefill_chunk=args.prefill_chunk, max_seq_len=args.max_seq_len)
    accepted = inspect.signature(Engine).parameters
    wanted = {"speculative": (args.speculative, 0, "--speculative"),
              "prefix_cache": (args.prefix_cache, True, "--no-prefix-cache"),
              "prefix_cache_memory_gib": (args.prefix_cache_memory, None, "--prefix-cache-memory")}
    for name, (value, default, flag) in wanted.items():
        if name in accepted:
            kw[name] = value
        elif value != default:
            raise ArgumentValueError(f"{flag}: this engine build has no {name.replace('_', ' ')}")
    if args.max_seq_len is not None and args.max_seq_len > model.cfg.max_position_embeddings:
        raise ArgumentValueError(f"--max-seq-len {args.max_seq_len} exceeds the config's max_position_embeddings="
                                 f"{model.cfg.max_position_embeddings}")
    engine = Engine(model, **kw)
    if args.warmup:
        engine.warmup()
    return engine
