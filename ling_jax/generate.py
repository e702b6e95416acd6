"""Jit-compiled generation: prefill, a decode loop inside one `lax.while_loop`, MTP speculation.

State is explicit: `DecodeState` carries the hybrid cache, the last emitted (not yet fed) token,
the final-normed hidden of the last fed token (the MTP layer's input), done flags and the output
buffer. Prompts of different lengths are right-padded and handled exactly (padding never enters a
KDA/conv state or an MLA softmax). Sampling, speculation (`speculation.speculative_round`) and
token statistics are the engine's own, row b seeded with seed + b, so a row's tokens equal those
of an engine request with that seed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.call_mode import DECODE, PREFILL
from ling_jax.checks import check_int
from ling_jax.exec_config import ExecConfig
from ling_jax.model import HybridCache, init_cache
from ling_jax.placement import logits_sharding, model_mesh
from ling_jax.rows import take_last
from ling_jax.sampling import MAX_LOGPROBS, RowSampling, SamplingParams, TokenLogprob, check_logprobs, token_logprobs
from ling_jax.speculation import MAX_SPECULATIVE, speculative_round
from ling_jax.token_stats import TokenStats, init_token_stats, penalize_rows, update_rows


class LogprobBuffers(NamedTuple):
    """Per emitted token (aligned with `DecodeState.out`): the sampled token's logprob [B,W] and
    the top-N ids / logprobs [B,W,N] of the model's raw distribution (`token_logprobs`)."""
    token: jax.Array
    top_ids: jax.Array
    top: jax.Array


class DecodeState(NamedTuple):
    cache: HybridCache
    token: jax.Array      # [B] last emitted token, not yet fed to the model
    hidden: jax.Array     # [B,D] final-normed hidden of the last processed token
    done: jax.Array       # [B] bool
    out: jax.Array        # [B,max_new] emitted tokens
    n_out: jax.Array      # [B] how many emitted (= the index of the token each row draws next)
    rounds: jax.Array     # [B] verify rounds (speculative) or steps
    accepted: jax.Array   # [B] tokens emitted by those rounds
    stats: Optional[TokenStats] = None  # penalties on: the tokens fed so far ([B,V] counts + prompt mask)
    logprobs: Optional[LogprobBuffers] = None  # when logprobs were asked for, else None


@dataclasses.dataclass
class GenerationResult:
    tokens: list            # per prompt, the new tokens (stop token included when hit)
    acceptance_length: Optional[float] = None  # mean tokens emitted per verify round (speculative)
    finished: Optional[list] = None            # per prompt: hit a stop token
    logprobs: Optional[list] = None            # per prompt, per new token: TokenLogprob (when asked for)


# ---------------------------------------------------------------------------------------------
# prefill

@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "with_mtp", "exec"),
                   donate_argnames=("cache",))
def prefill(graphdef, params, cache: HybridCache, ids, n_valid, prev_hidden, *, sampling: SamplingParams | None,
            with_mtp: bool, exec: ExecConfig | None = None):
    """Feed [B,T] right-padded tokens (n_valid[b] real) into the cache. Returns (cache, logits at each
    row's last real token [B,V], the rows' token 0 drawn with `sampling` (None: not drawn), last
    hidden [B,D]). With MTP the MTP cache gets each fed token paired with the hidden before it (`model.mtp_fill`;
    `prev_hidden`: an earlier call's last hidden, unused by a row starting at position 0)."""
    model = nnx.merge(graphdef, params)
    ex = exec or model.exec
    B = ids.shape[0]
    start = cache.lengths
    out = model(ids, cache, n_valid, exec=ex, mode=PREFILL)
    new = out["cache"]
    hid = take_last(out["hidden"], n_valid)
    logits = model.logits(hid, ex)
    if with_mtp:
        new = new._replace(mtp=model.mtp_fill(cache.mtp, ids, out["hidden"], prev_hidden, start, n_valid, ex))
    hid = jnp.where((n_valid > 0)[:, None], hid, prev_hidden.astype(hid.dtype))
    tok = None if sampling is None else RowSampling.broadcast(sampling, B).draw(logits,
                                                                                  vocab_sharding=logits_sharding(model))
    return new, logits, tok, hid


