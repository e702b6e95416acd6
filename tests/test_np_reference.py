"""Self-consistency tests of the float64 NumPy reference (tests/np_reference.py)."""
import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import np_reference as ref  # noqa: E402

from ling_jax.config import LingConfig  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_CONFIG = next((p for p in (os.path.join(_ROOT, "shared", "spec", "config.ling-3.1-flash.json"),
                                os.path.join(_ROOT, "..", "shared", "spec", "config.ling-3.1-flash.json"))
                    if os.path.exists(p)), "")


@pytest.fixture(scope="module")
def cfg():
    return ref.tiny_config()


@pytest.fixture(scope="module")
def params(cfg):
    return ref.random_params(cfg, seed=0)


def _ids(cfg, T, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, T)


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------
def test_layer_types_tiny_trailing_group(cfg):
    t = ref.layer_types(cfg)
    assert [i for i, x in enumerate(t) if x == ref.MLA] == [3, 7, 8, 9]


def test_layer_types_real_config():
    path = os.environ.get("LING_SPEC_CONFIG", SPEC_CONFIG)
    if not os.path.exists(path):
        pytest.skip("spec config not present")
    with open(path) as f:
        real = LingConfig.from_dict(json.load(f))
    t = ref.layer_types(real)
    assert [i for i, x in enumerate(t) if x == ref.MLA] == list(range(7, 72, 8))
    assert ref.swiglu_limits(real, 64) == (0.0, 5.0)
    assert ref.swiglu_limits(real, 65) == (4.0, 5.0)
    assert ref.swiglu_limits(real, 71) == (4.0, 7.0)
    assert ref.swiglu_limits(real, 72) == (0.0, 0.0)  # MTP layer unclamped
    assert ref.swiglu_limits(real, 71, clamp=False) == (0.0, 0.0)
    # rope width is qk_rope_head_dim regardless of partial_rotary_factor / rotary_dim
    inv, af = ref.rope_inv_freq(real)
    assert inv.shape == (32,) and af == 1.0
    assert ref.mla_softmax_scale(real) == pytest.approx(192 ** -0.5)


# ---------------------------------------------------------------------------------------------
# KDA pieces
# ---------------------------------------------------------------------------------------------
def _kda_inputs(T=37, H=2, dk=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, H, dk))
    k = rng.standard_normal((T, H, dk))
    v = rng.standard_normal((T, H, dv))
    f = rng.standard_normal((T, H * dk))
    A_log = np.log(rng.uniform(1, 16, H))
    dt_bias = 0.1 * rng.standard_normal(H * dk)
    g = ref.kda_gate(f, A_log, dt_bias, -5.0)
    beta = ref.sigmoid(rng.standard_normal((T, H)))
    S0 = rng.standard_normal((H, dk, dv))
    return q, k, v, g, beta, S0


