"""Training: loss falls, KDA chunk gradients, exact Orbax resume, aux-loss-free expert balancing.

One 2-layer model (KDA dense layer 0, MLA + MoE layer 1, MLA + MoE MTP layer) and one compiled
train step are shared by the tests (compilation dominates on CPU).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as R
from ling_jax import train as T

STEPS = 20
LOSS_BOUND = 0.5  # ln(97) ≈ 4.57 at init; the 4 fixed sequences are memorised well below this


def small_cfg(**kw):
    d = dict(num_hidden_layers=2, layer_group_size=2, expert_swiglu_limit_list=[0.0, 4.0],
             share_expert_swiglu_limit_list=[0.0, 5.0], eos_token_id=96, pad_token_id=95)
    d.update(kw)
    return R.tiny_config(**d)


TCFG = T.TrainConfig(lr=3e-3, warmup_steps=4, total_steps=40, bias_rate=1e-3, seed=0, remat=True)


def small_model(cfg, seed=0):
    from conftest import load_from_dict
    return load_from_dict(cfg, R.random_params(cfg, seed))  # numpy init: no per-op compiles


def synthetic_tokens(cfg, n_seq=4, period=8, seq=24, seed=0):
    """A stream of 4 sequences, each a random 8-token pattern repeated (rows of one batch)."""
    rng = np.random.default_rng(seed)
    rows = [np.tile(rng.integers(0, cfg.vocab_size - 2, period), seq // period + 1)[:seq] for _ in range(n_seq)]
    return np.concatenate(rows).astype(np.int32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cfg = small_cfg()
    trainer = T.Trainer(small_model(cfg, 0), TCFG)
    stream = T.BatchStream(synthetic_tokens(cfg), batch=4, seq=24, seed=0)
    bias0 = {k: np.asarray(v) for k, v in trainer.state["bias"].items()}
    hist = [trainer.train_step(stream.next()) for _ in range(STEPS)]
    return {"cfg": cfg, "trainer": trainer, "stream": stream, "hist": hist, "bias0": bias0,
            "dir": tmp_path_factory.mktemp("orbax")}


def test_loss_falls_below_bound(trained):
    hist = trained["hist"]
    assert hist[0]["loss"] > 4.0
    assert hist[-1]["ce"] < LOSS_BOUND, [round(h["ce"], 3) for h in hist]
    assert hist[-1]["mtp_ce"] < 2 * LOSS_BOUND
    # total = CE + λ·MTP-CE with λ = 0.3 (config factor is 0)
    h = hist[-1]
    assert h["loss"] == pytest.approx(h["ce"] + 0.3 * h["mtp_ce"], rel=1e-5)
    assert hist[0]["lr"] == 0.0 and hist[4]["lr"] == pytest.approx(3e-3, rel=1e-6)  # warmup
    assert all(np.isfinite(x["grad_norm"]) for x in hist)


def test_expert_bias_not_optimised_and_sign_rule(trained):
    tr = trained["trainer"]
    # expert_bias is not an optimizer leaf
    opt_keys = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tr.state["opt_state"])[0]}
    assert not any("expert_bias" in k for k in opt_keys)
    # one expert_bias per MoE layer (layer 1; the MTP layer), keyed as the layers are stored
    assert sorted(T.bias_layers(trained["cfg"], tr.state["bias"])) == [1, trained["cfg"].num_hidden_layers]
    assert "mtp/block/mlp/gate/expert_bias" in tr.state["bias"] and len(tr.state["bias"]) == 2
    for k, b0 in trained["bias0"].items():
        steps = (np.asarray(tr.state["bias"][k]) - b0) / TCFG.bias_rate
        # each step moves every entry by exactly ±rate (or 0 when load == mean): an integer in [-n, n]
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
        assert np.all(np.abs(steps) <= STEPS + 1e-3) and np.any(steps != 0)
    load = trained["hist"][-1]["load"]
    assert load.shape == (2, 8)
    np.testing.assert_allclose(load.sum(-1), 1.0, rtol=1e-6)


def test_resume_reproduces_next_loss_exactly(trained):
    tr, stream, d = trained["trainer"], trained["stream"], trained["dir"]
    mngr = T.checkpoint_manager(str(d))
    T.save_state(mngr, tr, stream.position(), force=True)
    mngr.wait_until_finished()
    saved_step = tr.step
    ref = tr.train_step(stream.next())
    ref_params = {k: np.asarray(v) for k, v in tr.state["params"].items()}
    ref_bias = {k: np.asarray(v) for k, v in tr.state["bias"].items()}

    fresh = T.Trainer(small_model(trained["cfg"], 7), TCFG)  # different init, same structure
    stream2 = T.BatchStream(synthetic_tokens(trained["cfg"]), batch=4, seq=24, seed=0)
    meta = T.restore_state(T.checkpoint_manager(str(d)), fresh)
    stream2.set_position(meta["data_position"])
    assert fresh.step == saved_step and meta["step"] == saved_step
    got = fresh.train_step(stream2.next())
    assert got["loss"] == ref["loss"] and got["mtp_ce"] == ref["mtp_ce"] and got["lr"] == ref["lr"]
    for k, v in fresh.state["params"].items():
        np.testing.assert_array_equal(np.asarray(v), ref_params[k])
    for k, v in fresh.state["bias"].items():
        np.testing.assert_array_equal(np.asarray(v), ref_bias[k])
    np.testing.assert_array_equal(np.asarray(fresh.state["rng"]), np.asarray(tr.state["rng"]))

    # the trained model can be rebuilt from the Orbax directory alone
    m = T.load_trained_model(str(d))
    np.testing.assert_array_equal(np.asarray(m.mtp.block.mlp.gate.expert_bias[...]),
                                  np.asarray(T.Trainer(m, TCFG).state["bias"]["mtp/block/mlp/gate/expert_bias"]))


def test_remat_forward_equals_model_call(trained):
    """The remat forward (layer scans with jax.checkpoint bodies) gives model.__call__'s logits."""
    from ling_jax.forward import forward

    model = trained["trainer"].model()
    ids = jnp.asarray(trained["stream"].next())
    lg, mt, routing = nnx_jit_forward(model, ids)
    ref = forward(model, ids, mtp=True)
    np.testing.assert_allclose(np.asarray(lg), np.asarray(ref["logits"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mt), np.asarray(ref["mtp_logits"]), rtol=1e-5, atol=1e-5)
    assert sorted(routing) == sorted(ref["routing"])
    for k in routing:
        np.testing.assert_array_equal(np.asarray(routing[k]), np.asarray(ref["routing"][k]))


def nnx_jit_forward(model, ids):
    from flax import nnx

    return nnx.jit(lambda m, x: T.forward(m, x, mtp=True, remat=True))(model, ids)


def test_kda_chunk_gradient_equals_recurrent():
    from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_scan

    B, Tn, H, d = 1, 11, 2, 8
    ks = jax.random.split(jax.random.key(3), 8)
    q = jax.random.normal(ks[0], (B, Tn, H, d))
    k = jax.random.normal(ks[1], (B, Tn, H, d))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * d ** -0.5
    v = jax.random.normal(ks[2], (B, Tn, H, d))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, Tn, H, d)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, Tn, H)))
    s0 = 0.1 * jax.random.normal(ks[5], (B, H, d, d))
    wo = jax.random.normal(ks[6], (B, Tn, H, d))
    ws = jax.random.normal(ks[7], (B, H, d, d))

    def obj(fn):
        def f(*a):
            o, s = fn(*a)
            return jnp.sum(o * wo) + jnp.sum(s * ws)
        return f

    args = (q, k, v, g, beta, s0)
    ga = jax.grad(obj(lambda *a: kda_chunk_scan(*a, chunk_size=4)), argnums=tuple(range(6)))(*args)
    gb = jax.grad(obj(kda_recurrent_scan), argnums=tuple(range(6)))(*args)
    for name, x, y in zip("q k v g beta state".split(), ga, gb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.linalg.norm(x - y) <= 1e-4 * np.linalg.norm(y), name


def test_expert_bias_rule_balances_skewed_routing():
    """Routers that send most tokens to 2 experts are pulled towards uniform load by the sign rule."""
    from ling_jax.moe import route

    cfg = small_cfg()
    E = cfg.num_experts
    rng = np.random.default_rng(0)
    D = cfg.hidden_size
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    x = jnp.asarray(rng.standard_normal((512, D)) + 2.0 * u, jnp.float32)  # tokens share a direction u
    w = rng.standard_normal((E, D)) * 0.1
    w[:2] += 2.0 * u  # experts 0 and 1 align with u: most tokens pick them
    w = jnp.asarray(w, jnp.float32)
    bias = jnp.zeros((E,), jnp.float32)

    @jax.jit
    def step(bias):
        idx, _ = route(x, w, bias, cfg)
        load = T.expert_load({0: idx}, E)[0]
        return T.update_expert_bias(bias, load, 0.01), load

    ratios = []
    for _ in range(150):
        bias, load = step(bias)
        ratios.append(float(load.max() * E))
    assert ratios[0] > 2.4, ratios[0]  # skewed: the busiest expert gets > 2.4x its share
    assert max(ratios[-20:]) < 1.3, ratios[-20:]  # near balance after 150 updates
    assert float(bias[0]) < 0 and float(bias[1]) < 0  # overloaded experts pushed down
