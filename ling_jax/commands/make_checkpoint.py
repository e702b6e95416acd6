"""`ling-jax make-checkpoint`: write a seeded random checkpoint in the release format.

    ling-jax make-checkpoint --config FILE --out DIR [--layers N] [--experts E]
                             [--dtype fp8|bf16] [--expert-format mxfp4] [--fp8-layout A|B]
                             [--conv-dtype BF16|F32]
                             [--seed S] [--header-only]
                             [--vocab V] [--hidden H] [--shards K] [--no-mtp] [--no-tokenizer] [--force]

Storage layout (spec §12.7; the table is `ling_jax.checkpoint.layout.BF16_MATRICES`, shared with
`ling-jax plan`): `--fp8-layout B` (default) keeps KDA b_proj and the MLA head-wise g_proj BF16, as
the release config's modules_to_not_convert says and the spec prefers; `--fp8-layout A` keeps KDA
b_proj and MLA kv_a_proj_with_mqa BF16 and stores g_proj FP8. `--conv-dtype` is the KDA conv taps'
storage dtype (default BF16; the spec allows BF16 or F32). The published release size is reproduced by

    ling-jax make-checkpoint --config config.ling-3.1-flash.json --out DIR --header-only \
        --fp8-layout A --conv-dtype F32 --no-tokenizer
    ling-jax inspect DIR --json      # 573,753,349,632 tensor bytes = 534.35 GiB

(the defaults give 573,719,996,928 B = 534.32 GiB; layout B with F32 taps 573,732,383,232 B).

Size overrides (applied by `apply_overrides`, re-validated by the config parser):

* `--layers N`: num_hidden_layers = N. Both SwiGLU limit lists keep their LAST N entries (the
  clamp lives on the last layers: the release clamps the last 7 routed / last 8 shared layers,
  so a reduced model clamps the last min(7, N) / min(8, N) layers with the same values); when
  N exceeds the original depth the lists are extended with zeros (no clamp) at the front.
  first_k_dense_replace is lowered to min(first_k_dense_replace, N - 1) so at least one main
  layer stays MoE (for N = 1 the only layer is MoE).
* `--experts E`: num_experts = E (E >= 2). n_group becomes the largest divisor of E not above the
  original n_group that leaves >= 2 experts per group; topk_group <= max(1, n_group // 2) and
  num_experts_per_tok <= min(topk_group * E / n_group, E // 2), so both routing stages (group
  selection and expert top-k) still choose something for a small E. The release's ratios
  (4 of 8 groups, 8 of 512 experts) are kept unchanged whenever they already satisfy this.
* `--vocab V`: vocab_size = V; eos / pad ids that fall outside are moved to V-1 / V-2.
* `--hidden H`: hidden_size = H (heads and head widths unchanged).
"""
from __future__ import annotations

import argparse
import sys

from ling_jax.checkpoint import layout as L
from ling_jax.checks import check_int
from ling_jax.config import LingConfig


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("make-checkpoint", help="write a seeded random checkpoint in the release format",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, metavar="FILE", help="config.json (or a directory holding one)")
    p.add_argument("--out", required=True, metavar="DIR", help="output checkpoint directory")
    p.add_argument("--layers", type=int, metavar="N", help="override num_hidden_layers")
    p.add_argument("--experts", type=int, metavar="E", help="override num_experts")
    p.add_argument("--vocab", type=int, metavar="V", help="override vocab_size")
    p.add_argument("--hidden", type=int, metavar="H", help="override hidden_size")
    p.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8", help="weight format (default fp8)")
    p.add_argument("--expert-format", choices=("mxfp4",), default=None,
                   help="store the routed experts (MTP layer's too) as MXFP4: U8 packed E2M1 codes + U8 E8M0 "
                        "scales per 32 inputs, encoded from their --dtype values (what `ling-jax quantize "
                        "--experts mxfp4` makes of the --dtype checkpoint)")
    p.add_argument("--fp8-layout", metavar="A|B", default=L.DEFAULT_FP8_LAYOUT,
                   help="which matrices fp8 keeps BF16 (spec §12.7): B = KDA b_proj + MLA head-wise g_proj "
                        "(default; the release config's modules_to_not_convert), A = KDA b_proj + MLA "
                        "kv_a_proj_with_mqa (with --conv-dtype F32: the published 534.35 GiB)")
    p.add_argument("--conv-dtype", metavar="BF16|F32", default=L.DEFAULT_CONV_DTYPE,
                   help=f"storage dtype of the KDA conv taps (default {L.DEFAULT_CONV_DTYPE})")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--header-only", action="store_true",
                   help="write headers/index with real shapes but no tensor bytes (parameter accounting)")
    p.add_argument("--shards", type=int, metavar="K", help="number of shard files (default: ~5 GB each, >= 2)")
    p.add_argument("--no-mtp", action="store_true", help="omit the MTP layer (config gets 0 MTP layers)")
    p.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _positive(name: str, v) -> int:
    if v is None:
        return v
    return check_int(v, name, low=1, expected="a positive integer")