def test_kda_gate_range_and_form():
    rng = np.random.default_rng(3)
    f = rng.standard_normal((5, 2 * 4))
    A_log = np.array([0.3, 2.0])
    dt = rng.standard_normal(8)
    g = ref.kda_gate(f, A_log, dt, -5.0)
    assert g.shape == (5, 2, 4)
    assert np.all(g < 0) and np.all(g > -5)
    h, d = 1, 2
    expect = -5.0 / (1 + np.exp(-np.exp(A_log[h]) * (f[:, h * 4 + d] + dt[h * 4 + d])))
    np.testing.assert_allclose(g[:, h, d], expect, rtol=1e-14)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_kda_chunked_equals_recurrent(chunk):
    q, k, v, g, beta, S0 = _kda_inputs()
    o_r, s_r = ref.kda_recurrent(q, k, v, g, beta, S0)
    o_c, s_c = ref.kda_chunked(q, k, v, g, beta, S0, chunk)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-10, atol=1e-10)
    # zero initial state too
    o_r0, s_r0 = ref.kda_recurrent(q, k, v, g, beta, None)
    o_c0, s_c0 = ref.kda_chunked(q, k, v, g, beta, None, chunk)
    np.testing.assert_allclose(o_c0, o_r0, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(s_c0, s_r0, rtol=1e-10, atol=1e-10)


def test_kda_recurrent_matches_closed_form_and_normalize_flag():
    q, k, v, g, beta, S0 = _kda_inputs(T=9, seed=5)
    o, S = ref.kda_recurrent(q, k, v, g, beta, S0)
    # S_t = (I - b k k^T) Diag(e^g) S_{t-1} + b k v^T,  o_t = S_t^T q̄_t   per head
    dk = q.shape[-1]
    for h in range(q.shape[1]):
        St = S0[h].copy()
        for t in range(q.shape[0]):
            kt = k[t, h] / math.sqrt(np.sum(k[t, h] ** 2) + 1e-6)
            qt = q[t, h] / math.sqrt(np.sum(q[t, h] ** 2) + 1e-6) / math.sqrt(dk)
            St = (np.eye(dk) - beta[t, h] * np.outer(kt, kt)) @ np.diag(np.exp(g[t, h])) @ St \
                + beta[t, h] * np.outer(kt, v[t, h])
            np.testing.assert_allclose(o[t, h], St.T @ qt, rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(S[h], St, rtol=1e-11, atol=1e-12)
    qn = ref.l2_normalize(q) / math.sqrt(dk)
    kn = ref.l2_normalize(k)
    o2, S2 = ref.kda_recurrent(qn, kn, v, g, beta, S0, normalize=False)
    np.testing.assert_allclose(o2, o, rtol=1e-13, atol=1e-13)


def test_kda_recurrent_split_state():
    q, k, v, g, beta, S0 = _kda_inputs(T=20, seed=2)
    o, S = ref.kda_recurrent(q, k, v, g, beta, S0)
    o1, S1 = ref.kda_recurrent(q[:7], k[:7], v[:7], g[:7], beta[:7], S0)
    o2, S2 = ref.kda_recurrent(q[7:], k[7:], v[7:], g[7:], beta[7:], S1)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(S2, S, rtol=1e-12, atol=1e-13)


def test_short_conv_taps_and_state():
    rng = np.random.default_rng(0)
    T, C, K = 11, 5, 4
    u = rng.standard_normal((T, C))
    taps = rng.standard_normal((C, K))
    y, st = ref.short_conv(u, taps)
    # explicit definition: y_t = SiLU(sum_j w[j] u_{t-(K-1)+j}), zeros before the start
    for t in range(T):
        acc = np.zeros(C)
        for j in range(K):
            s = t - (K - 1) + j
            if s >= 0:
                acc += taps[:, j] * u[s]
        np.testing.assert_allclose(y[t], acc / (1 + np.exp(-acc)), rtol=1e-13)
    np.testing.assert_array_equal(st, u[-(K - 1):])
    # only the last tap -> current token
    only_last = np.zeros((C, K))
    only_last[:, -1] = 2.0
    y2, _ = ref.short_conv(u, only_last)
    np.testing.assert_allclose(y2, ref.silu(2.0 * u), rtol=1e-14)
    # split with carried state
    ya, sa = ref.short_conv(u[:2], taps)
    yb, sb = ref.short_conv(u[2:], taps, sa)
    np.testing.assert_allclose(np.concatenate([ya, yb]), y, rtol=1e-13)
    np.testing.assert_array_equal(sb, st)


def test_norms():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16))
    w = rng.standard_normal(16)
    g = rng.standard_normal((3, 16))
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6),
                               w * x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6), rtol=1e-14)
    np.testing.assert_allclose(ref.l2_normalize(x), x / np.sqrt((x ** 2).sum(-1, keepdims=True) + 1e-6),
                               rtol=1e-14)
    np.testing.assert_allclose(ref.gated_rms_norm(x, g, w, 1e-6),
                               ref.rms_norm(x, w, 1e-6) / (1 + np.exp(-g)), rtol=1e-14)
    # eps inside the sqrt, added to the sum: a zero vector stays finite (0)
    assert np.all(ref.l2_normalize(np.zeros(4)) == 0)


