"""Per-row token statistics on the device for the presence / frequency / repetition penalties: the one
form used by `generate`'s decode loop (rows = prompts) and the engine's steps (rows = slots, the
`Pools` field `stats`).

Why on the device, inside the compiled step: a penalty changes every logit of a token the sequence
has seen, so the step needs per row how often each token was generated (`gen_counts [S, V]`
int32) and which tokens the prompt holds (`prompt_seen [S, V]` bool, 5·V bytes a row); sending
them each step would cost [slots, V] transfers. They are rebuilt from the tokens each step *feeds*
(a fed token at position p < prompt_len is a prompt token, else a generated one; a row starting a
new sequence is cleared first), so before token n is drawn a row holds exactly tokens 0..n-1 and
its prompt, in a reused slot and after a preemption's recompute alike, with no host bookkeeping
(serve/README.md, *Penalties and logprobs*). An all-neutral batch costs one scatter of the fed ids:
clearing and the penalty arithmetic run under `lax.cond`.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ling_jax.sampling import apply_penalties_rows


class TokenStats(NamedTuple):
    """gen_counts [S, V] int32 generated-token counts; prompt_seen [S, V] bool prompt tokens."""
    gen_counts: jax.Array
    prompt_seen: jax.Array


def stats_bytes_per_slot(vocab_size: int) -> int:
    """int32 counts + bool seen-mask per vocabulary entry."""
    return vocab_size * (4 + 1)


def init_token_stats(max_slots: int, vocab_size: int) -> TokenStats:
    return TokenStats(jnp.zeros((max_slots, vocab_size), jnp.int32), jnp.zeros((max_slots, vocab_size), bool))


def update_rows(stats: TokenStats, ids: jax.Array, n_valid: jax.Array, lengths: jax.Array,
                prompt_len: jax.Array, fresh: jax.Array, mesh=None) -> TokenStats:
    """Rows' statistics [R, V] after feeding ids [R, T] (n_valid [R] real, from position lengths
    [R]); rows with fresh [R] are cleared first. mesh: the model's (None: one device); the rows are
    kept replicated on it, as the pools hold them (left to itself the partitioner split the update
    like the vocabulary-split logits and all-gathered the whole pool back every step: 50 MB a
    decode step on v6e-64, BENCHMARKS.md "The pods' all-gathers")."""
    counts, seen = stats
    R, T = ids.shape
    V = counts.shape[-1]
    counts, seen = jax.lax.cond(
        jnp.any(fresh), lambda: (jnp.where(fresh[:, None], 0, counts), jnp.where(fresh[:, None], False, seen)),
        lambda: (counts, seen))
    t = jnp.arange(T)[None, :]
    valid = t < n_valid[:, None]
    in_prompt = (lengths[:, None] + t) < prompt_len[:, None]
    r = jnp.arange(R)[:, None]
    counts = counts.at[r, ids].add((valid & ~in_prompt).astype(jnp.int32))
    seen = seen.at[r, jnp.where(valid & in_prompt, ids, V)].set(True, mode="drop")
    if mesh is not None:  # the result pinned, so the partitioner runs the update where the rows live
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        counts, seen = (jax.lax.with_sharding_constraint(a, rep) for a in (counts, seen))
    return TokenStats(counts, seen)


def penalize_rows(logits: jax.Array, stats: TokenStats, presence: jax.Array, frequency: jax.Array,
                  repetition: jax.Array) -> jax.Array:
    """float32 logits [R, V] with each row's penalties (`sampling.apply_penalties_rows`); a batch
    whose rows are all neutral (0, 0, 1) skips the arithmetic."""
    x = jnp.asarray(logits, jnp.float32)
    neutral = (presence == 0.0) & (frequency == 0.0) & (repetition == 1.0)
    return jax.lax.cond(jnp.all(neutral), lambda: x,
                        lambda: apply_penalties_rows(x, stats.gen_counts, stats.prompt_seen, presence,
                                                     frequency, repetition))

