"""Every Pallas kernel compiled (not only lowered) for TPU v5e, v5p, v6e and tpu7x through Mosaic and for
H100 / H200 through Triton, at Ling-3.1-flash widths and the engine's shapes.

No accelerator is needed: the compile-only devices of `ling_jax.aot.targets` run the real compilers on
this host (libtpu's Mosaic passes; XLA:GPU's Triton pipeline and ptxas), so a block shape, a VMEM or
shared-memory budget or an op the backend rejects fails here. Each case must come out as a kernel
custom call in the optimised HLO (`tpu_custom_call` / Triton): a kernel that fell back to interpret
mode (plain XLA ops) fails the test. KDA chunk: 64 tokens on TPU, 32 on GPU (the backends' defaults,
`ExecConfig.for_backend`; Triton compiles the 64-token chunk in ~6 min on this host, 32 in ~45 s).
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels._common import backend_platform
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas
from pallas_kernels.kda.step_kernel import kda_recurrent_scan_pallas, kda_recurrent_step_pallas
from pallas_kernels.mla.kernel import latent_attention_pallas
from pallas_kernels.mla.paged import paged_latent_attention_pallas

S_ = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
H, D = 64, 128

CASES = {
    "kda_chunk": (lambda *a, **kw: kda_chunk_scan_pallas(*a, 64, interpret=False, **kw),
                  [S_((1, 300, H, D), F32)] * 4 + [S_((1, 300, H), F32), S_((1, H, D, D), F32)]),
    "kda_step": (lambda *a, **kw: kda_recurrent_step_pallas(*a, interpret=False, **kw),
                 [S_((8, H, D, D), F32)] + [S_((8, H, D), F32)] * 4 + [S_((8, H), F32)]),
    "kda_scan": (lambda *a, **kw: kda_recurrent_scan_pallas(*a, interpret=False, **kw),  # T > 1: a lax.scan
                 [S_((2, 3, H, D), F32)] * 4 + [S_((2, 3, H), F32), S_((2, H, D, D), F32)]),
    "mla_decode": (lambda *a, **kw: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, **kw),
                   [S_((2, 1, H, 512), BF16), S_((2, 1, H, 64), BF16), S_((2, 4096, 512), BF16),
                    S_((2, 4096, 64), BF16), S_((2,), I32), S_((2, 1), I32)]),
    "mla_verify": (lambda *a, **kw: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, **kw),
                   [S_((1, 3, H, 512), BF16), S_((1, 3, H, 64), BF16), S_((1, 1000, 512), BF16),
                    S_((1, 1000, 64), BF16), S_((1,), I32), S_((1, 3), I32)]),
    # a prefill chunk of 2 x 64 tokens over an 8K cache: enough row blocks that no key split is needed
    "mla_prefill": (lambda *a, **kw: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, **kw),
                    [S_((2, 64, H, 512), BF16), S_((2, 64, H, 64), BF16), S_((2, 8192, 512), BF16),
                     S_((2, 8192, 64), BF16), S_((2,), I32), S_((2, 64), I32)]),
    # the engine's paged reads: 8 rows over a 512-page table of a scanned run's stacked pool at layer (g, j)
    "mla_paged_decode": (lambda q, qp, c, k, bt, n, pos, g, j, **kw: paged_latent_attention_pallas(
        q, qp, c, k, bt, n, pos, 192 ** -0.5, layer=(g, j), interpret=False, **kw),
        [S_((8, 1, H, 512), BF16), S_((8, 1, H, 64), BF16), S_((2, 1, 4096, 16, 512), BF16),
         S_((2, 1, 4096, 16, 64), BF16), S_((8, 512), I32), S_((8,), I32), S_((8, 1), I32), S_((), I32), S_((), I32)]),
    "mla_paged_prefill": (lambda q, qp, c, k, bt, n, pos, g, j, **kw: paged_latent_attention_pallas(
        q, qp, c, k, bt, n, pos, 192 ** -0.5, layer=(g, j), interpret=False, **kw),
        [S_((2, 64, H, 512), BF16), S_((2, 64, H, 64), BF16), S_((2, 1, 4096, 16, 512), BF16),
         S_((2, 1, 4096, 16, 64), BF16), S_((2, 512), I32), S_((2,), I32), S_((2, 64), I32), S_((), I32), S_((), I32)]),
    "fp8_linear": (lambda *a, **kw: fp8_linear_pallas(*a, interpret=False, **kw),
                   [S_((8, 4096), BF16), S_((576, 4096), jnp.float8_e4m3fn), S_((5, 32), F32)]),
}
TARGETS = {"tpu": ("v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"), "gpu": ("h100x1", "h200x1")}


@functools.lru_cache(maxsize=None)
def _device(name):
    from ling_jax.aot.targets import resolve_target
    return resolve_target(name).devices[0]


def _compile(plat, target, name):
    from ling_jax.aot.analysis import kernel_calls
    fn, args = CASES[name]
    if name == "kda_chunk" and plat == "gpu":
        fn = lambda *a, **kw: kda_chunk_scan_pallas(*a, 32, interpret=False, **kw)  # noqa: E731
    sh = jax.sharding.SingleDeviceSharding(_device(target))
    placed = [S_(a.shape, a.dtype, sharding=sh) for a in args]
    compiled = jax.jit(functools.partial(fn, platform=plat)).lower(*placed).compile()
    assert kernel_calls(compiled.as_text()) >= 1, f"{name} on {target}: no kernel in the compiled program"
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes > 0
    if name.startswith("mla_paged"):  # the pages read in place: less temp than a copy of the 128 MiB latent
        # pool (what remains: the float32 partials, 16 MiB for the prefill chunk, and on TPU a relayout of the
        # 16 MiB k_pe pool, 64 values per token in 128 lanes: 32 MiB)
        assert mem.temp_size_in_bytes < args[2].size * 2, (target, mem.temp_size_in_bytes)
    if name == "mla_prefill":  # float32 partials of at most a few key splits (was 1.07 GiB on GPU: 66 splits)
        assert mem.temp_size_in_bytes < 64 * 2 ** 20, (target, mem.temp_size_in_bytes)


@pytest.mark.parametrize("target", TARGETS["tpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_compiles_for_tpu(target, name):
    _compile("tpu", target, name)


@pytest.mark.parametrize("target", TARGETS["gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_compiles_for_gpu(target, name):
    _compile("gpu", target, name)


def test_paged_kernel_with_a_table_over_smem_compiles_for_tpu():
    """64 rows x 5,000 pages of block table (1.28 MB) do not fit the v5p's 1 MiB of SMEM, where the grid
    kernel scalar-prefetches the table: the kernel runs the rows in groups (`SMEM_TABLE_BYTES`). The real
    config's decode at 64 rows x 89K tokens was refused by Mosaic before ("would exceed memory ...
    prefetched SMEM operand 0")."""
    from ling_jax.aot.analysis import kernel_calls
    sh = jax.sharding.SingleDeviceSharding(_device("v5p:2x2x1"))
    args = [S_((64, 1, H, 512), BF16), S_((64, 1, H, 64), BF16), S_((2, 1, 4096, 16, 512), BF16),
            S_((2, 1, 4096, 16, 64), BF16), S_((64, 5000), I32), S_((64,), I32), S_((64, 1), I32), S_((), I32),
            S_((), I32)]
    fn = CASES["mla_paged_decode"][0]
    compiled = jax.jit(functools.partial(fn, platform="tpu")).lower(
        *[S_(a.shape, a.dtype, sharding=sh) for a in args]).compile()
    assert kernel_calls(compiled.as_text()) == 3  # 26 + 26 + 12 rows of 5,000 entries (520 KB a call)


def test_unknown_platform_is_rejected():
    with pytest.raises(ValueError, match="platform must be one of"):
        backend_platform("cuda")
    assert backend_platform("tpu") == "tpu"
