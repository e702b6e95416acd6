"""Sharding: mesh specs, the partition-rule table, sharded loading and expert-parallel logits.

A tiny written checkpoint (4 heads, 8 experts, vocab 300: divisible by every mesh below) is loaded
straight into sharded arrays on several meshes of the 8 simulated CPU devices; float32 logits must
equal the single-device result within 1e-5 relative, and the arrays must be split as the rules say.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import np_reference as R
import sharding as S
from conftest import rel_err
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.config import LingConfig
from ling_jax.runtime import full_logits, load_model

TOL = 1e-5
IDS = (np.arange(2 * 9) * 37 % 295).reshape(2, 9).astype(np.int32)


def small_cfg_dict(**kw):
    """4 layers (3 KDA + 1 MLA; layer 0 dense, 1-3 MoE) + MTP, 4 heads, 8 experts, vocab 300."""
    d = R.tiny_config_dict(vocab_size=300, eos_token_id=295, pad_token_id=296, num_attention_heads=4,
                           num_key_value_heads=4, num_hidden_layers=4,
                           expert_swiglu_limit_list=[0.0, 0.0, 0.0, 0.6],
                           share_expert_swiglu_limit_list=[0.0, 0.0, 0.8, 1.0])
    d.update(kw)
    return d


def write_small(path, seed=5, dtype="fp8", **kw):
    cfg = LingConfig.from_dict(small_cfg_dict(**kw))
    write_checkpoint(cfg, str(path), dtype=dtype, seed=seed, progress=False)
    return cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard") / "ckpt"
    write_small(d)
    return str(d)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Single-device float32 logits and MTP logits of IDS."""
    model = load_model(ckpt, "float32", progress=False)
    out = full_logits(model, IDS, mtp=True)
    return np.asarray(out["logits"]), np.asarray(out["mtp_logits"])


def spec_of(x):
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


