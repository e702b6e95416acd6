"""`ling-jax train`: train a small Ling model from scratch on a text corpus.

Writes into --out: tokenizer/ (byte-level BPE trained on the corpus), orbax/ (train state every
--save-every steps; rerunning with the same --out resumes exactly), metrics.jsonl (one line per
step), loss.png (loss curve), and checkpoint/ (the final model exported in the release layout with
the tokenizer files, loadable by `generate`, `logits`, `eval`).
"""
from __future__ import annotations

import json
import os
import time

from ling_jax.checks import check_int


def add_parser(sub):
    p = sub.add_parser("train", help="train a small model on a text corpus (tokenizer, Orbax state, export)")
    p.add_argument("--text", required=True, help="text file, or directory searched recursively (see --pattern)")
    p.add_argument("--pattern", default="*", help="file-name glob inside a --text directory (default: all files)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", default=None, help="model config.json (default: the 6-layer 4M-parameter demo architecture)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size without --config")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/10, at most 100)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clip")
    p.add_argument("--mtp-weight", type=float, default=0.3,
                   help="MTP loss weight when the config's mtp_loss_scaling_factor is 0")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="expert_bias update rate (aux-loss-free balance)")
    p.add_argument("--chunk-size", type=int, default=16,
                   help="KDA chunk length (any value gives the same result; 16 is fastest for CPU training)")
    p.add_argument("--remat", action="store_true", help="rematerialise each decoder layer (less memory)")
    p.add_argument("--save-every", type=int, default=100, help="Orbax save interval in steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-dtype", choices=["fp8", "bf16"], default="fp8", help="dtype of the exported checkpoint")
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a train state (deletes --out/orbax)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def plot_loss(metrics: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [m["ce"] for m in metrics], label="next-token CE")
    if any(m.get("mtp_ce") for m in metrics):
        ax.plot(steps, [m["mtp_ce"] for m in metrics], label="MTP CE", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def run(args) -> int:
    import numpy as np

    from ling_jax.checkpoint.tokenizer_files import write_tokenizer_files
    from ling_jax.config import LingConfig
    from ling_jax.export import export_checkpoint
    from ling_jax.tokenizer import Tokenizer
    from ling_jax.train import (BatchStream, TrainConfig, Trainer, checkpoint_manager, corpus_tokens,
                                default_model_config, init_model, read_corpus, restore_state, save_state,
                                train_tokenizer)

    for flag, v, low in (("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--seq", args.seq, 3)):
        check_int(v, flag, low=low, expected=f">= {low}")
    from ling_jax.commands.common import check_output_path
    check_output_path(args.out, [args.text, args.config])
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    docs = read_corpus(args.text, args.pattern)
    cfg = LingConfig.from_json(args.config) if args.config else default_model_config(args.vocab_size)
    tok_dir = os.path.join(out, "tokenizer")
    orbax_dir = os.path.join(out, "orbax")
    if args.no_resume and os.path.isdir(orbax_dir):
        import shutil
        shutil.rmtree(orbax_dir)
    resume = os.path.isdir(orbax_dir) and bool(os.listdir(orbax_dir))
    if not (resume and os.path.isfile(os.path.join(tok_dir, "tokenizer.json"))):
        write_tokenizer_files(tok_dir, train_tokenizer(docs, cfg))
    tok = Tokenizer.from_dir(tok_dir)
    tokens = corpus_tokens(docs, tok, int(cfg.eos_token_id[0]))
    stream = BatchStream(tokens, args.batch, args.seq, args.seed)
    warm = args.warmup if args.warmup is not None else min(100, args.steps // 10)
    tcfg = TrainConfig(lr=args.lr, warmup_steps=warm, total_steps=args.steps, weight_decay=args.weight_decay,
                       clip_norm=args.clip, mtp_weight=args.mtp_weight, remat=args.remat, bias_rate=args.bias_rate, chunk_size=args.chunk_size,
                       seed=args.seed)
    trainer = Trainer(init_model(cfg, args.seed), tcfg)
    n_params = sum(int(np.prod(v.shape)) for v in trainer.state["params"].values())
    mngr = checkpoint_manager(orbax_dir)
    metrics_path = os.path.join(out, "metrics.jsonl")
    history: list[dict] = []
    if resume and mngr.latest_step() is not None:
        meta = restore_state(mngr, trainer)
        if meta.get("data_position"):
            stream.set_position(meta["data_position"])
        if os.path.isfile(metrics_path):
            with open(metrics_path) as f:
                history = [m for m in map(json.loads, f) if m["step"] <= trainer.step]
    if not args.quiet:
        print(f"corpus: {len(docs)} documents, {len(tokens)} tokens; model: {n_params:,} trainable parameters; "
              f"starting at step {trainer.step}")
    from tqdm.auto import tqdm

    bar = tqdm(total=args.steps, initial=min(trainer.step, args.steps), desc="train", disable=args.quiet,
               unit="step")
    t_last = time.perf_counter()
    with open(metrics_path, "w") as mf:
        for m in history:
            mf.write(json.dumps(m) + "\n")
        while trainer.step < args.steps:
            m = trainer.train_step(stream.next())
            now = time.perf_counter()
            tps = args.batch * args.seq / max(now - t_last, 1e-9)
            t_last = now
            rec = {"step": trainer.step, **{k: v for k, v in m.items() if k != "load"}, "tokens_per_s": tps}
            history.append(rec)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            save_state(mngr, trainer, stream.position(), every=args.save_every)
            bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tps:,.0f}", maxload=f"{m['max_load_ratio']:.2f}")
            bar.update(1)
    bar.close()
    save_state(mngr, trainer, stream.position(), force=True)
    mngr.wait_until_finished()
    mngr.close()
    if history:
        plot_loss(history, os.path.join(out, "loss.png"))
    summary = export_checkpoint(trainer.model(), os.path.join(out, "checkpoint"), dtype=args.export_dtype,
                                tokenizer_dir=tok_dir, overwrite=True, progress=False)
    last = history[-1] if history else {}
    if not args.quiet:
        print(f"step {trainer.step}: loss {last.get('loss', float('nan')):.4f}; wrote {orbax_dir}, "
              f"{summary['out_dir']} ({args.export_dtype}), {os.path.join(out, 'loss.png')}")
    return 0
