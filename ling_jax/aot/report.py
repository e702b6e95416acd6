"""`ling-jax aot`'s report: build the shape-only model and programs, compile each, read the compiler.

The report (`--json`, the contract checked from outside): {"target", "mesh": {axis: size}, "devices",
"hbm_bytes" (per device), "programs": [{"name", "argument_bytes", "output_bytes", "temp_bytes",
"alias_bytes", "total_bytes", "plan_bytes", "collectives": {kind: {"count", "bytes"}}, "flops",
"bytes_accessed", "roofline_seconds", "compile_seconds", "copies": {"count", "bytes", "per_step_bytes",
"largest"} (`analysis.copies`: the relayouts and copies of at least 1 MiB a call runs), ...}]}, every
byte figure per device.
"""
from __future__ import annotations

import os
import time

from ling_jax import accounting as A
from ling_jax.aot.analysis import analyse
from ling_jax.aot.targets import resolve_target

GIB = 1 << 30


def _config_path(path: str) -> str:
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def plan_arguments(cfg, weights: str, mesh_shape: dict, include_mtp: bool, kv_cache_dtype: str = "auto"):
    """plan(kind, ...) -> `ling-jax plan`'s per-device bytes of a program's arguments (jit drops the
    arguments a program does not read, so each kind counts what its program reads):
      "weights":  the resident weights (`accounting.resident_bytes_per_device`), without the MTP layer's
                  unless `mtp` (the cache-free forward and plain `generate` never read it);
      "engine":   + the page pool (pages x page_size x MLA bytes per token, main layers and MTP, replicated)
                  + max_slots KDA and conv states (split by head over `model`) [+ the snapshot rows, as many
                  KDA states, for the programs that take them]; "pools": the same without the weights (the
                  snapshot copy programs);
      "generate": + batch x max_len tokens of MLA cache + batch KDA states.
    Left out (small; the difference the report shows): the hidden rows, the token statistics and the step
    inputs."""
    kv = "fp8" if kv_cache_dtype == "fp8" else "bf16"  # the MLA cache bytes per token (`--kv-cache-dtype`)
    full = A.plan(cfg, weights, mesh_shape, include_mtp=include_mtp, kv_cache_dtype=kv)
    main_only = A.plan(cfg, weights, mesh_shape, include_mtp=False) if include_mtp else full
    kda = full["kda_state_bytes_per_sequence_per_device"] + full["kda_conv_state_bytes_per_sequence_per_device"]

    def plan(kind: str, eng=None, snapshots: bool = False, batch: int = 0, max_len: int = 0, mtp: bool = True) -> int:
        resident = (full if mtp else main_only)["resident_bytes_per_device"]
        if kind == "weights":
            return resident
        if kind in ("engine", "pools"):
            s = eng.sizes
            per_tok = full["mla_cache_bytes_per_token_main"] + (full["mla_cache_bytes_per_token_mtp"] if s.with_mtp else 0)
            if s.kpe_stored:  # k_pe rows padded as stored (ExecConfig.pool_layout "token_rows" on TPU; bf16 pages)
                n_mla = sum(t == "mla" for t in cfg.layer_types) + (1 if s.with_mtp else 0)
                per_tok += (s.kpe_stored - cfg.qk_rope_head_dim) * 2 * n_mla
            rows = eng.runner.snapshots.rows if (snapshots and eng.runner.snapshots is not None) else 0
            pools = s.num_pages * s.page_size * per_tok + (s.max_slots + rows) * kda
            return pools + (resident if kind == "engine" else 0)
        per_tok = full["mla_cache_bytes_per_token_main"] + (full["mla_cache_bytes_per_token_mtp"] if mtp else 0)
        return resident + batch * (max_len * per_tok + kda)
    return plan


def _compile(prog, target, progress, i: int, n: int) -> dict:
    if progress is not None:
        print(f"[{i}/{n}] compiling {prog.name} for {target.name} ...", file=progress, flush=True)
    t = time.perf_counter()
    r = {"name": prog.name, "family": prog.family, "plan_bytes": prog.plan_bytes}
    try:
        compiled = prog.lower().compile()
    except Exception as e:  # the compiler's refusal (out of memory, a kernel it rejects): its own words
        text = str(e).strip()
        line = next((ln for ln in text.splitlines() if "exceeds" in ln or "RESOURCE_EXHAUSTED" in ln),
                    text.splitlines()[0] if text else type(e).__name__)
        r.update(error=line.strip(), error_detail=text.splitlines()[:40],
                 compile_seconds=round(time.perf_counter() - t, 2))
        if progress is not None:
            print(f"[{i}/{n}] {prog.name}: does not compile ({r['compile_seconds']} s): {r['error']}", file=progress,
                  flush=True)
        return r
    r["compile_seconds"] = round(time.perf_counter() - t, 2)
    r.update(analyse(compiled, target.platform, target.spec.hbm_bandwidth, target.spec.peak_flops, prog.tokens))
    r["fits"] = r["total_bytes"] <= target.spec.hbm_bytes
    if not r["fits"]:
        r["error"] = (f"needs {r['total_bytes'] / GIB:.2f} GiB per device (temp {r['temp_bytes'] / GIB:.2f} GiB), "
                      f"the target has {target.spec.hbm_bytes / GIB:.2f} GiB of HBM")
    if progress is not None:
        print(f"[{i}/{n}] {prog.name}: {r['compile_seconds']} s, total {r['total_bytes'] / GIB:.3f} GiB per device "
              f"(temp {r['temp_bytes'] / GIB:.3f})", file=progress, flush=True)
    return r


