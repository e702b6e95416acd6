"""The release tensor inventory (spec §12) for the real and for small configs."""
import json
import math

import pytest

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.writer import tiny_config
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


def test_q_lora_null_uses_single_q_proj():
    c = tiny_config(q_lora_rank=None)
    t = L.expected_tensors(c)
    assert t["model.layers.7.attention.q_proj.weight"].shape == (2 * 48, 192)
    assert t["model.layers.7.attention.q_proj.weight"].quantizable
    assert not any("q_a_proj" in n or "q_b_proj" in n or "q_a_layernorm" in n for n in t)


def test_trailing_group_and_counts():
    c = tiny_config(num_hidden_layers=10, layer_group_size=4)
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
    c = tiny_config(num_shared_experts=2, moe_shared_expert_intermediate_size=40)
    t = L.expected_tensors(c)
    assert t["model.layers.2.mlp.shared_experts.gate_proj.weight"].shape == (80, 192)
    c = tiny_config(num_shared_experts=0)
    assert not any("shared_experts" in n for n in L.expected_tensors(c))


def test_no_mtp_config():
    c = tiny_config(num_nextn_predict_layers=0)
    t = L.expected_tensors(c)
    assert not any(n.startswith("model.layers.9.") for n in t)
    assert "model.layers.9.mlp.gate" not in L.modules_to_not_convert(c)


def test_scale_names():
    assert L.scale_name("a.b.weight") == "a.b.weight_scale_inv"
    assert L.weight_of_scale("a.b.weight_scale_inv") == "a.b.weight"
    assert L.weight_of_scale("a.b.weight") is None
    with pytest.raises(ValueError):
        L.scale_name("a.A_log")
