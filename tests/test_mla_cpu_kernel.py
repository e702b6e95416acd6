"""The native CPU latent-attention kernel (`pallas_kernels.mla.cpu_kernel`) against an independent
float64 NumPy evaluation of spec §10.6's absorbed core (softmax over the visible latent keys, values
the latents), and its equalities: contiguous = paged (shuffled page tables), a stacked pool at a
traced layer, alone = in a batch (bit for bit), decode-sized calls whose keys are split over
threads, causal prefill chunks, empty rows; its VJP is the XLA reference's. Tolerance: float32
1e-5 relative to the largest output (the kernel's exp is a ≈1-ulp polynomial)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import cpu_kernel
from pallas_kernels.mla.reference import attention_mask, latent_attention

TOL = 1e-5


def test_native_kernel_builds():
    """It compiles and registers here (CI has a C++ compiler): a failure is a failure, not a silent
    fallback to the XLA forms."""
    assert cpu_kernel.available(), cpu_kernel.load_error()


def numpy_latent(q_hat, q_pe, c, k_pe, q_pos, kv_len, scale):
    """float64: out[b,t,h] = Σ_τ softmax_τ(scale·(q_hat·c_τ + q_pe·kpe_τ)) c_τ over τ ≤ q_pos, τ < kv_len."""
    q_hat, q_pe, c, k_pe = (np.asarray(a, np.float64) for a in (q_hat, q_pe, c, k_pe))
    B, T, H, r = q_hat.shape
    out = np.zeros((B, T, H, r))
    for b in range(B):
        for t in range(T):
            n = min(int(q_pos[b, t]) + 1, int(kv_len[b]))
            if n <= 0:
                continue
            s = (q_hat[b, t] @ c[b, :n].T + q_pe[b, t] @ k_pe[b, :n].T) * scale  # [H, n]
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, t] = (p / p.sum(-1, keepdims=True)) @ c[b, :n]
    return out


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))


def _inputs(rng, B, T, H, S, r, dr, kv_len, causal=True):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    kv = np.asarray(kv_len, np.int32)
    q_pos = (kv[:, None] - T + np.arange(T)[None, :]) if causal else np.full((B, T), 10 ** 6)
    return f(B, T, H, r), f(B, T, H, dr), f(B, S, r), f(B, S, dr), q_pos.astype(np.int32), kv


CASES = [
    # B, T, H, S, r, dr, kv_len: decode with keys split over threads (9,000 > 2 × 4,096), an empty row
    (3, 1, 4, 9000, 48, 16, [9000, 0, 4100]),
    (2, 1, 3, 300, 44, 8, [300, 65]),            # H·T not a multiple of 4; r with an 8-lane and a scalar tail
    (2, 5, 4, 200, 32, 16, [200, 7]),            # verify-sized chunk, causal, keys in one split
    (2, 37, 2, 700, 40, 16, [700, 37]),          # prefill chunk: 64-row blocks, a row block seeing no key
    (1, 70, 4, 70, 64, 16, [70]),                # cache-free forward (keys = queries)
]


@pytest.mark.parametrize("B,T,H,S,r,dr,kv_len", CASES)
def test_kernel_matches_float64(B, T, H, S, r, dr, kv_len):
    rng = np.random.default_rng(B * 1000 + T * 10 + S)
    q_hat, q_pe, c, k_pe, q_pos, kv = _inputs(rng, B, T, H, S, r, dr, kv_len)
    scale = float((r + dr) ** -0.5) * 2.0  # sharper than uniform
    got = jax.jit(cpu_kernel.latent_attention_cpu)(q_hat, q_pe, c, k_pe, q_pos, kv, scale)
    want = numpy_latent(q_hat, q_pe, c, k_pe, q_pos, kv, scale)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel(got, want) < TOL
    for b, n in enumerate(kv_len):  # a row that sees no key gives zeros, not NaN
        if n == 0:
            assert np.all(np.asarray(got[b]) == 0.0)
    xla = latent_attention(q_hat, q_pe, c, k_pe, attention_mask(jnp.asarray(q_pos), S, jnp.asarray(kv)), scale)
    assert _rel(got, np.asarray(xla, np.float64)) < TOL  # kernel = XLA twin


def test_paged_stacked_pool_matches_contiguous():
    """Pages of each row anywhere in a stacked [2, 3, n_pages, P, ...] pool, read at a traced layer
    inside a jitted scan, give the contiguous cache's result."""
    rng = np.random.default_rng(7)
    B, T, H, r, dr, P, nb = 3, 2, 4, 32, 16, 16, 10
    kv_len = [160, 33, 90]
    q_hat, q_pe, c, k_pe, q_pos, kv = _inputs(rng, B, T, H, P * nb, r, dr, kv_len)
    n_pages = B * nb + 4
    table = rng.permutation(n_pages)[:B * nb].reshape(B, nb).astype(np.int32)
    pool_c = rng.standard_normal((2, 3, n_pages, P, r)).astype(np.float32)
    pool_k = rng.standard_normal((2, 3, n_pages, P, dr)).astype(np.float32)
    g, j = 1, 2
    for b in range(B):  # the contiguous cache's keys placed into layer (g, j)'s pages
        for i in range(nb):
            pool_c[g, j, table[b, i]] = c[b, i * P:(i + 1) * P]
            pool_k[g, j, table[b, i]] = k_pe[b, i * P:(i + 1) * P]
    scale = 0.2

    @jax.jit
    def paged(pc, pk):
        def body(_, layer):
            return None, cpu_kernel.paged_latent_attention_cpu(q_hat, q_pe, pc, pk, jnp.asarray(table), kv, q_pos,
                                                               scale, layer=layer)
        return jax.lax.scan(body, None, (jnp.arange(2, dtype=jnp.int32), jnp.full((2,), j, jnp.int32)))[1][g]

    got = paged(pool_c, pool_k)
    want = numpy_latent(q_hat, q_pe, c, k_pe, q_pos, kv, scale)
    assert _rel(got, want) < TOL
    contiguous = cpu_kernel.latent_attention_cpu(q_hat, q_pe, c, k_pe, q_pos, kv, scale)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(contiguous))  # same keys, same order: same bits


