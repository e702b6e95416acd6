"""Parameter / byte / cache accounting: `ling_jax.accounting`, `ling-jax plan`, `ling-jax inspect`.

The real-config numbers are the published ones (spec §0, §14; seed articles): 563,946,483,520 main +
8,174,197,248 MTP parameters, 24,250,707,776 active, 10,368 / 11,520 B of MLA cache per token,
252 MiB of KDA state per sequence, 534.35 GiB release (fp8) and 291.64 GiB MXFP4-expert weights.
"""
import json
import math
import re

import pytest

from ling_jax import accounting as A
from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.cli import main
from ling_jax.checkpoint.safetensors_io import nbytes
from ling_jax.commands.inspect import format_table, inspect_dir
from ling_jax.config import LingConfig
from sharding.mesh import parse_mesh_shape

REAL = "/work/shared/spec/config.ling-3.1-flash.json"
MAIN, MTP, ACTIVE, EMBED = 563_946_483_520, 8_174_197_248, 24_250_707_776, 643_825_664
GiB = 1 << 30


@pytest.fixture(scope="module")
def real_cfg():
    return LingConfig.from_json(REAL)


def run_json(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def run_err(argv, capsys):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and "\n" not in err
    return err


# ---------------------------------------------------------------------------------------------
# config-level accounting
# ---------------------------------------------------------------------------------------------
def test_param_counts_real(real_cfg):
    p = A.param_counts(real_cfg)
    assert (p["main"], p["mtp"], p["total"]) == (MAIN, MTP, MAIN + MTP)
    assert p["active"] == ACTIVE
    assert p["embedding"] == EMBED and p["active_with_embedding"] == ACTIVE + EMBED  # 24.89 B
    g = p["by_group"]
    assert sum(g.values()) == MAIN + MTP and g["other"] == 0
    # the seed's header audit, to its printed precision
    for k, billions in [("routed_experts", 547.61), ("kda_attention", 12.71), ("shared_experts", 1.07),
                        ("mla_attention", 0.63), ("dense_ffn", 0.50), ("embed_head", 1.29),
                        ("routers_norms", 0.14), ("mtp", 8.17)]:
        assert round(g[k] / 1e9, 2) == billions, k
    q = A.param_counts(real_cfg, include_mtp=False)
    assert (q["main"], q["mtp"], q["active"]) == (MAIN, 0, ACTIVE)


def test_cache_bytes_real(real_cfg):
    c = A.cache_bytes(real_cfg)
    assert (c["num_mla_layers"], c["num_kda_layers"]) == (9, 63)
    assert c["mla_bytes_per_token"] == 10_368 and c["mla_bytes_per_token_with_mtp"] == 11_520
    assert c["mla_bytes_per_token_per_layer"] == 1_152
    assert c["mla_expanded_bytes_per_token"] == 368_640
    assert c["kda_state_bytes_per_sequence"] == 264_241_152 == 252 * (1 << 20)
    assert c["kda_conv_state_bytes_per_sequence"] == 9_289_728
    assert A.cache_bytes(real_cfg, cache_dtype_bytes=1)["mla_bytes_per_token"] == 5_184


def test_weight_bytes_real(real_cfg):
    fp8 = A.weight_bytes(real_cfg, "fp8")
    assert fp8["total"] == sum(v for k, v in fp8.items() if k != "total")
    assert round(fp8["total"] / GiB, 2) == 534.35
    # within 0.1 MB of the published tensor-byte total (spec §12.7, Layout A)
    assert abs(fp8["total"] - 573_753_281_152) < 100_000
    assert round(A.weight_bytes(real_cfg, "mxfp4")["total"] / GiB, 2) == 291.64
    assert A.weight_bytes(real_cfg, "bf16")["total"] == 2 * (MAIN + MTP)
    # Layout B (our writer's) is 20.9 MB lighter: 534.33 GiB
    b = A.weight_bytes(real_cfg, "fp8", fp8_layout="B")["total"]
    assert fp8["total"] - b == 10 * ((576 * 4096 * 2 - (576 * 4096 + 5 * 32 * 4)) - (64 * 4096 - 32 * 4))
    n = A.summary(real_cfg, "fp8")
    assert (n["num_tensors"], n["num_scale_tensors"]) == (214_025, 106_632)


def test_stored_tensors_consistent_with_layout(real_cfg):
    """fp8_layout=None reproduces exactly what layout.release_tensors (our writer) stores."""
    ours = [(t.name, t.dtype, tuple(t.shape)) for t in A.stored_tensors(real_cfg, "fp8", fp8_layout=None,
                                                                           conv_dtype=L.DEFAULT_CONV_DTYPE)]
    assert ours == [(n, d, tuple(s)) for n, d, s in L.release_tensors(real_cfg, "fp8")]


@pytest.mark.parametrize("layout", ["A", "B"])
@pytest.mark.parametrize("conv", ["F32", "BF16"])
def test_stored_tensors_use_the_writers_layout_table(real_cfg, layout, conv):
    """plan's byte rules and the writer's files come from the same table (layout.BF16_MATRICES)."""
    ours = [(t.name, t.dtype, tuple(t.shape)) for t in A.stored_tensors(real_cfg, "fp8", fp8_layout=layout,
                                                                           conv_dtype=conv)]
    assert ours == [(n, d, tuple(s)) for n, d, s in L.release_tensors(real_cfg, "fp8", fp8_layout=layout,
                                                                         conv_dtype=conv)]
    assert A.detect_fp8_layout(A.stored_tensors(real_cfg, "fp8", fp8_layout=layout, conv_dtype=conv)) == layout
    assert A.detect_fp8_layout(A.stored_tensors(real_cfg, "bf16")) is None


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------
def test_plan_real_release_formats(capsys):
    r = run_json(["plan", "--config", REAL, "--weights", "fp8", "--json"], capsys)
    assert r["weight_gib"] == 534.35 and round(r["weight_bytes"] / GiB, 2) == 534.35
    assert r["params"] == MAIN + MTP
    assert r["mla_cache_bytes_per_token"] == 11_520 and r["mla_cache_bytes_per_token_main"] == 10_368
    assert r["kda_state_bytes_per_sequence"] == 264_241_152
    assert r["kda_conv_state_bytes_per_sequence"] == 9_289_728
    assert r["weight_bytes_per_device"] == r["weight_bytes"] and r["tokens_fit"] is None

    r = run_json(["plan", "--config", REAL, "--weights", "mxfp4", "--json"], capsys)
    assert r["weight_gib"] == 291.64 and round(r["weight_bytes"] / GiB, 2) == 291.64

    r = run_json(["plan", "--config", REAL, "--weights", "bf16", "--json"], capsys)
    assert r["weight_bytes"] == 2 * (MAIN + MTP) and r["weight_gib"] == 1065.66


def test_plan_no_mtp(capsys, real_cfg):
    r = run_json(["plan", "--config", REAL, "--weights", "fp8", "--no-mtp", "--json"], capsys)
    assert r["mla_cache_bytes_per_token"] == 10_368 and r["mla_cache_bytes_per_token_mtp"] == 0
    assert r["params"] == MAIN and not r["include_mtp"]
    full = A.summary(real_cfg, "fp8")
    assert r["weight_bytes"] == full["bytes_by_part"]["main"]
    r = run_json(["plan", "--config", REAL, "--weights", "mxfp4", "--no-mtp", "--json"], capsys)
    assert 287.5 < r["weight_gib"] < 287.6  # the seed prints 287.51 for this row; see accounting docs


REPLICATED_ON_MODEL = re.compile(  # tensors whose parameter has no dimension split over `model`
    r".*(?:mlp\.gate\.(?:weight|expert_bias)|layernorm\.weight|model\.norm\.weight|[eh]norm\.weight"
    r"|o_norm\.weight|q_a_proj\.weight(?:_scale_inv)?|kv_a_proj_with_mqa\.weight(?:_scale_inv)?)"
    r"|(?!.*\.mlp\.experts\.).*\.weight_scale_inv")  # dense-matrix FP8 scale grids are replicated


def test_plan_mesh_and_fit(capsys, real_cfg):
    base = ["plan", "--config", REAL, "--weights", "mxfp4", "--json"]
    # the seed's 4xH100 case. Its 72.9 GiB of weights per GPU (~1 GiB left, ~96K tokens, 213K w/o
    # MTP) split every tensor 4 ways; placed as the loader places them (the same rules), the tensors
    # with no head / width dimension (routers, norms, MLA latent down-projections, dense FP8 scale
    # grids) are replicated: 73.19 GiB per GPU, ~0.8 GiB left, ~69K tokens (184K w/o MTP).
    r = run_json(base + ["--mesh", "model=4", "--device-memory", "80", "--reserve", "6"], capsys)
    assert r["devices"] == 4 and r["weight_gib_per_device"] == 73.19
    repl = sum(t.nbytes for t in A.stored_tensors(real_cfg, "mxfp4") if REPLICATED_ON_MODEL.fullmatch(t.name))
    assert 0 < repl < r["weight_bytes"] / 100
    assert abs(r["weight_bytes_per_device"] - ((r["weight_bytes"] - repl) / 4 + repl)) < 4
    assert 0.7 < r["free_bytes_per_device"] / GiB < 0.9
    assert r["kda_state_bytes_per_sequence_per_device"] == 264_241_152 // 4
    assert 65_000 < r["tokens_fit"] < 75_000 and r["fits"]
    free = r["free_bytes_per_device"] - r["kda_state_bytes_per_sequence_per_device"] \
        - r["kda_conv_state_bytes_per_sequence_per_device"]
    assert r["tokens_fit"] == free // 11_520
    r = run_json(base + ["--mesh", "model=4", "--device-memory", "80", "--reserve", "6", "--no-mtp"], capsys)
    assert 180_000 < r["tokens_fit"] < 190_000
    # expert axis splits only the routed experts; data replicates
    r1 = run_json(base, capsys)
    r8 = run_json(base + ["--mesh", "data=2,expert=8"], capsys)
    routed = r1["routed_expert_bytes_per_device"]
    assert r8["devices"] == 16 and r8["routed_expert_bytes_per_device"] == routed // 8
    assert r8["weight_bytes_per_device"] - r8["routed_expert_bytes_per_device"] == r1["weight_bytes"] - routed
    # too little memory: does not fit, no tokens
    r = run_json(base + ["--device-memory", "80"], capsys)
    assert r["fits"] is False and r["tokens_fit"] == 0 and r["free_bytes_per_device"] < 0
    # several sequences of KDA state reduce the tokens that fit
    a = run_json(base + ["--mesh", "model=4", "--device-memory", "141"], capsys)["tokens_fit"]
    b = run_json(base + ["--mesh", "model=4", "--device-memory", "141", "--sequences", "8"], capsys)["tokens_fit"]
    assert a - b == pytest.approx(7 * (264_241_152 + 9_289_728) / 4 / 11_520, abs=2)


def test_plan_text(capsys):
    assert main(["plan", "--config", REAL, "--weights", "fp8", "--mesh", "model=8", "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "534.35 GiB" in out and "11,520 B/token" in out and "tokens fit" in out


def test_parse_mesh():
    """`plan` parses --mesh with the one mesh-spec parser (sharding/mesh.py), without devices."""
    assert parse_mesh_shape("data=1,expert=8,model=4") == {"data": 1, "expert": 8, "model": 4}
    assert parse_mesh_shape(" model=2 ") == {"data": 1, "expert": 1, "model": 2}
    assert parse_mesh_shape(None) == {"data": 1, "expert": 1, "model": 1}
    for bad in ["expert=x", "expert=0", "expert=-1", "tensor=2", "model=2,model=4", "model", "", "model=2=3",
                "expert=1.5"]:
        with pytest.raises(ValueError, match="bad mesh spec"):
            parse_mesh_shape(bad)


@pytest.mark.parametrize("extra,needle", [
    (["--weights", "fp4"], "unknown --weights format 'fp4'"),
    (["--weights", "fp8", "--mesh", "expert=x"], "bad mesh spec 'expert=x'"),
    (["--weights", "fp8", "--mesh", "gpu=4"], "unknown axis 'gpu'"),
    (["--weights", "fp8", "--device-memory", "lots"], "--device-memory must be a number"),
    (["--weights", "fp8", "--device-memory", "0"], "--device-memory must be a positive"),
    (["--weights", "fp8", "--sequences", "-1"], "--sequences must be a non-negative integer"),
    (["--weights", "fp8", "--fp8-layout", "C"], "unknown --fp8-layout"),
])
def test_plan_bad_inputs(capsys, extra, needle):
    assert needle in run_err(["plan", "--config", REAL, *extra], capsys)


def test_plan_missing_config(capsys, tmp_path):
    err = run_err(["plan", "--config", str(tmp_path / "nope.json"), "--weights", "fp8"], capsys)
    assert "not found" in err


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_header_only(tmp_path_factory, real_cfg):
    d = tmp_path_factory.mktemp("hdr") / "real"
    write_checkpoint(real_cfg, str(d), header_only=True, tokenizer=False, progress=False)
    return d


def test_inspect_real_header_only(capsys, real_header_only, real_cfg):
    r = run_json(["inspect", str(real_header_only), "--json"], capsys)
    p = r["params"]
    assert (p["main"], p["mtp"], p["total"], p["active"]) == (MAIN, MTP, MAIN + MTP, ACTIVE)
    assert p["active_with_embedding"] == ACTIVE + EMBED
    assert r["header_only"] and r["num_tensors"] == 214_025
    # bytes: exactly what the writer's layout stores (Layout B, BF16 conv taps: 534.32 GiB), and the
    # same grouping as the config-level accounting
    ref = A.summary(real_cfg, "fp8", fp8_layout=None, conv_dtype=L.DEFAULT_CONV_DTYPE)
    assert r["bytes"] == ref["bytes"] and r["params"]["by_group"] == ref["params"]["by_group"]
    assert r["bytes"]["total"] == 573_719_996_928 and round(r["bytes"]["total"] / GiB, 2) == 534.32
    assert r["fp8_layout"] == "B"
    assert r["bytes"]["total"] == r["index_total_size"] == sum(r["dtype_bytes"].values())
    assert r["bytes"]["total"] == sum(v for k, v in r["bytes"].items() if k != "total")
    assert r["bytes_by_part"]["main"] + r["bytes_by_part"]["mtp"] == r["bytes"]["total"]
    assert r["header_bytes"] == r["file_bytes"] > 0
    # text table (what `ling-jax inspect DIR` prints)
    out = format_table(r)
    assert "563,946,483,520" in out and "24,250,707,776" in out and "Routed experts" in out


@pytest.mark.parametrize("layout,conv,total", [
    ("A", "F32", 573_753_349_632),  # the published 573,753,281,152 B (534.35 GiB) to within 0.1 MB
    ("B", "F32", 573_732_383_232),  # spec §12.7's layout-B payload
])
def test_inspect_real_header_only_cli_layouts(capsys, tmp_path, real_cfg, layout, conv, total):
    """`ling-jax make-checkpoint --header-only --fp8-layout A --conv-dtype F32` + `ling-jax inspect
    --json` reproduce the published release size; both layouts agree with `ling-jax plan`."""
    import time
    d = tmp_path / f"real-{layout}"
    t0 = time.monotonic()
    assert main(["make-checkpoint", "--config", REAL, "--out", str(d), "--header-only", "--fp8-layout", layout,
                 "--conv-dtype", conv, "--no-tokenizer", "--quiet"]) == 0
    assert f"(layout {layout}, conv taps {conv})" in capsys.readouterr().out
    assert time.monotonic() - t0 < 120  # headers only: no tensor bytes generated
    assert sum(f.stat().st_size for f in d.iterdir()) < 64 << 20
    r = run_json(["inspect", str(d), "--json"], capsys)
    p = r["params"]
    assert (p["main"], p["mtp"], p["total"]) == (MAIN, MTP, MAIN + MTP)
    assert r["bytes"]["total"] == r["index_total_size"] == total
    assert r["header_only"] and r["num_tensors"] == 214_025 and r["num_scale_tensors"] == 106_632
    assert r["fp8_layout"] == layout
    if layout == "A":
        assert round(r["bytes"]["total"] / GiB, 2) == 534.35
        assert abs(r["bytes"]["total"] - 573_753_281_152) < 100_000
    # the same bytes, by group, as `ling-jax plan` (whose default is layout A with FP32 taps)
    plan = run_json(["plan", "--config", REAL, "--weights", "fp8", "--fp8-layout", layout, "--json"], capsys)
    assert plan["weight_bytes"] == total and plan["weight_bytes_by_group"] == {
        k: v for k, v in r["bytes"].items() if k != "total"}
    with open(d / "config.json") as f:
        mods = json.load(f)["quantization_config"]["modules_to_not_convert"]
    assert mods == L.modules_to_not_convert(real_cfg, fp8_layout=layout)
    assert ("model.layers.72.attention.kv_a_proj_with_mqa" in mods) == (layout == "A")
    assert ("model.layers.72.attention.g_proj" in mods) == (layout == "B")
    CheckpointReader(str(d)).validate()


def test_inspect_real_header_only_no_mtp(capsys, tmp_path, real_cfg):
    d = tmp_path / "nomtp"
    write_checkpoint(real_cfg, str(d), header_only=True, tokenizer=False, progress=False, include_mtp=False)
    r = run_json(["inspect", str(d), "--json"], capsys)
    p = r["params"]
    assert (p["main"], p["mtp"], p["total"], p["active"]) == (MAIN, 0, MAIN, ACTIVE)
    assert r["bytes"]["mtp"] == 0 and r["bytes_by_part"]["mtp"] == 0
    ref = A.summary(real_cfg, "fp8", include_mtp=False, fp8_layout=None, conv_dtype=L.DEFAULT_CONV_DTYPE)
    assert r["bytes"] == ref["bytes"]


def _tiny_cfg():
    import np_reference as R
    return R.tiny_config(eos_token_id=96, pad_token_id=95)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_inspect_small_checkpoint_matches_reader(tmp_path, dtype):
    cfg = _tiny_cfg()
    d = tmp_path / "ck"
    write_checkpoint(cfg, str(d), dtype=dtype, seed=3, tokenizer=False, progress=False, num_shards=3)
    r = inspect_dir(str(d))
    rd = CheckpointReader(str(d))
    N, k, E = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts
    count = {"main": 0, "mtp": 0, "routed": 0, "embed": 0, "bytes": 0, "scales": 0}
    for name in rd.names():
        count["bytes"] += rd.info(name).nbytes
        if name.endswith(".weight_scale_inv"):
            count["scales"] += rd.info(name).nbytes
            continue
        n = rd.get(name).size  # actually read (and dequantized) by the reader
        mtp = name.startswith(f"model.layers.{N}.")
        count["mtp" if mtp else "main"] += n
        if ".mlp.experts." in name and not mtp:
            count["routed"] += n
        if name == "model.word_embeddings.weight":
            count["embed"] += n
    p = r["params"]
    assert (p["main"], p["mtp"], p["total"]) == (count["main"], count["mtp"], count["main"] + count["mtp"])
    assert p["main"] + p["mtp"] == L.count_params(cfg)
    assert p["by_group"]["routed_experts"] == count["routed"]
    active = count["main"] - count["routed"] - count["embed"] + count["routed"] * k // E
    assert p["active"] == active and count["routed"] * k % E == 0
    assert r["bytes"]["total"] == count["bytes"] == sum(r["dtype_bytes"].values())
    assert r["bytes"]["scales"] == count["scales"] and (count["scales"] > 0) == (dtype == "fp8")
    assert r["files"] == 3 and not r["header_only"]
    # the trailing incomplete layer group (layers 8, 9) is MLA; the MTP layer is its own group
    assert p["by_group"]["mla_attention"] > 0 and p["by_group"]["other"] == 0
    # config-level accounting agrees with the files
    assert r["params"] == A.param_counts(cfg)
    if dtype == "fp8":  # the writer's layout
        assert r["bytes"] == A.weight_bytes(cfg, "fp8", fp8_layout=None, conv_dtype=L.DEFAULT_CONV_DTYPE)
    else:  # the writer's bf16 keeps the FP32 vectors (A_log, dt_bias, expert_bias) at FP32
        assert r["bytes"]["total"] == sum(nbytes(d, s) for _, d, s in L.release_tensors(cfg, "bf16"))


def test_inspect_without_config(tmp_path):
    """No config.json: the MTP layer is found by its eh_proj; active counts are omitted."""
    cfg = _tiny_cfg()
    d = tmp_path / "ck"
    write_checkpoint(cfg, str(d), header_only=True, tokenizer=False, progress=False)
    (d / "config.json").unlink()
    r = inspect_dir(str(d))
    assert r["params"]["mtp"] == A.param_counts(cfg)["mtp"] > 0
    assert r["params"]["active"] is None and r["num_hidden_layers"] == cfg.num_hidden_layers


def test_inspect_single_file(tmp_path):
    from ling_jax.checkpoint.safetensors_io import save_file
    import numpy as np
    d = tmp_path / "one"
    d.mkdir()
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((4, 8), np.float32),
               "model.layers.0.mlp.experts.1.up_proj.weight": np.zeros((4, 8), np.float32),
               "lm_head.weight": np.zeros((3, 8), np.float32), "foo": np.zeros(5, np.float32)},
              str(d / "model.safetensors"))
    r = inspect_dir(str(d))
    assert r["params"]["total"] == 32 + 32 + 24 + 5 and r["params"]["by_group"]["other"] == 5
    assert r["bytes"]["total"] == 4 * r["params"]["total"]


def test_inspect_bad_inputs(capsys, tmp_path):
    assert "not found" in run_err(["inspect", str(tmp_path / "missing")], capsys)
    (tmp_path / "empty").mkdir()
    assert "no model.safetensors.index.json" in run_err(["inspect", str(tmp_path / "empty")], capsys)
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in run_err(["inspect", str(f)], capsys)
    # index naming a shard that does not exist
    d = tmp_path / "broken"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s.safetensors"}}))
    assert "does not exist" in run_err(["inspect", str(d)], capsys)
    # corrupt shard header
    (d / "s.safetensors").write_bytes((10).to_bytes(8, "little") + b"{not json}")
    assert "error: " in run_err(["inspect", str(d)], capsys)


def test_mxfp4_saving_is_the_routed_experts(real_cfg):
    """MXFP4 changes only the routed experts (main and MTP); the rest stays in release format."""
    fp8 = A.weight_bytes(real_cfg, "fp8")["total"] / GiB
    mx = A.weight_bytes(real_cfg, "mxfp4")["total"] / GiB
    assert 534.345 < fp8 < 534.355 and 291.635 < mx < 291.645
    assert math.isclose(fp8 - mx, (A.summary(real_cfg, "fp8")["routed_bytes"]
                                   - A.summary(real_cfg, "mxfp4")["routed_bytes"]) / GiB)


@pytest.mark.parametrize("q_lora", [48, None])
def test_groups_follow_layer_types(q_lora):
    """Name-based grouping agrees with the config's layer schedule (also without q_lora, where MLA
    layers have a `q_proj` like KDA layers), including the trailing incomplete MLA group."""
    import np_reference as R
    cfg = R.tiny_config(eos_token_id=96, pad_token_id=95, q_lora_rank=q_lora)
    types = cfg.layer_types
    want = {"kda_attention": 0, "mla_attention": 0}
    for name, s in L.expected_tensors(cfg).items():
        if s.layer is not None and s.layer < cfg.num_hidden_layers and ".attention." in name:
            want["kda_attention" if types[s.layer] == "kda" else "mla_attention"] += s.numel
    g = A.param_counts(cfg)["by_group"]
    assert {k: g[k] for k in want} == want and g["other"] == 0
    assert types[-2:] == ("mla", "mla") and want["mla_attention"] > 0
