"""`ling-jax aot`: compile the model's and the engine's programs for a TPU pod or NVIDIA nodes on this host.

    ling-jax aot --config FILE --weights bf16|fp8|mxfp4 --target NAME [--mesh SPEC]
                 [--programs forward,generate-prefill,generate-decode,decode,verify,prefill,snapshot|all]
                 [--shapes largest|all] [engine flags: --max-slots --page-size --max-seq-len --prefill-chunk
                 --cache-memory GIB (required: no device to size it from) --speculative K
                 --prefix-cache-memory GIB --no-prefix-cache] [--forward-tokens N] [--json]

Nothing is read or allocated: the parameters are the loader's shape-only model in the release's stored
dtypes (FP8 / MXFP4 kept resident) placed by the loader's rules on compile-only devices of the target,
the pools are the engine's placed by its rules, and each program is the one `load_model` + `Engine` (or
`generate`, `forward`) would run, with the target's platform in every kernel call and execution choice
(`ExecConfig.for_backend(target platform, cfg)`). The target's compiler compiles it: libtpu for TPU
(Pallas through Mosaic), XLA:GPU for NVIDIA (Pallas through Triton, PTX for sm_90).

Targets: any libtpu topology name (`v5e:2x2`, `v5p:4x4x4` = 64 chips, `v6e:8x8`, `tpu7x:2x2x1` = 4
chips / 8 devices); `h100x8`, `h200x8` (one 8-GPU node) and `h200x8:N` (N nodes). Install the
compile-only compilers with `pip install -e ".[aot]"` (libtpu, the CUDA 12 plugin and ptxas).

Per program, per device: the compiler's argument / output / temp / alias bytes and total (argument +
output - alias + temp) against the target's HBM; `plan_bytes`, `ling-jax plan`'s arithmetic for the
arguments (resident weights + the pools or cache), beside the compiler's argument bytes; the
collectives of the optimised HLO (count and result bytes per kind); its copies and relayouts of at least
1 MiB (count, bytes, the largest with their shapes and operands: a pool or weight stack relaid out every
call shows here); flops and bytes accessed (TPU: the
compiler's cost analysis; GPU: XLA's HLO cost analysis of the optimised module); the roofline time of
one call, max(bytes accessed / HBM bandwidth, flops / bf16 peak), the compiler's own estimate on TPU,
and the tokens/s the roofline implies. A program that does not fit is reported with the compiler's
out-of-memory text; the command then exits 3.
"""
from __future__ import annotations

import argparse
import os
import sys

from ling_jax.commands.common import ArgumentValueError, positive_int, print_report

# libtpu reads these at load: without them it warns about TPU_* variables a compile-only host lacks, and
# its lockfile (one process per TPU host) would refuse a second compile-only process that has no TPU to share
_TPU_ENV = {"TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3", "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_WORKER_ID": "0", "TPU_SKIP_MDS_QUERY": "1", "GRPC_VERBOSITY": "ERROR",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
EXIT_DOES_NOT_FIT = 3


def add_parser(subparsers):
    from ling_jax.commands.engine_args import add_engine_flags
    p = subparsers.add_parser("aot", help="compile every program for a TPU / GPU target on this host (memory, "
                                          "collectives, roofline)",
                              description=__doc__.split("\n\n", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE", help="config.json (or a checkpoint directory holding one)")
    p.add_argument("--weights", required=True, metavar="FORMAT",
                   help="stored weights: bf16, fp8 (the release: FP8 kept resident) or mxfp4 (experts MXFP4)")
    p.add_argument("--target", required=True, metavar="NAME",
                   help="libtpu topology (v5e:2x2, v5p:4x4x4, v6e:8x8, tpu7x:2x2x1, ...), h100x8, h200x8 or h200x8:N")
    p.add_argument("--mesh", metavar="SPEC", default=None,
                   help="mesh axes over the target's devices, e.g. expert=8 or expert=16,model=4 (default: "
                        "expert = every device)")
    p.add_argument("--programs", default="decode", metavar="LIST",
                   help="comma list of forward, generate-prefill, generate-decode, decode, verify, prefill, "
                        "snapshot, or all (default decode)")
    p.add_argument("--shapes", choices=("largest", "all"), default="largest",
                   help="the engine's programs at their largest shape only (default), or every row bucket x width "
                        "and token bucket warmup() compiles")
    p.add_argument("--decode-rows", type=_rows, default=None, metavar="R,R,...",
                   help="decode / verify row buckets to compile (e.g. 1,8,64; default: the engine's largest, "
                        "--max-slots)")
    p.add_argument("--forward-tokens", type=positive_int, default=1, metavar="N", help="tokens of the forward program")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_flags(p)
    return p


def _rows(text: str) -> tuple:
    try:
        rows = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of row counts, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected row counts >= 1, got {text!r}")
    return rows


def run(args) -> int:
    for k, v in _TPU_ENV.items():
        os.environ.setdefault(k, v)
    import jax
    jax.config.update("jax_platforms", "cpu")  # the host's own backend; the target's devices are compile-only
    # A compile-only client cannot load executables (jax 0.10.2: "PjRtCompiler must be constructed with a
    # Client to call DeserializeLoadedExecutable"), so JAX's persistent cache would only write entries of
    # tens of MB that no later run can read: it is off for this command.
    jax.config.update("jax_enable_compilation_cache", False)

    from ling_jax.aot.report import aot_report, format_text
    if args.cache_memory is None and any(f in args.programs for f in ("decode", "verify", "prefill", "snapshot", "all")):
        raise ArgumentValueError("--cache-memory: required for the engine's programs (a compile-only target has no "
                                 "free memory to size the pools from); e.g. --cache-memory 8")
    if args.decode_rows and max(args.decode_rows) > args.max_slots:
        raise ArgumentValueError(f"--decode-rows: {max(args.decode_rows)} rows exceed --max-slots {args.max_slots}")
    report = aot_report(args, progress=sys.stderr)
    print_report(report, args.json, format_text)
    if any(p.get("error") for p in report["programs"]):
        bad = next(p for p in report["programs"] if p.get("error"))
        print(f"error: {bad['name']} does not compile for {report['target']}: {bad['error']}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0

