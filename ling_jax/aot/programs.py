"""The programs a compile-only run lowers: each is (name, jitted function, abstract arguments, tokens per step).

Families (`--programs`):
  forward          the cache-free forward of `ling_jax.forward` ([1, forward_tokens] tokens; `logits`)
  generate-prefill `generate.prefill` of a [batch, prefill_chunk] prompt into a cache of max_seq_len
  generate-decode  `generate.decode_loop` (one while loop; the compiler's cost is one step's)
  decode | verify  the engine's decode step ([R, 1]) or speculative verify ([R, K+1]) per row bucket R
                   and block-table width W
  prefill          the engine's prefill chunk ([R, T]) per row bucket R and token bucket T
  snapshot         the prefix cache's save / restore copy programs
The engine's programs come from `Engine.program_calls()` of an Engine built on the shape-only model,
so they are the ones `Engine.warmup()` compiles, with its padding inputs. `shapes="largest"` keeps the
largest row bucket and width (decode / verify) and row and token bucket (prefill): the memory bound.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import numpy as np
from flax import nnx

from ling_jax.aot.abstract import abstract_like, replicated
from ling_jax.forward import OUTPUTS
from ling_jax.generate import DecodeState, decode_loop, prefill
from ling_jax.model import init_cache
from ling_jax.placement import model_mesh
from ling_jax.sampling import SamplingParams
from ling_jax.serve.engine import Engine
from ling_jax.serve.pools import pool_shardings

FAMILIES = ("forward", "generate-prefill", "generate-decode", "decode", "verify", "prefill", "snapshot")
ENGINE_FAMILIES = ("decode", "verify", "prefill", "snapshot")


@dataclasses.dataclass
class Program:
    name: str
    family: str
    fn: Callable
    args: tuple
    kwargs: dict
    tokens: int          # tokens one call produces (decode rows) or feeds (prefill)
    plan_bytes: int      # `ling-jax plan`'s per-device arithmetic for the arguments (see `plan_arguments`)

    def lower(self):
        return self.fn.lower(*self.args, **self.kwargs)


def parse_families(spec: str) -> tuple[str, ...]:
    """`--programs` (comma list, or "all") -> families; ValueError naming the flag."""
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    if names == ["all"]:
        return FAMILIES
    bad = [n for n in names if n not in FAMILIES]
    if bad or not names:
        raise ValueError(f"--programs: unknown program {bad[0] if bad else spec!r} (expected a comma list of "
                         f"{', '.join(FAMILIES)}, or all)")
    return tuple(dict.fromkeys(names))


def _dims(name: str) -> dict:
    """{"R": 8, "W": 512} of a program name like `decode[R=8,W=512]`."""
    return {k: int(v) for k, v in re.findall(r"([A-Z])=(\d+)", name)}


def _largest(calls: list, per_rows: bool = False) -> list:
    """Per family (per family and row count R with `per_rows`), the call of the largest shape (the
    name's numbers compared in order)."""
    best: dict = {}
    for c in calls:
        fam = c[0].split("[")[0]
        if per_rows and fam in ("decode", "verify"):
            fam = (fam, _dims(c[0]).get("R"))
        key = tuple(int(x) for x in re.findall(r"=(\d+)", c[0]))
        if fam not in best or key > best[fam][0]:
            best[fam] = (key, c)
    return [v[1] for v in best.values()]


def _step_tokens(name: str, speculative: int) -> int:
    nums = _dims(name)
    if name.startswith("verify"):
        return nums["R"] * (speculative + 1)
    if name.startswith("decode"):
        return nums["R"]
    if name.startswith("prefill"):
        return nums.get("R", 1) * nums["T"]
    return 0


def engine_programs(model, families, *, plan: Callable, shapes: str = "largest", speculative: int = 0,
                    rows: tuple | None = None, **engine_kw) -> list[Program]:
    """The Engine's programs (see module doc) on the shape-only `model`. rows: only the decode / verify
    row buckets R in `rows` (each at its widest block table with shapes="largest")."""
    if rows:
        engine_kw["decode_rows"] = tuple(sorted(set(rows) | {engine_kw["max_slots"]}))
    eng = Engine(model, speculative=speculative, **engine_kw)
    mesh = model_mesh(model) or jax.tree.leaves(eng.runner.params)[0].sharding.mesh
    calls = eng.program_calls()
    calls = [c for c in calls if c[0].split("[")[0].split("-")[0] in families]
    if rows:
        calls = [c for c in calls if not c[0].startswith(("decode", "verify")) or _dims(c[0])["R"] in rows]
    if shapes == "largest":
        calls = _largest(calls, per_rows=bool(rows))
    out = []
    for name, fn, args in calls:
        fam = name.split("[")[0].split("-")[0]
        args = tuple(_abstract_inputs(a, mesh) for a in args)
        kind = "pools" if fam == "snapshot" else "engine"
        out.append(Program(name, fam, fn, args, {}, _step_tokens(name, speculative),
                           plan(kind, eng=eng, snapshots=fam in ("prefill", "snapshot"), mtp=eng.sizes.with_mtp)))
    return out


def _abstract_inputs(tree, mesh):
    """Host inputs (numpy / a StepInputs of numpy) -> replicated ShapeDtypeStructs; abstract leaves kept."""
    leaves = jax.tree.leaves(tree)
    if leaves and isinstance(leaves[0], jax.ShapeDtypeStruct):
        return tree
    return replicated(tree, mesh)


def forward_program(model, mesh, tokens: int, plan: Callable) -> Program:
    """`ling_jax.forward`'s cache-free program on [1, tokens] ids."""
    graphdef, params = nnx.split(model)
    ex = model.exec

    def fwd(params, ids, n_valid):
        out = nnx.merge(graphdef, params)(ids, n_valid=n_valid, mtp=False, exec=ex)
        return {k: out[k] for k in OUTPUTS if k in out}

    ids = replicated((np.zeros((1, tokens), np.int32), np.full((1,), tokens, np.int32)), mesh)
    return Program(f"forward[T={tokens}]", "forward", jax.jit(fwd), (params,) + ids, {}, tokens,
                   plan("weights", mtp=False))


def generate_programs(model, mesh, families, *, batch: int, prompt: int, max_len: int, speculative: int,
                      plan: Callable, kv_cache_dtype: str | None = None) -> list[Program]:
    """`generate.prefill` and `generate.decode_loop` at [batch, prompt] / [batch] over a max_len cache
    (the cache placed as the engine places its pools: KDA states split by head, the rest replicated)."""
    cfg = model.cfg
    graphdef, params = nnx.split(model)
    with_mtp = bool(speculative)
    make_cache = lambda: init_cache(cfg, batch, max_len, model.dtype, with_mtp=with_mtp,  # noqa: E731
                                    kv_cache_dtype=kv_cache_dtype)
    cache = abstract_like(make_cache, pool_shardings(cfg, jax.eval_shape(make_cache), mesh))
    rep = lambda tree: replicated(tree, mesh)  # noqa: E731
    out = []
    if "generate-prefill" in families:
        args = (graphdef, params, cache) + rep((np.zeros((batch, prompt), np.int32), np.zeros((batch,), np.int32),
                                                np.zeros((batch, cfg.hidden_size), model.dtype)))
        out.append(Program(f"generate-prefill[B={batch},T={prompt}]", "generate-prefill", prefill,
                           args, dict(sampling=SamplingParams(), with_mtp=with_mtp),
                           batch * prompt, plan("generate", batch=batch, max_len=max_len, mtp=with_mtp)))
    if "generate-decode" in families:
        B, W = batch, 16
        z = lambda *s, dt=np.int32: np.zeros(s, dt)  # noqa: E731
        small = rep((z(B), z(B, cfg.hidden_size, dt=model.dtype), z(B, dt=bool), z(B, W), z(B), z(B), z(B)))
        state = DecodeState(cache, small[0], small[1], small[2], small[3], small[4], small[5], small[6])
        out.append(Program(f"generate-decode[B={batch}]", "generate-decode", decode_loop,
                           (graphdef, params, state),
                           dict(sampling=SamplingParams(), stop_ids=tuple(cfg.eos_token_id),
                                max_new=rep(np.int32(W)), speculative=speculative),
                           batch, plan("generate", batch=batch, max_len=max_len, mtp=with_mtp)))
    return out
