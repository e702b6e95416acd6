"""Train the demo model on the Python standard library's top-level modules (`Lib/*.py`, ~4.7 MB).

    python tools/train_demo.py --out runs/demo [--steps 2000] [--batch 8] [--seq 256]

Runs `ling-jax train` with the default small model (4 layers: 3 KDA + 1 MLA, 8 experts top-2 with
a shared expert, MTP layer, vocabulary 4096) on symlinks to the stdlib sources, so the output
directory holds tokenizer/, orbax/ (resumable: rerun the same command to continue), metrics.jsonl,
loss.png and checkpoint/ (release layout + tokenizer). A held-out module (`--eval-file`, default
`this.py`'s sibling `textwrap.py`, excluded from training) is then scored with `ling-jax eval`.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--export-dtype", choices=["fp8", "bf16"], default="bf16")
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
    return cli(["eval", "--checkpoint", os.path.join(a.out, "checkpoint"), "--text-file", held_out])


if __name__ == "__main__":
    sys.exit(main())
