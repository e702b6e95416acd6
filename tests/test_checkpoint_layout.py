"""The release tensor inventory (spec §12) for the real and for small configs."""
import json
import math

import pytest

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.synthetic_config import synthetic_config
from ling_jax.config import LingConfig

REAL = "/work/shared/spec/config.ling-3.1-flash.json"
MID = "/work/shared/bench/config.mid.json"


@pytest.fixture(scope="module")
def real():
    return LingConfig.from_json(REAL)


def test_real_counts_match_spec_12_7(real):
    t = L.expected_tensors(real)
    assert len(t) == 107_393
    r = L.release_tensors(real, "fp8")
    assert len(r) == 214_025
    scales = [n for n, _, _ in r if n.endswith(L.SCALE_SUFFIX)]
    assert len(scales) == 106_632
    assert sum(s.quantizable for s in t.values()) == 106_632
    assert len(L.release_tensors(real, "bf16")) == 107_393
    # 69 MoE blocks × 1,536 routed + 207 shared + 12 dense + 63·6 KDA + 10·5 MLA + eh_proj
    assert 69 * 1536 + 207 + 12 + 63 * 6 + 10 * 5 + 1 == 106_632


def test_real_param_and_byte_totals(real):
    assert L.count_params(real) == 572_120_680_768
    assert L.count_params(real, include_mtp=False) == 563_946_483_520
    item = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    # spec §12.7 Layout B payload (with FP32 conv taps)
    total = sum(math.prod(s) * item[d] for _, d, s in L.release_tensors(real, "fp8", conv_dtype="F32"))
    assert total == 573_732_383_232


def test_real_shapes(real):
    t = L.expected_tensors(real)
    assert t["model.layers.0.attention.q_conv1d.weight"].shape == (8192, 1, 4)
    assert t["model.layers.0.attention.g_proj.weight"].shape == (8192, 4096)
    assert t["model.layers.7.attention.g_proj.weight"].shape == (64, 4096)
    assert t["model.layers.7.attention.kv_a_proj_with_mqa.weight"].shape == (576, 4096)
    assert t["model.layers.72.eh_proj.weight"].shape == (4096, 8192)
    assert t["model.layers.72.mlp.experts.511.down_proj.weight"].shape == (4096, 1280)
    assert t["model.layers.3.mlp.gate_proj.weight"].shape == (10240, 4096)
    assert "model.layers.3.mlp.gate.weight" not in t
    assert t["model.layers.4.mlp.gate.expert_bias"].dtype == "F32"
    assert t["model.layers.0.attention.A_log"].dtype == "F32"
    r = {n: (d, s) for n, d, s in L.release_tensors(real)}
    assert r["model.layers.7.attention.kv_a_proj_with_mqa.weight_scale_inv"] == ("F32", (5, 32))
    assert r["model.layers.7.attention.kv_b_proj.weight_scale_inv"] == ("F32", (128, 4))
    assert r["model.layers.7.attention.q_b_proj.weight_scale_inv"] == ("F32", (96, 12))
    assert r["model.layers.0.attention.b_proj.weight"][0] == "BF16"
    assert r["model.layers.7.attention.g_proj.weight"][0] == "BF16"
    assert r["model.layers.0.attention.g_proj.weight"][0] == "F8_E4M3"
    assert r["model.layers.72.eh_proj.weight"][0] == "F8_E4M3"
    assert r["model.layers.4.mlp.gate.weight"][0] == "BF16"
    assert r["lm_head.weight"][0] == "BF16"


@pytest.mark.parametrize("path", [REAL, MID])
def test_modules_to_not_convert_matches_release_configs(path):
    cfg = LingConfig.from_json(path)
    with open(path) as f:
        want = json.load(f)["quantization_config"]["modules_to_not_convert"]
    assert L.modules_to_not_convert(cfg) == want
    # and the list is exactly the unquantized linear modules of Layout B
    t = L.expected_tensors(cfg)
    unq = {L.module_of(n) for n, s in t.items() if s.kind in (L.LINEAR, L.ROUTER, L.EMBEDDING) and not s.quantizable}
    assert unq == set(want)


# spec §12.7: Layout B payload with FP32 conv taps / A_log / dt_bias / expert_bias, BF16 norms/router
LAYOUT_B_F32 = 573_732_383_232
PUBLISHED = 573_753_281_152


def _payload(cfg, **kw):
    item = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    return sum(math.prod(s) * item[d] for _, d, s in L.release_tensors(cfg, "fp8", **kw))


def test_real_layout_a(real):
    """Layout A: same tensor count and names; per MLA layer (9 main + MTP) kv_a_proj_with_mqa BF16
    and the head-wise g_proj FP8 with a [1, 32] grid; the payload lands on the published total."""
    ra = L.release_tensors(real, "fp8", fp8_layout="A")
    rb = L.release_tensors(real, "fp8", fp8_layout="B")
    assert len(ra) == 214_025 and {n for n, _, _ in ra} != {n for n, _, _ in rb}
    d = {n: (dt, s) for n, dt, s in ra}
    for i in (7, 15, 71, 72):
        p = f"model.layers.{i}.attention."
        assert d[p + "kv_a_proj_with_mqa.weight"] == ("BF16", (576, 4096))
        assert p + "kv_a_proj_with_mqa.weight_scale_inv" not in d
        assert d[p + "g_proj.weight"] == ("F8_E4M3", (64, 4096))
        assert d[p + "g_proj.weight_scale_inv"] == ("F32", (1, 32))
    assert d["model.layers.0.attention.b_proj.weight"][0] == "BF16"
    assert d["model.layers.0.attention.g_proj.weight"][0] == "F8_E4M3"
    # independent of the writer: B's spec figure, then per MLA layer kv_a BF16 instead of FP8 + [5, 32]
    # scales, g_proj FP8 + [1, 32] scales instead of BF16
    per_layer = (576 * 4096 * 2 - (576 * 4096 + 5 * 32 * 4)) + ((64 * 4096 + 1 * 32 * 4) - 64 * 4096 * 2)
    assert _payload(real, fp8_layout="B", conv_dtype="F32") == LAYOUT_B_F32
    a = _payload(real, fp8_layout="A", conv_dtype="F32")
    assert a == LAYOUT_B_F32 + 10 * per_layer == 573_753_349_632
    assert abs(a - PUBLISHED) < 100_000 and round(a / 2**30, 2) == round(PUBLISHED / 2**30, 2) == 534.35
    # BF16 conv taps: 3 x 63 x 8192 x 4 taps x 2 bytes less
    assert a - _payload(real, fp8_layout="A", conv_dtype="BF16") == 3 * 63 * 8192 * 4 * 2


