"""`ling-jax convert` / ling_jax.convert: HF checkpoint → Orbax, restore on other meshes
(ling_jax.loader.load_model), atomicity, and bounded host memory."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding as S
from ling_jax.convert import convert
from ling_jax.checkpoint.orbax import is_converted
from ling_jax.cli import main as cli_main
from ling_jax.loader import load_model
from ling_jax.placement import model_mesh
from ling_jax.quantized import BlockFP8
from ling_jax.config import LingConfig
from ling_jax.checkpoint.writer import write_checkpoint
from test_sharding import small_cfg_dict, write_small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv") / "hf"
    write_small(d, seed=9)
    return str(d)


def flat_params(model):
    """{path: array}, a BlockFP8's values and scales as two entries."""
    out = {}
    for p, v in nnx.to_flat_state(nnx.state(model)):
        k, a = "/".join(map(str, p)), v.get_value()
        if isinstance(a, BlockFP8):
            out[k], out[k + ":scales"] = a.values, a.scales
        else:
            out[k] = a
    return out


def assert_same_params(a, b, mesh=None):
    fa, fb = flat_params(a), flat_params(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))), k
        if mesh is not None:
            assert x.sharding.mesh.shape == mesh.shape and x.sharding.spec == y.sharding.spec, k


def test_convert_then_restore_on_another_mesh(ckpt, tmp_path):
    out = tmp_path / "orbax"
    meta = convert(ckpt, str(out), S.parse_mesh("expert=4,model=2"), dtype="float32", progress=False)
    assert is_converted(str(out)) and not os.path.exists(tmp_path / ".orbax.converting")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).is_file(), f
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    on_disk = json.loads((out / "ling_jax_orbax.json").read_text())
    assert on_disk["groups"] == ["globals", "layer_000", "layer_001", "layer_002", "layer_003", "mtp"]
    assert meta["mesh"] == "data=1,expert=4,model=2" and on_disk["dtype"] == "float32"
    # restore onto a different mesh shape: same values as loading the HF checkpoint there directly
    mesh = S.parse_mesh("data=2,model=4")
    restored = load_model(str(out), "float32", mesh=mesh, progress=False)
    direct = load_model(ckpt, "float32", mesh=mesh, progress=False)  # the HF directory itself
    assert_same_params(restored, direct, mesh)
    g = restored.model.layers[1].mlp.experts.gate_proj[...]
    assert tuple(g.sharding.spec) == (None, "model", None) and model_mesh(restored) == mesh
    # stored float32, restored as bfloat16: a plain cast
    bf = load_model(str(out), "bfloat16", mesh=S.parse_mesh("expert=8"), progress=False)
    x = bf.model.layers[2].mlp.experts.down_proj[...]
    assert x.dtype == jnp.bfloat16 and tuple(x.sharding.spec)[:1] == ("expert",)
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                  np.asarray(direct.model.layers[2].mlp.experts.down_proj[...]
                                             .astype(jnp.bfloat16).astype(jnp.float32)))