# ---------------------------------------------------------------------------------------------
# whole model: split calls, causality, absorbed MLA
# ---------------------------------------------------------------------------------------------
def test_forward_shapes(cfg, params):
    T = 7
    out = ref.forward(params, cfg, _ids(cfg, T), mtp=True)
    assert out["logits"].shape == (T, cfg.vocab_size)
    assert out["mtp_logits"].shape == (T, cfg.vocab_size)
    assert out["hidden_normed"].shape == (T, cfg.hidden_size)
    assert sorted(out["routing"]) == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers + 1))
    assert np.isfinite(out["logits"]).all() and np.isfinite(out["mtp_logits"]).all()
    st = out["state"]
    assert st["offset"] == T
    H, dk, K = cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    assert st["layers"][0]["recurrent"].shape == (H, dk, dk)
    assert st["layers"][0]["conv_q"].shape == (K - 1, H * dk)
    assert st["layers"][3]["c"].shape == (T, cfg.kv_lora_rank)
    assert st["layers"][cfg.num_hidden_layers]["k_pe"].shape == (T, cfg.qk_rope_head_dim)
    # routing is not degenerate: several experts are used
    assert len(np.unique(out["routing"][5])) >= 4


@pytest.mark.parametrize("splits", [[5], [1], [4, 9, 10]])
def test_forward_split_equals_one_call(cfg, params, splits):
    T = 12
    ids = _ids(cfg, T)
    full = ref.forward(params, cfg, ids, mtp=True)
    state, logits, mtp_logits, routing = None, [], [], {}
    bounds = [0] + splits + [T]
    for a, b in zip(bounds[:-1], bounds[1:]):
        nxt = int(ids[b]) if b < T else None
        o = ref.forward(params, cfg, ids[a:b], state=state, mtp=True, mtp_next_id=nxt)
        state = o["state"]
        logits.append(o["logits"])
        mtp_logits.append(o["mtp_logits"])
        for k, v in o["routing"].items():
            routing.setdefault(k, []).append(v)
    np.testing.assert_allclose(np.concatenate(logits), full["logits"], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.concatenate(mtp_logits), full["mtp_logits"], rtol=1e-10, atol=1e-10)
    for k, v in full["routing"].items():
        np.testing.assert_array_equal(np.concatenate(routing[k]), v)
    for i, s in full["state"]["layers"].items():
        for key, val in s.items():
            np.testing.assert_allclose(state["layers"][i][key], val, rtol=1e-10, atol=1e-10)


def test_forward_causal(cfg, params):
    T, t0 = 12, 6
    ids = _ids(cfg, T)
    ids2 = ids.copy()
    ids2[t0:] = (ids2[t0:] + 1 + np.arange(T - t0)) % cfg.vocab_size
    a = ref.forward(params, cfg, ids, mtp=True)
    b = ref.forward(params, cfg, ids2, mtp=True)
    np.testing.assert_allclose(b["logits"][:t0], a["logits"][:t0], rtol=1e-12, atol=1e-12)
    # MTP slot t reads x_{t+1}: slots < t0-1 are unaffected
    np.testing.assert_allclose(b["mtp_logits"][:t0 - 1], a["mtp_logits"][:t0 - 1], rtol=1e-12, atol=1e-12)
    assert not np.allclose(b["logits"][t0:], a["logits"][t0:])
    assert not np.allclose(b["mtp_logits"][t0 - 1], a["mtp_logits"][t0 - 1])