@functools.partial(jax.jit, static_argnames=("sampling", "vocab_sharding"))
def _first_token(logits, stats: TokenStats | None, *, sampling: SamplingParams, vocab_sharding=None):
    """Each row's token 0 from its last prompt logits [B,V] (penalised by the prompt's statistics
    when penalties are on), drawn as `RowSampling.broadcast(sampling, B)`."""
    rows = RowSampling.broadcast(sampling, logits.shape[0])
    return rows.draw(_penalized(logits, stats, rows), vocab_sharding=vocab_sharding)


def prefill_in_chunks(graphdef, params, cache: HybridCache, ids: np.ndarray, lens: np.ndarray, hidden0,
                      chunk: int, *, with_mtp: bool, exec: ExecConfig | None = None):
    """`prefill` of a right-padded prompt batch ids [B, n·chunk] as n calls of `chunk` tokens (one
    compiled program), so activation memory is that of one chunk, not of the prompt. The cache
    carries everything across calls (the MTP layer pairs each later token with the previous call's
    last hidden); a row whose prompt ended earlier feeds nothing more (n_valid 0) and keeps its
    logits and hidden. Returns (cache, logits at each row's last prompt token [B,V], last hidden
    [B,D]); the caller draws the first token (`prefill` draws none here)."""
    B, W = ids.shape
    logits, hid = None, hidden0
    for i in range(W // chunk):
        nv = np.clip(lens - i * chunk, 0, chunk).astype(np.int32)
        cache, lg, _, hid = prefill(graphdef, params, cache, jnp.asarray(ids[:, i * chunk:(i + 1) * chunk]),
                                    jnp.asarray(nv), hid, sampling=None, with_mtp=with_mtp, exec=exec)
        logits = lg if logits is None else jnp.where(jnp.asarray(nv > 0)[:, None], lg, logits)
    return cache, logits, hid


# ---------------------------------------------------------------------------------------------
# decode loops

def _emit(state: DecodeState, toks, count, stop_ids, max_new, logprobs: LogprobBuffers | None = None):
    """Append toks[:, :count[b]] (truncated at the first stop id and at max_new) to the output.
    max_new may be traced (≤ the output buffer's width). logprobs: the same tokens' values
    ([B,n], [B,n,N], [B,n,N]) for `state.logprobs`."""
    B, n = toks.shape
    j = jnp.arange(n)[None, :]
    stop = (jnp.isin(toks, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros(toks.shape, bool)) \
        & (j < count[:, None])
    first_stop = jnp.where(stop.any(1), jnp.argmax(stop, axis=1), n)
    room = max_new - state.n_out
    take = jnp.minimum(jnp.minimum(count, first_stop + 1), room)
    take = jnp.where(state.done, 0, take)
    out, lp = state.out, state.logprobs
    rows = jnp.arange(B)
    for i in range(n):
        pos = jnp.clip(state.n_out + i, 0, out.shape[1] - 1)  # the buffer may be longer than max_new
        upd = i < take
        cur = jnp.take_along_axis(out, pos[:, None], axis=1)[:, 0]
        out = out.at[rows, pos].set(jnp.where(upd, toks[:, i], cur))
        if lp is not None:
            lp = LogprobBuffers(*(buf.at[rows, pos].set(jnp.where(upd.reshape((B,) + (1,) * (v.ndim - 2)), v[:, i],
                                                                  buf[rows, pos]))
                                  for buf, v in zip(lp, logprobs)))
    n_out = state.n_out + take
    done = state.done | (first_stop < jnp.minimum(count, room)) | (n_out >= max_new)
    return state._replace(out=out, n_out=n_out, done=done, logprobs=lp), take


def _logprob_values(logits, toks, state: DecodeState, vocab_sharding=None):
    """token_logprobs of toks [B,n] under logits [B,n,V], shaped for `_emit` (None when off)."""
    if state.logprobs is None:
        return None
    B, n = toks.shape
    N = state.logprobs.top.shape[-1]
    a, b, c = token_logprobs(logits.reshape(B * n, -1), toks.reshape(-1), N, vocab_sharding)
    return a.reshape(B, n), b.reshape(B, n, N), c.reshape(B, n, N)


def _penalized(logits, stats: TokenStats | None, rows: RowSampling):
    """The logits the next token is drawn from: penalised by the rows' history when penalties are on
    (`token_stats.penalize_rows`, the engine's)."""
    if stats is None:
        return logits
    return penalize_rows(logits, stats, rows.presence, rows.frequency, rows.repetition)


def _plain_step(model, state: DecodeState, sampling, stop_ids, max_new, ex: ExecConfig):
    active = ~state.done
    B = active.shape[0]
    stats = state.stats
    if stats is not None:  # the fed token (the last one emitted) is a generated one
        stats = update_rows(stats, state.token[:, None], active.astype(jnp.int32), state.cache.lengths,
                            jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool), model_mesh(model))
    out = model(state.token[:, None], state.cache, active.astype(jnp.int32), exec=ex, mode=DECODE)
    logits = out["logits"][:, 0]
    rows = RowSampling.broadcast(sampling, B, state.n_out)
    vocab_sharding = logits_sharding(model)
    nxt = rows.draw(_penalized(logits, stats, rows), vocab_sharding=vocab_sharding)
    cache = out["cache"]
    hidden = jnp.where(active[:, None], out["hidden"][:, 0], state.hidden)
    new, take = _emit(state, nxt[:, None], jnp.ones_like(state.n_out), stop_ids, max_new,
                      _logprob_values(logits[:, None], nxt[:, None], state, vocab_sharding))
    return new._replace(cache=cache, hidden=hidden, token=jnp.where(active, nxt, state.token), stats=stats,
                        rounds=state.rounds + active, accepted=state.accepted + take)


def _spec_step(model, state: DecodeState, k, sampling, stop_ids, max_new, ex: ExecConfig):
    """One `speculative_round`; a row with r tokens left verifies min(k, r - 1) drafts (the engine's
    `Scheduler.drafts_for`), so its draws are the engine's for the same seed."""
    active = ~state.done
    rows = RowSampling.broadcast(sampling, state.token.shape[0], state.n_out)
    n_drafts = jnp.clip(max_new - state.n_out - 1, 0, k)
    r = speculative_round(model, state.cache, state.token, state.hidden, n_drafts, active, rows, k, ex)
    # emitted token j was drawn from the verify logits at position j: its logprobs are those
    lp = _logprob_values(r.logits, r.emitted, state, logits_sharding(model))
    new, take = _emit(state, r.emitted, r.n_emitted, stop_ids, max_new, lp)
    return new._replace(cache=r.cache, hidden=r.hidden, token=jnp.where(active, r.next_token, state.token),
                        rounds=state.rounds + active, accepted=state.accepted + take)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "stop_ids", "speculative", "exec"),
                   donate_argnames=("state",))
