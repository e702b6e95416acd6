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
    """Every parameter of the real config (its FP8-expert variant, cut to 8 layers) has a rule; on
    expert=8,model=4 the big tensors are split as documented (no divisibility fallback)."""
    full = LingConfig.from_json("/work/shared/spec/config.ling-3.1-flash.json")
    # the first 8 layers (one full 7 KDA + 1 MLA group, dense and MoE layers) + MTP: every kind of tensor
    cfg = full.replace(num_hidden_layers=8, expert_swiglu_limit_list=list(full.expert_swiglu_limit_list[-8:]),
                       share_expert_swiglu_limit_list=list(full.share_expert_swiglu_limit_list[-8:]))
    mesh = jax.sharding.AbstractMesh((1, 8, 4), S.AXES)  # 32 devices: shapes only
    abstract = _abstract(cfg, fp8=True)
    specs = S.param_specs(abstract, mesh, cfg)
    by = {"/".join(map(str, k)): as_tuple(v, 3) for k, v in specs.items()}
    assert by["model/layers/5/mlp/experts/gate_proj"] == ("expert", "model", None)
    assert by["model/layers/5/mlp/experts/down_proj"] == ("expert", None, "model")
    assert by["model/layers/5/mlp/experts/down_proj_scale"] == ("expert", None, "model")
    assert by["model/layers/0/attention/q_proj/weight_scale_inv"][:2] == (None, None)  # FP8Linear scales
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
    assert total > 40e9 and per_dev < total / 12  # (4 of these 8 layers are dense; the full model: ~/28)


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
    assert S.resolve("model/layers/1/mlp/experts/gate_proj", (12, 24, 64), mesh, 4) == P(None, None, None)
    assert S.resolve("model/layers/1/mlp/experts/gate_proj", (16, 24, 64), mesh, 4) == P("expert", None, None)


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
    model = S.load_sharded(ckpt, mesh, "float32", progress=False)
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
    assert L[1].mlp.ep_plan is not None
    ref, ref_mtp = reference
    if spec == "expert=4,model=2":  # the MTP layer too (once: each variant is a separate compile)
        logits, mtp_logits = S.sharded_logits(model, IDS, mesh, mtp=True)
        assert rel_err(mtp_logits, ref_mtp) < TOL
    else:
        logits = S.sharded_logits(model, IDS, mesh)
    assert rel_err(logits, ref) < TOL


def test_keep_fp8_on_mesh(ckpt, reference):
    """--keep-fp8: every FP8-stored matrix stays float8 (+ float32 scales) on device, sharded by the
    rules (FP8Linear weights like their float twins, their scale grids replicated); the
    dequantise-in-matmul result equals the dequantised single-device model."""
    mesh = S.parse_mesh("expert=4,model=2")
    model = S.load_sharded(ckpt, mesh, "float32", keep_fp8=True, progress=False)
    L = model.model.layers
    ex = L[2].mlp.experts
    assert type(ex).__name__ == "FP8Experts"
    assert ex.gate_proj[...].dtype == jnp.float8_e4m3fn and ex.down_proj_scale[...].dtype == jnp.float32
    assert spec_of(ex.gate_proj[...]) == ("expert", "model", None)
    assert spec_of(ex.gate_proj_scale[...]) == ("expert", "model", None)
    assert spec_of(ex.down_proj_scale[...]) == ("expert", None, "model")
    for lin, want in [(L[0].attention.q_proj, ("model", None)), (L[0].attention.o_proj, (None, "model")),
                      (L[3].attention.kv_b_proj, ("model", None)), (L[3].attention.dense, (None, "model")),
                      (L[3].attention.q_a_proj, (None, None)), (L[0].mlp.gate_proj, ("model", None)),
                      (L[1].mlp.shared_experts.down_proj, (None, "model")), (model.mtp.eh_proj, (None, "model"))]:
        assert type(lin).__name__ == "FP8Linear", lin
        w, s = lin.weight[...], lin.weight_scale_inv[...]
        assert w.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
        assert spec_of(w) == want and spec_of(s) == (None, None)
    assert L[0].attention.b_proj.weight[...].dtype == jnp.float32  # stored BF16: loaded as dtype
    logits = S.sharded_logits(model, IDS, mesh)
    assert rel_err(logits, reference[0]) < TOL


