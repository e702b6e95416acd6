"""Routed experts stored in the native CPU kernel's panel order (`pallas_kernels/experts/panels.py`):
the layout against its definition, the round trip, the kernel over packed weights against the same
kernel over `[out, in]` rows (bit for bit, both of its forms) and against float64, its gradients,
and the named refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_moe_active import _case, _reference
from pallas_kernels.experts.cpu_kernel import experts_decode_cpu
from pallas_kernels.experts.panels import pack_panels, unpack_panels

f32 = lambda a: jnp.asarray(a, jnp.float32)


def _packed_np(w):
    """The definition, element by element: panel p (rows 16p..16p+15) as [K][16], its K positions in
    lane-class order (position l·K/8 + j holds column 8j + l)."""
    O, K = w.shape[-2:]
    flat = np.empty(w.shape[:-2] + (O * K,), w.dtype)
    for p in range(O // 16):
        for pos in range(K):
            l, j = divmod(pos, K // 8)
            for r in range(16):
                flat[..., p * 16 * K + pos * 16 + r] = w[..., p * 16 + r, 8 * j + l]
    return flat.reshape(w.shape)


def test_pack_panels_is_the_layout_and_unpack_inverts_it():
    w = np.random.default_rng(0).standard_normal((3, 32, 24)).astype(np.float32)
    packed = np.asarray(pack_panels(jnp.asarray(w)))
    np.testing.assert_array_equal(packed, _packed_np(w))
    np.testing.assert_array_equal(np.asarray(unpack_panels(jnp.asarray(packed))), w)
    assert not np.array_equal(packed, w)


@pytest.mark.parametrize("lim", [0.0, 0.9])
def test_kernel_over_packed_weights_has_the_bits_of_the_rows(lim):
    """1-11 tokens an expert (the row form's dot tiles) and 12+ (its GEMM): the packed form runs the GEMM
    at every count with the same sums in the same order, so every bit agrees; and both equal float64."""
    rng = np.random.default_rng(1)
    for N, E, k in ((1, 8, 2), (5, 4, 3), (40, 3, 2), (23, 2, 2)):
        x, idx, wts, w = _case(rng, N, E, k, D=32, I=16)
        args = (f32(x), jnp.asarray(idx), f32(wts))
        rows = np.asarray(experts_decode_cpu(*args, *map(f32, w), lim))
        packed = np.asarray(experts_decode_cpu(*args, *(pack_panels(f32(a)) for a in w), lim, packed=True))
        np.testing.assert_array_equal(packed, rows)
        ref = _reference(x, idx, wts, *w, lim if lim else np.inf, E)
        assert np.abs(packed - ref).max() <= 1e-4 * np.abs(ref).max()


def test_gradients_through_packed_weights_are_the_rows_gradients_packed():
    rng = np.random.default_rng(2)
    x, idx, wts, w = _case(rng, 6, 4, 2, D=32, I=16)
    loss = lambda packed: lambda x, wts, g, u, d: jnp.sum(  # noqa: E731
        experts_decode_cpu(x, jnp.asarray(idx), wts, g, u, d, 0.0, packed=packed) ** 2)
    ws = tuple(map(f32, w))
    g_rows = jax.grad(loss(False), argnums=(0, 1, 2, 3, 4))(f32(x), f32(wts), *ws)
    g_packed = jax.grad(loss(True), argnums=(0, 1, 2, 3, 4))(f32(x), f32(wts), *(pack_panels(a) for a in ws))
    for a, b in zip(g_rows[:2], g_packed[:2]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    for a, b in zip(g_rows[2:], g_packed[2:]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(pack_panels(a)), rtol=1e-6, atol=1e-6)


def test_named_refusals():
    with pytest.raises(ValueError, match=r"w: panel order needs \[out, in\] with out a multiple of 16.*\(3, 24, 32\)"):
        pack_panels(jnp.zeros((3, 24, 32)))
    x, idx, wts, w = _case(np.random.default_rng(3), 2, 3, 2, D=32, I=24)
    with pytest.raises(ValueError, match="experts_decode_cpu: wg: panel order needs"):
        experts_decode_cpu(f32(x), jnp.asarray(idx), f32(wts), *map(f32, w), 0.0, packed=True)


# ------------------------------------------------------------------------------------------------
# the model stores its experts so (ExecConfig.expert_panels, ling_jax/expert_panels.py)
# ------------------------------------------------------------------------------------------------
def _panel_cfg():
    import np_reference as R
    return R.tiny_config(moe_intermediate_size=32)  # D = 64, I = 32: both multiples of 16


def _expert_values(model) -> dict:
    from flax import nnx
    out = {}
    for p, v in nnx.to_flat_state(nnx.state(model)):
        keys = [str(k) for k in p]
        if "experts" in keys and keys[-1] in ("gate_proj", "up_proj", "down_proj"):
            out[tuple(keys)] = v.get_value()
    return out


@pytest.fixture(scope="module")
def panel_case():
    import np_reference as R
    cfg = _panel_cfg()
    return cfg, R.random_params(cfg, seed=5)


def _load(case, loop, **kw):
    from conftest import DictReader
    from ling_jax.loader import load_from_reader
    cfg, params = case
    return load_from_reader(DictReader(params), cfg, progress=False, layer_loop=loop, **kw)


@pytest.mark.parametrize("loop", ["unroll", "scan"])
def test_a_loaded_model_runs_its_experts_from_panels_with_the_bits_of_rows(panel_case, loop):
    """Loaded on one CPU device in float32, every routed expert weight (main layers and MTP) is stored
    `PanelOrdered` (the shared experts and dense weights are not); the forward pass equals the float64
    reference, and bit for bit the same model with its experts stored back as rows; at call time with
    the native kernel off (every other path reads `rows()`) within the float32 tolerance."""
    import np_reference as R
    from conftest import rel_err
    from ling_jax.expert_panels import PanelOrdered, as_rows, store_experts
    cfg, params = panel_case
    model = _load(panel_case, loop)
    values = _expert_values(model)
    assert values and all(isinstance(v, PanelOrdered) for k, v in values.items() if "shared_experts" not in k)
    assert any(k[0] == "mtp" for k in values) and model.exec.expert_panels
    assert not any(isinstance(v, PanelOrdered) for k, v in values.items() if "shared_experts" in k)
    # the stored values are the checkpoint's experts in panel order
    g = np.asarray(as_rows(model.model.layers[1].mlp.experts.gate_proj.get_value()))
    np.testing.assert_array_equal(g[3], np.asarray(params["model.layers.1.mlp.experts.3.gate_proj.weight"], np.float32))
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 21)
    packed = np.asarray(model(jnp.asarray(ids[None], jnp.int32))["logits"][0])
    ref = R.forward(params, cfg, ids)["logits"]
    assert rel_err(packed, ref) <= 1e-4
    no_kernel = model.exec.replace(native_experts=False)
    xla = np.asarray(model(jnp.asarray(ids[None], jnp.int32), exec=no_kernel)["logits"][0])
    assert rel_err(xla, ref) <= 1e-4
    assert store_experts(model, panels=False) == len(values) - sum("shared_experts" in k for k in values)
    assert not any(isinstance(v, PanelOrdered) for v in _expert_values(model).values())
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(ids[None], jnp.int32))["logits"][0]), packed)


def test_weights_that_do_not_fit_panels_keep_rows(tiny_cfg, tiny_params):
    """I = 24 is not a multiple of 16: the loaded model keeps every expert as rows (and runs as before);
    `store_experts` converts nothing either."""
    from conftest import load_from_dict
    from ling_jax.expert_panels import PanelOrdered, store_experts
    model = load_from_dict(tiny_cfg, tiny_params)
    assert tiny_cfg.moe_intermediate_size % 16
    assert not any(isinstance(v, PanelOrdered) for v in _expert_values(model).values())
    assert store_experts(model, panels=True) == 0


def test_export_reads_panel_stored_experts_as_rows(panel_case):
    """The exporter writes the checkpoint's [out, in] experts from a model that stores them in panel
    order (`as_rows`): the same tensors as the checkpoint it was loaded from."""
    from ling_jax.export import model_tensors
    cfg, params = panel_case
    model = _load(panel_case, "scan")
    out = model_tensors(model)
    for name in ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.9.mlp.experts.7.down_proj.weight",
                 "model.layers.10.mlp.experts.0.up_proj.weight"):
        np.testing.assert_array_equal(out[name], np.asarray(params[name], np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["unroll", "scan"])
def test_engine_over_panels_serves_the_tokens_of_rows_and_reads_them_in_place(panel_case, loop):
    """The engine over a panel-stored model: the same greedy tokens and logprobs as over the same model
    with rows; and no program it compiles unpacks (transposes or copies) an expert weight: the native
    kernel reads the panels where they are stored, a scanned run's as one table (`moe.ExpertTable`)."""
    import re
    from ling_jax.expert_panels import store_experts
    from ling_jax.serve import Engine, RequestParams
    cfg, _ = panel_case
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    prompts = [np.random.default_rng(s).integers(0, cfg.vocab_size, n).tolist() for s, n in ((1, 13), (2, 6))]

    def serve(model):
        eng = Engine(model, max_slots=2, page_size=8, num_pages=12, prefill_chunk=16, max_seq_len=32)
        hs = [eng.submit(p, RequestParams(max_tokens=5, stop_ids=(), logprobs=0)) for p in prompts]
        while not all(h.finished for h in hs):
            eng.step()
        return eng, [(h.generated, h.logprobs) for h in hs]

    eng, packed = serve(_load(panel_case, loop))
    names = []
    for name, program, args in eng.program_calls():
        names.append(name)
        hlo = program.lower(*args).compile().as_text()
        for line in hlo.splitlines():  # an array of one or more experts' [I, D] / [D, I] built by an op
            m = re.search(r"= f32\[([\d,]*)\]\S* (transpose|copy|fusion|dynamic-slice|gather)\(", line)
            dims = tuple(int(d) for d in m.group(1).split(",")) if m and m.group(1) else ()
            assert not (len(dims) >= 3 and dims[-2:] in ((I, D), (D, I)) and np.prod(dims[:-2]) >= E), \
                f"{loop}: {name} builds an expert-sized array: {line.strip()[:160]}"
    assert any(n.startswith("decode") for n in names) and any(n.startswith("prefill") for n in names), names
    rows_model = _load(panel_case, loop)
    store_experts(rows_model, panels=False)
    _, rows = serve(rows_model)
    assert packed == rows


def test_panels_are_a_one_device_cpu_choice(panel_case):
    """`ExecConfig.for_backend` stores panels on CPU only; a load onto a mesh of several devices keeps
    rows (the panels would be split), and `shard_model` puts a panel-stored model back to rows before
    placing it: the sharded forward equals the one-device one."""
    from ling_jax.exec_config import ExecConfig
    from ling_jax.expert_panels import PanelOrdered
    from ling_jax.placement import shard_model
    from sharding.mesh import parse_mesh
    assert ExecConfig.for_backend("cpu").expert_panels
    assert not ExecConfig.for_backend("tpu").expert_panels and not ExecConfig.for_backend("gpu").expert_panels
    mesh = parse_mesh("expert=2", jax.devices()[:2])
    sharded = _load(panel_case, "unroll", mesh=mesh)
    assert _expert_values(sharded) and not any(isinstance(v, PanelOrdered) for v in _expert_values(sharded).values())
    one = _load(panel_case, "unroll")
    ids = jnp.asarray(np.random.default_rng(8).integers(0, panel_case[0].vocab_size, (2, 9)), jnp.int32)
    want = np.asarray(one(ids)["logits"])
    placed = shard_model(one, mesh)
    assert not any(isinstance(v, PanelOrdered) for v in _expert_values(placed).values())
    np.testing.assert_allclose(np.asarray(placed(ids)["logits"]), want, rtol=1e-5, atol=1e-5)


def test_reading_a_panel_stored_weight_as_an_array_is_refused_by_name():
    """Indexing or converting a `PanelOrdered` (what `experts.gate_proj[...]` does) would hand out values
    in panel order as if they were rows: refused, naming the reader to use."""
    from ling_jax.expert_panels import PanelOrdered, as_rows
    w = jnp.asarray(np.random.default_rng(4).standard_normal((2, 16, 8)), jnp.float32)
    p = PanelOrdered(pack_panels(w))
    for read in (lambda: p[...], lambda: np.asarray(p), lambda: p[0]):
        with pytest.raises(TypeError, match=r"panel order.*expert_panels\.as_rows\(value\) or value\.rows\(\)"):
            read()
    np.testing.assert_array_equal(np.asarray(as_rows(p)), np.asarray(w))
    assert p.shape == (2, 16, 8) and p.dtype == jnp.float32 and p.nbytes == w.nbytes and as_rows(w) is w