def as_tuple(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


# ---------------------------------------------------------------------------------------------
# meshes
# ---------------------------------------------------------------------------------------------
def test_parse_mesh_specs():
    assert S.parse_mesh_spec("data=1,expert=8,model=4", 32) == {"data": 1, "expert": 8, "model": 4}
    assert S.parse_mesh_spec("expert=4, model=2", 8) == {"data": 1, "expert": 4, "model": 2}
    assert S.parse_mesh_spec("model=2,expert=-1", 8) == {"data": 1, "expert": 4, "model": 2}
    assert S.parse_mesh_spec("tp=2,dp=*", 8) == {"data": 4, "expert": 1, "model": 2}
    assert S.parse_mesh_spec(None, 8) == {"data": 1, "expert": 8, "model": 1}
    mesh = S.parse_mesh("expert=4,model=2")
    assert mesh.axis_names == ("data", "expert", "model") and mesh.devices.shape == (1, 4, 2)
    assert S.mesh_spec_string(mesh) == "data=1,expert=4,model=2"
    for bad, msg in [("expert=3", "needs 3 devices"), ("foo=8", "unknown axis"), ("expert", "axis=size"),
                     ("expert=x", "integer"), ("expert=0", ">= 1"), ("expert=-1,model=-1", "only one"),
                     ("expert=4,expert=2", "twice"), ("model=3,expert=-1", "not divisible")]:
        with pytest.raises(ValueError, match=msg):
            S.parse_mesh(bad)


# ---------------------------------------------------------------------------------------------
# the rule table
# ---------------------------------------------------------------------------------------------
def _abstract(cfg, fp8=False):
    from sharding.load import abstract_model
    return abstract_model(cfg, jnp.bfloat16, True, fp8)


def test_rules_cover_the_real_model_and_split_it():
    """Every parameter of the full 560B config (and its FP8-expert variant) has a rule; on
    expert=8,model=4 the big tensors are split as documented and nothing falls back."""
    cfg = LingConfig.from_json("/work/shared/spec/config.ling-3.1-flash.json")
    mesh = jax.sharding.AbstractMesh((1, 8, 4), S.AXES)  # 32 devices: shapes only
    abstract = _abstract(cfg, fp8=True)
    specs = S.param_specs(abstract, mesh, cfg)
    by = {"/".join(map(str, k)): as_tuple(v, 3) for k, v in specs.items()}
    assert by["model/layers/5/mlp/experts/gate_proj"] == ("expert", None, "model")
    assert by["model/layers/5/mlp/experts/down_proj"] == ("expert", "model", None)
    assert by["model/layers/5/mlp/experts/down_proj_scale"] == ("expert", "model", None)
    assert by["model/layers/0/attention/q_proj/weight"][:2] == ("model", None)
    assert by["model/layers/0/attention/o_proj/weight"][:2] == (None, "model")
    assert by["model/layers/0/attention/q_conv1d"][:2] == ("model", None)
    assert by["model/layers/0/attention/A_log"][:1] == ("model",)
    assert by["model/layers/7/attention/kv_b_proj/weight"][:2] == ("model", None)
    assert by["model/layers/7/attention/kv_a_proj_with_mqa/weight"][:2] == (None, None)
    assert by["model/layers/7/attention/dense/weight"][:2] == (None, "model")
    assert by["mtp/block/attention/q_b_proj/weight"][:2] == ("model", None)
    assert by["model/word_embeddings/weight"][:2] == ("model", None)
    assert by["lm_head/weight"][:2] == ("model", None)
    assert by["model/layers/0/mlp/gate_proj/weight"][:2] == ("model", None)
    assert by["model/layers/5/mlp/shared_experts/down_proj/weight"][:2] == (None, "model")
    assert by["model/layers/5/mlp/gate/weight"][:2] == (None, None)
    # bytes per device: the routed experts (97% of the model) are split 32 ways
    total = per_dev = 0
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        v = var.get_value()
        n = int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
        split = np.prod([dict(mesh.shape)[a] for a in specs[tuple(path)] if a is not None] or [1])
        total += n
        per_dev += n / split
    assert total > 500e9 and per_dev < total / 20


def test_unknown_parameter_fails_loudly():
    mesh = S.parse_mesh("expert=8")
    with pytest.raises(S.UnknownParameterError, match="no partition rule for 'model/layers/0/attention/new_proj"):
        S.resolve(("model", "layers", 0, "attention", "new_proj", "weight"), (4, 4), mesh, 4)
    with pytest.raises(S.UnknownParameterError, match="cache/layers/0/mystery"):
        S.resolve("cache/layers/0/mystery", (2,), mesh, 4)
    with pytest.raises(ValueError, match="has 2 dims"):
        S.resolve("lm_head/weight", (4, 4, 4), mesh, 4)


def test_divisibility_fallback_replicates_that_dim():
    mesh = S.parse_mesh("model=8")
    # vocab 300 % 8 != 0 → replicated; 4 heads over model=8 → head-split dims replicated even though
    # the row count (64) divides 8; dense widths that divide stay split.
    assert S.resolve("lm_head/weight", (300, 64), mesh, 4) == P(None, None)
    assert S.resolve("model/layers/0/attention/q_proj/weight", (64, 64), mesh, 4) == P(None, None)
    assert S.resolve("model/layers/0/attention/q_proj/weight", (64, 64), mesh, 8) == P("model", None)
    assert S.resolve("model/layers/0/mlp/up_proj/weight", (96, 64), mesh, 4) == P("model", None)
    mesh = S.parse_mesh("expert=8")
    assert S.resolve("model/layers/1/mlp/experts/gate_proj", (12, 64, 24), mesh, 4) == P(None, None, None)
    assert S.resolve("model/layers/1/mlp/experts/gate_proj", (16, 64, 24), mesh, 4) == P("expert", None, None)


def test_cache_shardings():
    from ling_jax.model import init_cache

    cfg = LingConfig.from_dict(small_cfg_dict())
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 16, jnp.float32))
    specs = S.cache_specs(cache, S.parse_mesh("data=2,model=4"))
    kda, mla = specs.layers[0], specs.layers[3]
    assert as_tuple(kda.recurrent, 4) == ("data", "model", None, None)
    assert as_tuple(kda.conv_q, 3) == ("data", None, "model")
    assert as_tuple(mla.c, 3) == ("data", None, None) and as_tuple(specs.mtp.k_pe, 3) == ("data", None, None)
    assert as_tuple(specs.lengths, 1) == ("data",)
    odd = S.cache_specs(jax.eval_shape(lambda: init_cache(cfg, 3, 16, jnp.float32)), S.parse_mesh("data=2,model=4"))
    assert as_tuple(odd.layers[0].recurrent, 4) == (None, "model", None, None)  # batch 3 over data=2: replicated
    sh = S.cache_shardings(cache, S.parse_mesh("expert=8"))
    assert isinstance(sh.layers[0].recurrent, jax.sharding.NamedSharding)