def test_shard_model_and_sharded_cache_prefill(ckpt, reference):
    """shard_model on a loaded model + a cache placed by cache_shardings: a prefill through the cache
    on (data=2, model=4) reproduces the cache-free single-device logits and keeps the cache layout."""
    from ling_jax.model import init_cache

    mesh = S.parse_mesh("data=2,model=4")
    model = S.shard_model(load_model(ckpt, "float32", progress=False), mesh)
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
    (grouped / gather), dense and FP8 (dequantised inside the matmul) weights, a traced SwiGLU limit
    and tokens split over `data`."""
    from ling_jax.moe import dequant_cols, dequant_rows, experts_ep, experts_grouped

    mesh = S.parse_mesh("data=2,expert=2,model=2")  # all three axes at once
    E, D, I, N, k, b = 8, 64, 24, 6, 3, 16
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((N, D)), jnp.float32)
    idx = jnp.asarray(np.stack([r.permutation(E)[:k] for _ in range(N)]), jnp.int32)
    wts = jnp.asarray(r.uniform(0.1, 1.0, (N, k)), jnp.float32)
    f8 = [jnp.asarray(np.clip(r.standard_normal(s) * 100, -440, 440), jnp.float32).astype(jnp.float8_e4m3fn)
          for s in ((E, I, D), (E, I, D), (E, D, I))]
    sc = [jnp.asarray(r.uniform(1e-3, 2e-3, s), jnp.float32) for s in ((E, I, D // b), (E, I, D // b), (E, D // b, I))]
    dense = [dequant_cols(f8[0], sc[0], b, jnp.float32), dequant_cols(f8[1], sc[1], b, jnp.float32),
             dequant_rows(f8[2], sc[2], b, jnp.float32)]
    limit = jnp.asarray(0.6, jnp.float32)
    ref = jnp.einsum("nkd,nk->nd", experts_grouped(x, idx, *dense, 0.6), wts, precision="highest")
    names = ["gate_proj", "up_proj", "down_proj", "gate_proj_scale", "up_proj_scale", "down_proj_scale"]
    for fp8 in (False, True):
        ws = f8 + sc if fp8 else dense
        specs = tuple(S.resolve(f"model/layers/1/mlp/experts/{n}", w.shape, mesh, 4) for n, w in zip(names, ws))
        assert specs[0] == P("expert", "model", None)
        ws = [jax.device_put(w, jax.sharding.NamedSharding(mesh, sp)) for w, sp in zip(ws, specs)]
        plan = S.EPPlan(mesh, specs)
        for impl in ("grouped", "gather"):
            f = jax.jit(lambda x, i, w, lim, *ws: experts_ep(x, i, w, ws, lim, plan, impl, (b, b) if fp8 else None))
            y = f(S.global_batch(np.asarray(x), mesh), idx, wts, limit, *ws)
            assert rel_err(y, ref) < TOL, (fp8, impl)


def test_moe_impl_ep_under_context_mesh():
    """A MoE block without an attached plan runs expert-parallel with impl='ep' under
    `sharding.use_mesh(mesh)` (the context mesh), and equals the single-device block."""
    from ling_jax.moe import MoE

    cfg = LingConfig.from_dict(small_cfg_dict())
    moe = MoE(cfg, 3, dtype=jnp.float32, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
    call = nnx.jit(lambda m, x, impl: m(x, impl=impl)[0], static_argnums=2)
    ref = call(moe, x, "grouped")
    with pytest.raises(ValueError, match="needs a mesh"):
        call(moe, x, "ep")
    with S.use_mesh(S.parse_mesh("expert=4,model=2")):
        got = call(moe, x, "ep")
    assert rel_err(got, ref) < TOL
