"""Sharding: mesh specs, the logical-axis rules, sharded loading and expert-parallel logits.

Every parameter's PartitionSpec comes from the logical axes it declares (sharding/rules.py); an
explicit table (EXPECTED_SPECS, taken from the path-regex rule table these rules replaced) pins
them on five meshes, with and without FP8-kept matrices. A tiny written checkpoint (4 heads, 8
experts, vocab 300: divisible by every mesh below) is loaded straight into sharded arrays on
several meshes of the 8 simulated CPU devices; float32 logits must equal the single-device result
within 1e-5 relative, and the arrays must be split as the rules say.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import np_reference as R
import sharding as S
from conftest import rel_err
from ling_jax.checkpoint.blocks import release_fp8
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.config import LingConfig
from ling_jax.forward import forward
from ling_jax.linear import Linear
from ling_jax.checkpoint.layout import canonical_path
from ling_jax.loader import abstract_model, load_model
from ling_jax.placement import block_fp8_specs, model_mesh, param_specs, shard_model
from ling_jax.quantized import BlockFP8

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
    out = forward(model, IDS, mtp=True)
    return np.asarray(out["logits"]), np.asarray(out["mtp_logits"])


def spec_of(x):
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


def as_tuple(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


# ---------------------------------------------------------------------------------------------
# meshes
# ---------------------------------------------------------------------------------------------
def test_parse_mesh_specs():
    assert S.parse_mesh_shape("data=1,expert=8,model=4", 32) == {"data": 1, "expert": 8, "model": 4}
    assert S.parse_mesh_shape("expert=4, model=2", 8) == {"data": 1, "expert": 4, "model": 2}
    assert S.parse_mesh_shape("model=2,expert=-1", 8) == {"data": 1, "expert": 4, "model": 2}
    assert S.parse_mesh_shape("tp=2,dp=*", 8) == {"data": 4, "expert": 1, "model": 2}
    assert S.parse_mesh_shape(None, 8) == {"data": 1, "expert": 8, "model": 1}
    mesh = S.parse_mesh("expert=4,model=2")
    assert mesh.axis_names == ("data", "expert", "model") and mesh.devices.shape == (1, 4, 2)
    assert S.mesh_spec_string(mesh) == "data=1,expert=4,model=2"
    for bad, msg in [("expert=3", "needs 3 devices"), ("foo=8", "unknown axis"), ("expert", "axis=size"),
                     ("expert=x", "integer"), ("expert=0", ">= 1"), ("expert=-1,model=-1", "only one"),
                     ("expert=4,expert=2", "twice"), ("model=3,expert=-1", "not divisible")]:
        with pytest.raises(ValueError, match=msg):
            S.parse_mesh(bad)


def test_parse_mesh_shape_for_planning():
    """`plan` plans meshes it does not have: the same parser without a device count."""
    assert S.parse_mesh_shape("data=1,expert=8,model=4") == {"data": 1, "expert": 8, "model": 4}
    assert S.parse_mesh_shape(None) == {"data": 1, "expert": 1, "model": 1}
    with pytest.raises(ValueError, match="needs a device count"):
        S.parse_mesh_shape("expert=-1")


# ---------------------------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------------------------
def _abstract(cfg, fp8=False, layer_loop=None):
    return abstract_model(cfg, jnp.bfloat16, True, release_fp8(cfg) if fp8 else None, layer_loop=layer_loop)


def flat_specs(specs) -> dict[str, tuple]:
    """{"/"-path: spec tuple} with a BlockFP8's scales under "<path>:scales"."""
    out = {}
    for k, v in specs.items():
        p = "/".join(map(str, canonical_path(k)))  # a layer stored on its own: model/layers/{i}/...
        if isinstance(v, BlockFP8):
            out[p], out[p + ":scales"] = tuple(v.values), tuple(v.scales)
        else:
            out[p] = tuple(v)
    return out