def test_convert_keep_fp8(ckpt, tmp_path):
    """convert --keep-quantized (float32 for the rest) → restore on other meshes: the FP8 matrices (experts
    and dense projections) come back as BlockFP8 (float8 + scales), equal to a direct keep_quantized load,
    and the logits equal the dequantising single-device load."""
    from ling_jax.forward import forward
    from test_sharding import IDS

    out = tmp_path / "fp8"
    convert(ckpt, str(out), S.parse_mesh("expert=8"), dtype="float32", keep_quantized=True, progress=False)
    mesh = S.parse_mesh("expert=4,model=2")
    restored = load_model(str(out), "bfloat16", mesh=mesh, progress=False)
    direct = load_model(ckpt, "bfloat16", mesh=mesh, keep_quantized=True, progress=False)
    assert_same_params(restored, direct, mesh)
    assert restored.model.layers[1].mlp.experts.up_proj.get_value().values.dtype == jnp.float8_e4m3fn
    assert restored.model.layers[0].attention.q_proj.weight.get_value().values.dtype == jnp.float8_e4m3fn
    assert restored.mtp.eh_proj.weight.get_value().scales.dtype == jnp.float32
    with pytest.raises(ValueError, match="converted with --keep-quantized"):
        load_model(str(out), "bfloat16", mesh=mesh, keep_quantized=False, progress=False)
    mesh = S.parse_mesh("data=2,model=4")
    got = np.asarray(forward(load_model(str(out), "float32", mesh=mesh, progress=False), IDS)["logits"])
    ref = forward(load_model(ckpt, "float32", progress=False), IDS)["logits"]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def _partial_run(ckpt, out, code):
    """Run a conversion in a subprocess that dies (os._exit, like kill -9) after the 2nd group."""
    prog = (f"import os, sharding as S\n"
            f"from ling_jax.convert import convert\n"
            f"def hook(g):\n"
            f"    if g == 'layer_000':\n"
            f"        {code}\n"
            f"convert({ckpt!r}, {out!r}, S.parse_mesh('expert=8'), progress=False, _after_group=hook)\n")
    return subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_v1_conversion_is_refused_with_the_reason(tmp_path):
    """A directory converted before the [E, out, in] expert layout (marker v1) is refused by name."""
    d = tmp_path / "old"
    d.mkdir()
    (d / "ling_jax_orbax.json").write_text(json.dumps({"format": "ling-jax-orbax", "version": 1}))
    with pytest.raises(ValueError, match=r"v1, written before routed experts moved to the \[E, out, in\]"):
        load_model(str(d), mesh=S.parse_mesh("expert=8"))


def test_interrupted_conversion_leaves_nothing_complete(ckpt, tmp_path):
    out = str(tmp_path / "conv")
    partial = str(tmp_path / ".conv.converting")
    # an exception (e.g. Ctrl-C) mid-way: no output, temporary directory removed
    calls = []

    def boom(g):
        calls.append(g)
        if g == "layer_000":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(ckpt, out, S.parse_mesh("expert=8"), progress=False, _after_group=boom)
    assert calls == ["globals", "layer_000"] and not os.path.exists(out) and not os.path.exists(partial)
    # a hard kill mid-way: only the hidden `.conv.converting` directory remains, without the marker
    p = _partial_run(ckpt, out, "os._exit(9)")
    assert p.returncode == 9, p.stderr[-2000:]
    assert not os.path.exists(out) and os.path.isdir(partial)
    assert os.listdir(os.path.join(partial, "params")) and not is_converted(partial)
    with pytest.raises(ValueError, match="incomplete conversion"):
        load_model(partial, mesh=S.parse_mesh("expert=8"))
    with pytest.raises(FileNotFoundError):
        load_model(out, mesh=S.parse_mesh("expert=8"))
    # the next run starts over and completes
    assert cli_main(["convert", "--checkpoint", ckpt, "--out", out, "--quiet"]) == 0
    assert is_converted(out) and not os.path.exists(partial)


def test_converted_dir_loads_by_relative_path_on_one_device(ckpt, tmp_path, monkeypatch):
    """A converted directory is a checkpoint like any other: a relative path, no mesh (issue 15.6)."""
    convert(ckpt, str(tmp_path / "rel"), S.parse_mesh("expert=8"), progress=False, with_mtp=False)
    monkeypatch.chdir(tmp_path)
    m = load_model("rel", "bfloat16", with_mtp=False, progress=False)
    assert model_mesh(m) is None and len(m.lm_head.weight[...].sharding.device_set) == 1
    assert_same_params(m, load_model(ckpt, "bfloat16", with_mtp=False, progress=False))


