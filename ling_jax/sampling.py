"""Token sampling and speculative-decoding acceptance, as pure jit-friendly JAX functions.

Everything here is shape-static and free of Python control flow on traced values, so it can run
inside a `lax.while_loop` decode loop. The only Python branching is on `SamplingParams`, which is
a frozen (hashable) dataclass meant to be passed as a *static* jit argument.

Conventions
-----------
* `logits` are `[B, V]` (any float dtype); all processing happens in float32.
* Masked-out entries are set to `-inf`; at least one entry per row always survives.
* Ties are broken by token id: among equal logits the lower id ranks first (the order of
  `lax.top_k`, of a stable descending sort, and of `jnp.argmax`). So top-k keeps *exactly* k
  entries and top-p keeps exactly the prefix of that order, even when values tie.
* The processing order is penalties -> temperature -> top-k -> top-p (top-p renormalises over
  what top-k kept). Penalties need the token history, so the caller applies them
  (`apply_penalties` / `apply_penalties_rows`) before `sample` / `sample_rows`; `sample` itself
  never reads the penalty fields.

Penalties (the OpenAI API's and Hugging Face's, as vLLM implements them):
* repetition_penalty r (HF / CTRL): over the prompt AND the generated tokens, a seen token's
  positive logit is divided by r, a negative one multiplied by r (1.0 = off; r > 1 discourages).
* frequency_penalty f and presence_penalty p (OpenAI): over the generated tokens only,
  logit -= f * count + p * (count > 0).
Repetition is applied first, then frequency and presence (vLLM's order).

Log-probabilities (`token_logprobs`) are those of the model's raw distribution,
log_softmax(logits), before penalties, temperature, top-k and top-p (vLLM's default): they say
what the model thinks of each token, whatever the sampling settings drew it with.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

# the settings and their checks are host-only (`ling_jax.sampling_params`); part of this module's API too
from ling_jax.sampling_params import (MAX_LOGPROBS, SamplingParams, TokenLogprob, check_logprobs,  # noqa: F401
                                      check_penalties)

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "TokenLogprob",
    "apply_penalties",
    "apply_penalties_rows",
    "check_logprobs",
    "check_penalties",
    "token_logprobs",
    "token_stats",
    "mask_top_k",
    "mask_top_p",
    "processed_logits",
    "probs",
    "processed_logits_rows",
    "request_keys",
    "RowSampling",
    "sample",
    "sample_rows",
    "speculative_accept",
    "speculative_accept_greedy",
]

_NEG_INF = float("-inf")


def _nucleus_keep_sorted(sorted_logits: jax.Array, p: float) -> jax.Array:
    """Keep-mask for logits already sorted in descending order along the last axis.

    Keeps entry i iff the probability mass strictly before it is < p, i.e. the smallest prefix
    whose cumulative probability reaches p. The first entry is always kept.
    """
    pr = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(pr, axis=-1)
    excl = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    keep = (excl < p) | (p >= 1.0)
    return keep.at[..., 0].set(True)


def _scatter_rows(values: jax.Array, idx: jax.Array, vocab: int) -> jax.Array:
    """out[b, idx[b, j]] = values[b, j]; every other entry -inf. values/idx are [B, n]."""
    rows = jnp.arange(values.shape[0])[:, None]
    out = jnp.full((values.shape[0], vocab), _NEG_INF, dtype=values.dtype)
    return out.at[rows, idx].set(values)


def mask_top_k(logits: jax.Array, k: int) -> jax.Array:
    """Set all but the k largest logits of each row to -inf.

    `k` is a static Python int; k <= 0 or k >= V returns the logits unchanged. With ties the
    lower token ids win (the `lax.top_k` order), so exactly k entries stay finite (given finite
    input).
    """
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    k = int(k)
    if k <= 0 or k >= vocab:
        return logits
    vals, idx = jax.lax.top_k(logits, k)
    return _scatter_rows(vals, idx, vocab)


def mask_top_p(logits: jax.Array, p: float) -> jax.Array:
    """Nucleus mask: keep the smallest set of highest-probability tokens with mass >= p.

    `p` is a Python float (p >= 1 then returns the logits unchanged without sorting) or a traced
    scalar / [B, 1] array (then p >= 1 keeps every token). The top token is always kept. Ties
    follow the lower-id-first order (stable descending sort).
    """
    logits = jnp.asarray(logits, jnp.float32)
    if isinstance(p, (int, float)):
        if p >= 1.0:
            return logits
    else:
        p = jnp.asarray(p, jnp.float32)
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    keep = _nucleus_keep_sorted(sorted_logits, p)
    return _scatter_rows(jnp.where(keep, sorted_logits, _NEG_INF), order, vocab)


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 logits after temperature, then top-k, then top-p (masked entries are -inf).

    For greedy params this is the argmax entry alone (everything else -inf), so that
    `softmax(processed_logits(...))` is the one-hot distribution greedy decoding draws from.
    """
    x = jnp.asarray(logits, jnp.float32)
    vocab = x.shape[-1]
    if params.greedy:
        return mask_top_k(x, 1) if vocab > 1 else x
    x = x / jnp.float32(params.temperature)
    k = int(params.top_k)
    if 0 < k < vocab:
        # top_k returns its values sorted, so top-p can run on the k survivors without
        # sorting the whole vocabulary.
        vals, idx = jax.lax.top_k(x, k)
        if params.top_p < 1.0:
            vals = jnp.where(_nucleus_keep_sorted(vals, params.top_p), vals, _NEG_INF)
        return _scatter_rows(vals, idx, vocab)
    return mask_top_p(x, params.top_p)


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[B, V] float32: exactly the distribution `sample(logits, key, params)` draws from."""
    return jax.nn.softmax(processed_logits(logits, params), axis=-1)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """Draw one token per row: [B, V] -> [B] int32 (argmax when `params.greedy`)."""
    if params.greedy:
        return jnp.argmax(jnp.asarray(logits, jnp.float32), axis=-1).astype(jnp.int32)
    x = processed_logits(logits, params)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# penalties and log-probabilities

def token_stats(ids: jax.Array, n_valid: jax.Array, vocab: int) -> jax.Array:
    """Per-row token counts [B, V] int32 of ids[b, :n_valid[b]] (ids [B, T], n_valid [B]):
    the histories `apply_penalties` reads (count > 0 is the seen-mask)."""
    ids = jnp.asarray(ids, jnp.int32)
    B, T = ids.shape
    valid = jnp.arange(T)[None, :] < jnp.asarray(n_valid)[:, None]
    return jnp.zeros((B, vocab), jnp.int32).at[jnp.arange(B)[:, None], ids].add(valid.astype(jnp.int32))


def apply_penalties_rows(logits: jax.Array, gen_counts: jax.Array, prompt_seen: jax.Array,
                         presence: jax.Array, frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """Penalised float32 logits [B, V] with per-row parameters ([B] arrays, or scalars).

    gen_counts [B, V] int: how often each token was generated so far (frequency, presence, and
    the repetition mask); prompt_seen [B, V] bool: tokens of the prompt (repetition mask only).
    Rows with neutral parameters (0, 0, 1) come out exactly unchanged.
    """
    x = jnp.asarray(logits, jnp.float32)
    col = lambda v: jnp.reshape(jnp.asarray(v, jnp.float32), (-1, 1))
    rep = col(repetition)
    seen = jnp.asarray(prompt_seen, bool) | (gen_counts > 0)
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    counts = jnp.asarray(gen_counts, jnp.float32)
    return x - col(frequency) * counts - col(presence) * (counts > 0).astype(jnp.float32)


def apply_penalties(logits: jax.Array, gen_counts: jax.Array, prompt_seen: jax.Array,
                    params: SamplingParams) -> jax.Array:
    """`apply_penalties_rows` with one `SamplingParams` for every row (a no-op when none is on)."""
    if not params.penalized:
        return jnp.asarray(logits, jnp.float32)
    return apply_penalties_rows(logits, gen_counts, prompt_seen, params.presence_penalty,
                                params.frequency_penalty, params.repetition_penalty)


def token_logprobs(logits: jax.Array, tokens: jax.Array, n_top: int) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the model's raw distribution log_softmax(logits) (why raw: the
    numbers then describe the model, not the sampling settings; vLLM's default too).

    logits [B, V], tokens [B] -> (logprob of tokens [B] f32, top ids [B, n] int32, top logprobs
    [B, n] f32), n = min(n_top, V), best first, ties lower id first (`lax.top_k`'s order).
    """
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    tok_lp = jnp.take_along_axis(lp, jnp.asarray(tokens, jnp.int32)[:, None], axis=-1)[:, 0]
    n = min(int(n_top), lp.shape[-1])
    top_lp, top_ids = jax.lax.top_k(lp, n)
    return tok_lp, top_ids.astype(jnp.int32), top_lp


