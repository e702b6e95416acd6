"""The native CPU KDA decode kernel (`pallas_kernels.kda.cpu_kernel`) against an independent float64
NumPy evaluation of spec §9.6's delta rule, in place on a slot pool: rows in any order, padding rows,
fresh rows, a stacked pool at a static and a traced layer, T > 1 tokens, head sizes with 64-, 8-lane
and scalar column tails; untouched slots keep their bits; the pool is not copied; the model's decode
with it (`ExecConfig.native_kda`, `kda.SlotKDAState`) equals its XLA twin. Tolerance: float32 1e-5
relative to the largest value."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import cpu_kernel
from pallas_kernels.kda.reference import kda_recurrent_scan

TOL = 1e-5


def test_native_kernel_builds():
    """It compiles and registers here (CI has a C++ compiler): a failure is a failure, not a silent
    fallback to the XLA reference."""
    assert cpu_kernel.available(), cpu_kernel.load_error()


def numpy_delta_rule(s, q, k, v, g, beta):
    """float64, one state s [dk, dv] over T tokens (spec §9.6): S ← S·diag(e^g); S ← S + β k (v − Sᵀk)ᵀ;
    o = Sᵀq. Returns (o [T, dv], S)."""
    s = np.array(s, np.float64)
    out = []
    for t in range(q.shape[0]):
        s = s * np.exp(np.asarray(g[t], np.float64))[:, None]
        err = np.asarray(v[t], np.float64) - s.T @ np.asarray(k[t], np.float64)
        s = s + float(beta[t]) * np.outer(np.asarray(k[t], np.float64), err)
        out.append(s.T @ np.asarray(q[t], np.float64))
    return np.stack(out), s


def _inputs(rng, R, T, H, dk, dv):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q = f(R, T, H, dk)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
    k = f(R, T, H, dk)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.abs(f(R, T, H, dk)) * 0.5
    beta = 1 / (1 + np.exp(-f(R, T, H)))
    return q, k, f(R, T, H, dv), g, beta.astype(np.float32)


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))


CASES = [
    # repeats, n, S, R, T, H, dk, dv: decode rows of a shuffled pool; a verify-sized T; column tails
    (1, 3, 6, 4, 1, 2, 128, 128),
    (2, 2, 5, 3, 4, 3, 24, 72),     # 72 = 64-column block + an 8-lane block
    (1, 1, 3, 3, 2, 1, 16, 13),     # 13 = an 8-lane block + 5 scalar columns
]


@pytest.mark.parametrize("repeats,n,S,R,T,H,dk,dv", CASES)
def test_kernel_matches_float64_in_place(repeats, n, S, R, T, H, dk, dv):
    rng = np.random.default_rng(S * 31 + T)
    pool0 = (rng.standard_normal((repeats, n, S, H, dk, dv)) * 0.3).astype(np.float32)
    q, k, v, g, beta = _inputs(rng, R, T, H, dk, dv)
    rows = rng.permutation(S)[:R].astype(np.int32)
    rows[-1] = S + 2  # a padding row: no state touched, output zero
    fresh = np.zeros(R, bool)
    fresh[0] = True   # a new sequence in a reused slot: its state starts at zero
    gj = (repeats - 1, n - 1)

    @jax.jit
    def run(pool, gi, ji):  # the layer traced, as a scanned run passes it
        return cpu_kernel.kda_recurrent_rows_cpu(pool, jnp.asarray(rows), *map(jnp.asarray, (q, k, v, g, beta)),
                                                 fresh=jnp.asarray(fresh), layer=(gi, ji))

    o, pool = run(jnp.asarray(pool0), *gj)
    o, pool = np.asarray(o), np.asarray(pool)
    want_pool = pool0.astype(np.float64)
    for r in range(R):
        if rows[r] >= S:
            assert np.all(o[r] == 0)
            continue
        for h in range(H):
            s0 = 0 * pool0[gj][rows[r], h] if fresh[r] else pool0[gj][rows[r], h]
            want_o, want_s = numpy_delta_rule(s0, q[r, :, h], k[r, :, h], v[r, :, h], g[r, :, h], beta[r, :, h])
            assert _rel(o[r, :, h], want_o) < TOL
            want_pool[gj][rows[r], h] = want_s
    assert _rel(pool, want_pool) < TOL
    untouched = np.ones(pool0.shape[:3], bool)
    untouched[gj[0], gj[1], rows[rows < S]] = False
    assert np.array_equal(pool[untouched], pool0[untouched])  # every other slot and layer: same bits


def test_plain_state_equals_the_xla_reference():
    """`kda_recurrent_scan_cpu` = `reference.kda_recurrent_scan` (the model's decode without the kernel)."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta = map(jnp.asarray, _inputs(rng, 3, 2, 2, 32, 32))
    s0 = jnp.asarray(rng.standard_normal((3, 2, 32, 32)).astype(np.float32))
    o1, s1 = kda_recurrent_scan(q, k, v, g, beta, s0)
    o2, s2 = jax.jit(cpu_kernel.kda_recurrent_scan_cpu)(q, k, v, g, beta, s0)
    assert _rel(o2, np.asarray(o1, np.float64)) < TOL and _rel(s2, np.asarray(s1, np.float64)) < TOL


def test_the_pool_is_updated_in_place():
    """Layer after layer on a donated stacked pool: the compiled program copies no pool-sized buffer
    (a reshaped operand of the aliased call made XLA copy the whole pool before and after)."""
    S, H, d, R = 8, 2, 16, 3
    pool = jnp.zeros((2, 2, S, H, d, d))
    x, b = jnp.zeros((R, 1, H, d)), jnp.zeros((R, 1, H))

    def chain(pool, rows):
        for g in range(2):
            for j in range(2):
                pool = cpu_kernel.kda_recurrent_rows_cpu(pool, rows, x, x, x, x, b, layer=(g, j))[1]
        return pool

    txt = jax.jit(chain, donate_argnums=0).lower(pool, jnp.arange(R, dtype=jnp.int32)).compile().as_text()
    pool_shapes = ("f32[2,2,8,2,16,16]", "f32[4,8,2,16,16]")
    copies = [ln for ln in txt.splitlines() if "copy" in ln and any(s in ln.split("=")[1][:40] for s in pool_shapes)]
    assert not copies, copies
    assert txt.count('custom_call_target="ling_kda_recurrent"') == 4


def test_refuses_other_dtypes_and_shapes_by_name():
    x = jnp.zeros((1, 1, 1, 8), jnp.bfloat16)
    f = jnp.zeros((1, 1, 1, 8))
    with pytest.raises(TypeError, match="q must be float32"):
        cpu_kernel.kda_recurrent_rows_cpu(jnp.zeros((2, 1, 8, 8)), jnp.zeros((1,), jnp.int32), x, f, f, f,
                                          jnp.zeros((1, 1, 1)))
    with pytest.raises(ValueError, match=r"stacked pool is \[repeats,n,S,H,dk,dv\]"):
        cpu_kernel.kda_recurrent_rows_cpu(jnp.zeros((2, 1, 8, 8)), jnp.zeros((1,), jnp.int32), f, f, f, f,
                                          jnp.zeros((1, 1, 1)), layer=(0, 0))


def test_decode_with_the_kernel_equals_the_xla_reference(tiny_model, tiny_cfg):
    """`generate` (prefill in chunks, then decode in place on its cache: `kda.SlotKDAState`) gives the
    XLA reference's greedy tokens and logprobs within float32 (CPU's default turns it on)."""
    from ling_jax.exec_config import ExecConfig
    from ling_jax.generate import generate
    assert ExecConfig.for_backend("cpu").native_kda and not ExecConfig.for_backend("gpu").native_kda
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, n).tolist() for n in (1, 33, 20)]
    ex = tiny_model.exec.replace(prefill_chunk=16)
    native = generate(tiny_model, prompts, 10, stop_ids=(), exec=ex.replace(native_kda=True), logprobs=0)
    xla = generate(tiny_model, prompts, 10, stop_ids=(), exec=ex.replace(native_kda=False), logprobs=0)
    assert native.tokens == xla.tokens
    a, b = ([[t.logprob for t in row] for row in r.logprobs] for r in (native, xla))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) < 1e-4