# ---------------------------------------------------------------------------------------------
# sharded loading + expert-parallel logits
# ---------------------------------------------------------------------------------------------
MESHES = ["expert=8", "expert=4,model=2", "data=2,model=4"]


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_logits_match_single_device(ckpt, reference, spec):
    mesh = S.parse_mesh(spec)
    model = S.load_sharded(ckpt, mesh, "float32", progress=False)
    sizes = dict(mesh.shape)
    e, m = ("expert" if sizes["expert"] > 1 else None), ("model" if sizes["model"] > 1 else None)
    L = model.model.layers
    checks = [
        (L[1].mlp.experts.gate_proj, (e, None, m)), (L[2].mlp.experts.down_proj, (e, m, None)),
        (L[0].attention.q_proj.weight, (m, None)), (L[0].attention.o_proj.weight, (None, m)),
        (L[0].attention.q_conv1d, (m, None)), (L[0].attention.dt_bias, (m,)), (L[0].attention.A_log, (m,)),
        (L[3].attention.kv_b_proj.weight, (m, None)), (L[3].attention.dense.weight, (None, m)),
        (L[3].attention.kv_a_proj_with_mqa.weight, (None, None)), (L[1].mlp.gate.weight, (None, None)),
        (L[0].mlp.gate_proj.weight, (m, None)), (L[0].mlp.down_proj.weight, (None, m)),
        (L[1].mlp.shared_experts.up_proj.weight, (m, None)),
        (model.model.word_embeddings.weight, (m, None)), (model.lm_head.weight, (m, None)),
        (model.mtp.block.mlp.experts.up_proj, (e, None, m)), (model.mtp.eh_proj.weight, (None, m)),
    ]
    for var, want in checks:
        x = var[...]
        assert spec_of(x) == want, (var, x.sharding.spec, want)
        assert x.sharding.mesh.shape == mesh.shape
    # each device really holds only its block
    g = L[1].mlp.experts.gate_proj[...]
    assert g.addressable_shards[0].data.shape == (8 // sizes["expert"], 64, 24 // sizes["model"])
    assert L[1].mlp.ep_plan is not None
    logits, mtp_logits = S.sharded_logits(model, IDS, mesh, mtp=True)
    ref, ref_mtp = reference
    assert rel_err(logits, ref) < TOL
    assert rel_err(mtp_logits, ref_mtp) < TOL


def test_keep_fp8_experts_and_decode_path(ckpt, reference):
    """--keep-fp8: routed experts stay float8 (+ scales) on device, sharded; the dequantise-in-matmul
    result equals the dequantised model. A one-token batch exercises the gather (decode) path."""
    mesh = S.parse_mesh("expert=4,model=2")
    model = S.load_sharded(ckpt, mesh, "float32", keep_fp8=True, progress=False)
    ex = model.model.layers[2].mlp.experts
    assert type(ex).__name__ == "FP8Experts"
    assert ex.gate_proj[...].dtype == jnp.float8_e4m3fn and ex.down_proj_scale[...].dtype == jnp.float32
    assert spec_of(ex.gate_proj[...]) == ("expert", None, "model")
    assert spec_of(ex.gate_proj_scale[...]) == ("expert", None, "model")
    assert spec_of(ex.down_proj_scale[...]) == ("expert", "model", None)
    assert model.model.layers[0].attention.q_proj.weight[...].dtype == jnp.float32  # dequantised at load
    logits = S.sharded_logits(model, IDS, mesh)
    assert rel_err(logits, reference[0]) < TOL
    one = S.sharded_logits(model, IDS[:1, :2], mesh)  # 2 tokens x 3 experts <= 8: gather path
    ref_one = np.asarray(full_logits(load_model(ckpt, "float32", progress=False), IDS[:1, :2])["logits"])
    assert rel_err(one, ref_one) < TOL


def test_shard_model_and_sharded_cache_steps(ckpt, reference):
    """shard_model on a loaded model + a cache placed by cache_shardings: prefill then one decode
    step on (data=2, model=4) reproduce the cache-free single-device logits."""
    from ling_jax.model import init_cache

    mesh = S.parse_mesh("data=2,model=4")
    model = S.shard_model(load_model(ckpt, "float32", progress=False), mesh)
    assert spec_of(model.model.layers[0].attention.q_proj.weight[...]) == ("model", None)
    T = IDS.shape[1] - 1
    cache = S.shard_cache(init_cache(model.cfg, 2, 16, jnp.float32), mesh)
    assert spec_of(cache.layers[0].recurrent) == ("data", "model", None, None)
    assert spec_of(cache.layers[0].conv_k) == ("data", None, "model")
    assert spec_of(cache.layers[3].c) == ("data", None, None)

    @nnx.jit
    def step(model, ids, cache):
        out = model(ids, cache=cache)
        return out["logits"], out["cache"]

    ref = reference[0]
    lg, cache = step(model, S.global_batch(IDS[:, :T], mesh), cache)
    assert rel_err(lg, ref[:, :T]) < TOL
    lg1, cache = step(model, S.global_batch(IDS[:, T:], mesh), cache)
    assert rel_err(lg1, ref[:, T:]) < TOL
    assert np.asarray(cache.lengths).tolist() == [T + 1, T + 1]
