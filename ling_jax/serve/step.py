"""The engine's compiled programs: a prefill chunk over a few slot rows, a decode step over the
decoding slots, and with speculation the verify step in decode's place.

Each is a pure function `(params, pools, inputs) -> (pools, tokens, ...)` with the pools donated,
so the page pools are updated in place. Why prefill apart from decode: decode feeds one token per
slot through the token-by-token KDA recurrence, prefill up to a chunk of a few rows through the
chunked scan; fused into one [slots, chunk] batch every decoding row would pay for a whole chunk.
A program with fewer rows than slots gathers its rows' KDA states, hidden and token statistics
(`rows` [R] = each row's slot, max_slots = padding) and scatters them back; one with R = max_slots
runs every slot in place. A decode on XLA:CPU leaves the KDA states in the slot pool whatever its
rows (the native kernel updates them where they lie, `kda.SlotKDAState`). A row with n_valid = 0
changes nothing: its KDA state passes through, its latents are never written
(`mla.paged_write` drops them). The verify program is one `speculation.speculative_round` over
the slots' pages (row b verifies `n_valid[b] - 1` drafts, cut by `Scheduler.drafts_for` so it
never writes past its pages nor emits past max_tokens).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.call_mode import CallMode
from ling_jax.exec_config import ExecConfig
from ling_jax.kda import conv_like, kda_in_place
from ling_jax.placement import logits_sharding, model_mesh
from ling_jax.rows import put_rows, take_last, take_rows
from ling_jax.sampling import MAX_LOGPROBS, RowSampling, token_logprobs
from ling_jax.token_stats import penalize_rows, update_rows
from ling_jax.serve.pools import Pools, as_cache, pin_pools, with_cache
from ling_jax.speculation import speculative_round


class StepInputs(NamedTuple):
    """One call's inputs: rows [R] each row's slot (max_slots = padding), ids [R,T] int32 right-padded,
    n_valid [R] real tokens, lengths [R] tokens already cached, block_table [R, W], sampling;
    snap_rows (a prefill with a prefix cache) [R, T // interval] int32: the snapshot row taking row
    r's state after (j+1)·interval of its tokens (past the pool = none)."""
    rows: jax.Array
    ids: jax.Array
    n_valid: jax.Array
    lengths: jax.Array
    block_table: jax.Array
    sampling: RowSampling
    snap_rows: jax.Array | None = None


def _save_boundaries(snaps, bounds: dict, hidden, snap_rows, interval: int):
    """The snapshot rows `snap_rows` [R, J] := the KDA states after (j+1)·interval tokens of each row
    (`bounds`: the model's `kda_boundary_states`, KDAState [repeats, n, R, J, ...] per KDA run) and
    the hidden there (hidden [R, T, D] at position (j+1)·interval - 1). Rows past the pool are dropped.
    snaps: a `snapshots.Snapshots` (layers per block per run, hidden [rows, D])."""
    R, J = snap_rows.shape
    idx = snap_rows.reshape(-1)

    def put(dst, src):  # dst [m, n, rows, ...] <- src [m, n, R, J, ...]
        flat = src.reshape(src.shape[:2] + (R * J,) + src.shape[4:])
        return put_rows(dst, idx, flat, axis=2)

    layers = tuple(tuple(None if s is None else jax.tree.map(put, s, conv_like(bounds[(b, r)], s))
                         for r, s in enumerate(sb)) for b, sb in enumerate(snaps.layers))
    h = hidden[:, interval - 1::interval][:, :J].reshape(R * J, -1)
    return snaps._replace(layers=layers, hidden=put_rows(snaps.hidden, idx, h))


def _slot_view(model, pools: Pools, inp: StepInputs, gather_rows: bool, fresh, in_place: bool = False):
    """(rows, or None for every slot in place; the rows' cache (`pools.as_cache`); their last hidden)."""
    rows = inp.rows if gather_rows else None
    cache = as_cache(model.cfg, pools, inp.block_table, inp.lengths, rows, fresh, in_place)
    return rows, cache, (take_rows(pools.hidden, rows) if gather_rows else pools.hidden)


def _write_back(model, pools: Pools, cache, rows, hidden) -> Pools:
    """The pools after a call: its cache's rows (`pools.with_cache`) and each row's last hidden."""
    hidden = hidden.astype(pools.hidden.dtype) if rows is None else put_rows(pools.hidden, rows, hidden)
    return with_cache(model.cfg, pools, cache, rows)._replace(hidden=hidden)


def _run(graphdef, params, pools: Pools, inp: StepInputs, ex: ExecConfig, mode: CallMode, gather_rows: bool,
         snaps=None):
    model = nnx.merge(graphdef, params)
    fresh = (inp.lengths == 0) & (inp.n_valid > 0)  # a new sequence, maybe in a reused slot
    # a decode's KDA states stay in the slot pool, updated there by the native kernel (no gather of
    # the rows' states and no scatter back: `kda.kda_in_place`; a model on a mesh keeps the gather)
    in_place = kda_in_place(ex, mode, jnp.float32) and model_mesh(model) is None
    rows, cache, prev_hidden = _slot_view(model, pools, inp, gather_rows, fresh, in_place)
    out = model(inp.ids, cache, inp.n_valid, exec=ex, mode=mode)
    new_cache = out["cache"]
    if pools.mtp is not None:
        new_cache = new_cache._replace(mtp=model.mtp_fill(cache.mtp, inp.ids, out["hidden"], prev_hidden,
                                                          inp.lengths, inp.n_valid, ex))
    hid = take_last(out["hidden"], inp.n_valid)
    logits = model.logits(hid, ex)
    s = inp.sampling
    stats, x, vocab_sharding = pools.stats, logits, logits_sharding(model)
    if stats is not None and s.prompt_len is not None:
        rs = jax.tree.map(lambda x: take_rows(x, inp.rows), stats) if gather_rows else stats
        rs = update_rows(rs, inp.ids, inp.n_valid, inp.lengths, s.prompt_len, fresh, model_mesh(model))
        x = penalize_rows(logits, rs, s.presence, s.frequency, s.repetition)
        stats = jax.tree.map(lambda x, n: put_rows(x, inp.rows, n), stats, rs) if gather_rows else rs
    tok = s.draw(x, vocab_sharding=vocab_sharding)
    hid = jnp.where((inp.n_valid > 0)[:, None], hid, prev_hidden.astype(hid.dtype))
    lp = row_logprobs(logits, tok, s.logprobs, vocab_sharding)
    result = (_write_back(model, pools, new_cache, rows, hid)._replace(stats=stats), tok, lp)
    if snaps is None:
        return result
    if "kda_boundary_states" in out and inp.snap_rows is not None and inp.snap_rows.shape[1] > 0:
        snaps = _save_boundaries(snaps, out["kda_boundary_states"], out["hidden"], inp.snap_rows,
                                 mode.snapshot_every)
    return result + (snaps,)


def _verify(graphdef, params, pools: Pools, inp: StepInputs, ex: ExecConfig, k: int):
    """(pools, emitted [R, k+1] int32, n_emitted [R] int32, logprobs per verify position): one
    speculative round (module docstring). inp.ids [R, 1]: each row's pending token; inp.n_valid [R]:
    1 + drafts to verify (0 idle)."""
    model = nnx.merge(graphdef, params)
    R = inp.ids.shape[0]
    rows, cache, prev_hidden = _slot_view(model, pools, inp, gathers_rows(pools, inp), jnp.zeros((R,), bool))
    r = speculative_round(model, cache, inp.ids[:, 0], prev_hidden, jnp.maximum(inp.n_valid - 1, 0),
                          inp.n_valid > 0, inp.sampling, k, ex)
    # emitted token j was drawn at verify position j: its logprobs are that position's (the model's
    # raw distribution, as plain decoding reports them), for every position of a row that asked
    wanted = None if inp.sampling.logprobs is None else jnp.repeat(inp.sampling.logprobs, k + 1)
    lp = row_logprobs(r.logits.reshape(R * (k + 1), -1), r.emitted.reshape(-1), wanted, logits_sharding(model))
    return (_write_back(model, pools, r.cache, rows, r.hidden), r.emitted, r.n_emitted,
            tuple(x.reshape((R, k + 1) + x.shape[1:]) for x in lp))


def row_logprobs(logits, tok, wanted, vocab_sharding=None):
    """(sampled token's logprob [R], top ids [R, N], top logprobs [R, N]), N = min(MAX_LOGPROBS, V),
    of the raw distribution (`sampling.token_logprobs`): fixed shapes whatever N a row asked (the
    host keeps its N); zeros, skipping the softmax and top-k, when no row asked."""
    R, V = logits.shape
    n = min(MAX_LOGPROBS, V)
    zeros = lambda: (jnp.zeros((R,), jnp.float32), jnp.zeros((R, n), jnp.int32), jnp.zeros((R, n), jnp.float32))
    if wanted is None:
        return zeros()
    return jax.lax.cond(jnp.any(wanted), lambda: token_logprobs(logits, tok, n, vocab_sharding), zeros)


def gathers_rows(pools: Pools, inp: StepInputs) -> bool:
    """A decode-like program gathers its rows unless it has one row per slot (static shapes)."""
    return inp.rows.shape[0] != pools.hidden.shape[0]


def make_step_fns(graphdef, ex: ExecConfig, snapshot_interval: int = 0, snap_sharding=None, pool_sharding=None,
                  speculative: int = 0):
    """(prefill, decode, verify): jitted `(params, pools, StepInputs) -> (pools, tokens [R], logprobs)`
    (`row_logprobs`' triple), pools donated; verify (None when speculative = 0) `-> (pools, emitted
    [R, K+1], n_emitted [R], logprobs [R, K+1, ...])`. Each function object compiles once per new
    shape; `_cache_size()` counts them (the engine's compile bound). snapshot_interval > 0 (a prefix
    cache): prefill takes and returns the snapshot rows too, both donated, and writes the KDA states
    at every `snapshot_interval` tokens of a row into the rows `inp.snap_rows` names
    (`_save_boundaries`, `CallMode.snapshot_every`). snap_sharding / pool_sharding: the snapshot rows'
    and the pools' placement, fixed as the outputs': every program returning them must return one
    spelling of it, or the next call sees a new signature (P() vs P(None, None)) and compiles after
    warm-up; `Format`s ("token_rows") fix their layout too, read and written (`pools.pin_pools`)."""
    prefill_mode, decode_mode = CallMode.prefill(snapshot_interval), CallMode.decode(logits=False)
    pinned = dict(donate_argnums=(1,), **pin_pools(pool_sharding, 3))
    if snapshot_interval:
        prefill = jax.jit(lambda params, pools, inp, snaps: _run(graphdef, params, pools, inp, ex, prefill_mode, True, snaps),
                          donate_argnums=(1, 3), out_shardings=(pool_sharding, None, None, snap_sharding),
                          **pin_pools(pool_sharding, 4))
    else:
        prefill = jax.jit(lambda params, pools, inp: _run(graphdef, params, pools, inp, ex, prefill_mode, True),
                          out_shardings=(pool_sharding, None, None), **pinned)
    decode = jax.jit(lambda params, pools, inp: _run(graphdef, params, pools, inp, ex, decode_mode,
                                                     gathers_rows(pools, inp)),
                     out_shardings=(pool_sharding, None, None), **pinned)
    verify = None if not speculative else jax.jit(
        lambda params, pools, inp: _verify(graphdef, params, pools, inp, ex, speculative),
        out_shardings=(pool_sharding, None, None, None), **pinned)
    return prefill, decode, verify