@pytest.mark.parametrize("T", [1, 24])
def test_alone_equals_in_a_batch_bit_for_bit(T):
    rng = np.random.default_rng(T)
    B, H, S, r, dr = 4, 4, 5000, 32, 16
    kv_len = [5000, 1200, 4097, 24]
    q_hat, q_pe, c, k_pe, q_pos, kv = _inputs(rng, B, T, H, S, r, dr, kv_len)
    both = np.asarray(cpu_kernel.latent_attention_cpu(q_hat, q_pe, c, k_pe, q_pos, kv, 0.1))
    for b in range(B):
        alone = cpu_kernel.latent_attention_cpu(q_hat[b:b + 1], q_pe[b:b + 1], c[b:b + 1], k_pe[b:b + 1],
                                                q_pos[b:b + 1], kv[b:b + 1], 0.1, threads=1)
        np.testing.assert_array_equal(np.asarray(alone)[0], both[b])


def test_a_row_decoded_equals_the_row_prefilled_within_float32_not_bit_for_bit():
    """One query position computed in a 1-row call (the decode path: dot products) and among 30 rows
    (prefill tiles, keys in lanes) sums its scores in other orders: equal within float32 tolerance, not
    bit for bit. The XLA dense core gives the same bits either way, which is why FP8 latent caches (an
    e4m3 rounding turns a last-bit difference into a ~6% step now and then) keep the XLA forms
    (`ling_jax/mla.py`; BENCHMARKS.md, "FP8 latent caches keep the XLA forms")."""
    rng = np.random.default_rng(3)
    T, S = 30, 32
    q_hat, q_pe, c, k_pe, q_pos, kv = _inputs(rng, 1, T, 4, S, 128, 64, [T])
    native = np.asarray(cpu_kernel.latent_attention_cpu(q_hat, q_pe, c, k_pe, q_pos, kv, 0.1))
    dense = np.asarray(latent_attention(q_hat, q_pe, c, k_pe, attention_mask(q_pos, S, kv), 0.1))
    bits_differ = 0
    for t in range(T):
        one = (q_hat[:, t:t + 1], q_pe[:, t:t + 1], c, k_pe)
        alone = np.asarray(cpu_kernel.latent_attention_cpu(*one, q_pos[:, t:t + 1], jnp.asarray([t + 1]), 0.1))[0, 0]
        np.testing.assert_allclose(alone, native[0, t], rtol=1e-5, atol=1e-5)
        bits_differ += int(not np.array_equal(alone, native[0, t]))
        xla_alone = latent_attention(*one, attention_mask(q_pos[:, t:t + 1], S, jnp.asarray([t + 1])), 0.1)
        np.testing.assert_array_equal(np.asarray(xla_alone)[0, 0], dense[0, t])
    assert bits_differ > 0  # if the kernel becomes row-invariant, FP8 caches can use it (drop the fallback)


def test_vjp_is_the_references():
    rng = np.random.default_rng(3)
    q_hat, q_pe, c, k_pe, q_pos, kv = _inputs(rng, 2, 3, 2, 40, 16, 8, [40, 11])
    mask = attention_mask(jnp.asarray(q_pos), 40, jnp.asarray(kv))

    def loss(fn, *a):
        return jnp.sum(jnp.sin(fn(*a)))

    kern = lambda qh, qp, c_, kp: cpu_kernel.latent_attention_cpu(qh, qp, c_, kp, q_pos, kv, 0.3)  # noqa: E731
    ref = lambda qh, qp, c_, kp: latent_attention(qh, qp, c_, kp, mask, 0.3)  # noqa: E731
    got = jax.grad(lambda *a: loss(kern, *a), argnums=(0, 1, 2, 3))(q_hat, q_pe, c, k_pe)
    want = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3))(q_hat, q_pe, c, k_pe)
    for g_, w_ in zip(got, want):
        assert _rel(g_, np.asarray(w_, np.float64)) < 1e-5


def test_refuses_other_dtypes_by_name():
    x = jnp.zeros((1, 1, 1, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="q_hat must be float32"):
        cpu_kernel.latent_attention_cpu(x, jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 4, 8)), jnp.zeros((1, 4, 8)),
                                        jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), 1.0)


def test_generate_with_the_kernel_equals_the_xla_forms(tiny_model, tiny_cfg):
    """The model's cached prefill (several chunks) and decode with the native core give the XLA forms'
    greedy tokens (CPU's default turns it on: ExecConfig.for_backend)."""
    from ling_jax.exec_config import ExecConfig
    from ling_jax.generate import generate
    assert ExecConfig.for_backend("cpu").native_attention and not ExecConfig.for_backend("tpu").native_attention
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, n).tolist() for n in (1, 45, 70)]
    ex = tiny_model.exec.replace(prefill_chunk=32)
    native = generate(tiny_model, prompts, 12, stop_ids=(), exec=ex.replace(native_attention=True))
    xla = generate(tiny_model, prompts, 12, stop_ids=(), exec=ex.replace(native_attention=False))
    assert native.tokens == xla.tokens
