"""Converted (Orbax) checkpoints: up-front validation and one named line for every break (issue 15 item 6).

One real converted directory is made with today's `ling-jax convert` (in-process); each case breaks a
copy and checks `validate_converted` and, through `ling-jax logits`, the CLI contract (one `error:`
line naming the file/group/parameter, no traceback, no output, input unchanged).
"""
import hashlib
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling_jax.checkpoint.orbax import key_of
from ling_jax.checkpoint.orbax_validate import CheckpointError, validate_converted
from ling_jax.checkpoint.synthetic_config import synthetic_config as tiny_config
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.cli import main
from ling_jax.loader import abstract_model, converted_entries

META = "ling_jax_orbax.json"


def expected_shapes(cfg, meta):
    """{parameter key: shape} of the model config.json describes, as the converted dir stores it."""
    f8 = str(jnp.dtype(jnp.float8_e4m3fn))
    stored = (lambda p: meta["params"].get(key_of(p), {}).get("dtype") == f8) if meta["keep_fp8"] else None  # noqa: E731
    model = abstract_model(cfg, jnp.float32, meta["with_mtp"] and cfg.has_mtp, stored, layer_loop="unroll")  # stored per layer
    return {k: tuple(a.shape) for p, v in nnx.to_flat_state(nnx.state(model)) if isinstance(v, nnx.Param)
            for k, a in converted_entries(p, v.get_value()).items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("orbax")
    write_checkpoint(tiny_config(num_hidden_layers=2, layer_group_size=2), str(base / "ck"), num_shards=2,
                     progress=False, tokenizer=False)
    assert main(["convert", "--checkpoint", str(base / "ck"), "--out", str(base / "conv"), "--quiet"]) == 0
    return base / "conv"


def _meta_edit(fn):
    def f(d):
        p = d / META
        m = json.loads(p.read_text())
        fn(m)
        p.write_text(json.dumps(m))
    return f


def _largest_data_file(d, group="layer_000"):
    files = [os.path.join(r, f) for r, _, fs in os.walk(d / "params" / group) for f in fs
             if os.sep + "d" + os.sep in os.path.join(r, f) or os.path.basename(r) == "d"]
    return max(files, key=os.path.getsize)


def _truncate_data(d):
    f = _largest_data_file(d)
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


CASES = {
    "no_marker": (lambda d: os.remove(d / META), [META]),
    "marker_not_json": (lambda d: (d / META).write_text("{nope"), [META, "JSON"]),
    "marker_list": (lambda d: (d / META).write_text("[]"), [META, "object"]),
    "old_version": (_meta_edit(lambda m: m.update(version=1)), [META, "v1"]),
    "groups_entry_missing": (_meta_edit(lambda m: m["groups"].remove("layer_001")), ["layer_001", "groups"]),
    "groups_not_list": (_meta_edit(lambda m: m.update(groups="globals")), ["groups"]),
    "param_shape_wrong": (_meta_edit(lambda m: m["params"]["model__norm__weight"].update(shape=[7])),
                          ["model__norm__weight", "[7]", "[192]"]),
    "param_missing": (_meta_edit(lambda m: m["params"].pop("model__norm__weight")), ["model__norm__weight", "missing"]),
    "param_bad_dtype": (_meta_edit(lambda m: m["params"]["model__norm__weight"].update(dtype="int4")),
                        ["model__norm__weight", "'int4'"]),
    # issue 24 item 5: the dtype rule of the converted path, each refusal naming the parameter
    "param_int32": (_meta_edit(lambda m: m["params"]["model__norm__weight"].update(dtype="int32")),
                    ["model__norm__weight", "int32", "float"]),
    "param_bool": (_meta_edit(lambda m: m["params"]["model__norm__weight"].update(dtype="bool")),
                   ["model__norm__weight", "bool"]),
    "param_float16": (_meta_edit(lambda m: m["params"]["model__norm__weight"].update(dtype="float16")),
                      ["model__norm__weight", "float16", "refused"]),
    "param_e5m2": (_meta_edit(lambda m: m["params"]["model__norm__weight"].update(dtype="float8_e5m2")),
                   ["model__norm__weight", "float8_e5m2", "float8_e4m3fn"]),
    "param_fp8_without_scale": (_meta_edit(lambda m: m.update(keep_fp8=True) or m["params"][
                                    "model__layers__0__attention__q_proj__weight"].update(dtype="float8_e4m3fn")),
                                ["model__layers__0__attention__q_proj__weight", "float8_e4m3fn",
                                 "model__layers__0__attention__q_proj__weight_scale_inv"]),
    "param_fp8_not_kept": (_meta_edit(lambda m: m["params"]["model__layers__0__attention__q_proj__weight"].update(
                               dtype="float8_e4m3fn")),
                           ["model__layers__0__attention__q_proj__weight", "keep_fp8"]),
    "commit_marker_deleted": (lambda d: os.remove(d / "params" / "layer_000" / "commit_success.txt"),
                              ["layer_000", "commit_success.txt"]),
    "group_dir_deleted": (lambda d: shutil.rmtree(d / "params" / "mtp"), ["mtp", "missing"]),
    "data_file_truncated": (_truncate_data, ["layer_000", "bytes", "truncated"]),
    "config_broken": (lambda d: (d / "config.json").write_text('{"hidden_size": 3}'), ["config.json"]),
}


def _digest(d):
    return {os.path.relpath(os.path.join(r, f), d): hashlib.sha256(open(os.path.join(r, f), "rb").read()).hexdigest()
            for r, _, fs in os.walk(d) for f in fs}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_converted_dir(case, converted, tmp_path, capsys):
    d = tmp_path / "conv"
    shutil.copytree(converted, d)
    mutate, needles = CASES[case]
    mutate(d)
    with pytest.raises(CheckpointError) as ei:
        validate_converted(str(d), expected_shapes)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))
    if case == "no_marker":
        return  # not a converted dir any more: the loader treats it as an incomplete conversion (below)
    before = _digest(d)
    out = tmp_path / "x.npz"
    rc = main(["logits", "--checkpoint", str(d), "--input-ids", "1,2", "--out", str(out)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert rc != 0 and last.startswith("error:") and "Traceback" not in err, err
    assert any(n in last for n in needles), last
    assert not out.exists() and _digest(d) == before


def test_incomplete_conversion_named(converted, tmp_path, capsys):
    d = tmp_path / "conv"
    shutil.copytree(converted, d)
    os.remove(d / META)
    assert main(["logits", "--checkpoint", str(d), "--input-ids", "1", "--out", str(tmp_path / "x.npz")]) == 2
    assert "incomplete conversion" in capsys.readouterr().err.strip().splitlines()[-1]


def test_storage_failure_is_one_line(converted, tmp_path, capsys):
    """A directory from before the data-file inventory: the truncation only shows in TensorStore."""
    d = tmp_path / "conv"
    shutil.copytree(converted, d)
    _meta_edit(lambda m: m.pop("data_files"))(d)
    validate_converted(str(d), expected_shapes)  # nothing to see up front
    _truncate_data(d)
    rc = main(["logits", "--checkpoint", str(d), "--input-ids", "1,2", "--out", str(tmp_path / "x.npz")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert "params/layer_000" in lines[0] and "Orbax" in lines[0]


def test_valid_dir_relative_path_no_mesh(converted, tmp_path, monkeypatch):
    meta = validate_converted(str(converted), expected_shapes)
    assert meta["data_files"] and set(meta["groups"]) == {"globals", "layer_000", "layer_001", "mtp"}
    monkeypatch.chdir(converted.parent)
    out = tmp_path / "x.npz"
    assert main(["logits", "--checkpoint", "conv", "--input-ids", "1,2,3", "--out", str(out)]) == 0
    assert np.isfinite(np.load(out)["logits"]).all()


def test_converted_float_variants_give_the_direct_logits(converted, tmp_path):
    """Issue 24 item 5 on the converted path: a checkpoint with an F32 router gate, an F32 norm and a
    BF16 A_log converts (float32) and gives the logits the direct load gives."""
    import ml_dtypes
    from ling_jax.checkpoint.safetensors_io import load_file, save_file
    ck = tmp_path / "ck"
    shutil.copytree(converted.parent / "ck", ck)
    idx_path = ck / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    change = {"model.layers.1.mlp.gate.weight": np.float32, "model.layers.0.input_layernorm.weight": np.float32,
              "model.layers.0.attention.A_log": ml_dtypes.bfloat16}
    for shard in sorted({idx["weight_map"][n] for n in change}):
        t = load_file(str(ck / shard))
        for n, dt in change.items():
            if n in t:
                t[n] = t[n].astype(dt)
        save_file(t, str(ck / shard))
    idx["metadata"].pop("total_size", None)
    idx_path.write_text(json.dumps(idx))
    conv = tmp_path / "conv"
    assert main(["convert", "--checkpoint", str(ck), "--out", str(conv), "--dtype", "float32", "--quiet"]) == 0
    validate_converted(str(conv), expected_shapes)
    got = {}
    for d in (ck, conv):
        out = tmp_path / f"{d.name}.npz"
        assert main(["logits", "--checkpoint", str(d), "--input-ids", "1,2,3", "--dtype", "float32",
                     "--out", str(out)]) == 0
        got[d.name] = np.load(out)["logits"]
    np.testing.assert_array_equal(got["conv"], got["ck"])
