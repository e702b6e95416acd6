"""`ling-jax eval`: perplexity of a checkpoint on a text file.

The file is tokenized with the checkpoint's tokenizer (no special tokens added) into x_0..x_{N-1}.
Windows of `--window` (default 256) targets: window w feeds x[wW .. wW+W] (W+1 tokens) from an
empty state and scores its last W tokens, so every token but x_0 is scored exactly once, with at
most W-1 tokens of context (context restarts at every window boundary). Perplexity is
exp(mean negative log-likelihood) over the N-1 scored tokens. The MTP head is not used.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from ling_jax.checks import check_int


def add_parser(sub):
    p = sub.add_parser("eval", help="perplexity of a checkpoint on a text file")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory with tokenizer.json")
    p.add_argument("--text-file", required=True, help="UTF-8 text file")
    p.add_argument("--window", type=int, default=256, help="scored tokens per window (default 256)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype")
    p.add_argument("--json", action="store_true", help='print {"perplexity": float, "tokens": int, ...}')
    return p


def window_batches(ids, window: int, batch: int):
    """Yield (ids [batch, window+1] int32, n_valid [batch]) covering targets x_1..x_{N-1} once."""
    N = len(ids)
    starts = list(range(0, N - 1, window))
    for b0 in range(0, len(starts), batch):
        rows = np.zeros((batch, window + 1), np.int32)
        n_valid = np.zeros((batch,), np.int32)
        for j, s in enumerate(starts[b0:b0 + batch]):
            seg = ids[s:s + window + 1]
            rows[j, :len(seg)] = seg
            n_valid[j] = len(seg)
        yield rows, n_valid


def perplexity(model, ids, window: int = 256, batch: int = 4) -> dict:
    """{'perplexity', 'tokens' (scored), 'nll' (mean, nats), 'window'} of token ids under `model`."""
    import jax
    import jax.numpy as jnp

    from ling_jax.forward import forward

    if len(ids) < 2:
        raise ValueError("--text-file: fewer than 2 tokens; nothing to score")
    check_int(window, "--window", low=1)
    check_int(batch, "--batch", low=1)
    total, count = 0.0, 0
    for rows, n_valid in window_batches(ids, window, batch):
        logits = forward(model, rows, n_valid=jnp.asarray(np.maximum(n_valid, 1)))["logits"]
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        tgt = jnp.asarray(rows[:, 1:])
        nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        m = np.arange(window)[None, :] + 1 < n_valid[:, None]
        total += float(jnp.sum(jnp.where(jnp.asarray(m), nll, 0.0)))
        count += int(m.sum())
    mean = total / count
    return {"perplexity": math.exp(mean), "tokens": count, "nll": mean, "window": window}


def run(args) -> int:
    from ling_jax.loader import load_model
    from ling_jax.tokenizer import Tokenizer

    if not os.path.isfile(args.text_file):
        raise FileNotFoundError(f"--text-file: {args.text_file} not found")
    tok = Tokenizer.from_dir(args.checkpoint) if os.path.isdir(args.checkpoint) else None
    if tok is None:
        raise FileNotFoundError(f"--checkpoint: {args.checkpoint} has no tokenizer.json")
    with open(args.text_file, encoding="utf-8", errors="replace") as f:
        ids = tok.encode(f.read())
    model = load_model(args.checkpoint, args.dtype, with_mtp=False, progress=False)
    res = perplexity(model, ids, args.window, args.batch)
    if args.json:
        print(json.dumps({"perplexity": res["perplexity"], "tokens": res["tokens"]}))
    else:
        print(f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens "
              f"(mean NLL {res['nll']:.4f} nats, window {res['window']})")
    return 0