def decode_loop(graphdef, params, state: DecodeState, *, sampling: SamplingParams, stop_ids: tuple,
                max_new, speculative: int = 0, exec: ExecConfig | None = None, max_steps=None) -> DecodeState:
    """Run decode steps until every sequence is done, all inside one `lax.while_loop`.

    max_new: new tokens per sequence, a traced int (not a static shape: a new value does not
    compile again), at most `state.out`'s width. max_steps: None, or a traced int: stop after that
    many steps even if not done (`generate` streams by calling the loop again with the returned
    state: the same steps, the same tokens, and no host callback in the program, so the persistent
    compilation cache can store it)."""
    model = nnx.merge(graphdef, params)
    ex = exec or model.exec
    if speculative:
        body = lambda s: _spec_step(model, s, speculative, sampling, stop_ids, max_new, ex)
    else:
        body = lambda s: _plain_step(model, s, sampling, stop_ids, max_new, ex)
    if max_steps is None:
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done) & (c[1] < max_steps),
                              lambda c: (body(c[0]), c[1] + 1), (state, jnp.int32(0)))[0]


# ---------------------------------------------------------------------------------------------
# user API

def length_bucket(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, … (2^k and 1.5·2^k) that is ≥ n. Why: `generate`
    pads prompt widths, output buffers and cache lengths to these, so a new prompt length or
    `max_new_tokens` inside a bucket reuses the compiled programs; the ladder wastes at most a
    third of a shape (50% of the smallest steps)."""
    b = 16
    while True:
        if n <= b:
            return b
        if n <= b * 3 // 2:
            return b * 3 // 2
        b *= 2


def prompt_width(prompt_len: int, prefill_chunk: int = ExecConfig.prefill_chunk) -> int:
    """The padded prompt width `generate` feeds: its length bucket, or for a prompt longer than
    `prefill_chunk` whole chunks (prefilled one call each)."""
    if prompt_len <= prefill_chunk:
        return length_bucket(prompt_len)
    return -(-prompt_len // prefill_chunk) * prefill_chunk


def cache_length(prompt_len: int, max_new_tokens: int, speculative: int = 0,
                 prefill_chunk: int = ExecConfig.prefill_chunk) -> int:
    """The cache length `generate` allocates (without `max_len`): room for the prompt, the new
    tokens and a verify chunk, at least the padded prompt width, bucketed."""
    return max(length_bucket(max(prompt_len + max_new_tokens + speculative + 1, length_bucket(prompt_len))),
               prompt_width(prompt_len, prefill_chunk))


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lens = np.array([len(p) for p in prompts], np.int32)
    if (lens == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lens))} is empty (need at least one token)")
    ids = np.zeros((len(prompts), int(lens.max())), np.int32)
    for b, p in enumerate(prompts):
        p = np.asarray(p, np.int64)
        if ((p < 0) | (p >= vocab_size)).any():
            bad = int(p[(p < 0) | (p >= vocab_size)][0])
            raise ValueError(f"prompt {b}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        ids[b, :len(p)] = p
    return ids, lens


STREAM_CHUNK = 8  # decode steps per compiled call when streaming (`generate(stream=..., stream_chunk=...)`)


def _decode_streamed(graphdef, params, state: DecodeState, stream, chunk: int, **kw) -> DecodeState:
    """`decode_loop` in calls of at most `chunk` steps, handing each call's new tokens to
    `stream(tokens [B,n], counts [B])` between calls: the same steps and tokens as one whole call
    (the state is carried), and a program without a host callback, which the persistent compilation
    cache stores (`max_steps` is traced)."""
    seen = np.asarray(state.n_out)
    while True:
        state = decode_loop(graphdef, params, state, max_steps=np.int32(chunk), **kw)
        out, n_out, done = np.asarray(state.out), np.asarray(state.n_out), np.asarray(state.done)
        new = n_out - seen
        if new.any():
            toks = np.zeros((out.shape[0], int(new.max())), out.dtype)
            for b in range(out.shape[0]):
                toks[b, :new[b]] = out[b, seen[b]:n_out[b]]
            stream(toks, new.astype(np.int32))
        seen = n_out
        if done.all():
            return state


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             sampling: SamplingParams = SamplingParams(), speculative: int = 0,
             stop_ids: Sequence[int] | None = None, max_len: int | None = None,
             stream: Callable[[np.ndarray, np.ndarray], None] | None = None,
             exec: ExecConfig | None = None, kv_cache_dtype: str | None = None,
             logprobs: int | None = None, stream_chunk: int = STREAM_CHUNK) -> GenerationResult:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids of any lengths).

    sampling: greedy by default, else `SamplingParams` (temperature, top-k, top-p, seed and the
    penalties of `ling_jax.sampling`; penalties not with `speculative`). logprobs: None (off), 0
    (each new token's logprob) or N <= 20 (plus the top N), of the raw distribution:
    `result.logprobs[b]` lists `TokenLogprob`s aligned with `result.tokens[b]`. speculative: MTP
    drafts per round (0 = plain decoding). stop_ids: default the config's EOS ids. Compiles once
    per batch size and bucket (`length_bucket`) of the prompt width, the cache length and
    `max_new_tokens`. stream(tokens [B,n], counts [B]) is called on the host with each row's new
    tokens: the first after prefill, then after every `stream_chunk` decode steps (the same tokens
    as unstreamed). exec: how to run (default `model.exec`). kv_cache_dtype: "auto" (None) or
    "fp8" (`ling_jax.kv_quant`). A prompt batch longer than `exec.prefill_chunk` tokens is
    prefilled in whole chunks of that many (`prefill_in_chunks`).
    """
    cfg = model.cfg
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", low=1)
    speculative = check_int(speculative, "speculative", low=0, high=MAX_SPECULATIVE)  # MTP drafts per step
    stream_chunk = check_int(stream_chunk, "stream_chunk", low=1)
    if speculative and model.mtp is None:
        raise ValueError("speculative decoding needs the MTP layer, and this checkpoint/model has none")
    if speculative and sampling.penalized:
        raise ValueError("sampling: presence_penalty / frequency_penalty / repetition_penalty are not supported "
                         "with speculative decoding (speculative=0 applies them)")
    check_logprobs(logprobs)
    ids, lens = pad_prompts(prompts, cfg.vocab_size)
    B = len(prompts)
    chunk = (exec or model.exec).prefill_chunk
    width = prompt_width(ids.shape[1], chunk)  # right padding is exact
    ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])))
    need = int(lens.max()) + max_new_tokens + speculative + 1
    if max_len is not None and int(lens.max()) + max_new_tokens > max_len:
        raise ValueError(f"prompt of {int(lens.max())} tokens + {max_new_tokens} new tokens does not fit the "
                         f"cache of max_len={max_len}")
    # the padded prompt is written whole: the cache must hold its width too
    max_len = max(max_len, need, width) if max_len is not None else cache_length(int(lens.max()), max_new_tokens,
                                                                                 speculative, chunk)
    stop = tuple(int(s) for s in (cfg.eos_token_id if stop_ids is None else stop_ids))
    graphdef, params = nnx.split(model)
    with_mtp = bool(speculative)
    cache = init_cache(cfg, B, max_len, model.dtype, with_mtp=with_mtp, kv_cache_dtype=kv_cache_dtype)
    cache, logits, hid = prefill_in_chunks(graphdef, params, cache, ids, lens, jnp.zeros((B, cfg.hidden_size),
                                           model.dtype), min(width, chunk), with_mtp=with_mtp, exec=exec)
    stats = None  # penalties: the prompt's tokens fed (prompt_len = its length), nothing generated yet
    if sampling.penalized:
        stats = update_rows(init_token_stats(B, cfg.vocab_size), jnp.asarray(ids), jnp.asarray(lens),
                            jnp.zeros((B,), jnp.int32), jnp.asarray(lens), jnp.zeros((B,), bool))
    tok = _first_token(logits, stats, sampling=sampling, vocab_sharding=logits_sharding(model))
    out_width = length_bucket(max_new_tokens)  # the output buffer is bucketed; max_new is traced
    n_top = 0 if logprobs is None else min(MAX_LOGPROBS, cfg.vocab_size)  # always the top 20: one program for any N
    lp_bufs = None if logprobs is None else LogprobBuffers(
        jnp.zeros((B, out_width), jnp.float32), jnp.zeros((B, out_width, n_top), jnp.int32),
        jnp.zeros((B, out_width, n_top), jnp.float32))
    zeros = lambda: jnp.zeros((B,), jnp.int32)  # noqa: E731  (distinct buffers: the loop state is donated)
    state = DecodeState(cache, tok, hid, jnp.zeros((B,), bool), jnp.zeros((B, out_width), jnp.int32),
                        zeros(), zeros(), zeros(), stats=stats, logprobs=lp_bufs)
    state, take = _emit(state, tok[:, None], jnp.ones((B,), jnp.int32), stop, max_new_tokens,
                        _logprob_values(logits[:, None], tok[:, None], state))
    kw = dict(sampling=sampling, stop_ids=stop, max_new=np.int32(max_new_tokens), speculative=speculative, exec=exec)
    if stream is None:
        state = decode_loop(graphdef, params, state, **kw)
    else:
        stream(np.asarray(tok[:, None]), np.asarray(take))
        state = _decode_streamed(graphdef, params, state, stream, stream_chunk, **kw)
    out, n_out = np.asarray(state.out), np.asarray(state.n_out)
    toks = [out[b, :n_out[b]].tolist() for b in range(B)]
    finished = [bool(len(t) and t[-1] in stop) for t in toks]
    acc = float(np.asarray(state.accepted).sum() / max(np.asarray(state.rounds).sum(), 1)) if speculative else None
    lps = None
    if logprobs is not None:
        lp, ids_, vals = (np.asarray(a) for a in state.logprobs)
        lps = [[TokenLogprob(float(lp[b, i]), tuple((int(ids_[b, i, j]), float(vals[b, i, j]))
                                                    for j in range(logprobs)))
                for i in range(n_out[b])] for b in range(B)]
    return GenerationResult(toks, acc, finished, lps)
