"""tools/bench_long_context.py's prediction (issue 22): counted FLOPs and bytes at the rates measured,
checked on hand-made rows against the arithmetic written out here."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_long_context",
                                               os.path.join(ROOT, "tools", "bench_long_context.py"))
blc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(blc)


@pytest.fixture(scope="module")
def cfg():
    from ling_jax.checkpoint.synthetic_config import synthetic_config
    return synthetic_config(**blc.MODEL)


def _rows(cfg, L0, L1, step0, step1):
    rows = []
    for L, step in ((L0, step0), (L1, step1)):
        g = blc.prefill_flops(cfg, L, 10 ** 6) / 1e9
        rows.append(dict(path="engine", tokens=L, prefill_s=g / 50.0, prefill_gflop=g, decode_step_median_s=step,
                         peak_rss_gib=1.0 + L / 2 ** 20, prefill_tok_s=L / (g / 50.0), decode_tok_s=1 / step))
    return rows


def test_counts_are_the_model_s_arithmetic(cfg):
    H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n_mla = sum(t == "mla" for t in cfg.layer_types)
    assert n_mla == 1 and (H, r, dr) == (4, 48, 16)
    assert blc.decode_attn_flops(cfg, 1000) == 2 * 4 * (2 * 48 + 16) * 1000
    assert blc.decode_attn_bytes(cfg, 262144) == 64 * 2 ** 20  # 256K keys of 64 float32 values: 64 MiB
    # three chunks of 2,048 over 5,000 tokens read 2,048 + 4,096 + 5,000 keys
    assert blc.prefill_attn_bytes(cfg, 5000, 2048) == blc.decode_attn_bytes(cfg, 2048 + 4096 + 5000)


@pytest.mark.parametrize("read_gbs", [1e6, 5.0])
def test_decode_prediction_is_the_larger_of_flops_and_bytes(cfg, read_gbs):
    L0, L1, step0 = 4096, 262144, 3e-3
    rows = _rows(cfg, L0, L1, step0, 9e-3)
    blc.predicted(cfg, rows, read_gbs)
    d_flops = 2 * 4 * 112 * (L1 - L0) / 50e9                   # at the shortest length's 50 GFLOP/s
    d_bytes = 4 * 64 * (L1 - L0) / (read_gbs * 1e9)
    want = step0 + max(d_flops, d_bytes)
    assert rows[1]["decode_tok_s_pred"] == pytest.approx(1 / want, rel=1e-9)
    assert rows[1]["decode_tok_s_pred_flops_only"] == pytest.approx(1 / (step0 + d_flops), rel=1e-9)
    assert rows[0]["decode_tok_s_pred"] == pytest.approx(1 / step0)  # the base row predicts itself
    if read_gbs > 1e3:  # memory free: the FLOPs alone, as before the thirty-eighth session
        assert rows[1]["decode_tok_s_pred"] == rows[1]["decode_tok_s_pred_flops_only"]
    else:  # 5 GB/s: 64 MiB take 13 ms, more than the FLOPs' 4.6 ms
        assert d_bytes > d_flops and rows[1]["decode_tok_s_pred"] < rows[1]["decode_tok_s_pred_flops_only"]
    assert rows[1]["peak_rss_gib_pred"] == pytest.approx(rows[1]["peak_rss_gib"])  # linear from the two rows


def test_stream_read_rate_is_measured():
    gbs = blc.stream_read_gbs(8 << 20, reps=3)
    assert 0.1 < gbs < 1e4  # a rate in GB/s, not a constant: each call times real reads