MESHES = ('expert=8', 'expert=4,model=2', 'data=2,model=4', 'model=8', 'data=2,expert=2,model=2')
EXPECTED_SPECS = {  # parameter path (layer index *) -> spec per mesh of MESHES; '-' replicated, M model, E expert
    'lm_head/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/A_log': ('-', 'M', 'M', '-', 'M'),
    'model/layers/*/attention/b_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/dense/weight': ('--', '-M', '-M', '--', '-M'),
    'model/layers/*/attention/dt_bias': ('-', 'M', 'M', '-', 'M'),
    'model/layers/*/attention/f_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/g_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/k_conv1d': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/k_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/kv_a_layernorm/weight': ('-', '-', '-', '-', '-'),
    'model/layers/*/attention/kv_a_proj_with_mqa/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/kv_b_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/o_norm': ('-', '-', '-', '-', '-'),
    'model/layers/*/attention/o_proj/weight': ('--', '-M', '-M', '--', '-M'),
    'model/layers/*/attention/q_a_layernorm/weight': ('-', '-', '-', '-', '-'),
    'model/layers/*/attention/q_a_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/q_b_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/q_conv1d': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/q_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/v_conv1d': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/attention/v_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'model/layers/*/input_layernorm/weight': ('-', '-', '-', '-', '-'),
    'model/layers/*/mlp/down_proj/weight': ('--', '-M', '-M', '-M', '-M'),
    'model/layers/*/mlp/experts/down_proj': ('E--', 'E-M', '--M', '--M', 'E-M'),
    'model/layers/*/mlp/experts/gate_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'model/layers/*/mlp/experts/up_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'model/layers/*/mlp/gate/expert_bias': ('-', '-', '-', '-', '-'),
    'model/layers/*/mlp/gate/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/gate_proj/weight': ('--', 'M-', 'M-', 'M-', 'M-'),
    'model/layers/*/mlp/routed_limit': ('', '', '', '', ''),
    'model/layers/*/mlp/shared_experts/down_proj/weight': ('--', '-M', '-M', '-M', '-M'),
    'model/layers/*/mlp/shared_experts/gate_proj/weight': ('--', 'M-', 'M-', 'M-', 'M-'),
    'model/layers/*/mlp/shared_experts/limit': ('', '', '', '', ''),
    'model/layers/*/mlp/shared_experts/up_proj/weight': ('--', 'M-', 'M-', 'M-', 'M-'),
    'model/layers/*/mlp/up_proj/weight': ('--', 'M-', 'M-', 'M-', 'M-'),
    'model/layers/*/post_attention_layernorm/weight': ('-', '-', '-', '-', '-'),
    'model/norm/weight': ('-', '-', '-', '-', '-'),
    'model/word_embeddings/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'mtp/block/attention/dense/weight': ('--', '-M', '-M', '--', '-M'),
    'mtp/block/attention/g_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'mtp/block/attention/kv_a_layernorm/weight': ('-', '-', '-', '-', '-'),
    'mtp/block/attention/kv_a_proj_with_mqa/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/kv_b_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'mtp/block/attention/q_a_layernorm/weight': ('-', '-', '-', '-', '-'),
    'mtp/block/attention/q_a_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/q_b_proj/weight': ('--', 'M-', 'M-', '--', 'M-'),
    'mtp/block/input_layernorm/weight': ('-', '-', '-', '-', '-'),
    'mtp/block/mlp/experts/down_proj': ('E--', 'E-M', '--M', '--M', 'E-M'),
    'mtp/block/mlp/experts/gate_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'mtp/block/mlp/experts/up_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'mtp/block/mlp/gate/expert_bias': ('-', '-', '-', '-', '-'),
    'mtp/block/mlp/gate/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/mlp/routed_limit': ('', '', '', '', ''),
    'mtp/block/mlp/shared_experts/down_proj/weight': ('--', '-M', '-M', '-M', '-M'),
    'mtp/block/mlp/shared_experts/gate_proj/weight': ('--', 'M-', 'M-', 'M-', 'M-'),
    'mtp/block/mlp/shared_experts/limit': ('', '', '', '', ''),
    'mtp/block/mlp/shared_experts/up_proj/weight': ('--', 'M-', 'M-', 'M-', 'M-'),
    'mtp/block/post_attention_layernorm/weight': ('-', '-', '-', '-', '-'),
    'mtp/eh_proj/weight': ('--', '-M', '-M', '-M', '-M'),
    'mtp/enorm/weight': ('-', '-', '-', '-', '-'),
    'mtp/final_layernorm/weight': ('-', '-', '-', '-', '-'),
    'mtp/hnorm/weight': ('-', '-', '-', '-', '-'),
}
EXPECTED_FP8_SCALE_SPECS = {  # BlockFP8 scales of the parameters kept FP8, per mesh of MESHES
    'model/layers/*/attention/dense/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/f_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/g_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/k_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/kv_a_proj_with_mqa/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/kv_b_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/o_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/q_a_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/q_b_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/q_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/attention/v_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/down_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/experts/down_proj': ('E--', 'E-M', '--M', '--M', 'E-M'),
    'model/layers/*/mlp/experts/gate_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'model/layers/*/mlp/experts/up_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'model/layers/*/mlp/gate_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/shared_experts/down_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/shared_experts/gate_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/shared_experts/up_proj/weight': ('--', '--', '--', '--', '--'),
    'model/layers/*/mlp/up_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/dense/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/kv_a_proj_with_mqa/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/kv_b_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/q_a_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/attention/q_b_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/mlp/experts/down_proj': ('E--', 'E-M', '--M', '--M', 'E-M'),
    'mtp/block/mlp/experts/gate_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'mtp/block/mlp/experts/up_proj': ('E--', 'EM-', '-M-', '-M-', 'EM-'),
    'mtp/block/mlp/shared_experts/down_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/mlp/shared_experts/gate_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/block/mlp/shared_experts/up_proj/weight': ('--', '--', '--', '--', '--'),
    'mtp/eh_proj/weight': ('--', '--', '--', '--', '--'),
}

