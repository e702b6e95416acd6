"""Long prompts: chunked `forward` / `generate` prefill equal the whole-sequence forms and the
float64 reference, and their peak memory is bounded by the chunk (issue 22)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax.numpy as jnp

import np_reference as R
from conftest import rel_err
from ling_jax.forward import forward
from ling_jax.generate import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chunked_forward_equals_whole_and_float64(tiny_model, tiny_cfg, tiny_params):
    """Chunks of 16 tokens (KDA states and MLA cache carried; MTP inputs shifted across chunk ends),
    attention blocks of 8 keys, ragged rows: the same logits, MTP logits and routing as one call,
    and the float64 reference's logits."""
    V = tiny_cfg.vocab_size
    rng = np.random.default_rng(5)
    ids = rng.integers(0, V, size=(2, 45)).astype(np.int32)
    nv = np.array([45, 30], np.int32)
    whole = forward(tiny_model, ids, n_valid=nv, mtp=True)
    ex = tiny_model.exec.replace(prefill_chunk=16, attn_block=8)
    chunked = forward(tiny_model, ids, n_valid=nv, mtp=True, exec=ex)
    # one call, the expanded form over key blocks of 8 (on a scanned CPU model its up-projection reads
    # kv_b_proj's stored rows: `linear.TableRows.apply`)
    blocks = forward(tiny_model, ids, n_valid=nv, exec=tiny_model.exec.replace(attn_block=8))
    for b, n in enumerate(nv):
        assert rel_err(chunked["logits"][b, :n], whole["logits"][b, :n]) < 1e-5
        assert rel_err(chunked["mtp_logits"][b, :n - 1], whole["mtp_logits"][b, :n - 1]) < 1e-5
        assert rel_err(blocks["logits"][b, :n], whole["logits"][b, :n]) < 1e-5
        ref = R.forward(tiny_params, tiny_cfg, ids[b, :n], mtp=True)
        assert rel_err(chunked["logits"][b, :n], ref["logits"]) < 1e-4
        assert rel_err(chunked["mtp_logits"][b, :n], ref["mtp_logits"]) < 1e-4
    for layer, idx in whole["routing"].items():
        same = np.all(np.sort(np.asarray(chunked["routing"][layer][0]), -1) == np.sort(np.asarray(idx[0]), -1), -1)
        assert same.mean() > 0.95, layer


def test_chunked_generate_prefill_equals_one_call_and_float64(tiny_model, tiny_cfg, tiny_params):
    """Prompts of 40 and 13 tokens prefilled in chunks of 16 (the short one ends in the first chunk)
    give the same greedy tokens as a single prefill call, and each prompt's first-token
    log-probability is the float64 reference's."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, size=n).tolist() for n in (40, 13)]
    one = generate(tiny_model, prompts, 8)
    chunked = generate(tiny_model, prompts, 8, logprobs=0, exec=tiny_model.exec.replace(prefill_chunk=16, attn_block=8))
    assert chunked.tokens == one.tokens
    for b, prompt in enumerate(prompts):
        ref = R.forward(tiny_params, tiny_cfg, np.asarray(prompt), mtp=False)["logits"][-1]
        ref_lp = ref - (np.log(np.exp(ref - ref.max()).sum()) + ref.max())
        tok = chunked.tokens[b][0]
        assert tok == int(np.argmax(ref))
        assert abs(chunked.logprobs[b][0].logprob - ref_lp[tok]) < 1e-4


@pytest.mark.slow
def test_chunked_generate_prefill_with_speculation_equals_one_call(tiny_model, tiny_cfg):
    """With MTP speculation the MTP cache is built across the chunk ends (fresh first chunk, then
    each token paired with the hidden before it): the same tokens as one prefill call."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, size=n).tolist() for n in (40, 13)]
    one = generate(tiny_model, prompts, 8, speculative=1)
    chunked = generate(tiny_model, prompts, 8, speculative=1,
                       exec=tiny_model.exec.replace(prefill_chunk=16, attn_block=8))
    assert chunked.tokens == one.tokens


PEAK_RSS_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp
    from flax import nnx
    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.model import LingForCausalLM
    from ling_jax.forward import forward
    T, chunk = int(sys.argv[1]), int(sys.argv[2])
    # the real layer pattern (7 KDA + 1 MLA per group of 8), hidden 256, 4 heads
    cfg = synthetic_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8,
                           vocab_size=4096, pad_token_id=4094, eos_token_id=4095, max_position_embeddings=T)
    model = LingForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), with_mtp=False)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, T)).astype(np.int32)
    out = forward(model, ids, exec=model.exec.replace(prefill_chunk=chunk))
    lg = np.asarray(out["logits"])
    assert lg.shape == (1, T, cfg.vocab_size) and np.isfinite(lg).all()
    # VmHWM, this process's own high-water mark: ru_maxrss keeps the parent's peak across the spawn
    # (Linux records the old address space's at exec), so it read the pytest worker's RSS, not this run's
    print("peak_rss_kib", [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0])
