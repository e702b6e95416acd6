"""Config parsing: the real config, derived schedules, and clear errors for bad values."""
import json
import os

import pytest

from ling_jax.config import ConfigError, LingConfig

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "spec", "config.ling-3.1-flash.json")
if not os.path.isfile(SPEC):  # a worktree that is not a sibling of shared/
    SPEC = "/work/shared/spec/config.ling-3.1-flash.json"


def real():
    with open(SPEC) as f:
        return json.load(f)


def test_real_config_schedule():
    c = LingConfig.from_json(SPEC)
    assert [i for i, t in enumerate(c.layer_types) if t == "mla"] == [7, 15, 23, 31, 39, 47, 55, 63, 71]
    assert [c.is_moe(i) for i in range(6)] == [False] * 4 + [True] * 2
    assert c.swiglu_limits(64) == (0.0, 5.0) and c.swiglu_limits(65) == (4.0, 5.0)
    assert c.swiglu_limits(71) == (4.0, 7.0) and c.swiglu_limits(72) == (0.0, 0.0)  # MTP unclamped
    assert c.qk_head_dim == 192 and c.kda_width == 8192 and c.eos_token_id == (156895,)
    assert c.rope_scaling is None and c.weight_block_size == (128, 128)


def test_trailing_remainder_group_is_mla():
    d = real()
    d.update(num_hidden_layers=11, expert_swiglu_limit_list=[0.0] * 11, share_expert_swiglu_limit_list=[0.0] * 11)
    c = LingConfig.from_dict(d)
    assert c.layer_types == ("kda",) * 7 + ("mla",) * 4


def test_clamp_switch_and_roundtrip():
    d = real()
    d["apply_swiglu_clamp"] = False
    c = LingConfig.from_dict(d)
    assert c.swiglu_limits(71) == (0.0, 0.0)
    again = LingConfig.from_dict(LingConfig.from_json(SPEC).to_dict())
    assert again == LingConfig.from_json(SPEC)
    assert LingConfig.from_dict({**real(), "expert_swiglu_limit_list": []}).swiglu_limits(70) == (0.0, 5.0)


def test_yarn_parsed():
    d = real()
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144,
                         "mscale": 1.0, "mscale_all_dim": 1.0}
    c = LingConfig.from_dict(d)
    assert c.rope_scaling.factor == 4.0 and c.rope_scaling.beta_fast == 32.0


@pytest.mark.parametrize("change,msg", [
    ({"no_kda_lora": False}, "no_kda_lora"),
    ({"model_type": "llama"}, "model_type"),
    ({"n_group": 7}, "n_group=7 must divide num_experts=512"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"qk_head_dim": 128}, "qk_head_dim=128 contradicts"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"expert_swiglu_limit_list": [4.0] * 3}, "expert_swiglu_limit_list"),
    ({"hidden_size": "4096"}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"kda_lower_bound": 1.0}, "kda_lower_bound"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
])
def test_bad_values_are_refused(change, msg):
    d = real()
    d.update(change)
    with pytest.raises(ConfigError, match=msg):
        LingConfig.from_dict(d, "x/config.json")


def test_missing_and_corrupt_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        LingConfig.from_json(str(tmp_path / "nope.json"))
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LingConfig.from_json(str(p))