@pytest.mark.parametrize("fp8", [False, True])
def test_param_specs_match_the_table(fp8):
    """Every parameter (and SwiGLU constant) of the small model gets exactly the table's spec on each
    mesh — the specs of the former path-regex rules, incl. the head/vocab divisibility fallback on
    model=8 — and, kept FP8, its BlockFP8 scales: dense grids replicated, expert scales split."""
    cfg = LingConfig.from_dict(small_cfg_dict())
    abstract = _abstract(cfg, fp8)
    for m, spec in enumerate(MESHES):
        got = flat_specs(param_specs(abstract, S.parse_mesh(spec)))
        generic = {}
        for p, sp in got.items():
            sp = "".join("-" if a is None else {"model": "M", "expert": "E", "data": "D"}[a] for a in sp)
            if "layers/runs/" in p:  # a run's stacked parameter [repeats, n, ...]: its two layer axes replicated
                assert sp[:2] == "--", (p, sp)
                p, sp = re.sub(r"layers/runs/\d+/\d+", "layers/0", p), sp[2:]
            q = re.sub(r"layers/\d+", "layers/*", p)
            generic.setdefault(q, set()).add(sp)
        want = {q: {v[m]} for q, v in EXPECTED_SPECS.items()}
        if fp8:
            want.update({q + ":scales": {v[m]} for q, v in EXPECTED_FP8_SCALE_SPECS.items()})
        assert generic == want, spec


