"""Train the demo model on the Python standard library's top-level modules (`Lib/*.py`, ~4.7 MB).

    python tools/train_demo.py --out runs/demo [--steps 900] [--batch 16] [--seq 128] [--ship]

Runs `ling-jax train` with the default small model (`ling_jax.train.default_model_config`: 6
layers, KDA + MLA with a trailing MLA group, dense + MoE layers, 8 experts top-2 in 4 groups with a
shared expert, clamped last layer, MTP layer, vocabulary 4096) on symlinks to the stdlib sources,
so the output directory holds tokenizer/, orbax/ (resumable: rerun the same command to continue),
metrics.jsonl, loss.png and checkpoint/ (release layout, FP8 blocks, + tokenizer). Then, on a
held-out module (`--eval-file`, default `textwrap.py`, excluded from training):
  * the model's perplexity (`ling-jax eval`'s windows) next to a unigram model of the training
    tokens (add-one smoothed) on the same tokens;
  * the MTP acceptance length: greedy speculative decoding (k = 1, 2, 3) from held-out prompts.
The numbers go to OUT/demo_results.json; `--ship` copies the checkpoint, the numbers and the loss
curve into `ling_jax/demo_model/` (written beside it, then renamed), which `ling-jax demo` loads.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--export-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--ship", action="store_true", help="install the result as ling_jax/demo_model/")
    p.add_argument("--eval-file", default=None, help="held-out file (default: stdlib textwrap.py)")
    a = p.parse_args(argv)

    from ling_jax.cli import main as cli

    lib = os.path.dirname(os.__file__)
    held_out = a.eval_file or os.path.join(lib, "textwrap.py")
    corpus = os.path.join(os.path.abspath(a.out), "corpus")
    os.makedirs(corpus, exist_ok=True)
    for f in sorted(glob.glob(os.path.join(lib, "*.py"))):
        if os.path.abspath(f) == os.path.abspath(held_out):
            continue
        link = os.path.join(corpus, os.path.basename(f))
        if not os.path.lexists(link):
            os.symlink(f, link)
    t0 = time.time()
    rc = cli(["train", "--text", corpus, "--pattern", "*.py", "--out", a.out, "--steps", str(a.steps),
              "--batch", str(a.batch), "--seq", str(a.seq), "--lr", str(a.lr), "--vocab-size", str(a.vocab_size),
              "--export-dtype", a.export_dtype])
    print(f"training took {time.time() - t0:.0f} s")
    if rc:
        return rc
    ckpt = os.path.join(a.out, "checkpoint")
    res = evaluate(ckpt, corpus, held_out)
    res.update(steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, python=sys.version.split()[0])
    with open(os.path.join(a.out, "demo_results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    if a.ship:
        ship(a.out, res)
    return 0


def unigram_perplexity(train_ids, eval_ids, vocab: int) -> float:
    """exp(mean NLL) of eval_ids under add-one-smoothed training token frequencies."""
    counts = np.bincount(np.asarray(train_ids, np.int64), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[np.asarray(eval_ids, np.int64)].mean()))


def evaluate(ckpt: str, corpus: str, held_out: str) -> dict:
    from ling_jax.commands.eval import perplexity
    from ling_jax.train.data import read_corpus
    from ling_jax.generate import generate
    from ling_jax.loader import load_model
    from ling_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ckpt)
    with open(held_out, encoding="utf-8") as f:
        ids = tok.encode(f.read())
    train_ids = [i for d in read_corpus(corpus, "*.py") for i in tok.encode(d)]
    model = load_model(ckpt, "float32", with_mtp=True, progress=False)
    ppl = perplexity(model, ids)
    # the unigram model scores the same targets as the windows (every token but the first)
    uni = unigram_perplexity(train_ids, ids[1:], model.cfg.vocab_size)
    prompts = [ids[s:s + 32] for s in range(0, 8 * 200, 200)]
    plain = generate(model, prompts, 48, stop_ids=())
    accept = {}
    for k in (1, 2, 3):
        spec = generate(model, prompts, 48, stop_ids=(), speculative=k)
        if spec.tokens != plain.tokens:
            raise AssertionError(f"speculative k={k} greedy output differs from plain greedy")
        accept[str(k)] = spec.acceptance_length
    return {"held_out_file": os.path.basename(held_out), "held_out_tokens": ppl["tokens"],
            "perplexity": ppl["perplexity"], "unigram_perplexity": uni, "train_tokens": len(train_ids),
            "mtp_acceptance_length": accept, "sample": tok.decode(list(prompts[0]) + list(plain.tokens[0]))}


def ship(out: str, res: dict) -> None:
    """Copy OUT/checkpoint (+ results, loss curve) to ling_jax/demo_model/ via a temporary sibling."""
    import shutil

    from ling_jax.commands.demo import SHIPPED
    tmp = SHIPPED + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(os.path.join(out, "checkpoint"), tmp)
    with open(os.path.join(tmp, "demo_results.json"), "w") as f:
        json.dump(res, f, indent=1)
    shutil.copy(os.path.join(out, "loss.png"), os.path.join(tmp, "loss.png"))
    old = SHIPPED + ".old"
    if os.path.isdir(SHIPPED):
        os.replace(SHIPPED, old)
    os.replace(tmp, SHIPPED)
    shutil.rmtree(old, ignore_errors=True)
    print(f"shipped {SHIPPED}")


if __name__ == "__main__":
    sys.exit(main())