def test_cli_convert(ckpt, tmp_path, capsys):
    out = str(tmp_path / "c")
    assert cli_main(["convert", "--checkpoint", ckpt, "--out", out, "--mesh", "expert=4,model=2", "--quiet",
                     "--no-mtp"]) == 0
    msg = capsys.readouterr().out
    assert "converted" in msg and "groups" in msg and "mesh data=1,expert=4,model=2" in msg
    assert "mtp" not in json.loads(open(os.path.join(out, "ling_jax_orbax.json")).read())["groups"]
    m = load_model(out, "float32", mesh=S.parse_mesh("expert=8"), with_mtp=False, progress=False)
    assert m.mtp is None
    with pytest.raises(ValueError, match="without the MTP layer"):
        load_model(out, "float32", mesh=S.parse_mesh("expert=8"), progress=False)
    assert cli_main(["convert", "--checkpoint", ckpt, "--out", out, "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", "--checkpoint", ckpt, "--out", out, "--quiet", "--force", "--mesh", "expert=3"]) == 2
    assert "needs 3 devices" in capsys.readouterr().err
    assert cli_main(["convert", "--checkpoint", ckpt, "--out", out, "--quiet", "--force"]) == 0
    assert "mtp" in json.loads(open(os.path.join(out, "ling_jax_orbax.json")).read())["groups"]
    with pytest.raises(ValueError, match="--keep-quantized"):
        load_model(ckpt_bf16(tmp_path), mesh=S.parse_mesh("expert=8"), keep_quantized=True, progress=False)


@pytest.mark.parametrize("command", ["convert", "logits", "generate", "serve"])
def test_keep_quantized_is_canonical_and_keep_fp8_its_alias(command):
    """`--keep-quantized` is the flag (args.keep_quantized, the Python API's keep_quantized); `--keep-fp8`
    is only its alias: both spellings set the same destination, and the help names the canonical one first."""
    from ling_jax.cli import build_parser

    required = {"convert": ["--checkpoint", "a", "--out", "b"], "logits": ["--checkpoint", "a", "--input-ids", "1",
                                                                          "--out", "o.npz"],
                "generate": ["--checkpoint", "a", "--input-ids", "1", "--max-new-tokens", "1"],
                "serve": ["--checkpoint", "a"]}[command]
    parser = build_parser()
    for flag in ("--keep-quantized", "--keep-fp8"):
        args = parser.parse_args([command, *required, flag])
        assert args.keep_quantized is True and not hasattr(args, "keep_fp8"), flag
    assert parser.parse_args([command, *required]).keep_quantized is False
    sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[1]
    assert "--keep-quantized, --keep-fp8" in sub.format_help()


def ckpt_bf16(tmp_path):
    d = tmp_path / "bf16"
    write_small(d, dtype="bf16")
    return str(d)


# Memory bound (stated in sharding/README.md): converting streams one group (one decoder layer) at a
# time, so the peak RSS growth over the warmed-up process is at most 64 MiB + 3 x the largest group's
# converted bytes, and in any case below half of all converted parameter bytes.
def test_conversion_host_memory_is_bounded(ckpt, tmp_path):
    n = 8
    cfg = LingConfig.from_dict(small_cfg_dict(
        hidden_size=512, head_dim=128, num_experts=32, moe_intermediate_size=288, intermediate_size=1024,
        moe_shared_expert_intermediate_size=512, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64,
        qk_rope_head_dim=32, qk_head_dim=96, v_head_dim=64, num_hidden_layers=n,
        expert_swiglu_limit_list=[0.0] * n, share_expert_swiglu_limit_list=[0.0] * n))
    big = tmp_path / "big"
    write_checkpoint(cfg, str(big), dtype="fp8", seed=3, progress=False, tokenizer=False)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "measure_convert_memory.py"), str(big),
                        str(tmp_path / "big_orbax"), "--warmup", ckpt], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(r)
    assert 100e6 < r["checkpoint_bytes"] < 300e6
    growth = r["peak_rss"] - r["base_rss"]
    assert growth <= 64 * 2**20 + 3 * r["largest_group_bytes"], r
    assert growth < 0.5 * r["param_bytes"], r
    assert r["tracemalloc_peak"] < 1.5 * r["largest_group_bytes"], r