def test_rules_cover_the_real_model_and_split_it():
    """Every parameter of the real config (its FP8-expert variant, cut to 8 layers) has a rule; on
    expert=8,model=4 the big tensors are split as documented (no divisibility fallback)."""
    full = LingConfig.from_json("/work/shared/spec/config.ling-3.1-flash.json")
    # the first 8 layers (one full 7 KDA + 1 MLA group, dense and MoE layers) + MTP: every kind of tensor
    cfg = full.replace(num_hidden_layers=8, expert_swiglu_limit_list=list(full.expert_swiglu_limit_list[-8:]),
                       share_expert_swiglu_limit_list=list(full.share_expert_swiglu_limit_list[-8:]))
    mesh = jax.sharding.AbstractMesh((1, 8, 4), S.AXES)  # 32 devices: shapes only
    abstract = _abstract(cfg, fp8=True, layer_loop="unroll")  # per layer: the paths below name layers
    specs = param_specs(abstract, mesh)
    by = {k: as_tuple(v, 3) for k, v in flat_specs(specs).items()}
    assert by["model/layers/5/mlp/experts/gate_proj"] == ("expert", "model", None)
    assert by["model/layers/5/mlp/experts/down_proj"] == ("expert", None, "model")
    assert by["model/layers/5/mlp/experts/down_proj:scales"] == ("expert", None, "model")
    assert by["model/layers/0/attention/q_proj/weight:scales"][:2] == (None, None)  # dense FP8 scales
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
        v, sp = var.get_value(), specs[tuple(path)]
        for a, s in ((v.values, sp.values), (v.scales, sp.scales)) if isinstance(v, BlockFP8) else ((v, sp),):
            n = int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
            split = np.prod([dict(mesh.shape)[x] for x in s if x is not None] or [1])
            total += n
            per_dev += n / split
    assert total > 40e9 and per_dev < total / 12  # (4 of these 8 layers are dense; the full model: ~/28)


def test_unknown_parameter_fails_loudly():
    """A parameter created without logical axes, an unknown logical name, a cache array without a
    rule and axes of the wrong rank all fail with the name of what is wrong."""
    mesh = S.parse_mesh("expert=8")
    model = _abstract(LingConfig.from_dict(small_cfg_dict()), layer_loop="unroll")  # layer 0 is a module of its own
    model.model.layers[0].attention.new_proj = nnx.eval_shape(
        lambda: type("NoAxes", (nnx.Module,), {"__init__": lambda self: setattr(self, "weight", nnx.Param(
            jnp.zeros((4, 4))))})())
    with pytest.raises(S.UnknownParameterError, match="parameter 'model/layers/per_layer/0/attention/new_proj/weight' has no"):
        param_specs(model, mesh)
    model.model.layers[0].attention.new_proj = nnx.eval_shape(
        lambda: Linear(4, 4, axes=("mystery", "embed"), dtype=jnp.float32, rngs=nnx.Rngs(0)))
    with pytest.raises(S.UnknownParameterError, match="unknown logical axis 'mystery' of model/layers/per_layer/0/attention"):
        param_specs(model, mesh)
    with pytest.raises(S.UnknownParameterError, match="cache/layers/0/mystery"):
        S.cache_axes("cache/layers/0/mystery")
    with pytest.raises(ValueError, match="has 3 dims .* but 2 logical axes"):
        S.spec(("vocab", "embed"), (4, 4, 4), mesh, 4, where="lm_head/weight")


def test_divisibility_fallback_replicates_that_dim():
    mesh = S.parse_mesh("model=8")
    # vocab 300 % 8 != 0 → replicated; 4 heads over model=8 → head-split dims replicated even though
    # the row count (64) divides 8; dense widths that divide stay split.
    assert S.spec(("vocab", "embed"), (300, 64), mesh, 4) == P(None, None)       # lm_head
    assert S.spec(("heads", "embed"), (64, 64), mesh, 4) == P(None, None)        # q_proj
    assert S.spec(("heads", "embed"), (64, 64), mesh, 8) == P("model", None)
    assert S.spec(("mlp", "embed"), (96, 64), mesh, 4) == P("model", None)       # dense up_proj
    mesh = S.parse_mesh("expert=8")
    experts = ("expert", "expert_mlp", "embed")
    assert S.spec(experts, (12, 24, 64), mesh, 4) == P(None, None, None)
    assert S.spec(experts, (16, 24, 64), mesh, 4) == P("expert", None, None)
    # the mesh may be a plain {axis: size} dict (plans for meshes one does not have)
    assert S.spec(experts, (16, 24, 64), {"expert": 8, "model": 4}, 4) == P("expert", "model", None)


