"""The paged MLA kernel (`pallas_kernels.mla.paged`, interpret mode) against its XLA twin
`paged_latent_attention` (= the pages gathered into a contiguous cache, then `latent_attention` under
`attention_mask`), and the engine running it: paged-in-place = gathered.

Shuffled page tables (pages of a row anywhere in the pool, entries past a row's keys naming arbitrary
pages), ragged lengths (an empty row, a partial last page, a full table), a scanned run's stacked pool
read at a traced layer (g, j) and a single layer's pool, decode (T = 1) and verify/prefill chunks (T > 1,
causal), both drivers, several page sizes, pages per step and key splits. Tolerances: float32 1e-5,
bfloat16 1e-2 (relative), as for the contiguous kernel (tests/test_pallas_mla.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from pallas_kernels.mla.paged import paged_latent_attention_pallas
from pallas_kernels.mla.reference import gather_pages, paged_latent_attention
from test_pallas_mla import TOL, fast

H, R, DR = 2, 32, 16

CASES = [
    # T, page size, table width, kv_len per row, dtype, stacked, kernel kwargs
    (1, 8, 6, [0, 48, 13], "float32", True, {"mode": "grid"}),                              # empty row, full table
    (1, 4, 9, [1, 36, 22], "float32", False, {"mode": "grid", "pages_per_step": 4, "num_splits": 2}),
    (1, 8, 6, [5, 48, 17], "float32", True, {"mode": "loop", "num_splits": 4}),              # splits > pages of a row
    (3, 8, 5, [3, 40, 19], "float32", True, {"mode": "grid", "pages_per_step": 2}),          # verify chunk: causal
    (4, 16, 4, [64, 9, 30], "float32", False, {"mode": "loop"}),
    (3, 8, 5, [3, 40, 19], "bfloat16", True, {"mode": "grid"}),
    # a table over the SMEM budget: rows in groups of one (4 B x 6 entries > 20 B), then of two
    (1, 8, 6, [0, 48, 13], "float32", True, {"mode": "grid", "smem_table_bytes": 20}),
    (3, 8, 5, [3, 40, 19], "float32", False, {"mode": "grid", "smem_table_bytes": 40}),
]


def _inputs(seed, B, T, P, nb, kv_len, dtype, stacked):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    n_pages = B * nb + 5
    lead = (2, 3) if stacked else ()
    q_hat = jnp.asarray(rng.standard_normal((B, T, H, R)), dt)
    q_pe = jnp.asarray(rng.standard_normal((B, T, H, DR)), dt)
    c = jnp.asarray(rng.standard_normal(lead + (n_pages, P, R)), dt)
    k_pe = jnp.asarray(rng.standard_normal(lead + (n_pages, P, DR)), dt)
    table = rng.permutation(n_pages)[:B * nb].reshape(B, nb)
    for b, n in enumerate(kv_len):  # entries past the row's keys: any page (another row's, even)
        table[b, -(-n // P):] = rng.integers(0, n_pages, nb - (-(-n // P)))
    q_pos = np.asarray(kv_len)[:, None] - T + np.arange(T)[None, :]  # the row's last T keys are its queries
    return q_hat, q_pe, c, k_pe, jnp.asarray(table, jnp.int32), jnp.asarray(kv_len, jnp.int32), \
        jnp.asarray(q_pos, jnp.int32)


@pytest.mark.parametrize("T,P,nb,kv_len,dtype,stacked,kw", CASES)
def test_paged_kernel_matches_twin(T, P, nb, kv_len, dtype, stacked, kw):
    B = len(kv_len)
    q_hat, q_pe, c, k_pe, table, kv, q_pos = _inputs(T * 100 + P + nb, B, T, P, nb, kv_len, dtype, stacked)
    scale = 192 ** -0.5
    layer = (jnp.int32(1), jnp.int32(2)) if stacked else None

    def twin(qh, qp, c, kp, bt, n, pos, layer):
        return paged_latent_attention(qh, qp, c, kp, bt, n, pos, scale, layer=layer)

    def kern(qh, qp, c, kp, bt, n, pos, layer):
        return paged_latent_attention_pallas(qh, qp, c, kp, bt, n, pos, scale, layer=layer, **kw)

    ref = fast(twin)(q_hat, q_pe, c, k_pe, table, kv, q_pos, layer)
    out = fast(kern)(q_hat, q_pe, c, k_pe, table, kv, q_pos, layer)
    assert out.shape == ref.shape == (B, T, H, R) and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL[dtype]
    if min(kv_len) == 0:  # a row with no visible key gives zeros, as the twin
        assert not np.asarray(out[kv_len.index(0)], np.float32).any()


def test_gather_pages_is_the_contiguous_view():
    """The twin's gather (also `ling_jax.mla.paged_gather`): key p of row b is page table[b, p // P], offset
    p % P, of layer (g, j) of a stacked pool."""
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((2, 3, 7, 4, 5)).astype(np.float32)
    table = np.array([[3, 0, 6], [5, 5, 1]])
    got = np.asarray(gather_pages(jnp.asarray(pool), jnp.asarray(table), layer=(1, 2)))
    for b in range(2):
        for p in range(12):
            np.testing.assert_array_equal(got[b, p], pool[1, 2, table[b, p // 4], p % 4])


def test_engine_with_paged_kernel_gives_the_xla_engine_tokens(tiny_model):
    """The engine's decode and prefill programs with `kernels="pallas"` (the paged kernel reading the stacked
    pools in place, inside the layer scan; KDA kernels too) give the XLA engine's greedy tokens, over
    prompts of 1 token, exactly one page and several pages with a partial last one."""
    from ling_jax.serve import Engine, RequestParams
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, tiny_model.cfg.vocab_size, n).tolist() for n in (1, 8, 21)]
    tokens = {}
    for kernels in ("xla", "pallas"):
        ex = tiny_model.exec.replace(kernels=kernels, platform="cpu")
        eng = Engine(tiny_model, max_slots=4, page_size=8, num_pages=24, prefill_chunk=16, max_seq_len=48,
                     buckets=(16,), decode_rows=(4,), exec=ex)
        handles = [eng.submit(p, RequestParams(max_tokens=6)) for p in prompts]
        eng.run_until_done()
        tokens[kernels] = [h.generated for h in handles]
    assert tokens["pallas"] == tokens["xla"] and all(len(t) == 6 for t in tokens["xla"])


def test_engine_pallas_step_has_no_page_gather(tiny_model):
    """With the paged kernel (Pallas, or the native CPU kernel), the decode program's MLA reads no gathered
    [rows, width·P, r] copy of the pages: no gather in the compiled program has a [rows, width, P, r or dr]
    result (the XLA forms' engine has them)."""
    from ling_jax.serve import Engine
    import re
    cfg = tiny_model.cfg

    def gathered_copies(kernels, native=False):
        ex = tiny_model.exec.replace(kernels=kernels, platform="cpu", native_attention=native)
        eng = Engine(tiny_model, max_slots=2, page_size=8, num_pages=16, prefill_chunk=16, max_seq_len=64,
                     buckets=(16,), decode_rows=(2,), exec=ex)
        name, program, args = next(c for c in eng.program_calls() if c[0].startswith("decode"))
        text = program.lower(*args).compile().as_text()
        nb = max(eng.runner.widths)  # pages of each row: [rows, nb, P, r] gathered
        shape = rf"\[2,{nb},8,(?:{cfg.kv_lora_rank}|{cfg.qk_rope_head_dim})\]"
        return len(re.findall(rf"= \w+{shape}\S* gather\(", text))

    assert gathered_copies("xla") >= 1
    assert gathered_copies("pallas") == 0
    assert gathered_copies("xla", native=True) == 0
