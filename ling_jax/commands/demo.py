"""`ling-jax demo`: generate from the demo model shipped in `ling_jax/demo_model/`.

The demo model is a 4.3M-parameter Ling-architecture model (KDA and MLA layers, a trailing MLA
group, dense and MoE layers, grouped routing, a clamped last layer, an MTP layer) trained on the
Python standard library's source by `tools/train_demo.py --ship`, stored in the release layout (FP8
blocks + scales, index, tokenizer). Its held-out perplexity and MTP acceptance length are in
`ling_jax/demo_model/demo_results.json` and the README. If the directory is missing (a stripped
install), a small random-weight checkpoint with the same features is written once into the cache
directory instead, so every code path still runs.
"""
from __future__ import annotations

import os
import sys

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")


def cache_dir() -> str:
    return os.environ.get("LING_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ling-jax"))


def demo_checkpoint(verbose: bool = True) -> str:
    if os.path.isfile(os.path.join(SHIPPED, "config.json")):
        return SHIPPED
    path = os.path.join(cache_dir(), "demo-random-v1")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from ling_jax.checkpoint.synthetic_config import synthetic_config
        from ling_jax.checkpoint.writer import write_checkpoint
        if verbose:
            print(f"building the demo checkpoint in {path} (once)", file=sys.stderr)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_checkpoint(synthetic_config(), path, dtype="fp8", seed=0, progress=False)
    return path


def add_parser(sub):
    p = sub.add_parser("demo", help="generate text with the small demo model")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--speculative", type=int, default=0, metavar="K")
    p.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    from ling_jax.commands import generate as gen

    ckpt = demo_checkpoint(verbose=not args.json)
    if ckpt != SHIPPED and not args.json:
        print(f"note: {SHIPPED} is missing, so this is a random-weight model and the text is noise "
              "(the architecture and every code path are real)", file=sys.stderr)
    ns = gen.add_parser(_Sub()).parse_args(["--checkpoint", ckpt, "--prompt", args.prompt,
                                             "--max-new-tokens", str(args.max_new_tokens),
                                             "--speculative", str(args.speculative)]
                                            + (["--json"] if args.json else []))
    if not args.json:
        print(args.prompt, end="", flush=True)
    return gen.run(ns)


class _Sub:
    """Lets `generate.add_parser` build a standalone parser for the demo's arguments."""

    def add_parser(self, name, **kw):
        import argparse
        return argparse.ArgumentParser(prog=f"ling-jax {name}")