def cache_leaf_specs(specs):
    """{field name: set of trailing-dim specs} over a spec pytree of a HybridCache (any layer stacking)."""
    out = {}
    for path, sp in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]:
        name = S.rules.path_str(path).split("/")[-1]
        out.setdefault(name, set()).add(tuple(sp))
    return out


def placed_specs(cache):
    """Like cache_leaf_specs, from the arrays' actual shardings (padded to full rank)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
        out.setdefault(S.rules.path_str(path).split("/")[-1], set()).add(spec_of(x))
    return out


def trailing(specs, n):
    return {tuple(s)[len(s) - n:] if len(s) >= n else (None,) * (n - len(s)) + tuple(s) for s in specs}


def test_cache_shardings():
    from ling_jax.model import init_cache

    cfg = LingConfig.from_dict(small_cfg_dict())
    mesh = S.parse_mesh("data=2,model=4")
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 16, jnp.float32))
    got = cache_leaf_specs(S.cache_specs(cache, mesh))
    assert trailing(got["recurrent"], 4) == {("data", "model", None, None)}      # [.., B, H, dk, dv]
    assert {trailing({s}, 3).pop() for s in got["conv_q"]} == {("data", None, "model")}  # [.., B, K-1, H*dk]
    assert trailing(got["c"], 3) == {("data", None, None)} and trailing(got["k_pe"], 3) == {("data", None, None)}
    assert got["lengths"] == {("data",)}
    # every leading (layer-stacking) dim is replicated
    assert all(e is None for s in got["recurrent"] for e in s[:-4])
    odd = cache_leaf_specs(S.cache_specs(jax.eval_shape(lambda: init_cache(cfg, 3, 16, jnp.float32)), mesh))
    assert trailing(odd["recurrent"], 4) == {(None, "model", None, None)}  # batch 3 over data=2: replicated
    sh = S.cache_shardings(cache, S.parse_mesh("expert=8"))
    assert all(isinstance(x, jax.sharding.NamedSharding) for x in jax.tree.leaves(sh))
    assert len(jax.tree.leaves(sh)) == len(jax.tree.leaves(cache))


# ---------------------------------------------------------------------------------------------
# sharded loading + expert-parallel logits
# ---------------------------------------------------------------------------------------------
MESHES = ["expert=8", "expert=4,model=2", "data=2,model=4"]


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_logits_match_single_device(ckpt, reference, spec):
    mesh = S.parse_mesh(spec)
    model = load_model(ckpt, "float32", mesh=mesh, progress=False)
    sizes = dict(mesh.shape)
    e, m = ("expert" if sizes["expert"] > 1 else None), ("model" if sizes["model"] > 1 else None)
    L = model.model.layers
    checks = [
        (L[1].mlp.experts.gate_proj, (e, m, None)), (L[2].mlp.experts.down_proj, (e, None, m)),
        (L[0].attention.q_proj.weight, (m, None)), (L[0].attention.o_proj.weight, (None, m)),
        (L[0].attention.q_conv1d, (m, None)), (L[0].attention.dt_bias, (m,)), (L[0].attention.A_log, (m,)),
        (L[3].attention.kv_b_proj.weight, (m, None)), (L[3].attention.dense.weight, (None, m)),
        (L[3].attention.kv_a_proj_with_mqa.weight, (None, None)), (L[1].mlp.gate.weight, (None, None)),
        (L[0].mlp.gate_proj.weight, (m, None)), (L[0].mlp.down_proj.weight, (None, m)),
        (L[1].mlp.shared_experts.up_proj.weight, (m, None)),
        (model.model.word_embeddings.weight, (m, None)), (model.lm_head.weight, (m, None)),
        (model.mtp.block.mlp.experts.up_proj, (e, m, None)), (model.mtp.eh_proj.weight, (None, m)),
    ]
    for var, want in checks:
        x = var[...]
        assert spec_of(x) == want, (var, x.sharding.spec, want)
        assert x.sharding.mesh.shape == mesh.shape
    # each device really holds only its block
    g = L[1].mlp.experts.gate_proj[...]
    assert g.addressable_shards[0].data.shape == (8 // sizes["expert"], 24 // sizes["model"], 64)
    assert model_mesh(model) == mesh  # the routed experts run expert-parallel (the parameters' mesh)
    ref, ref_mtp = reference
    if spec == "expert=4,model=2":  # the MTP layer too (once: each variant is a separate compile)
        out = forward(model, IDS, mtp=True)
        logits, mtp_logits = out["logits"], out["mtp_logits"]
        assert rel_err(mtp_logits, ref_mtp) < TOL
    else:
        logits = forward(model, IDS)["logits"]
    assert rel_err(logits, ref) < TOL


def test_keep_fp8_on_mesh(ckpt, reference):
    """keep_quantized: every FP8-stored matrix stays float8 (+ float32 scales, a BlockFP8) on device,
    sharded by the rules (values like their float twins, dense scale grids replicated); the
    dequantise-in-matmul result equals the dequantised single-device model."""
    mesh = S.parse_mesh("expert=4,model=2")
    model = load_model(ckpt, "float32", mesh=mesh, keep_quantized=True, progress=False)
    L = model.model.layers
    ex = L[2].mlp.experts
    assert all(isinstance(getattr(ex, n).get_value(), BlockFP8) for n in ("gate_proj", "up_proj", "down_proj"))
    gate, down = ex.gate_proj.get_value(), ex.down_proj.get_value()
    assert gate.values.dtype == jnp.float8_e4m3fn and down.scales.dtype == jnp.float32
    assert spec_of(gate.values) == ("expert", "model", None)
    assert spec_of(gate.scales) == ("expert", "model", None)
    assert spec_of(down.scales) == ("expert", None, "model")
    for lin, want in [(L[0].attention.q_proj, ("model", None)), (L[0].attention.o_proj, (None, "model")),
                      (L[3].attention.kv_b_proj, ("model", None)), (L[3].attention.dense, (None, "model")),
                      (L[3].attention.q_a_proj, (None, None)), (L[0].mlp.gate_proj, ("model", None)),
                      (L[1].mlp.shared_experts.down_proj, (None, "model")), (model.mtp.eh_proj, (None, "model"))]:
        assert isinstance(lin.weight.get_value(), BlockFP8), lin
        w, s = lin.weight.get_value().values, lin.weight.get_value().scales
        assert w.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
        assert spec_of(w) == want and spec_of(s) == (None, None)
    assert L[0].attention.b_proj.weight[...].dtype == jnp.float32  # stored BF16: loaded as dtype
    logits = forward(model, IDS)["logits"]
    assert rel_err(logits, reference[0]) < TOL


def test_shard_model_and_sharded_cache_prefill(ckpt, reference):
    """shard_model on a loaded model + a cache placed by cache_shardings: a prefill through the cache
    on (data=2, model=4) reproduces the cache-free single-device logits and keeps the cache layout."""
    from ling_jax.model import init_cache

    mesh = S.parse_mesh("data=2,model=4")
    model = shard_model(load_model(ckpt, "float32", progress=False), mesh)
    assert spec_of(model.model.layers[0].attention.q_proj.weight[...]) == ("model", None)
    T = IDS.shape[1]
    cache = S.shard_cache(init_cache(model.cfg, 2, 16, jnp.float32), mesh)
    want = cache_leaf_specs(S.cache_specs(cache, mesh))
    assert placed_specs(cache) == want and trailing(want["recurrent"], 4) == {("data", "model", None, None)}

    @nnx.jit
    def step(model, ids, cache):
        out = model(ids, cache=cache)
        return out["logits"], jax.lax.with_sharding_constraint(out["cache"], S.cache_shardings(cache, mesh))

    lg, cache = step(model, S.global_batch(IDS, mesh), cache)
    assert rel_err(lg, reference[0]) < TOL
    assert placed_specs(cache) == want
    assert np.asarray(cache.lengths).tolist() == [T, T]


def test_expert_parallel_kernel():
    """experts_ep (shard_map + psum) equals the single-device grouped MoE for both inner paths
    (grouped / gather), dense and FP8 (BlockFP8, dequantised inside the matmul) weights, a traced
    SwiGLU limit and tokens split over `data`; the weights placed by their logical axes."""
    from ling_jax.moe import experts_ep, experts_grouped
    from ling_jax.quantized import dequantize

    mesh = S.parse_mesh("data=2,expert=2,model=2")  # all three axes at once
    E, D, I, N, k, b = 8, 64, 24, 6, 3, 16
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((N, D)), jnp.float32)
    idx = jnp.asarray(np.stack([r.permutation(E)[:k] for _ in range(N)]), jnp.int32)
    wts = jnp.asarray(r.uniform(0.1, 1.0, (N, k)), jnp.float32)
    f8 = [jnp.asarray(np.clip(r.standard_normal(s) * 100, -440, 440), jnp.float32).astype(jnp.float8_e4m3fn)
          for s in ((E, I, D), (E, I, D), (E, D, I))]
    sc = [jnp.asarray(r.uniform(1e-3, 2e-3, s), jnp.float32) for s in ((E, I, D // b), (E, I, D // b), (E, D // b, I))]
    blocks = ((1, b), (1, b), (b, 1))
    quant = [BlockFP8(q, s, bl) for q, s, bl in zip(f8, sc, blocks)]
    dense = [dequantize(q, jnp.float32) for q in quant]
    limit = jnp.asarray(0.6, jnp.float32)
    ref = jnp.einsum("nkd,nk->nd", experts_grouped(x, idx, *dense, 0.6), wts, precision="highest")
    gu = S.spec(("expert", "expert_mlp", "embed"), (E, I, D), mesh, 4)
    dn = S.spec(("expert", "embed", "expert_mlp"), (E, D, I), mesh, 4)
    assert gu == P("expert", "model", None)
    for fp8 in (False, True):
        ws = quant if fp8 else dense
        specs = tuple(BlockFP8(v, block_fp8_specs(v, bl, 3), bl) if fp8 else v
                      for v, bl in zip((gu, gu, dn), blocks))
        named = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
        ws = jax.device_put(ws, list(named))
        for path in ("grouped", "gather"):
            f = jax.jit(lambda x, i, w, lim, ws: experts_ep(x, i, w, ws, specs, lim, mesh, path, "ragged"))
            y = f(S.global_batch(np.asarray(x), mesh), idx, wts, limit, tuple(ws))
            assert rel_err(y, ref) < TOL, (fp8, path)


def test_moe_expert_parallel_on_its_parameters_mesh(monkeypatch):
    """A MoE block whose parameters are placed on a mesh runs expert-parallel (the mesh read from
    its parameters under jit, not from the ExecConfig) and equals the single-device block."""
    from ling_jax import moe as moe_mod
    from ling_jax.exec_config import ExecConfig
    from ling_jax.moe import MoE

    calls = []
    real_ep = moe_mod.experts_ep
    monkeypatch.setattr(moe_mod, "experts_ep", lambda *a: calls.append(a[6]) or real_ep(*a))

    cfg = LingConfig.from_dict(small_cfg_dict())
    moe = MoE(cfg, 3, dtype=jnp.float32, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
    call = nnx.jit(lambda m, x, ex: m(x, ex)[0], static_argnums=2)
    ex = ExecConfig.for_backend(None, cfg, experts="grouped")
    ref = call(moe, x, ex)
    mesh = S.parse_mesh("expert=4,model=2")
    assert not calls and "mesh" not in {f.name for f in dataclasses.fields(ExecConfig)}
    shard_model(moe, mesh)
    assert spec_of(moe.experts.gate_proj[...]) == ("expert", "model", None) and model_mesh(moe) == mesh
    got = call(moe, x, ex)
    assert calls == [mesh]  # traced once, expert-parallel over the parameters' mesh
    assert rel_err(got, ref) < TOL
