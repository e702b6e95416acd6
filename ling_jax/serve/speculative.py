"""The engine's speculative decode program: one `speculation.speculative_round` over the decoding
slots, read from and written back to the page pools.

One call advances every decoding slot by 1 … K+1 tokens (drafting, verification, acceptance and
rollback: `ling_jax.speculation`, shared with `generate`). Row b verifies `n_valid[b] - 1` drafts
(k_b ≤ K; 0 for an idle row, n_valid = 0): the host cuts k_b so that the verify never writes past
the pages it holds and never emits past max_tokens (`Scheduler.drafts_for`). A row's random
streams depend only on its seed and token index (`RowSampling.n_gen`), so a sampled request draws
the same tokens alone, in any batch, after a preemption, and as `generate` row with that seed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.checks import check_int
from ling_jax.exec_config import ExecConfig
from ling_jax.placement import logits_sharding
from ling_jax.rows import put_rows, take_rows
from ling_jax.serve.pools import Pools, as_cache, pin_pools, with_cache
from ling_jax.serve.step import StepInputs, gathers_rows, row_logprobs
from ling_jax.speculation import MAX_SPECULATIVE, speculative_round

__all__ = ["MAX_SPECULATIVE", "make_spec_fn"]


def _spec(graphdef, params, pools: Pools, inp: StepInputs, ex: ExecConfig, k: int):
    """(pools, emitted [S, k+1] int32, n_emitted [S] int32): see the module docstring.
    inp.ids [S, 1] = each row's pending token; inp.n_valid [S] = 1 + drafts to verify (0 idle).
    S rows: every slot in place (S = max_slots), or the slots `inp.rows` gathered (`step.py`)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    S = inp.ids.shape[0]
    rows = inp.rows if gathers_rows(pools, inp) else None
    cache = as_cache(cfg, pools, inp.block_table, inp.lengths, rows, jnp.zeros((S,), bool))
    prev_hidden = pools.hidden if rows is None else take_rows(pools.hidden, rows)
    r = speculative_round(model, cache, inp.ids[:, 0], prev_hidden, jnp.maximum(inp.n_valid - 1, 0),
                          inp.n_valid > 0, inp.sampling, k, ex)
    hidden = r.hidden.astype(pools.hidden.dtype)
    if rows is not None:
        hidden = put_rows(pools.hidden, rows, hidden)
    new_pools = with_cache(cfg, pools, r.cache, rows)
    # emitted token j was drawn at verify position j: its logprobs are that position's (the model's
    # raw distribution, as plain decoding reports them), for every position of a row that asked
    s = inp.sampling
    wanted = None if s.logprobs is None else jnp.repeat(s.logprobs, k + 1)
    lp = row_logprobs(r.logits.reshape(S * (k + 1), -1), r.emitted.reshape(-1), wanted, logits_sharding(model))
    lp = tuple(x.reshape((S, k + 1) + x.shape[1:]) for x in lp)
    return new_pools._replace(hidden=hidden), r.emitted, r.n_emitted, lp


def make_spec_fn(graphdef, ex: ExecConfig, k: int, pool_sharding=None):
    """Jitted `(params, pools, StepInputs) -> (pools, emitted [R, k+1], n_emitted [R], logprobs)`,
    pools donated; logprobs: `step.row_logprobs`' triple per verify position ([R, k+1], [R, k+1, N] x2); one program per row bucket and block-table width (like decode). k: drafts per step
    (1 … MAX_SPECULATIVE). pool_sharding: the pools' shardings, fixed as the output's (see
    `step.make_step_fns`)."""
    check_int(k, "speculative drafts", field="speculative", low=1, high=MAX_SPECULATIVE)
    return jax.jit(lambda params, pools, inp: _spec(graphdef, params, pools, inp, ex, k), donate_argnums=(1,),
                   out_shardings=(pool_sharding, None, None, None), **pin_pools(pool_sharding, 3))