def apply_overrides(cfg: LingConfig, layers=None, experts=None, vocab=None, hidden=None) -> LingConfig:
    """A copy of `cfg` with the size overrides of the module docstring applied consistently."""
    kw: dict = {}
    if _positive("--layers", layers) is not None:
        n0, n = cfg.num_hidden_layers, layers
        for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            lst = list(getattr(cfg, k))
            if lst:
                kw[k] = lst[-n:] if n <= n0 else [0.0] * (n - n0) + lst
        kw["num_hidden_layers"] = n
        kw["first_k_dense_replace"] = min(cfg.first_k_dense_replace, max(n - 1, 0))
    if _positive("--experts", experts) is not None:
        e = check_int(experts, "--experts", low=2, expected=">= 2 (the router takes the top-2 per group)")
        g = next(g for g in range(min(cfg.n_group, e // 2), 0, -1) if e % g == 0 and e // g >= 2)
        tg = min(cfg.topk_group, max(1, g // 2)) if g > 1 else 1
        k = min(cfg.num_experts_per_tok, tg * (e // g), max(1, e // 2))
        kw.update(num_experts=e, n_group=g, topk_group=tg, num_experts_per_tok=k)
    if _positive("--vocab", vocab) is not None:
        kw["vocab_size"] = check_int(vocab, "--vocab", low=4, expected=">= 4")
        eos = [i if i < vocab else vocab - 1 for i in cfg.eos_token_id]
        kw["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        if cfg.pad_token_id is not None and cfg.pad_token_id >= vocab:
            kw["pad_token_id"] = vocab - 2
        if cfg.bos_token_id is not None and cfg.bos_token_id >= vocab:
            kw["bos_token_id"] = vocab - 3
    if _positive("--hidden", hidden) is not None:
        kw["hidden_size"] = hidden
    return cfg.replace(**kw) if kw else cfg


def run(args) -> int:
    from ling_jax.checkpoint.writer import write_checkpoint
    from ling_jax.commands.common import check_output_path

    try:
        fp8_layout = L.check_fp8_layout(args.fp8_layout)
    except ValueError:
        raise ValueError(f"unknown --fp8-layout {args.fp8_layout!r} (expected A or B)") from None
    try:
        conv_dtype = L.check_conv_dtype(args.conv_dtype)
    except ValueError:
        raise ValueError(f"unknown --conv-dtype {args.conv_dtype!r} (expected BF16 or F32)") from None
    check_output_path(args.out, [args.config])  # also with --force
    cfg = apply_overrides(LingConfig.from_json(args.config), args.layers, args.experts, args.vocab, args.hidden)
    _positive("--shards", args.shards)
    tokenizer = not args.no_tokenizer
    if tokenizer and cfg.vocab_size < 270:
        print(f"note: vocab_size={cfg.vocab_size} is too small for a byte-level tokenizer; writing none "
              "(use --input-ids with this checkpoint)", file=sys.stderr)
        tokenizer = False
    s = write_checkpoint(cfg, args.out, dtype=args.dtype, seed=args.seed, num_shards=args.shards,
                         header_only=args.header_only, tokenizer=tokenizer, include_mtp=not args.no_mtp,
                         overwrite=args.force, progress=not args.quiet and sys.stderr.isatty(),
                         fp8_layout=fp8_layout, conv_dtype=conv_dtype, experts=args.expert_format)
    kind = "header-only " if s["header_only"] else ""
    if s["experts"]:
        kind += f"{s['experts']}-expert "
    fmt = f"layout {s['fp8_layout']}, " if s["fp8_layout"] else ""
    print(f"wrote {kind}{s['dtype']} checkpoint {s['out_dir']}: {s['num_tensors']} tensors, "
          f"{s['total_size']:,} tensor bytes in {s['num_shards']} shards ({fmt}conv taps {s['conv_dtype']})")
    return 0