""")


def peak_rss_gib(T: int, chunk: int) -> float:
    """Peak resident memory (GiB) of a fresh process running `forward` over T tokens of the
    hidden-256 real-pattern model (measured by the process itself: its VmHWM, not an address-space
    limit, since XLA reserves much more virtual memory than it touches; not ru_maxrss, which a spawned
    process inherits from its parent)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one host device, as `ling-jax logits` runs
    r = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(T), str(chunk)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    kib = int(r.stdout.split("peak_rss_kib")[1].split()[0])
    return kib / 2**20


@pytest.mark.slow
def test_logits_over_16k_tokens_stays_under_3_gib():
    """Issue 22: 16,384 tokens peaked at 13.3 GiB with the dense score tensor; the chunked,
    blockwise forward must stay under 3 GiB (the [1,16384,4096] float32 logits alone are 0.25 GiB).
    The dense [B,H,T,T] float32 scores of this prompt would be 4 GiB per MLA layer, over the budget."""
    T = 16384
    assert 1 * 4 * T * T * 4 / 2**30 > 3.0  # the dense form could not fit this test's budget
    gib = peak_rss_gib(T, 2048)
    print(f"peak RSS over {T} tokens: {gib:.2f} GiB")
    assert gib < 3.0, gib


@pytest.mark.slow
def test_engine_prefill_reads_pages_up_to_its_width_bucket(tiny_model, tiny_cfg):
    """Prefill chunks run at the block-table width bucket of their rows' lengths (2 or 12 pages of 8),
    not always at max_blocks: the tokens equal `generate` (which attends over a contiguous cache), every
    width was used, and nothing compiles after warm-up (buckets x widths programs)."""
    from conftest import xla_compiles
    from ling_jax.serve import Engine, RequestParams

    eng = Engine(tiny_model, max_slots=2, page_size=8, num_pages=24, prefill_chunk=16, prefill_rows=2,
                 max_seq_len=96, buckets=(16,), widths=(2, 12))
    eng.warmup()
    assert eng.runner.prefill_fn._cache_size() >= 1 * 2
    widths, program = [], eng.runner.prefill_fn

    def spy(params, pools, inp, *snaps):
        widths.append(inp.block_table.shape[1])
        return program(params, pools, inp, *snaps)

    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, size=n).tolist() for n in (5, 70)]
    eng.runner.prefill_fn = spy
    try:
        with xla_compiles() as events:
            handles = [eng.submit(p, RequestParams(max_tokens=6)) for p in prompts]
            eng.run_until_done()
    finally:
        eng.runner.prefill_fn = program
    assert events == []
    assert set(widths) == {2, 12}, widths  # the short prompt's chunk gathered 2 pages, not 12
    want = generate(tiny_model, prompts, 6, stop_ids=()).tokens
    assert [h.generated for h in handles] == want


def test_kda_chunked_over_8k_tokens_matches_float64():
    """KDA prefill (the float32 chunked scan, chunks of 16 and 64) over 8,192 tokens with slowly
    decaying channels stays at float32 rounding of the float64 recurrence, outputs at the end of the
    prompt and final state included (`tools/measure_kda_drift.py` does 16K…256K)."""
    import jax
    import importlib.util

    from pallas_kernels.kda.reference import kda_chunk_scan

    spec = importlib.util.spec_from_file_location("kda_drift", os.path.join(ROOT, "tools", "measure_kda_drift.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    T, H, dk = 8192, 2, 16
    q, k, v, g, beta = tool.prepared_inputs(T, H, dk, dk, seed=3)
    o64, s64 = R.kda_recurrent(q, k, v, g, beta, normalize=False)  # the independent float64 reference
    s0 = jnp.zeros((1, H, dk, dk), jnp.float32)
    for c in (16, 64):
        o, s = jax.jit(kda_chunk_scan, static_argnames="chunk_size")(*(jnp.asarray(a)[None] for a in (q, k, v, g, beta)),
                                                                    s0, chunk_size=c)
        o, s = np.asarray(o[0]), np.asarray(s[0])
        assert rel_err(o, o64) < 1e-5, c
        assert rel_err(o[-1024:], o64[-1024:]) < 1e-5, c
        assert rel_err(s, s64) < 1e-5, c
