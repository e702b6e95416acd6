"""One speculative round (MTP drafts, one verify pass, per-row acceptance, rollback), shared by
`generate`'s decode loop and the engine's verify program (`serve/step.py`): the two differ only in
where the cache lives (a dense `HybridCache`; page pools seen through `pools.as_cache`), so both
emit the same tokens for the same seed. A round advances every active row by 1 … k+1 tokens:

1. **Draft** (the MTP layer, a `lax.scan` over k): draft j pairs the row's last token with the
   hidden before it (j = 0: the pending token and the main model's hidden; then the previous draft
   and the MTP layer's own hidden). Draft 0 also completes the MTP slot plain decoding would write
   for the pending token, so it runs for every active row.
2. **Verify** [pending, d_1 … d_k] through the main model in one [B, k+1] `VERIFY` pass (the
   token-by-token KDA recurrence, every per-token state returned).
3. **Accept** per row (`accept_rows`): greedy rows keep the drafts equal to the target argmax;
   sampled rows use `speculative_accept`, so the tokens are distributed exactly as plain sampling.
4. **Roll back** to the accepted length: KDA states picked from the per-token states
   (`layer_stack.roll_back_kda`), MLA entries past the length masked and later overwritten, the
   accepted drafts' MTP slots rewritten from the main model's hidden states (the MTP cache is then
   what plain decoding builds).
Row b verifies n_drafts[b] <= k drafts (callers cut it to the row's max_tokens and pages); the rest
are computed (one shape) but never written or accepted. Random streams: a round at token index n
uses base = fold_in(key(seed), n), draft j fold_in(base, 1 + j), the acceptance fold_in(base, 0),
so a row's draws never depend on its batch.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.call_mode import VERIFY
from ling_jax.exec_config import ExecConfig
from ling_jax.layer_stack import roll_back_kda
from ling_jax.model import HybridCache
from ling_jax.placement import logits_sharding
from ling_jax.rows import take_last
from ling_jax.sampling import RowSampling, request_keys, speculative_accept, speculative_accept_greedy

#: The most drafts per verify round (the MTP layer is trained for the next token; drafts further
#: out come from its own recursion and are rarely accepted).
MAX_SPECULATIVE = 3


class SpecRound(NamedTuple):
    """What one round produced. cache: rolled back to lengths + n_emitted (MTP rewritten);
    emitted [B, k+1] int32: drafts[:a] then the next token, zeros after; n_emitted [B] = a + 1
    (0 for an inactive row); next_token [B]: the token left pending; hidden [B, D]: the main
    hidden at the last accepted token (the previous one for an inactive row); logits [B, k+1, V]
    float32: the verify positions' raw logits (emitted token j was drawn at position j)."""
    cache: HybridCache
    emitted: jax.Array
    n_emitted: jax.Array
    next_token: jax.Array
    hidden: jax.Array
    logits: jax.Array


def _fold(keys: jax.Array, i) -> jax.Array:
    return jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to(jnp.asarray(i, jnp.uint32), keys.shape))


