"""FP8 layouts A and B of spec §12.7 written with real data: the reader and loader need no layout.

Layout A keeps MLA `kv_a_proj_with_mqa` BF16 and stores the head-wise `g_proj` FP8 (a partial
block row); layout B is the reverse. Both checkpoints of the same seed hold the same generated
values, so they must differ exactly in how those two matrices (and, here, the conv taps written
F32 in A) are rounded, and each must give the float64 reference's logits of its own dequantised
parameters. The loader finds quantised tensors by stored dtype + `weight_scale_inv`, never by
`modules_to_not_convert`.
"""
import json

import ml_dtypes
import numpy as np
import pytest

import np_reference as R
from conftest import rel_err
from fixtures import generate_tensor
from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.fp8 import block_dequant_fp8, block_quant_fp8
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.config import LingConfig
from ling_jax.forward import forward
from ling_jax.loader import load_model

SEED = 11
LAYOUT_MATRICES = ("attention.kv_a_proj_with_mqa.weight", "attention.g_proj.weight")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cfg = LingConfig.from_dict(R.tiny_config_dict(vocab_size=300, eos_token_id=295, pad_token_id=296))
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for layout, conv in (("A", "F32"), ("B", "BF16")):
        d = root / layout
        s = write_checkpoint(cfg, str(d), dtype="fp8", seed=SEED, progress=False, tokenizer=False,
                             fp8_layout=layout, conv_dtype=conv)
        assert (s["fp8_layout"], s["conv_dtype"]) == (layout, conv)
        r = CheckpointReader(str(d))
        r.validate()
        params = {n: r.get(n, dtype=np.float64) for n in r.names() if not n.endswith(L.SCALE_SUFFIX)}
        out[layout] = (str(d), r, params)
    return cfg, out


def _mla_layers(cfg):
    return [i for i, t in enumerate(cfg.layer_types) if t == "mla"] + [cfg.num_hidden_layers]


def test_stored_dtypes_and_config_follow_layout(ckpts):
    cfg, out = ckpts
    for layout, (d, r, _) in out.items():
        with open(f"{d}/config.json") as f:
            mods = json.load(f)["quantization_config"]["modules_to_not_convert"]
        assert mods == L.modules_to_not_convert(cfg, fp8_layout=layout)
        assert set(r.names()) == {n for n, _, _ in L.release_tensors(cfg, "fp8", fp8_layout=layout)}
        for i in _mla_layers(cfg):
            kv, g = (f"model.layers.{i}.{m}" for m in LAYOUT_MATRICES)
            fp8 = {kv: layout == "B", g: layout == "A"}
            for name, q in fp8.items():
                assert r.is_quantized(name) == q, (layout, name)
                assert (r.spec(name)[1] == "F8_E4M3") == q
                assert (L.scale_name(name) in r.names()) == q
                assert (L.module_of(name) in mods) == (not q)
            if layout == "A":  # head-wise gate: H rows < 128, one partial block row
                assert r.get_scale(g).shape == (1, -(-cfg.hidden_size // 128))
        conv = r.spec("model.layers.0.attention.q_conv1d.weight")[1]
        assert conv == {"A": "F32", "B": "BF16"}[layout]


def test_params_differ_only_by_layout_rounding(ckpts):
    """Same generated values; A and B differ exactly where their storage differs."""
    cfg, out = ckpts
    pa, pb = out["A"][2], out["B"][2]
    assert pa.keys() == pb.keys()
    block = tuple(cfg.weight_block_size or (128, 128))
    mla = {f"model.layers.{i}.{m}" for i in _mla_layers(cfg) for m in LAYOUT_MATRICES}

    def fp8(x):
        return block_dequant_fp8(*block_quant_fp8(x, block), block).astype(np.float64)

    def bf16(x):
        return x.astype(ml_dtypes.bfloat16).astype(np.float64)

    n_diff = 0
    for name in pa:
        if name in mla:
            ref = generate_tensor(cfg, name, seed=SEED)
            kv = name.endswith("kv_a_proj_with_mqa.weight")
            np.testing.assert_array_equal(pa[name], bf16(ref) if kv else fp8(ref))
            np.testing.assert_array_equal(pb[name], fp8(ref) if kv else bf16(ref))
            assert not np.array_equal(pa[name], pb[name])
            n_diff += 1
        elif name.endswith("_conv1d.weight"):
            ref = generate_tensor(cfg, name, seed=SEED)
            np.testing.assert_array_equal(pa[name], ref.astype(np.float64))  # F32: exact
            np.testing.assert_array_equal(pb[name], bf16(ref))
        else:
            np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)
    assert n_diff == 2 * len(_mla_layers(cfg))


def test_logits_equal_dequantized_reference_in_both_layouts(ckpts):
    cfg, out = ckpts
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=19)
    got, models = {}, {}
    for layout in ("B", "A"):
        d, _, params = out[layout]
        models[layout] = model = load_model(d, "float32", progress=False)
        o = forward(model, ids[None], mtp=True)
        ref = R.forward(params, cfg, ids, mtp=True)
        assert rel_err(o["logits"][0], ref["logits"]) < 1e-4, layout
        assert rel_err(o["mtp_logits"][0], ref["mtp_logits"]) < 1e-4, layout
        got[layout] = o
    # the two layouts round kv_a_proj / g_proj (and the conv taps) differently: not the same model
    assert rel_err(got["A"]["logits"][0], got["B"]["logits"][0]) > 1e-4
