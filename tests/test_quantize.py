"""`ling-jax quantize --experts mxfp4` and `make-checkpoint --expert-format mxfp4` on written checkpoints.

The written MXFP4 bytes are checked against the independent spec implementation of test_mxfp4
(`ref_encode` / `ref_decode`, which never call the codec).
"""
import json
import os

import numpy as np
import pytest

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint import mxfp4 as MX
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.checkpoint.safetensors_io import SafetensorsFile, load_file, save_file
from ling_jax.checkpoint.synthetic_config import synthetic_config as tiny_config
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.cli import main
from ling_jax.config import LingConfig
from ling_jax.commands.inspect import inspect_dir
from test_mxfp4 import ref_decode, ref_encode

GiB = 1 << 30
REAL = "/work/shared/spec/config.ling-3.1-flash.json"


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory):
    d = tmp_path_factory.mktemp("q") / "src"
    write_checkpoint(tiny_config(num_hidden_layers=3), str(d), progress=False)
    return str(d)


@pytest.fixture(scope="module")
def quantized(fp8_src, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("q") / "out")
    assert main(["quantize", "--checkpoint", fp8_src, "--out", out, "--experts", "mxfp4", "--quiet"]) == 0
    return out


def test_quantize_round_trip_bit_exact(fp8_src, quantized):
    src, out = CheckpointReader(fp8_src), CheckpointReader(quantized)
    experts = [n for n in src.names() if L.is_routed_expert_weight(n)]
    n_layers = src.config.num_hidden_layers
    assert any(n.startswith(f"model.layers.{n_layers}.") for n in experts)  # the MTP layer's too
    assert len(experts) == 2 * 8 * 3
    rel = []
    for i, n in enumerate(experts):
        codes, scales = out.get_raw(n), out.get_raw(L.scale_name(n))
        o, k = src.spec(n)[0]
        assert codes.dtype == np.uint8 and codes.shape == (o, k // 2)
        assert scales.dtype == np.uint8 and scales.shape == (o, k // 32)
        assert out.spec(n)[1] == "U8" and out.spec(L.scale_name(n))[1] == "U8"
        ref = ref_decode(codes, scales)                                       # independent decode
        assert np.array_equal(MX.dequantize_mxfp4(codes, scales, n).view(np.uint32), ref.view(np.uint32))
        fp8_values = src.get(n)
        if i % 16 == 0:                                                       # independent encode (slow)
            rp, rs = ref_encode(fp8_values)
            assert np.array_equal(rp, codes) and np.array_equal(rs, scales)
        rel.append(np.linalg.norm(ref - fp8_values) / np.linalg.norm(fp8_values))
    # re-quantised experts vs their FP8 values: 11.5% relative (Frobenius) error per tensor, stated
    assert 0.10 < min(rel) and max(rel) < 0.125, (min(rel), max(rel))
    # every other tensor (dense FP8 scales included) byte for byte
    others = [n for n in src.names() if not L.is_routed_expert_weight(n)
              and not L.is_routed_expert_weight(L.weight_of_scale(n) or "")]
    assert sorted(others + experts + [L.scale_name(n) for n in experts]) == sorted(out.names())
    for n in others:
        a, b = src.get_raw(n), out.get_raw(n)
        assert src.spec(n) == out.spec(n) and a.tobytes() == b.tobytes(), n
        assert src.file_of(n).rsplit("/", 1)[1] == out.file_of(n).rsplit("/", 1)[1]  # same shard


def test_quantize_config_index_and_files(fp8_src, quantized, tmp_path):
    with open(os.path.join(fp8_src, "config.json")) as f:
        a = json.load(f)
    with open(os.path.join(quantized, "config.json")) as f:
        b = json.load(f)
    qa, qb = a.pop("quantization_config"), b.pop("quantization_config")
    assert a == b
    assert qb == {**qa, "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}
    assert "scale_fmt" not in qb
    with open(os.path.join(quantized, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    r = CheckpointReader(quantized)                    # the reader re-checks total_size against the shards
    assert idx["metadata"]["total_size"] == r.total_size == sum(
        SafetensorsFile(os.path.join(quantized, f)).data_size for f in set(idx["weight_map"].values()))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(fp8_src, f), "rb") as x, open(os.path.join(quantized, f), "rb") as y:
            assert x.read() == y.read(), f
    # make-checkpoint --expert-format mxfp4 writes exactly what quantize makes of the fp8 checkpoint
    made = str(tmp_path / "made")
    assert main(["make-checkpoint", "--config", os.path.join(fp8_src, "config.json"), "--out", made,
                 "--expert-format", "mxfp4", "--quiet"]) == 0
    m = CheckpointReader(made)
    assert sorted(m.names()) == sorted(r.names()) and m.total_size == r.total_size
    assert all(m.get_raw(n).tobytes() == r.get_raw(n).tobytes() for n in r.names())
    with open(os.path.join(made, "config.json")) as f:
        assert json.load(f)["quantization_config"] == qb
    # inspect: logical parameters unchanged, bytes as stored
    i_src, i_out = inspect_dir(fp8_src), inspect_dir(quantized)
    assert i_out["params"]["total"] == i_src["params"]["total"]
    assert i_out["bytes"]["total"] == r.total_size and i_out["mxfp4"]["experts"] == 48
    assert i_out["mxfp4"]["bytes"] == sum(r.info(n).nbytes + r.info(L.scale_name(n)).nbytes
                                          for n in r.names() if L.is_routed_expert_weight(n))
    # an MXFP4 source comes out unchanged (decode -> encode is the identity on MXFP4 values)
    again = str(tmp_path / "again")
    assert main(["quantize", "--checkpoint", quantized, "--out", again, "--experts", "mxfp4", "--quiet"]) == 0
    g = CheckpointReader(again)
    assert all(g.get_raw(n).tobytes() == r.get_raw(n).tobytes() for n in r.names())


def test_quantize_bf16_source(tmp_path):
    cfg = tiny_config(num_hidden_layers=3)
    src, out = str(tmp_path / "bf16"), str(tmp_path / "out")
    write_checkpoint(cfg, src, dtype="bf16", tokenizer=False, progress=False)
    assert main(["quantize", "--checkpoint", src, "--out", out, "--experts", "mxfp4", "--quiet"]) == 0
    a, b = CheckpointReader(src), CheckpointReader(out)
    n = "model.layers.3.mlp.experts.5.down_proj.weight"
    rp, rs = ref_encode(a.get(n))
    assert np.array_equal(b.get_raw(n), rp) and np.array_equal(b.get_raw(L.scale_name(n)), rs)
    q = b.config.quantization_config
    assert q["routed_experts_quant_method"] == "mxfp4" and q["quant_method"] == "fp8"
    assert not any(".mlp.experts." in m for m in q["modules_to_not_convert"])
    assert "model.layers.0.attention.q_a_proj" in q["modules_to_not_convert"]  # BF16 dense: not fp8


# ---- refusals -------------------------------------------------------------------------------
def _rewrite(d: str, name: str, fn) -> None:
    """Replace tensor `name` of checkpoint `d` by fn(old array); fix the index's total_size."""
    idx_path = os.path.join(d, "model.safetensors.index.json")
    with open(idx_path) as f:
        idx = json.load(f)
    path = os.path.join(d, idx["weight_map"][name])
    t = load_file(path)
    t[name] = fn(t[name])
    save_file(t, path)
    idx["metadata"]["total_size"] = sum(SafetensorsFile(os.path.join(d, f)).data_size
                                        for f in set(idx["weight_map"].values()))
    with open(idx_path, "w") as f:
        json.dump(idx, f)


E = "model.layers.2.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize("what,fn,message", [
    ("nan", lambda s: np.where(np.arange(s.size).reshape(s.shape) == 7, 0xFF, s).astype(np.uint8),
     r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight_scale_inv: 1 MXFP4 scale byte\(s\) are 0xFF \(E8M0 NaN\)"),
    ("scale_shape", lambda s: np.zeros((s.shape[0], s.shape[1] + 1), np.uint8),
     r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight_scale_inv: MXFP4 scale shape \[96, 7\], expected \[96, 6\]"),
    ("odd_width", None,
     r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight: packed MXFP4 width 95 is odd"),
])
def test_quantize_refuses_malformed_mxfp4(quantized, tmp_path, capsys, what, fn, message):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(quantized, bad)
    if fn is not None:
        _rewrite(bad, L.scale_name(E), fn)
    else:
        _rewrite(bad, E, lambda c: c[:, :95].copy())
    out = tmp_path / "o" / "out"
    out.parent.mkdir()
    capsys.readouterr()
    assert main(["quantize", "--checkpoint", bad, "--out", str(out), "--experts", "mxfp4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    import re
    assert re.search(message, err), err
    assert not out.exists() and os.listdir(out.parent) == []   # nothing written, no temp left behind
    if what != "nan":   # shape errors are header-level: inspect refuses them too
        with pytest.raises(ValueError, match=message):
            inspect_dir(bad)


def test_undeclared_mxfp4_experts_refused(quantized, tmp_path, capsys):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(quantized, bad)
    p = os.path.join(bad, "config.json")
    with open(p) as f:
        c = json.load(f)
    del c["quantization_config"]["routed_experts_quant_method"]
    with open(p, "w") as f:
        json.dump(c, f)
    assert main(["quantize", "--checkpoint", bad, "--out", str(tmp_path / "o"), "--experts", "mxfp4"]) == 2
    assert "does not declare quantization_config.routed_experts_quant_method: mxfp4" in capsys.readouterr().err


# ---- the real config, header only -------------------------------------------------------------
def test_real_config_header_only_is_the_seed_291_64_gib(tmp_path):
    """Seed article: MXFP4 routed experts (incl. MTP), rest unchanged: 313.15 GB = 291.64 GiB."""
    fp8, mx, made = (str(tmp_path / n) for n in ("fp8", "mx", "made"))
    common = ["--config", REAL, "--header-only", "--fp8-layout", "A", "--conv-dtype", "F32", "--no-tokenizer", "--quiet"]
    assert main(["make-checkpoint", "--out", fp8, *common]) == 0
    assert main(["quantize", "--checkpoint", fp8, "--out", mx, "--experts", "mxfp4", "--quiet"]) == 0
    r = inspect_dir(mx)
    assert r["header_only"] and r["bytes"]["total"] == r["index_total_size"] == 313_151_411_712
    assert round(r["bytes"]["total"] / GiB, 2) == 291.64
    assert r["params"]["total"] == L.count_params(LingConfig.from_json(REAL)) == 572_120_680_768  # logical
    assert r["mxfp4"]["experts"] == (68 + 1) * 512 * 3  # 68 main MoE layers + MTP
    assert main(["make-checkpoint", "--out", made, "--expert-format", "mxfp4", *common]) == 0
    assert inspect_dir(made)["bytes"] == r["bytes"]