def accept_rows(drafts, draft_logits, target_logits, n_drafts, sampling: RowSampling, keys, vocab_sharding=None):
    """Per-row acceptance of a verify pass: drafts [R, K] int32 drawn from draft_logits [R, K, V];
    target_logits [R, K+1, V]; n_drafts [R] in [0, K] (later drafts are never accepted); keys [R]
    (each row's acceptance key). Returns (accepted [R] int32 in [0, n_drafts], next [R] int32): the
    row emits drafts[b, :accepted[b]] then next[b]. Greedy rows keep the drafts equal to the target
    argmax, then the argmax (plain greedy decoding's tokens); sampled rows run `speculative_accept`
    over their first n_drafts drafts (once per possible count, picked per row: the count is a static
    shape there) on distributions processed by their own parameters. An all-greedy batch skips the
    sampled path (`lax.cond`). vocab_sharding: `placement.logits_sharding`."""
    K = drafts.shape[1]
    greedy_a, _ = speculative_accept_greedy(drafts, target_logits)
    greedy_a = jnp.minimum(greedy_a, n_drafts)
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [R, K+1]
    greedy_next = jnp.take_along_axis(best, greedy_a[:, None], axis=1)[:, 0]
    is_greedy = sampling.temperature == 0.0

    def sampled():
        tp = jnp.stack([sampling.probs(target_logits[:, t], vocab_sharding) for t in range(K + 1)], axis=1)
        qp = jnp.stack([sampling.probs(draft_logits[:, t], vocab_sharding) for t in range(K)], axis=1)
        one = lambda d, q, p, key: tuple(x[0] for x in speculative_accept(d[None], q[None], p[None], key))
        a_s, n_s = greedy_a, greedy_next
        for k in range(K + 1):
            a_k, n_k = jax.vmap(one)(drafts[:, :k], qp[:, :k], tp[:, :k + 1], keys)
            pick = n_drafts == k
            a_s, n_s = jnp.where(pick, a_k, a_s), jnp.where(pick, n_k, n_s)
        return jnp.where(is_greedy, greedy_a, a_s), jnp.where(is_greedy, greedy_next, n_s)

    return jax.lax.cond(jnp.all(is_greedy), lambda: (greedy_a, greedy_next), sampled)


def speculative_round(model, cache: HybridCache, token, hidden, n_drafts, active, sampling: RowSampling, k: int,
                      ex: ExecConfig) -> SpecRound:
    """One round over B rows (module docstring). cache: the main cache with its MTP cache, holding
    `cache.lengths[b]` tokens (the pending token not among them); token [B]: each row's pending
    token; hidden [B, D]: the main hidden of the last token fed; n_drafts [B] in [0, k]; active [B]
    bool (an inactive row feeds nothing and keeps its state); sampling: the rows' parameters, with
    n_gen = the index of the token each row draws next."""
    cfg = model.cfg
    B = token.shape[0]
    n_drafts = jnp.where(active, n_drafts, 0)
    P = cache.lengths
    base = request_keys(sampling.seed, sampling.n_gen)
    vocab_sharding = logits_sharding(model)

    def draft(carry, j):
        tok, h, mtp = carry
        write = jnp.where(j == 0, active, j < n_drafts)
        lg, zm, mtp = model.mtp_forward(tok[:, None], h[:, None], mtp, P - 1 + j, write.astype(jnp.int32), ex)
        lg = lg[:, 0]
        d = sampling.draw(lg, _fold(base, 1 + j), vocab_sharding)
        return (d, zm[:, 0].astype(h.dtype), mtp), (d, lg)

    (_, _, mtp), (drafts, draft_logits) = jax.lax.scan(draft, (token, hidden, cache.mtp), jnp.arange(k))
    drafts, draft_logits = drafts.T, jnp.swapaxes(draft_logits, 0, 1)  # [B,k], [B,k,V]
    feed = jnp.concatenate([token[:, None], drafts], axis=1)
    out = model(feed, cache._replace(mtp=None), jnp.where(active, n_drafts + 1, 0), exec=ex, mode=VERIFY)
    a, nxt = accept_rows(drafts, draft_logits, out["logits"], n_drafts, sampling, _fold(base, 0), vocab_sharding)
    a = jnp.where(active, a, 0)
    adv = jnp.where(active, a + 1, 0)
    layers = roll_back_kda(cfg, out["cache"].layers, out["kda_states"], adv)
    _, _, mtp = model.mtp_forward(drafts, out["hidden"][:, :k], mtp, P, a, ex)
    new_hidden = jnp.where(active[:, None], take_last(out["hidden"], adv).astype(hidden.dtype), hidden)
    j = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(j < a[:, None], jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1),
                        jnp.where(j == a[:, None], nxt[:, None], 0)).astype(jnp.int32)
    return SpecRound(HybridCache(tuple(layers), mtp, P + adv), emitted, adv, nxt, new_hidden, out["logits"])
