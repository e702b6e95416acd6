"""Token sampling and speculative-decoding acceptance, as pure jit-friendly JAX functions.

One API, by rows: every parameter is a per-row array (`RowSampling`, `sample_rows`,
`processed_logits_rows`), so one compiled program serves any mix of requests; `generate`'s single
`SamplingParams` is a broadcast row (`RowSampling.broadcast`). Shape-static, no Python control flow
on traced values: it runs inside a `lax.while_loop` decode loop or an engine step.

Conventions: logits `[B, V]` of any float dtype, processed in float32; masked entries `-inf`, at
least one per row survives. Ties go to the lower token id (the order of `lax.top_k`, a stable
descending sort and `jnp.argmax`), so top-k keeps exactly k entries and top-p exactly a prefix of
that order. Order: penalties -> temperature -> top-k -> top-p (top-p renormalises over what top-k
kept); the caller applies the penalties (`apply_penalties_rows`, `token_stats.penalize_rows`), they
need the token history. Temperature 0 is greedy (the argmax).

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

__all__ = ["MAX_LOGPROBS", "SamplingParams", "TokenLogprob", "apply_penalties_rows", "check_logprobs",
           "check_penalties", "token_logprobs", "processed_logits_rows", "request_keys", "RowSampling", "sample_rows",
           "speculative_accept", "speculative_accept_greedy"]

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


# ---------------------------------------------------------------------------------------------
# penalties and log-probabilities

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


def token_logprobs(logits: jax.Array, tokens: jax.Array, n_top: int,
                   vocab_sharding=None) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the model's raw distribution log_softmax(logits) (module docstring):
    logits [B, V], tokens [B] -> (logprob of tokens [B] f32, top ids [B, n] int32, top logprobs
    [B, n] f32), n = min(n_top, V), best first, ties lower id first. vocab_sharding: the logits'
    split (`placement.logits_sharding`): the top n are taken per shard and merged, so the [B, V]
    row never crosses devices."""
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    tok_lp = jnp.take_along_axis(lp, jnp.asarray(tokens, jnp.int32)[:, None], axis=-1)[:, 0]
    n = min(int(n_top), lp.shape[-1])
    top_lp, top_ids = _best_candidates(lp, n, vocab_sharding)
    return tok_lp, top_ids, top_lp


# ---------------------------------------------------------------------------------------------
# per-row parameters: the one sampling API of `generate` and the engine (one batch, every row its
# own request; `generate`'s one SamplingParams is a broadcast row)

SEED_SPAN = 2 ** 32


class RowSampling(NamedTuple):
    """Per-row sampling parameters ([R] arrays): temperature f32 (0 = greedy), top_k int32 (0 = off),
    top_p f32, seed uint32, n_gen int32 (the index of the token being drawn, `request_keys`);
    presence / frequency / repetition f32 (0, 0, 1 = off), prompt_len int32 (`token_stats`), logprobs
    bool. The last five None = no penalties, no logprobs."""
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

    def draw(self, logits: jax.Array, keys: jax.Array | None = None, vocab_sharding=None) -> jax.Array:
        """`sample_rows` of logits [R, V] with these rows' parameters; keys default to each row's
        `request_keys(seed, n_gen)`. vocab_sharding: the logits' split (`placement.logits_sharding`)."""
        keys = request_keys(self.seed, self.n_gen) if keys is None else keys
        return sample_rows(logits, keys, self.temperature, self.top_k, self.top_p, vocab_sharding)

    def probs(self, logits: jax.Array, vocab_sharding=None) -> jax.Array:
        """[R, V] the distribution each row draws from (its temperature / top-k / top-p)."""
        return jax.nn.softmax(processed_logits_rows(logits, self.temperature, self.top_k, self.top_p,
                                                    vocab_sharding), axis=-1)


#: How many of a row's best tokens the sort-free masking looks at: a row whose kept set (its top-k,
#: or its nucleus) lies within them is masked by a threshold, with no sort of the vocabulary.
SORT_FREE_CANDIDATES = 256


