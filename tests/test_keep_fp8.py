"""`keep_quantized` on an FP8 checkpoint (`--keep-quantized`; `--keep-fp8` is its CLI alias): every
matrix the checkpoint stores as F8_E4M3 stays float8_e4m3fn + float32 block scales on device (a
`BlockFP8` value in its normal Linear / Experts) and is dequantised inside the matmul.

On a tiny written FP8 checkpoint (float32): the set of float8 parameters is exactly the set of
F8_E4M3 tensors in the headers, those matrices take ~half their bf16 bytes, the logits equal the
dequantising load's (1e-5), and `ling-jax logits --keep-fp8 --impl pallas` (the Pallas FP8 kernel,
interpret mode on CPU; the alias spelling on purpose) equals the XLA twin. On a mesh and through Orbax:
tests/test_sharding.py, tests/test_convert.py; both spellings of the flag: tests/test_convert.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from ling_jax.checkpoint.blocks import release_fp8
from ling_jax.checkpoint.layout import checkpoint_names
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.cli import main as cli_main
from ling_jax.config import LingConfig
from ling_jax.linear import Linear
from ling_jax.forward import forward
from ling_jax.loader import abstract_model, load_model
from ling_jax.layer_stack import is_stacked_path, stacked_layer_paths
from ling_jax.quantized import BlockFP8
from test_sharding import IDS, write_small

TOL = 1e-5
F8 = jnp.float8_e4m3fn


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8") / "ck"
    write_small(d, seed=7)
    return str(d)


@pytest.fixture(scope="module")
def fp8_model(ckpt):
    return load_model(ckpt, "float32", progress=False, keep_quantized=True)


@pytest.fixture(scope="module")
def fp8_logits(fp8_model):
    out = forward(fp8_model, IDS, mtp=True, exec=fp8_model.exec.replace(kernels="xla"))
    return np.asarray(out["logits"]), np.asarray(out["mtp_logits"])


def flat(model):
    return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def layer_paths(path, cfg):
    """The per-layer paths one stored parameter holds (a scanned run stacks several layers)."""
    return [lp for lp, _, _ in stacked_layer_paths(path, cfg)] if is_stacked_path(path) else [path]


def test_keep_fp8_holds_every_fp8_matrix(ckpt, fp8_model):
    m, params = fp8_model, flat(fp8_model)
    f8 = [p for p, v in params.items() if isinstance(v, BlockFP8)]
    assert all(params[p].values.dtype == F8 for p in f8)
    assert not any(v.dtype == F8 for v in params.values() if not isinstance(v, BlockFP8))
    held = {n for p in f8 for lp in layer_paths(p, m.cfg) for n in checkpoint_names(lp, m.cfg)[1]}
    with CheckpointReader(ckpt) as r:
        stored = {n for n in r.names() if r.info(n).dtype == "F8_E4M3"}
    assert stored and held == stored
    assert all(params[p].scales.dtype == jnp.float32 for p in f8)
    # a mix, as stored: KDA b_proj (BF16 in the checkpoint) holds a float weight beside FP8 q_proj,
    # both in the one Linear class
    att = m.model.layers[0].attention
    assert type(att.q_proj) is Linear and type(att.b_proj) is Linear
    assert isinstance(att.q_proj.weight.get_value(), BlockFP8)
    assert att.b_proj.weight[...].dtype == jnp.float32
    # weight bytes of the FP8-stored matrices on device vs the same matrices in bfloat16
    kept = sum(params[p].values.nbytes + params[p].scales.nbytes for p in f8)
    bf16 = sum(params[p].values.size * 2 for p in f8)
    assert 0.5 < kept / bf16 < 0.55, kept / bf16  # expert scales expanded along I: +3% at 64/24 wide


def test_export_refuses_fp8_model(fp8_model, tmp_path):
    from ling_jax.export import export_checkpoint

    with pytest.raises(ValueError, match="keeps FP8 weights .* --keep-fp8"):
        export_checkpoint(fp8_model, str(tmp_path / "x"), progress=False)


def test_keep_fp8_halves_the_real_model():
    """Shape-only, the release config (first 8 layers + MTP): with every FP8-stored matrix kept FP8 the
    whole model (bf16 embeddings, lm_head, norms, routers included) takes ~half its bfloat16 bytes
    (0.529 here; 0.517 for all 73 layers: 591 GB vs 1145 GB)."""
    full = LingConfig.from_json("/work/shared/spec/config.ling-3.1-flash.json")
    cfg = full.replace(num_hidden_layers=8, expert_swiglu_limit_list=list(full.expert_swiglu_limit_list[-8:]),
                       share_expert_swiglu_limit_list=list(full.share_expert_swiglu_limit_list[-8:]))
    nbytes = lambda m: sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize  # noqa: E731
                           for a in jax.tree.leaves(list(flat(m).values())))
    ratio = nbytes(abstract_model(cfg, jnp.bfloat16, True, release_fp8(cfg))) / nbytes(abstract_model(cfg, jnp.bfloat16))
    assert 0.5 < ratio < 0.535, ratio


def test_keep_fp8_logits_equal_dequantised_load(ckpt, fp8_logits):
    ref = forward(load_model(ckpt, "float32", progress=False), IDS, mtp=True)
    assert rel_err(fp8_logits[0], ref["logits"]) < TOL
    assert rel_err(fp8_logits[1], ref["mtp_logits"]) < TOL


def test_cli_logits_keep_fp8_pallas_equals_xla(ckpt, fp8_logits, tmp_path, monkeypatch):
    """`ling-jax logits --keep-fp8 --impl pallas` (the alias of --keep-quantized): the FP8 Pallas kernel
    (interpret mode on CPU) in every FP8-kept Linear gives the XLA twin's logits."""
    import ling_jax.linear as linear_mod  # Linear's module: the name its __call__ looks up

    calls = []
    real = linear_mod.fp8_linear_pallas
    monkeypatch.setattr(linear_mod, "fp8_linear_pallas", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    out = tmp_path / "p.npz"
    ids = ",".join(map(str, IDS[0]))
    assert cli_main(["logits", "--checkpoint", ckpt, "--input-ids", ids, "--out", str(out), "--mtp",
                     "--keep-fp8", "--impl", "pallas"]) == 0
    assert (64, 64) in calls and (64, 128) in calls  # e.g. KDA q_proj and the MTP eh_proj went through it
    got = np.load(out)
    assert rel_err(got["logits"], fp8_logits[0][0]) < TOL
    assert rel_err(got["mtp_logits"], fp8_logits[1][0]) < TOL