# ---------------------------------------------------------------------------------------------
# per-row parameters: the one sampling API of `generate` and the engine (one batch, every row its
# own request; `generate`'s one SamplingParams is a broadcast row)

SEED_SPAN = 2 ** 32


class RowSampling(NamedTuple):
    """Per-row sampling parameters ([R] arrays): temperature f32 (0 = greedy), top_k int32 (0 =
    off), top_p f32, seed uint32, n_gen int32 (index of the token being drawn: its random stream
    is fold_in(key(seed), n_gen), `request_keys`); presence / frequency / repetition f32 penalties
    (0, 0, 1 = off), prompt_len int32 (fed positions below it are prompt tokens, see
    `token_stats`), logprobs bool (the row wants log-probabilities). The last five None = no
    penalties, no logprobs."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    n_gen: jax.Array
    presence: jax.Array | None = None
    frequency: jax.Array | None = None
    repetition: jax.Array | None = None
    prompt_len: jax.Array | None = None
    logprobs: jax.Array | None = None

    @classmethod
    def broadcast(cls, params: SamplingParams, batch: int, n_gen=None) -> "RowSampling":
        """`params` as `batch` rows (what `generate` samples with). Row b's seed is
        (params.seed + b) mod 2**32: the rows of one call draw independently, and row b draws
        exactly as an engine request with that seed would. n_gen: [batch] (default zeros).
        Penalty fields only when `params.penalized`."""
        full = lambda v, dt: jnp.full((batch,), v, dt)  # noqa: E731
        seeds = jnp.asarray((params.seed + np.arange(batch, dtype=np.uint64)) % SEED_SPAN, jnp.uint32)
        pen = {}
        if params.penalized:
            pen = dict(presence=full(params.presence_penalty, jnp.float32),
                       frequency=full(params.frequency_penalty, jnp.float32),
                       repetition=full(params.repetition_penalty, jnp.float32))
        return cls(full(params.temperature, jnp.float32), full(params.top_k, jnp.int32),
                   full(params.top_p, jnp.float32), seeds,
                   jnp.zeros((batch,), jnp.int32) if n_gen is None else jnp.asarray(n_gen, jnp.int32), **pen)

    def draw(self, logits: jax.Array, keys: jax.Array | None = None) -> jax.Array:
        """`sample_rows` of logits [R, V] with these rows' parameters; keys default to each row's
        `request_keys(seed, n_gen)`."""
        keys = request_keys(self.seed, self.n_gen) if keys is None else keys
        return sample_rows(logits, keys, self.temperature, self.top_k, self.top_p)

    def probs(self, logits: jax.Array) -> jax.Array:
        """[R, V] the distribution each row draws from (its temperature / top-k / top-p)."""
        return jax.nn.softmax(processed_logits_rows(logits, self.temperature, self.top_k, self.top_p), axis=-1)


def processed_logits_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                          top_p: jax.Array) -> jax.Array:
    """`processed_logits` with the parameters given per row as arrays, so one compiled program
    serves any mix of requests: logits [B, V]; temperature [B] f32 (0 = greedy); top_k [B] int32
    (0 = off); top_p [B] f32 in (0, 1]. Row b equals `processed_logits(logits[b:b+1], params_b)`:
    the same temperature division, the same lower-id-first order (a stable descending sort in
    place of `lax.top_k`, whose order it is) and the same nucleus rule over the top-k survivors
    (their softmax is taken over the sorted row with the rest at -inf: equal in exact arithmetic,
    it may differ in the last bit of a sum, which matters only for a mass exactly at p).
    """
    x = jnp.asarray(logits, jnp.float32)
    vocab = x.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature == 0.0
    x = x / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-x, axis=-1, stable=True)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where((k > 0) & (k < vocab), k, vocab)
    keep = jnp.arange(vocab)[None, :] < k[:, None]
    sorted_k = jnp.where(keep, sorted_x, _NEG_INF)
    keep = keep & _nucleus_keep_sorted(sorted_k, jnp.asarray(top_p, jnp.float32)[:, None])
    out = _scatter_rows(jnp.where(keep, sorted_x, _NEG_INF), order, vocab)
    if vocab > 1:  # greedy rows: the argmax entry alone (as `processed_logits` does)
        top = jnp.argmax(jnp.asarray(logits, jnp.float32), axis=-1)
        onehot = jnp.arange(vocab)[None, :] == top[:, None]
        out = jnp.where(greedy[:, None], jnp.where(onehot, jnp.asarray(logits, jnp.float32), _NEG_INF), out)
    return out


def request_keys(seeds: jax.Array, counts: jax.Array) -> jax.Array:
    """One PRNG key per row: `fold_in(key(seed[b]), count[b])`. Why: a request's draw for its
    n-th token then depends only on its own seed and n, never on its batch neighbours, its slot,
    or how often it was preempted and recomputed."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(
        jnp.asarray(seeds, jnp.uint32), jnp.asarray(counts, jnp.int32))


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """`sample` with per-row parameters and keys: [B, V] -> [B] int32. Row b equals
    `sample(logits[b:b+1], keys[b], params_b)[0]`. A batch of only greedy rows skips the sort."""
    x = jnp.asarray(logits, jnp.float32)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    greedy = jnp.asarray(temperature, jnp.float32) == 0.0

    def sampled():
        p = processed_logits_rows(x, temperature, top_k, top_p)
        drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row[None], axis=-1)[0])(keys, p)
        return jnp.where(greedy, greedy_tok, drawn.astype(jnp.int32))

    return jax.lax.cond(jnp.all(greedy), lambda: greedy_tok, sampled)


