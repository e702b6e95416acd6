"""The engine's speculative decode program: MTP drafts, one verify pass, per-slot acceptance and rollback.

One call advances every decoding slot by 1 … K+1 tokens:

1. **Draft** (MTP layer, token by token): draft j of row b pairs the row's last token with the
   hidden before it (j = 0: the pending token and the slot's `hidden`, the main model's true
   hidden; j ≥ 1: the previous draft and the MTP layer's own hidden, the recursion of
   `generate._spec_step`). Draft 0 also completes the MTP page slot that plain decoding would
   write for the pending token, so it runs for every decoding row, even one with no drafts.
2. **Verify**: [pending, d_1 … d_k] through the main model in one [max_slots, K+1] pass (the
   per-token KDA recurrence, returning every per-token KDA state and the raw conv inputs).
3. **Accept** per row: greedy rows keep the longest prefix of drafts equal to the target argmax
   plus the target's token after it (correction or bonus); sampled rows use
   `sampling.speculative_accept` with the row's own key (below).
4. **Roll back** per row to the accepted length a+1: KDA recurrent and conv states picked from
   the per-token states (`kda.kda_rollback`); MLA and MTP pages beyond the new length are left
   as they are (masked by length, overwritten by the next write at those positions); the MTP
   slots of the accepted drafts are re-written from the main model's true hidden states, so the
   MTP pages are exactly what plain decoding would have written; `hidden` = the main hidden at
   the last accepted token.

Row b verifies `n_valid[b] - 1` drafts (k_b ≤ K; 0 for an idle row, n_valid = 0): the host cuts
k_b so that the verify never writes past the pages it holds and never emits past max_tokens
(`Scheduler.drafts_for`). Drafts beyond k_b are computed (one shape for all rows) but never
written, verified or accepted.

Random streams of a sampled row whose round starts at token index n (its n-th generated token,
`RowSampling.n_gen`): base = fold_in(key(seed), n); draft j draws with fold_in(base, 1 + j), the
acceptance with fold_in(base, 0). So a request's draws depend only on its seed and token index
(and K and its own earlier tokens), never on its slot or neighbours.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.call_mode import VERIFY
from ling_jax.checks import check_int
from ling_jax.rows import put_rows, take_rows
from ling_jax.exec_config import ExecConfig
from ling_jax.layer_stack import roll_back_kda
from ling_jax.model import HybridCache
from ling_jax.sampling import (processed_logits_rows, request_keys, sample_rows, speculative_accept,
                               speculative_accept_greedy)
from ling_jax.serve.pools import Pools, as_cache, with_cache
from ling_jax.serve.step import StepInputs, gathers_rows, row_logprobs

#: The most drafts per verify step: what `generate` allows (the MTP layer is trained for the next
#: token; drafts further out come from its own recursion and are rarely accepted).
MAX_SPECULATIVE = 3


def _fold(keys: jax.Array, i: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)


def _row_probs(logits: jax.Array, s) -> jax.Array:
    """[R, V] the distribution each row samples from (its own temperature / top-k / top-p)."""
    return jax.nn.softmax(processed_logits_rows(logits, s.temperature, s.top_k, s.top_p), axis=-1)


def accept_rows(drafts, draft_logits, target_logits, n_drafts, sampling, keys):
    """Per-row acceptance of a verify step.

    drafts [R, K] int32; draft_logits [R, K, V] (the MTP logits each draft was drawn from);
    target_logits [R, K+1, V]; n_drafts [R] int32 in [0, K] (drafts of row b past n_drafts[b]
    are never accepted); sampling: RowSampling; keys [R]: the acceptance key of each row.
    Returns (accepted [R] int32 in [0, n_drafts], next token [R] int32): the row emits
    drafts[b, :accepted[b]] then next[b].

    Greedy rows (temperature 0): the longest prefix of drafts equal to the target argmax, and
    the argmax after it — what plain greedy decoding emits. Sampled rows: `speculative_accept`
    over the row's first n_drafts drafts (run once per possible count and picked per row, since
    the count is a static shape there), with draft and target distributions processed by the
    row's own parameters: the emitted tokens are distributed exactly as plain sampling.
    An all-greedy batch skips the sampled path (`lax.cond`)."""
    K = drafts.shape[1]
    greedy_a, _ = speculative_accept_greedy(drafts, target_logits)
    greedy_a = jnp.minimum(greedy_a, n_drafts)
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [R, K+1]
    greedy_next = jnp.take_along_axis(best, greedy_a[:, None], axis=1)[:, 0]
    is_greedy = sampling.temperature == 0.0

    def sampled():
        tp = jnp.stack([_row_probs(target_logits[:, t], sampling) for t in range(K + 1)], axis=1)
        qp = jnp.stack([_row_probs(draft_logits[:, t], sampling) for t in range(K)], axis=1)
        one = lambda d, q, p, key: tuple(x[0] for x in speculative_accept(d[None], q[None], p[None], key))
        a_s, n_s = greedy_a, greedy_next
        for k in range(K + 1):
            a_k, n_k = jax.vmap(one)(drafts[:, :k], qp[:, :k], tp[:, :k + 1], keys)
            pick = n_drafts == k
            a_s, n_s = jnp.where(pick, a_k, a_s), jnp.where(pick, n_k, n_s)
        return jnp.where(is_greedy, greedy_a, a_s), jnp.where(is_greedy, greedy_next, n_s)

    return jax.lax.cond(jnp.all(is_greedy), lambda: (greedy_a, greedy_next), sampled)


def _spec(graphdef, params, pools: Pools, inp: StepInputs, ex: ExecConfig, k: int):
    """(pools, emitted [S, k+1] int32, n_emitted [S] int32): see the module docstring.
    inp.ids [S, 1] = each row's pending token; inp.n_valid [S] = 1 + drafts to verify (0 idle).
    S rows: every slot in place (S = max_slots), or the slots `inp.rows` gathered (`step.py`)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    S = inp.ids.shape[0]
    rows = inp.rows if gathers_rows(pools, inp) else None
    active = inp.n_valid > 0
    n_drafts = jnp.maximum(inp.n_valid - 1, 0)
    P = inp.lengths
    cache = as_cache(cfg, pools, inp.block_table, P, rows, jnp.zeros((S,), bool))
    prev_hidden = pools.hidden if rows is None else take_rows(pools.hidden, rows)
    s = inp.sampling
    base = request_keys(s.seed, s.n_gen)
    # 1. drafts: MTP slot P-1+j pairs the j-th input token with the hidden before it. A scan over j,
    #    so the MTP layer is compiled once, not K times.
    def draft(carry, j):
        tok, h, mtp = carry
        write = jnp.where(j == 0, active, j < n_drafts)
        lg, zm, mtp = model.mtp_forward(tok[:, None], h[:, None], mtp, P - 1 + j, write.astype(jnp.int32), ex)
        lg = lg[:, 0]
        keys = jax.vmap(jax.random.fold_in)(base, jnp.broadcast_to(1 + j, (S,)))
        d = sample_rows(lg, keys, s.temperature, s.top_k, s.top_p)
        return (d, zm[:, 0].astype(h.dtype), mtp), (d, lg)

    (_, _, mtp), (drafts, draft_logits) = jax.lax.scan(draft, (inp.ids[:, 0], prev_hidden, cache.mtp),
                                                       jnp.arange(k))
    drafts, draft_logits = drafts.T, jnp.swapaxes(draft_logits, 0, 1)  # [S,k], [S,k,V]
    # 2. verify [pending, d_1..d_k], every per-token KDA state kept for the rollback
    feed = jnp.concatenate([inp.ids[:, :1], drafts], axis=1)
    out = model(feed, cache._replace(mtp=None), inp.n_valid, exec=ex, mode=VERIFY)
    # 3. accept per row
    a, nxt = accept_rows(drafts, draft_logits, out["logits"], n_drafts, s, _fold(base, 0))
    a = jnp.where(active, a, 0)
    adv = jnp.where(active, a + 1, 0)
    # 4. roll back: KDA to the accepted length; pages past it are masked by length
    layers = roll_back_kda(cfg, out["cache"].layers, out["kda_states"], adv)
    # MTP slots P..P+a-1: the accepted drafts with the main model's true hidden states
    _, _, mtp = model.mtp_forward(drafts, out["hidden"][:, :k], mtp, P, a, ex)
    idx = jnp.maximum(adv - 1, 0)
    last = jnp.take_along_axis(out["hidden"], idx[:, None, None], axis=1)[:, 0]
    hidden = jnp.where(active[:, None], last.astype(pools.hidden.dtype), prev_hidden)
    if rows is not None:
        hidden = put_rows(pools.hidden, rows, hidden)
    new_pools = with_cache(cfg, pools, HybridCache(tuple(layers), mtp, P + adv), rows)
    j = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(j < a[:, None], jnp.concatenate([drafts, jnp.zeros((S, 1), jnp.int32)], axis=1),
                        jnp.where(j == a[:, None], nxt[:, None], 0)).astype(jnp.int32)
    # emitted token j was drawn at verify position j: its logprobs are that position's (the model's
    # raw distribution, as plain decoding reports them), for every position of a row that asked
    wanted = None if s.logprobs is None else jnp.repeat(s.logprobs, k + 1)
    lp = row_logprobs(out["logits"].reshape(S * (k + 1), -1), emitted.reshape(-1), wanted)
    lp = tuple(x.reshape((S, k + 1) + x.shape[1:]) for x in lp)
    return new_pools._replace(hidden=hidden), emitted, adv, lp


def make_spec_fn(graphdef, ex: ExecConfig, k: int, pool_sharding=None):
    """Jitted `(params, pools, StepInputs) -> (pools, emitted [R, k+1], n_emitted [R], logprobs)`,
    pools donated; logprobs: `step.row_logprobs`' triple per verify position ([R, k+1], [R, k+1, N] x2); one program per row bucket and block-table width (like decode). k: drafts per step
    (1 … MAX_SPECULATIVE). pool_sharding: the pools' shardings, fixed as the output's (see
    `step.make_step_fns`)."""
    check_int(k, "speculative drafts", field="speculative", low=1, high=MAX_SPECULATIVE)
    return jax.jit(lambda params, pools, inp: _spec(graphdef, params, pools, inp, ex, k), donate_argnums=(1,),
                   out_shardings=(pool_sharding, None, None, None))
