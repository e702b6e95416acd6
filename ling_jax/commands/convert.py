"""`ling-jax convert`: HF release checkpoint → ling-jax Orbax checkpoint of the sharded parameters.

    ling-jax convert --checkpoint DIR --out DIR2 [--keep-quantized] [--mesh SPEC] [--dtype bfloat16|float32]
                     [--no-mtp] [--force] [--quiet] [--coordinator H:P --num-processes N --process-id I]

The output holds one Orbax checkpoint per layer group plus copies of config.json / tokenizer files
and a `ling_jax_orbax.json` marker; it is written into `.DIR2.converting` and renamed only when
complete. Load it (or the HF directory itself) with `ling_jax.loader.load_model(path, mesh=...)`, on
any mesh. Multi-host: run the same command on every host (flags or JAX_* env vars); process 0 writes
the side files and the marker, every process writes its own parameter blocks (shared filesystem).
"""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("convert", help="convert an HF checkpoint into a (sharded) Orbax checkpoint",
                       description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="HF checkpoint directory (release layout)")
    p.add_argument("--out", required=True, metavar="DIR2", help="output directory (must not exist unless --force)")
    p.add_argument("--keep-quantized", "--keep-fp8", dest="keep_quantized", action="store_true",
                   help="store every FP8-stored matrix as float8_e4m3fn + scales and MXFP4 routed experts as "
                        "packed codes + E8M0 scales (dequantised inside the matmul; --keep-fp8: an alias)")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="mesh the parameters are built on while converting, e.g. expert=8 (default: all "
                        "devices on expert); the result can be restored onto any mesh")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="storage dtype of the parameters not kept FP8 (default bfloat16)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from ling_jax.commands.common import add_value_check_flag
    add_value_check_flag(p)
    from sharding.distributed import add_distributed_args
    add_distributed_args(p)
    return p


def run(args) -> int:
    import sys

    import sharding
    from ling_jax.convert import convert
    from sharding.distributed import init_from_args, primary_print

    from ling_jax.commands.common import apply_value_check_flag, check_output_path

    check_output_path(args.out, [args.checkpoint])  # also with --force: replacing --out must not delete the input
    apply_value_check_flag(args)
    init_from_args(args)
    mesh = sharding.parse_mesh(args.mesh)
    meta = convert(args.checkpoint, args.out, mesh, dtype=args.dtype, keep_quantized=args.keep_quantized,
                   with_mtp=not args.no_mtp, overwrite=args.force, progress=not args.quiet and sys.stderr.isatty())
    n = len(meta["params"])
    primary_print(f"converted {args.checkpoint} -> {args.out}: {n} parameters in {len(meta['groups'])} groups, "
                  f"dtype {meta['dtype']}{', quantised weights kept as stored' if meta['keep_fp8'] else ''}, "
                  f"mesh {meta['mesh']}, {meta['seconds']:.1f}s")
    return 0