def test_slot_state_twin_equals_the_kernel(tiny_model, tiny_cfg):
    """One decode step of the model on `SlotKDAState` caches (pool rows shuffled, a fresh row, a padding
    row): the native kernel and its XLA twin (`KimiDeltaAttention._slot_scan` without the kernel)
    give the same logits and pools within float32."""
    from ling_jax.config import KDA
    from ling_jax.kda import SlotKDAState
    from ling_jax.layer_stack import map_runs
    from ling_jax.model import HybridCache, init_cache
    S, R = 5, 3
    rng = np.random.default_rng(7)
    full = init_cache(tiny_cfg, S, 32, jnp.float32, with_mtp=False)
    rand = lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * 0.2)  # noqa: E731
    rows = jnp.asarray([3, 0, S], jnp.int32)
    fresh = jnp.asarray([False, True, False])

    def slots(run, c):
        if run.attn != KDA:
            return None
        convs = [rand(x)[:, :, :R] for x in (c.conv_q, c.conv_k, c.conv_v)]
        return SlotKDAState(rand(c.recurrent), *convs, rows, fresh)

    kda_layers = map_runs(tiny_cfg, slots, full.layers)
    # MLA layers: an empty contiguous cache of R rows (their tokens are not what is tested here)
    small = init_cache(tiny_cfg, R, 32, jnp.float32, with_mtp=False)
    layers = map_runs(tiny_cfg, lambda run, a, b: b if run.attn != KDA else a, kda_layers, small.layers)
    cache = HybridCache(layers, None, jnp.zeros((R,), jnp.int32), fresh)
    ids = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (R, 1)), jnp.int32)
    from ling_jax.call_mode import DECODE
    outs = {}
    for native in (True, False):
        ex = tiny_model.exec.replace(native_kda=native)
        out = tiny_model(ids, cache, exec=ex, mode=DECODE)
        pools = [c.recurrent for blk in out["cache"].layers for c in blk if isinstance(c, SlotKDAState)]
        outs[native] = (np.asarray(out["logits"]), [np.asarray(p) for p in pools])
    assert outs[True][1], "no SlotKDAState came back"
    # the real rows' logits (a padding row's output is meaningless: zero from the kernel, a clipped
    # slot's read-out from the twin)
    assert _rel(outs[True][0][:2], outs[False][0][:2].astype(np.float64)) < TOL
    for a, b in zip(outs[True][1], outs[False][1]):
        assert _rel(a, b.astype(np.float64)) < TOL