def aot_report(args, progress=None) -> dict:
    """Everything `ling-jax aot` prints (see the module doc), for parsed CLI `args`."""
    from sharding.mesh import make_mesh, parse_mesh_shape

    from ling_jax.aot.abstract import placed_abstract_model
    from ling_jax.aot.programs import ENGINE_FAMILIES, engine_programs, forward_program, generate_programs, parse_families
    from ling_jax.commands.common import ArgumentValueError
    from ling_jax.commands.engine_args import check_engine_args, engine_options, plan_engine_memory, prefill_policy
    from ling_jax.config import LingConfig

    weights = str(args.weights).lower()
    if weights not in A.FORMATS:
        raise ArgumentValueError(f"--weights: expected one of {', '.join(A.FORMATS)}, got {args.weights!r}")
    families = parse_families(args.programs)
    if "verify" in families and not args.speculative:
        raise ArgumentValueError("--programs verify: needs --speculative K (the verify program replaces decode)")
    cfg = LingConfig.from_json(_config_path(args.config))
    target = resolve_target(args.target)
    n = len(target.devices)
    shape = parse_mesh_shape(args.mesh if args.mesh else f"expert={n}", n)
    if shape["data"] * shape["expert"] * shape["model"] != n:
        raise ArgumentValueError(f"--mesh: {shape} has {shape['data'] * shape['expert'] * shape['model']} devices, "
                                 f"the target {args.target} has {n}")
    mesh = make_mesh(shape, target.devices)
    with_mtp = not args.no_mtp and cfg.has_mtp
    t = time.perf_counter()
    model = placed_abstract_model(cfg, weights, mesh, target.platform, with_mtp=with_mtp)
    kv = getattr(args, "kv_cache_dtype", "auto")
    plan = plan_arguments(cfg, weights, shape, with_mtp, kv)
    programs = []
    if "forward" in families:
        programs.append(forward_program(model, mesh, args.forward_tokens, plan))
    engine_fams = [f for f in families if f in ENGINE_FAMILIES]
    memory = None
    if engine_fams or any(f.startswith("generate") for f in families):
        prefill_policy(args, target.platform)  # the target's default policy, not this host's
        check_engine_args(args, model)
        memory, _ = plan_engine_memory(args, model)
    if any(f.startswith("generate") for f in families):
        programs += generate_programs(model, mesh, families, batch=args.max_slots, prompt=args.prefill_chunk,
                                      max_len=memory["max_seq_len"], speculative=args.speculative, plan=plan,
                                      kv_cache_dtype=kv)
    if engine_fams:
        fams = set(engine_fams) | ({"decode"} if "verify" in engine_fams else set())
        programs += engine_programs(model, fams, plan=plan, shapes=args.shapes, rows=args.decode_rows,
                                    max_slots=args.max_slots,
                                    page_size=args.page_size, **memory,
                                    **engine_options(args, target.platform))
    build_s = time.perf_counter() - t
    results = [_compile(p, target, progress, i + 1, len(programs)) for i, p in enumerate(programs)]
    return {"target": target.name, "platform": target.platform, "device_kind": target.device_kind,
            "mesh": {k: int(v) for k, v in shape.items()}, "devices": n, "hbm_bytes": target.spec.hbm_bytes,
            "hbm_bandwidth": target.spec.hbm_bandwidth, "peak_flops": target.spec.peak_flops,
            "config": os.path.abspath(_config_path(args.config)), "weights": weights,
            "engine": None if memory is None else {"max_slots": args.max_slots, "page_size": args.page_size,
                                                   "num_pages": memory["num_pages"],
                                                   "max_seq_len": memory["max_seq_len"],
                                                   "prefill_chunk": args.prefill_chunk,
                                                   "speculative": args.speculative},
            "build_seconds": round(build_s, 2), "programs": results}


def _copies_text(c: dict | None) -> str:
    if not c:
        return ""
    return f"; copies >= 1 MiB: {c['count']} ({c['per_step_bytes'] / 2**20:.1f} MiB)"


def format_text(r: dict) -> str:
    g = lambda b: "-" if b is None else f"{b / GIB:8.3f}"  # noqa: E731
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [f"target {r['target']} ({r['devices']} x {r['device_kind']}, {r['hbm_bytes'] / GIB:.2f} GiB HBM and "
             f"{r['hbm_bandwidth'] / 1e12:.2f} TB/s per device), mesh {mesh}, weights {r['weights']}",
             f"{'program':28s} {'args':>8s} {'plan':>8s} {'temp':>8s} {'out-al':>8s} {'total':>8s}  GiB/device   "
             f"{'roofline':>10s} {'tok/s':>10s} {'compile':>8s}  collectives"]
    for p in r["programs"]:
        if "argument_bytes" not in p:
            lines.append(f"{p['name']:28s} DOES NOT COMPILE ({p['compile_seconds']} s): {p['error']}")
            continue
        coll = ", ".join(f"{k} {v['per_step_count']}/call at {v['count']} sites ({v['per_step_bytes'] / 2**20:.1f} MiB"
                         + (f", {v['per_step_bytes_in_branches'] / 2**20:.1f} in branches)"
                            if v.get("per_step_bytes_in_branches") else ")")
                         for k, v in p["collectives"].items()) or "none"
        rt = p["roofline_seconds"]
        lines.append(f"{p['name']:28s} {g(p['argument_bytes'])} {g(p['plan_bytes'])} {g(p['temp_bytes'])} "
                     f"{g(p['output_bytes'] - p['alias_bytes'])} {g(p['total_bytes'])}              "
                     f"{rt * 1e3:8.3f}ms {p['roofline_tokens_per_second'] or 0:10.1f} {p['compile_seconds']:7.1f}s  {coll}"
                     + _copies_text(p.get("copies"))
                     + ("" if p["fits"] else "  -- DOES NOT FIT"))
    return "\n".join(lines)
