"""The blockwise (online-softmax) MLA attention (`pallas_kernels.mla.blockwise`) against an
independent float64 NumPy evaluation and against the dense XLA forms, at several key-block sizes
(dividing S or not, one block, more blocks than keys), ragged valid lengths, queries that see no key
(padding rows) and a query chunk placed late in a longer cache (the chunked-prefill case)."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import rel_err
from pallas_kernels.mla.blockwise import blockwise_expanded_attention, blockwise_latent_attention
from pallas_kernels.mla.reference import attention_mask, latent_attention

B, T, H, R, DR, DN, DV = 3, 24, 2, 20, 8, 12, 10
SCALE = 0.3


def np_masked_attention(scores: np.ndarray, mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64: softmax over visible keys of scores [B,H,T,S] (mask [B,T,S]) times values [B,S,H,d]
    (or [B,S,d], shared by heads) -> [B,T,H,d]; a row with no visible key gives zeros."""
    s = np.where(mask[:, None], scores, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask[:, None], np.exp(s - m), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    if values.ndim == 3:
        return np.einsum("bhts,bsd->bthd", p, values)
    return np.einsum("bhts,bshd->bthd", p, values)


def np_mask(q_pos, S, kv_len):
    kpos = np.arange(S)[None, None, :]
    return (kpos <= q_pos[:, :, None]) & (kpos < kv_len[:, None, None])


def case(S, seed=0, start=None):
    """Random operands; queries at positions start[b] + t (start default S - T: the new tokens are the
    last of the cache), valid keys kv_len ragged, one row with no valid query at all."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    start = np.array([S - T, max(S - T - 5, 0), 0] if start is None else start)
    n_valid = np.array([T, T - 7, 0])
    q_pos = (start[:, None] + np.arange(T)[None]).astype(np.int32)
    kv_len = (start + n_valid).astype(np.int32)
    return dict(q_hat=f(B, T, H, R), q_nope=f(B, T, H, DN), q_pe=f(B, T, H, DR), c=f(B, S, R), k_pe=f(B, S, DR),
                w=f(H * (DN + DV), R) * 0.3, q_pos=q_pos, kv_len=kv_len)


def np_latent(a):
    c, kpe = a["c"].astype(np.float64), a["k_pe"].astype(np.float64)
    s = (np.einsum("bthr,bsr->bhts", a["q_hat"].astype(np.float64), c)
         + np.einsum("bthd,bsd->bhts", a["q_pe"].astype(np.float64), kpe)) * SCALE
    return np_masked_attention(s, np_mask(a["q_pos"], c.shape[1], a["kv_len"]), c)


def np_expanded(a):
    c = a["c"].astype(np.float64)
    kv = (c @ a["w"].astype(np.float64).T).reshape(B, c.shape[1], H, DN + DV)
    s = (np.einsum("bthd,bshd->bhts", a["q_nope"].astype(np.float64), kv[..., :DN])
         + np.einsum("bthd,bsd->bhts", a["q_pe"].astype(np.float64), a["k_pe"].astype(np.float64))) * SCALE
    return np_masked_attention(s, np_mask(a["q_pos"], c.shape[1], a["kv_len"]), kv[..., DN:])


def valid_rows(a):
    """[B,T] bool: query rows that see at least one key (the third sequence, kv_len 0, has none; a
    padding row past a sequence's length sees its valid keys, as in the dense mask)."""
    return np.broadcast_to(a["kv_len"][:, None] > 0, a["q_pos"].shape)


@pytest.mark.parametrize("S,block", [(24, 8), (24, 24), (24, 64), (61, 16), (61, 7), (200, 32), (200, 64)])
def test_blockwise_latent_equals_float64(S, block):
    a = case(S)
    got = np.asarray(jax.jit(blockwise_latent_attention, static_argnames="block")(
        a["q_hat"], a["q_pe"], a["c"], a["k_pe"], a["q_pos"], a["kv_len"], SCALE, block=block))
    want = np_latent(a)
    v = valid_rows(a)
    assert rel_err(got[v], want[v]) < 1e-5
    assert np.all(got[~v] == 0)  # rows that see no key: zeros, never NaN


@pytest.mark.parametrize("S,block", [(24, 8), (61, 16), (61, 7), (200, 64)])
def test_blockwise_expanded_equals_float64(S, block):
    a = case(S, seed=1)
    got = np.asarray(jax.jit(blockwise_expanded_attention, static_argnames=("block", "dtype"))(
        a["q_nope"], a["q_pe"], a["c"], a["k_pe"], a["w"], a["q_pos"], a["kv_len"], SCALE, jnp.float32,
        block=block))
    want = np_expanded(a)
    v = valid_rows(a)
    assert rel_err(got[v], want[v]) < 1e-5
    assert np.all(got[~v] == 0)


@pytest.mark.parametrize("block", [16, 50])
def test_blockwise_latent_equals_dense_xla(block):
    """Same operands through the dense XLA core (the Pallas kernel's reference): one answer."""
    a = case(150, seed=2, start=[3, 100, 126])
    mask = attention_mask(jnp.asarray(a["q_pos"]), 150, jnp.asarray(a["kv_len"]))
    dense = np.asarray(latent_attention(a["q_hat"], a["q_pe"], a["c"], a["k_pe"], mask, SCALE))
    got = np.asarray(blockwise_latent_attention(a["q_hat"], a["q_pe"], a["c"], a["k_pe"], a["q_pos"], a["kv_len"],
                                                SCALE, block=block))
    assert rel_err(got, dense) < 1e-5


def test_blockwise_skips_blocks_past_every_limit():
    """Keys past the last visible one are never read: NaN there (uninitialised pages, say) cannot
    leak into the result, so the blocks are skipped, not merely masked (exp(NaN)·0 is NaN)."""
    a = case(64, seed=3, start=[0, 0, 0])
    c, kpe = a["c"].copy(), a["k_pe"].copy()
    c[:, 32:], kpe[:, 32:] = np.nan, np.nan  # every limit is ≤ 24 < 32: blocks 2, 3 of 16 never visited
    got = np.asarray(blockwise_latent_attention(a["q_hat"], a["q_pe"], c, kpe, a["q_pos"], a["kv_len"], SCALE,
                                                block=16))
    v = valid_rows(a)
    assert np.isfinite(got).all()
    assert rel_err(got[v], np_latent(a)[v]) < 1e-5


def test_blockwise_scores_are_one_block():
    """The compiled program holds no [B,H,T,S] (or [B,T,S]) buffer: its largest float32 temporary
    is a block's scores, independent of S (the memory claim, read from the HLO buffer sizes)."""
    def temp_bytes(S):
        a = case(S, seed=4)
        f = jax.jit(blockwise_latent_attention, static_argnames="block")
        mem = f.lower(a["q_hat"], a["q_pe"], a["c"], a["k_pe"], a["q_pos"], a["kv_len"], SCALE,
                      block=32).compile().memory_analysis()
        return mem.temp_size_in_bytes
    small, large = temp_bytes(256), temp_bytes(4096)
    dense_scores = B * H * T * 4096 * 4
    assert large < dense_scores, (large, dense_scores)
    assert large <= small * 1.5 + 65536, (small, large)  # does not grow with S