def speculative_accept(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    key: jax.Array,
) -> Tuple[jax.Array, jax.Array]:
    """Speculative-sampling accept/reject (Leviathan et al. 2023; Chen et al. 2023).

    Args:
      draft_tokens: [B, k] tokens the draft model sampled.
      draft_probs: [B, k, V] the full distributions those tokens were drawn from.
      target_probs: [B, k+1, V] target distributions at the same k positions plus one more
        (the bonus position after the last draft token). Use `probs(...)` with the same
        `SamplingParams` for both models to sample from the processed target distribution.
      key: PRNG key.

    Returns:
      (num_accepted [B] int32 in [0, k], next_token [B] int32). The emitted sequence is
      draft_tokens[b, :num_accepted[b]] followed by next_token[b]. Draft token i is accepted
      with probability min(1, p_target/p_draft), left to right; at the first rejection
      next_token ~ normalize(max(0, p_target - p_draft)) at that position; if all k are
      accepted next_token ~ target_probs[:, k]. The emitted tokens are distributed exactly as
      sampling from the target alone.
    """
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    draft_probs = jnp.asarray(draft_probs, jnp.float32)
    target_probs = jnp.asarray(target_probs, jnp.float32)
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    # One uniform draw per row covers both the k accept tests and the Gumbel noise for the
    # replacement/bonus token (a single RNG kernel instead of three).
    uniforms = jax.random.uniform(
        key, (batch, k + vocab), jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0
    )
    u, gumbel = uniforms[:, :k], -jnp.log(-jnp.log(uniforms[:, k:]))

    tok = draft_tokens[..., None]
    p_draft = jnp.take_along_axis(draft_probs, tok, axis=-1)[..., 0]  # [B, k]
    p_target = jnp.take_along_axis(target_probs[:, :k], tok, axis=-1)[..., 0]  # [B, k]
    # u < p_t / p_d without dividing (p_d > 0 for a token the draft actually sampled).
    accepted = u * p_draft < p_target
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)
    num_accepted = num_accepted.astype(jnp.int32)

    n_idx = num_accepted[:, None, None]
    t_n = jnp.take_along_axis(target_probs, n_idx, axis=1)[:, 0]  # [B, V]
    if k > 0:
        d_n = jnp.take_along_axis(draft_probs, jnp.minimum(n_idx, k - 1), axis=1)[:, 0]
        d_n = jnp.where((num_accepted < k)[:, None], d_n, 0.0)  # bonus position: plain target
    else:
        d_n = jnp.zeros_like(t_n)
    residual = jnp.maximum(t_n - d_n, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # A rejection implies p_target < p_draft somewhere, so total > 0 in exact arithmetic; fall
    # back to the target distribution if rounding empties it.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), t_n)
    # Gumbel-max: argmax(log w + G) ~ w / sum(w); zero-weight tokens get -inf and never win.
    next_token = jnp.argmax(jnp.log(residual) + gumbel, axis=-1).astype(jnp.int32)
    return num_accepted, next_token


def speculative_accept_greedy(
    draft_tokens: jax.Array, target_logits: jax.Array
) -> Tuple[jax.Array, jax.Array]:
    """Greedy verification: accept draft tokens while they equal the target argmax.

    Args:
      draft_tokens: [B, k].
      target_logits: [B, k+1, V] (probabilities work too; only the argmax is used).

    Returns:
      (num_accepted [B] int32, next_token [B] int32): next_token is the target argmax at the
      first mismatch, or at position k (the bonus token) when every draft token matched.
    """
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    k = draft_tokens.shape[1]
    best = jnp.argmax(jnp.asarray(target_logits, jnp.float32), axis=-1).astype(jnp.int32)
    match = (draft_tokens == best[:, :k]).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod(match, axis=-1), axis=-1).astype(jnp.int32)
    next_token = jnp.take_along_axis(best, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token
