"""Pallas kernels for Ling-3.1-flash, each beside the pure-XLA reference it must equal.

A leaf package: it imports jax and nothing of `ling_jax` or `sharding`, so the model imports it
and never the reverse (tests/test_import_graph.py checks this). One folder per op:

    kda/reference.py     kda_recurrent_step, kda_recurrent_scan, kda_chunk_scan   (XLA)
    kda/chunk_kernel.py  kda_chunk_scan_pallas                                   (Pallas, prefill)
    kda/step_kernel.py   kda_recurrent_step_pallas, kda_recurrent_scan_pallas    (Pallas, decode)
    mla/reference.py     attention_mask, masked_softmax, latent_attention,       (XLA)
                         gather_pages, paged_latent_attention
    mla/kernel.py        latent_attention_pallas                                 (Pallas)
    mla/paged.py         paged_latent_attention_pallas                           (Pallas, pages read in place)
    mla/blockwise.py     blockwise_latent_attention, blockwise_expanded_attention (XLA, online
                         softmax over key blocks: the references' twins for long key sets)
    mla/cpu_kernel.py    paged_latent_attention_cpu, latent_attention_cpu      (native C++ on CPU,
                         latent_cpu.cc: the absorbed core over the cache or pages in place)
    experts/cpu_kernel.py experts_decode_cpu                                     (native C++ on CPU)
    native.py            NativeKernel: build a C++ FFI source on first use, cache, register
    fp8/blocks.py        DEFAULT_BLOCK, scale_grid_shape, check_block, check_scale_grid
    fp8/reference.py     block_dequant_fp8_jax, fp8_linear                       (XLA)
    fp8/kernel.py        fp8_linear_pallas                                       (Pallas)
    matmul.py            linear, einsum, precision: the model's matmul policy, used by the references
    _common.py           backend detection, interpret default, compiler parameters, in-kernel dot

A kernel takes the reference's arguments and returns what it returns (shapes and dtypes); extra
keyword arguments are tile sizes, `interpret` (None = interpret mode on CPU, for tests) and
`platform` (the target backend; None = the default one). Which
of the two the model runs is its execution config's choice (`ExecConfig.kernels`), not this
package's.
"""
