"""`ling-jax export`: trained parameters (Orbax train state or a checkpoint) → release-layout checkpoint."""
from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser("export", help="write parameters as a release-layout checkpoint (FP8 blocks or BF16)")
    p.add_argument("--params", required=True,
                   help="Orbax train directory (`ling-jax train --out DIR`: DIR, DIR/orbax or a step dir) "
                        "or a checkpoint directory")
    p.add_argument("--out", required=True, help="output checkpoint directory (written atomically)")
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8",
                   help="fp8: quantizable matrices FP8 E4M3 + 128x128 block scales (release); bf16: no quantization")
    p.add_argument("--step", type=int, default=None, help="Orbax step to export (default: latest)")
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json to copy (default: found next to --params)")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    p.add_argument("--num-shards", type=int, default=None, help="number of safetensors shards")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def run(args) -> int:
    from ling_jax.commands.common import check_output_path
    from ling_jax.export import export_checkpoint, find_tokenizer, load_source

    tok = args.tokenizer if args.tokenizer is not None else find_tokenizer(args.params)
    check_output_path(args.out, [args.params, tok])  # also with --overwrite
    model = load_source(args.params, step=args.step)
    summary = export_checkpoint(model, args.out, dtype=args.dtype, tokenizer_dir=tok, num_shards=args.num_shards,
                                overwrite=args.overwrite, include_mtp=(False if args.no_mtp else None),
                                progress=not args.json)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {summary['out_dir']}: {summary['num_tensors']} tensors, {summary['total_size']} bytes, "
              f"{summary['num_shards']} shards, {summary['dtype']}"
              + (f", tokenizer ({', '.join(summary['tokenizer_files'])})" if summary["tokenizer_files"] else ""))
    return 0