def test_mla_absorbed_equals_expanded(cfg, params):
    rng = np.random.default_rng(7)
    T = 9
    x = rng.standard_normal((T, cfg.hidden_size))
    pos = np.arange(T) + 3
    for layer in (3, cfg.num_hidden_layers):
        pre = f"model.layers.{layer}"
        e, ce = ref.mla_layer(params, pre, x, pos, cfg)
        a, ca = ref.mla_layer_absorbed(params, pre + ".attention", x, pos, cfg)
        np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12)
        # split with the (shared-format) cache, crossing forms
        e1, c1 = ref.mla_layer(params, pre, x[:4], pos[:4], cfg)
        a2, _ = ref.mla_layer_absorbed(params, pre, x[4:], pos[4:], cfg, cache=c1)
        np.testing.assert_allclose(np.concatenate([e1, a2]), e, rtol=1e-10, atol=1e-12)
    full_e = ref.forward(params, cfg, _ids(cfg, 8), mtp=True)
    full_a = ref.forward(params, cfg, _ids(cfg, 8), mtp=True, mla_absorbed=True)
    np.testing.assert_allclose(full_a["logits"], full_e["logits"], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(full_a["mtp_logits"], full_e["mtp_logits"], rtol=1e-10, atol=1e-10)


def test_mla_without_q_lora():
    cfg = ref.tiny_config(q_lora_rank=None, num_hidden_layers=4, expert_swiglu_limit_list=[0.0] * 4,
                          share_expert_swiglu_limit_list=[0.0] * 4)
    assert cfg.q_lora_rank is None
    params = ref.random_params(cfg, seed=3)
    assert "model.layers.3.attention.q_proj.weight" in params
    assert "model.layers.3.attention.q_a_proj.weight" not in params
    ids = _ids(cfg, 8)
    e = ref.forward(params, cfg, ids, mtp=True)
    a = ref.forward(params, cfg, ids, mtp=True, mla_absorbed=True)
    np.testing.assert_allclose(a["logits"], e["logits"], rtol=1e-10, atol=1e-10)
    o1 = ref.forward(params, cfg, ids[:3], mtp=True, mtp_next_id=int(ids[3]))
    o2 = ref.forward(params, cfg, ids[3:], state=o1["state"], mtp=True)
    np.testing.assert_allclose(np.concatenate([o1["logits"], o2["logits"]]), e["logits"], rtol=1e-10,
                               atol=1e-10)


def test_mla_scale_and_positions(cfg, params):
    """A constant position shift of all tokens leaves MLA output unchanged (relative RoPE)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, cfg.hidden_size))
    a, _ = ref.mla_layer(params, "model.layers.7", x, np.arange(6), cfg)
    b, _ = ref.mla_layer(params, "model.layers.7", x, np.arange(6) + 1000, cfg)
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-11)
    c, _ = ref.mla_layer(params, "model.layers.7", x, np.arange(6) * 2, cfg)
    assert not np.allclose(c, a)


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------
def _kept_groups(sel_row, n_group, topk_group):
    g = sel_row.reshape(n_group, -1)
    gs = np.sort(g, axis=1)[:, -2:].sum(1)
    return set(np.argsort(-gs, kind="stable")[:topk_group].tolist())


def test_router_groups_and_weights(cfg, params):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, cfg.hidden_size))
    gw = params["model.layers.5.mlp.gate.weight"]
    bias = params["model.layers.5.mlp.gate.expert_bias"]
    idx, w = ref.router(x, gw, bias, cfg)
    assert idx.shape == (50, cfg.num_experts_per_tok) and w.shape == idx.shape
    per_group = cfg.num_experts // cfg.n_group
    scores = 1 / (1 + np.exp(-(x @ gw.T)))
    sel = scores + bias
    for t in range(50):
        kept = _kept_groups(sel[t], cfg.n_group, cfg.topk_group)
        assert {int(e) // per_group for e in idx[t]} <= kept
        assert len(set(idx[t].tolist())) == cfg.num_experts_per_tok
        # the chosen are the top-k biased scores among the kept groups
        allowed = [e for e in range(cfg.num_experts) if e // per_group in kept]
        best = sorted(allowed, key=lambda e: -sel[t, e])[:cfg.num_experts_per_tok]
        assert set(best) == set(idx[t].tolist())
        # weights: unbiased scores, normalised, x routed_scaling_factor
        s = scores[t, idx[t]]
        np.testing.assert_allclose(w[t], 2.5 * s / s.sum(), rtol=1e-13)
    np.testing.assert_allclose(w.sum(1), cfg.routed_scaling_factor, rtol=1e-13)
    # forced routing keeps indices, recomputes weights from unbiased scores
    forced = np.tile(np.array([7, 0, 2]), (50, 1))
    fi, fw = ref.router(x, gw, bias, cfg, forced_idx=forced)
    np.testing.assert_array_equal(fi, forced)
    s = scores[:, [7, 0, 2]]
    np.testing.assert_allclose(fw, 2.5 * s / s.sum(1, keepdims=True), rtol=1e-13)


def test_router_group_score_is_top2_sum():
    cfg = ref.tiny_config(num_experts=12, n_group=3, topk_group=1, num_experts_per_tok=2)
    x = np.ones((1, cfg.hidden_size))
    gw = np.zeros((12, cfg.hidden_size))  # all unbiased scores = 0.5
    bias = np.full(12, -0.45)
    bias[0] = 0.4      # group 0: one big expert -> top-2 sum 0.9 + 0.05 = 0.95
    bias[4] = bias[5] = 0.1  # group 1: two medium experts -> top-2 sum 0.6 + 0.6 = 1.2
    idx, w = ref.router(x, gw, bias, cfg)
    assert set(idx[0].tolist()) == {4, 5}  # a max-based group score would have picked group 0
    np.testing.assert_allclose(w[0], [1.25, 1.25])


def test_router_minus_inf_masking():
    """With all biased scores negative, a zero fill would select experts from dropped groups."""
    cfg = ref.tiny_config()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((20, cfg.hidden_size))
    gw = rng.standard_normal((cfg.num_experts, cfg.hidden_size)) / 8
    bias = np.full(cfg.num_experts, -2.0) + 0.01 * rng.standard_normal(cfg.num_experts)
    idx, _ = ref.router(x, gw, bias, cfg)
    sel = 1 / (1 + np.exp(-(x @ gw.T))) + bias
    per_group = cfg.num_experts // cfg.n_group
    n_zero_fill_wrong = 0
    for t in range(20):
        kept = _kept_groups(sel[t], cfg.n_group, cfg.topk_group)
        assert {int(e) // per_group for e in idx[t]} <= kept
        masked0 = np.array([sel[t, e] if e // per_group in kept else 0.0 for e in range(cfg.num_experts)])
        zero_fill = set(np.argsort(-masked0, kind="stable")[:cfg.num_experts_per_tok].tolist())
        if zero_fill != set(idx[t].tolist()):
            n_zero_fill_wrong += 1
    assert n_zero_fill_wrong == 20  # the case really exercises the -inf fill


# ---------------------------------------------------------------------------------------------
# SwiGLU clamp
# ---------------------------------------------------------------------------------------------
def test_swiglu_clamp_formula():
    rng = np.random.default_rng(0)
    x = 3 * rng.standard_normal((6, 8))
    wg, wu, wd = rng.standard_normal((5, 8)), rng.standard_normal((5, 8)), rng.standard_normal((8, 5))
    lam = 0.7
    gate = x @ wg.T
    up = x @ wu.T
    act = gate / (1 + np.exp(-gate))
    expect = (np.minimum(act, lam) * np.clip(up, -lam, lam)) @ wd.T
    np.testing.assert_allclose(ref.swiglu(x, wg, wu, wd, lam), expect, rtol=1e-12, atol=1e-12)
    plain = (act * up) @ wd.T
    np.testing.assert_allclose(ref.swiglu(x, wg, wu, wd, 0.0), plain, rtol=1e-12, atol=1e-12)
    assert not np.allclose(expect, plain)
    # clamp is after SiLU and from above only on the gate branch (SiLU's negative lobe passes)
    assert act.min() < 0 and np.any(act > lam)


def test_clamp_changes_outputs(cfg, params):
    rng = np.random.default_rng(1)
    N = cfg.num_hidden_layers
    x = rng.standard_normal((10, cfg.hidden_size))
    on, i_on = ref.moe_layer(params, f"model.layers.{N - 1}", x, cfg, N - 1)
    off, i_off = ref.moe_layer(params, f"model.layers.{N - 1}.mlp", x, cfg, N - 1, clamp=False)
    np.testing.assert_array_equal(i_on, i_off)
    assert np.max(np.abs(on - off)) > 1e-3
    # unclamped early MoE layer and the (always unclamped) MTP layer do not react to the flag
    for layer in (2, N):
        a, _ = ref.moe_layer(params, f"model.layers.{layer}", x, cfg, layer)
        b, _ = ref.moe_layer(params, f"model.layers.{layer}", x, cfg, layer, clamp=False)
        np.testing.assert_array_equal(a, b)
    ids = _ids(cfg, 8)
    fa = ref.forward(params, cfg, ids)
    fb = ref.forward(params, cfg, ids, clamp=False)
    assert np.max(np.abs(fa["logits"] - fb["logits"])) > 1e-4
    # forced routing reproduces the free routing exactly
    fc = ref.forward(params, cfg, ids, clamp=False, forced_routing=fb["routing"])
    np.testing.assert_array_equal(fc["logits"], fb["logits"])


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------
def test_rope_interleaved_properties(cfg):
    rng = np.random.default_rng(0)
    d = cfg.qk_rope_head_dim
    inv, af = ref.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, cfg.rope_theta ** (-np.arange(0, d, 2) / d), rtol=1e-14)
    assert af == 1.0
    T = 20
    pos = np.arange(T) * 7 + 3
    q = rng.standard_normal((T, d))
    k = rng.standard_normal((T, d))
    qr = ref.apply_rope_interleaved(q, pos, inv)
    np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-13)
    # adjacent pairs: pair i rotates like the complex number (x_2i + i x_2i+1) * e^{i p θ_i}
    z = (q[:, 0::2] + 1j * q[:, 1::2]) * np.exp(1j * pos[:, None] * inv[None])
    np.testing.assert_allclose(qr[:, 0::2], z.real, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(qr[:, 1::2], z.imag, rtol=1e-12, atol=1e-12)
    # q.k depends only on the position difference
    q1, k1 = q[0], k[0]
    dots = []
    for m, n in [(5, 2), (105, 102), (1003, 1000)]:
        a = ref.apply_rope_interleaved(q1[None], np.array([m]), inv)[0]
        b = ref.apply_rope_interleaved(k1[None], np.array([n]), inv)[0]
        dots.append(a @ b)
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)
    a = ref.apply_rope_interleaved(q1[None], np.array([6]), inv)[0]
    b = ref.apply_rope_interleaved(k1[None], np.array([2]), inv)[0]
    assert abs(a @ b - dots[0]) > 1e-6
    # leading head axis works
    qh = rng.standard_normal((3, T, d))
    np.testing.assert_allclose(ref.apply_rope_interleaved(qh, pos, inv)[1],
                               ref.apply_rope_interleaved(qh[1], pos, inv), rtol=1e-15)


def test_yarn():
    base = dict(rope_theta=10000.0, max_position_embeddings=4096)
    one = ref.tiny_config(rope_scaling={"rope_type": "yarn", "factor": 1.0,
                                         "original_max_position_embeddings": 4096}, **base)
    plain = ref.tiny_config(**base)
    np.testing.assert_allclose(ref.rope_inv_freq(one)[0], ref.rope_inv_freq(plain)[0], rtol=1e-14)
    assert ref.rope_inv_freq(one)[1] == 1.0
    s = 4.0
    y = ref.tiny_config(qk_rope_head_dim=64, qk_head_dim=80,
                        rope_scaling={"rope_type": "yarn", "factor": s, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
                        **base)
    inv, af = ref.rope_inv_freq(y)
    extra = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    d, L0, b = 64, 4096, 10000.0
    lo = math.floor(d * math.log(L0 / (2 * math.pi * 32)) / (2 * math.log(b)))
    hi = math.ceil(d * math.log(L0 / (2 * math.pi * 1)) / (2 * math.log(b)))
    assert 0 < lo < hi < 31
    np.testing.assert_allclose(inv[:lo + 1], extra[:lo + 1], rtol=1e-14)   # extrapolated (high freq)
    np.testing.assert_allclose(inv[hi:], extra[hi:] / s, rtol=1e-14)       # interpolated (low freq)
    assert np.all(inv[lo + 1:hi] < extra[lo + 1:hi]) and np.all(inv[lo + 1:hi] > extra[lo + 1:hi] / s)
    m = lambda mu: 0.1 * mu * math.log(s) + 1  # noqa: E731
    assert af == pytest.approx(m(1.0) / m(0.5))
    assert ref.mla_softmax_scale(y) == pytest.approx(80 ** -0.5 * m(0.5) ** 2)
    y2 = ref.tiny_config(rope_scaling={"rope_type": "yarn", "factor": s, "attention_factor": 1.3}, **base)
    assert ref.rope_inv_freq(y2)[1] == 1.3
    assert ref.mla_softmax_scale(y2) == pytest.approx(24 ** -0.5)
    y3 = ref.tiny_config(rope_scaling={"rope_type": "yarn", "factor": s}, **base)
    assert ref.rope_inv_freq(y3)[1] == pytest.approx(m(1.0))