def _shard_count(vocab_sharding) -> int:
    """How many pieces `vocab_sharding` (a NamedSharding of [R, V] logits, or None) splits V into."""
    if vocab_sharding is None:
        return 1
    axes = vocab_sharding.spec[1] if len(vocab_sharding.spec) > 1 else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([vocab_sharding.mesh.shape[a] for a in axes], dtype=np.int64))


def _best_candidates(x: jax.Array, n: int, vocab_sharding=None) -> Tuple[jax.Array, jax.Array]:
    """The n best entries of each row of x [R, V] in the lower-id-first order: (values [R, n], ids
    [R, n] int32), n <= V. Each vocabulary shard (`vocab_sharding`, None: one) takes its best n, then
    the S·n candidates are sorted by (value descending, id ascending), so over split logits only
    candidates leave their device (the real config at R = 64 gathered 120 MB a step otherwise)."""
    R, V = x.shape
    S = _shard_count(vocab_sharding)
    per = -(-V // S)
    c = min(n, per)
    if per * S != V:  # padded at the end: -inf with ids past V, after every real entry in the order
        x = jnp.pad(x, ((0, 0), (0, per * S - V)), constant_values=_NEG_INF)
    xs = x.reshape(R, S, per)
    if S > 1:
        spec = jax.sharding.PartitionSpec(vocab_sharding.spec[0], vocab_sharding.spec[1], None)
        xs = jax.lax.with_sharding_constraint(xs, jax.sharding.NamedSharding(vocab_sharding.mesh, spec))
    vals, idx = jax.lax.top_k(xs, c)  # [R, S, c], per shard
    ids = (idx + (jnp.arange(S, dtype=jnp.int32) * per)[None, :, None]).reshape(R, S * c)
    neg, ids = jax.lax.sort((-vals.reshape(R, S * c), ids), dimension=-1, num_keys=2)
    return -neg[:, :n], ids[:, :n]


def _processed_logits_rows_sorted(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits x [B, V] masked by top-k (k [B], V = off) then top-p: a stable
    descending sort of each whole row (the form for any k and nucleus size)."""
    vocab = x.shape[-1]
    order = jnp.argsort(-x, axis=-1, stable=True)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    keep = jnp.arange(vocab)[None, :] < k[:, None]
    sorted_k = jnp.where(keep, sorted_x, _NEG_INF)
    keep = keep & _nucleus_keep_sorted(sorted_k, top_p[:, None])
    return _scatter_rows(jnp.where(keep, sorted_x, _NEG_INF), order, vocab)


def _processed_logits_rows_sort_free(x, k, top_p, vals, ids):
    """The masking from the best C candidates (vals, ids [B, C], lower-id-first order): (masked x
    [B, V], exact [B] bool). A kept set is a prefix of the order, so it is a threshold at the last
    kept candidate (v, id): x > v, or x == v at an id <= id, applied where x lives. exact is False
    where the kept set may run past the candidates (a top-k beyond C, or a whole-vocabulary nucleus
    whose candidates' mass stays below p)."""
    B, V = x.shape
    C = vals.shape[1]
    pos = jnp.arange(C)[None, :]
    in_k = pos < k[:, None]
    # the nucleus' softmax: over the top-k survivors (k <= C: all candidates), else over the whole
    # row (k = V; a reduction, so on split logits a [B] all-reduce)
    top = vals[:, :1]
    mass = jnp.where(in_k, jnp.exp(vals - top), 0.0)
    whole = jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True)
    total = jnp.where(k[:, None] <= C, jnp.sum(mass, axis=-1, keepdims=True), whole)
    cum = jnp.cumsum(mass / total, axis=-1)
    excl = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    p = top_p[:, None]
    keep = in_k & ((excl < p) | (p >= 1.0))
    keep = keep.at[:, 0].set(True)
    last = jnp.sum(keep, axis=-1) - 1  # keep is a prefix
    v = jnp.take_along_axis(vals, last[:, None], axis=-1)
    i = jnp.take_along_axis(ids, last[:, None], axis=-1)
    col = jnp.arange(V, dtype=jnp.int32)[None, :]
    unmasked = ((k >= V) & (top_p >= 1.0))[:, None]
    kept = unmasked | (x > v) | ((x == v) & (col <= i))
    exact = (C >= V) | (k <= C) | ((k >= V) & ((top_p >= 1.0) | (cum[:, -1] >= top_p)))
    return jnp.where(kept, x, _NEG_INF), exact


def processed_logits_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                          top_p: jax.Array, vocab_sharding=None,
                          candidates: int = SORT_FREE_CANDIDATES) -> jax.Array:
    """float32 logits [B, V] after each row's temperature, then top-k, then top-p (masked entries
    -inf), per row: temperature [B] f32 (0 = greedy: the argmax entry alone), top_k [B] int32 (0 or
    >= V = off), top_p [B] f32 in (0, 1] (the smallest prefix of the lower-id-first order whose mass
    over the top-k survivors reaches p). A row's result does not depend on the other rows.
    How: when every row's kept set lies within its best `candidates` tokens, the rows are masked by
    a threshold from those candidates (`_best_candidates`, per vocabulary shard, so on split logits,
    `vocab_sharding`, only candidates cross devices); otherwise by a sort of the whole vocabulary."""
    x = jnp.asarray(logits, jnp.float32)
    vocab = x.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature == 0.0
    x = x / jnp.where(greedy, 1.0, temperature)[:, None]
    k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where((k > 0) & (k < vocab), k, vocab)
    p = jnp.asarray(top_p, jnp.float32)
    vals, ids = _best_candidates(x, min(int(candidates), vocab), vocab_sharding)
    out, exact = _processed_logits_rows_sort_free(x, k, p, vals, ids)
    out = jax.lax.cond(jnp.all(exact | greedy), lambda: out, lambda: _processed_logits_rows_sorted(x, k, p))
    if vocab > 1:  # greedy rows: the argmax entry alone
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
                top_p: jax.Array, vocab_sharding=None) -> jax.Array:
    """One token per row, [B, V] -> [B] int32: row b drawn with keys[b] from
    softmax(`processed_logits_rows`) (its argmax when greedy), whatever the other rows hold. A
    batch of only greedy rows skips the masking. vocab_sharding: as `processed_logits_rows`'."""
    x = jnp.asarray(logits, jnp.float32)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    greedy = jnp.asarray(temperature, jnp.float32) == 0.0

    def sampled():
        p = processed_logits_rows(x, temperature, top_k, top_p, vocab_sharding)
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

    draft_tokens [B, k] the draft sampled from draft_probs [B, k, V]; target_probs [B, k+1, V] the
    target distributions at those positions and the bonus one after (`RowSampling.probs` of the
    same rows for both, to sample from the processed target). Returns (num_accepted [B] int32 in
    [0, k], next_token [B] int32): the row emits draft_tokens[b, :num_accepted[b]], then
    next_token[b]. Draft i is accepted with probability min(1, p_target / p_draft), left to right;
    at the first rejection next_token ~ normalize(max(0, p_target - p_draft)) there, after k
    acceptances next_token ~ target_probs[:, k]: the tokens are distributed exactly as sampling the
    target alone.
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
    """Greedy verification: draft_tokens [B, k] are accepted while they equal the argmax of
    target_logits [B, k+1, V] (probabilities work too). Returns (num_accepted [B] int32, next_token
    [B] int32: the target argmax at the first mismatch, or at position k when all matched)."""
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    k = draft_tokens.shape[1]
    best = jnp.argmax(jnp.asarray(target_logits, jnp.float32), axis=-1).astype(jnp.int32)
    match = (draft_tokens == best[:, :k]).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod(match, axis=-1), axis=-1).astype(jnp.int32)
    next_token = jnp.take_along_axis(best, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token
