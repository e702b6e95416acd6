"""`ling-jax demo`: generate from the demo model shipped in `ling_jax/demo_model/`.

The demo model is a 4.3M-parameter Ling-architecture model (KDA and MLA layers, a trailing MLA
group, dense and MoE layers, grouped routing, a clamped last layer, an MTP layer) trained on the
Python standard library's source by `tools/train_demo.py --ship`, stored in the release layout (FP8
blocks + scales, index, tokenizer). Its held-out perplexity and MTP acceptance length are in
`ling_jax/demo_model/demo_results.json` and the README. If the directory is missing (a stripped
install), a small random-weight checkpoint with the same features is written once into the cache
directory instead, so every code path still runs.

Sampling defaults (`DEMO_SAMPLING`): greedy decoding of a 4M-parameter model falls into loops
(`import os` continued by `import sys` 26 times), so the demo samples at temperature 0.7 with
top-p 0.9 and a frequency penalty of 0.3, seed 0 (reproducible). On five prompts × 100 tokens
this lifts the distinct-line ratio from 0.38 (greedy) to 0.97 (`tests/test_demo_model.py`
checks it). A repetition penalty helps less for code, where `self`, brackets and indentation
repeat by nature. `--greedy` gives plain greedy decoding (no penalties) back.
"""
from __future__ import annotations

import os
import sys

from ling_jax.checkpoint.locate import SHIPPED, cache_dir, demo_checkpoint  # noqa: F401 (re-exported)
from ling_jax.commands.common import (ArgumentValueError, finite_float, non_negative_float, non_negative_int,
                                      positive_int)

# temperature, top_p, frequency_penalty, seed: why these, see the module docstring
DEMO_SAMPLING = dict(temperature=0.7, top_p=0.9, frequency_penalty=0.3, seed=0)
# not "def ": the tokenizer makes its trailing space a token of its own, after which the model writes
# "def (self" (names carry their leading space: " parse" is one token)
DEFAULT_PROMPT = "def parse"



def add_parser(sub):
    p = sub.add_parser("demo", help="generate text with the small demo model")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"default {DEFAULT_PROMPT!r}")
    p.add_argument("--max-new-tokens", type=positive_int, default=40)
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="MTP drafts per step (1..3; implies no penalties unless given)")
    p.add_argument("--greedy", action="store_true", help="plain greedy decoding, no penalties (loops on this model)")
    d = DEMO_SAMPLING
    p.add_argument("--temperature", type=non_negative_float, default=None, help=f"default {d['temperature']}")
    p.add_argument("--top-p", type=non_negative_float, default=None, help=f"default {d['top_p']}")
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--presence-penalty", type=finite_float, default=0.0)
    p.add_argument("--frequency-penalty", type=finite_float, default=None,
                   help=f"default {d['frequency_penalty']} ({0.0} with --greedy or --speculative)")
    p.add_argument("--repetition-penalty", type=finite_float, default=1.0)
    p.add_argument("--json", action="store_true")
    return p


def sampling_args(args) -> list:
    """The `ling-jax generate` flags for the demo's sampling: DEMO_SAMPLING where not given;
    --greedy: temperature 0 and (unless given) no frequency penalty; --speculative: no penalty
    unless given (penalties do not combine with speculation)."""
    d = DEMO_SAMPLING
    plain = args.greedy or args.speculative > 0
    temp = 0.0 if args.greedy and args.temperature is None else args.temperature
    temp = d["temperature"] if temp is None else temp
    freq = args.frequency_penalty if args.frequency_penalty is not None else (0.0 if plain else d["frequency_penalty"])
    out = ["--temperature", str(temp), "--top-p", str(d["top_p"] if args.top_p is None else args.top_p),
           "--top-k", str(args.top_k), "--seed", str(args.seed), "--presence-penalty", str(args.presence_penalty),
           "--frequency-penalty", str(freq), "--repetition-penalty", str(args.repetition_penalty)]
    return out + (["--greedy"] if args.greedy else [])


def run(args) -> int:
    from ling_jax.commands import generate as gen

    ckpt = demo_checkpoint(verbose=not args.json)
    check_demo_length(ckpt, args.prompt, args.max_new_tokens)
    if ckpt != SHIPPED and not args.json:
        print(f"note: {SHIPPED} is missing, so this is a random-weight model and the text is noise "
              "(the architecture and every code path are real)", file=sys.stderr)
    ns = gen.add_parser(_Sub()).parse_args(["--checkpoint", ckpt, "--prompt", args.prompt,
                                             "--max-new-tokens", str(args.max_new_tokens),
                                             "--speculative", str(args.speculative)]
                                            + sampling_args(args) + (["--json"] if args.json else []))
    if not args.json:
        print(args.prompt, end="", flush=True)
    return gen.run(ns)


def check_demo_length(ckpt: str, prompt: str, max_new_tokens: int) -> None:
    """The demo's own refusal of a prompt + --max-new-tokens beyond the demo model's context
    (`generate`'s would suggest --allow-long-context, which the demo does not take)."""
    from ling_jax.config import LingConfig
    from ling_jax.tokenizer import Tokenizer
    limit = LingConfig.from_json(os.path.join(ckpt, "config.json")).max_position_embeddings
    tok = Tokenizer.from_dir(ckpt)
    n = len(tok.encode(prompt, add_special_tokens=True)) if tok is not None else 0
    if n + max_new_tokens > limit:
        raise ArgumentValueError(f"--max-new-tokens: the prompt's {n} tokens + {max_new_tokens} new tokens exceed "
                                 f"the demo model's context of {limit} positions (at most {max(limit - n, 0)} new "
                                 f"tokens after this prompt)")


class _Sub:
    """Lets `generate.add_parser` build a standalone parser for the demo's arguments."""

    def add_parser(self, name, **kw):
        import argparse
        return argparse.ArgumentParser(prog=f"ling-jax {name}")