@pytest.mark.parametrize("layout", L.FP8_LAYOUTS)
def test_modules_to_not_convert_follow_layout(real, layout):
    mods = L.modules_to_not_convert(real, fp8_layout=layout)
    t = L.expected_tensors(real, fp8_layout=layout)
    unq = {L.module_of(n) for n, s in t.items() if s.kind in (L.LINEAR, L.ROUTER, L.EMBEDDING) and not s.quantizable}
    assert len(mods) == len(set(mods)) and set(mods) == unq
    mla = [i for i, k in enumerate(real.layer_types) if k == "mla"] + [real.num_hidden_layers]
    kept, fp8 = ("kv_a_proj_with_mqa", "g_proj") if layout == "A" else ("g_proj", "kv_a_proj_with_mqa")
    assert all(f"model.layers.{i}.attention.{kept}" in mods for i in mla)
    assert not any(m.endswith(f"attention.{fp8}") for m in mods)  # KDA g_proj is FP8 in both
    assert mods[: 2 + 69 + 63] == L.modules_to_not_convert(real, fp8_layout="B")[: 2 + 69 + 63]
    assert L.quantization_config(real, fp8_layout=layout)["modules_to_not_convert"] == mods
    # names, shapes and parameter counts do not depend on the layout
    tb = L.expected_tensors(real)
    assert [(n, s.shape, s.kind) for n, s in t.items()] == [(n, s.shape, s.kind) for n, s in tb.items()]


def test_layout_and_conv_dtype_arguments(real):
    assert L.DEFAULT_FP8_LAYOUT == "B" and L.DEFAULT_CONV_DTYPE == "BF16"
    assert L.release_tensors(real, "fp8") == L.release_tensors(real, "fp8", fp8_layout="B", conv_dtype="BF16")
    assert L.check_fp8_layout("a") == "A" and L.check_conv_dtype("fp32") == "F32"
    for bad in ("C", "", None, 1):
        with pytest.raises(ValueError, match="fp8 layout"):
            L.expected_tensors(real, fp8_layout=bad)
    with pytest.raises(ValueError, match="conv tap dtype"):
        L.expected_tensors(real, conv_dtype="F16")
    # bf16 release: no FP8 at all, whatever the layout
    assert L.release_tensors(real, "bf16", fp8_layout="A") == L.release_tensors(real, "bf16")


def test_q_lora_null_uses_single_q_proj():
    c = synthetic_config(q_lora_rank=None)
    t = L.expected_tensors(c)
    assert t["model.layers.7.attention.q_proj.weight"].shape == (2 * 48, 192)
    assert t["model.layers.7.attention.q_proj.weight"].quantizable
    assert not any("q_a_proj" in n or "q_b_proj" in n or "q_a_layernorm" in n for n in t)


def test_trailing_group_and_counts():
    c = synthetic_config(num_hidden_layers=10, layer_group_size=4)
    assert c.layer_types == ("kda",) * 3 + ("mla",) + ("kda",) * 3 + ("mla",) * 3
    t = L.expected_tensors(c)
    for i in (3, 7, 8, 9, 10):
        assert f"model.layers.{i}.attention.kv_b_proj.weight" in t
        assert f"model.layers.{i}.attention.q_proj.weight" not in t
    per_kda, per_mla = 15, 10
    moe = 2 + 3 * 8 + 3
    n_moe = 10 - c.first_k_dense_replace
    want = 3 + 6 * per_kda + 4 * per_mla + c.first_k_dense_replace * 3 + n_moe * moe + (per_mla + moe + 4)
    assert len(t) == want
    assert len(L.expected_tensors(c, include_mtp=False)) == want - (per_mla + moe + 4)


def test_shared_expert_width_and_none():
    c = synthetic_config(num_shared_experts=2, moe_shared_expert_intermediate_size=40)
    t = L.expected_tensors(c)
    assert t["model.layers.2.mlp.shared_experts.gate_proj.weight"].shape == (80, 192)
    c = synthetic_config(num_shared_experts=0)
    assert not any("shared_experts" in n for n in L.expected_tensors(c))


def test_no_mtp_config():
    c = synthetic_config(num_nextn_predict_layers=0)
    t = L.expected_tensors(c)
    assert not any(n.startswith("model.layers.9.") for n in t)
    assert "model.layers.9.mlp.gate" not in L.modules_to_not_convert(c)


def test_scale_names():
    assert L.scale_name("a.b.weight") == "a.b.weight_scale_inv"
    assert L.weight_of_scale("a.b.weight_scale_inv") == "a.b.weight"
    assert L.weight_of_scale("a.b.weight") is None
    with pytest.raises(ValueError):
        L.scale_name("a.A_log")
