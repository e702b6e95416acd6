"""Bad input through the CLI, as an adversary would try it (issue 15, items 1-5).

Every case runs `ling_jax.cli.main` in-process on a copy of one small written checkpoint and checks
the CLI contract: exit status non-zero, the last stderr line starts with `error:` and names the
file / tensor / field / argument, no traceback, no output file, and every input file's sha256
unchanged. No case reaches a compile: each is refused while reading config, files or arguments.
"""
import hashlib
import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from ling_jax.checkpoint.bounds import expected_tensor_count
from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.safetensors_io import load_file, save_file
from ling_jax.checkpoint.synthetic_config import synthetic_config as tiny_config
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.cli import main

INDEX = "model.safetensors.index.json"
S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"
Q = "model.layers.0.attention.q_proj.weight"          # FP8 + scale, shard 1
QS = "model.layers.0.attention.q_proj.weight_scale_inv"
NORM = "model.layers.0.input_layernorm.weight"        # BF16, shard 1
EMB = "model.word_embeddings.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad_input") / "ck"
    write_checkpoint(tiny_config(num_hidden_layers=2, layer_group_size=2), str(out), num_shards=2, progress=False,
                     tokenizer=False)
    return out


def _digest(d):
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in sorted(os.listdir(d)) if (d / f).is_file()}


def _shard_of(ck, name):
    return json.loads((ck / INDEX).read_text())["weight_map"][name]


def _rewrite(ck, name, fn):
    """Replace tensor `name` in its shard by fn(old array) (or drop it for None), keeping the index's
    total_size as it was: a real corruption does not fix up the metadata."""
    fname = _shard_of(ck, name)
    t = load_file(str(ck / fname))
    new = fn(t[name])
    if new is None:
        del t[name]
    else:
        t[name] = new
    save_file(t, str(ck / fname))
    idx = json.loads((ck / INDEX).read_text())
    idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if f != fname or n in t}
    idx["weight_map"].update({n: fname for n in t})
    (ck / INDEX).write_text(json.dumps(idx))


def _relabel(ck, name, dtype):
    """Change only the header's dtype string of `name` (same byte size), like a lying writer."""
    fname = _shard_of(ck, name)
    p = ck / fname
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    h[name]["dtype"] = dtype
    js = json.dumps(h, separators=(",", ":")).encode()
    js += b" " * (n - len(js))
    assert len(js) == n
    p.write_bytes(raw[:8] + js + raw[8 + n:])


def _config(ck, **change):
    d = json.loads((ck / "config.json").read_text())
    for k, v in change.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    (ck / "config.json").write_text(json.dumps(d))


_DROP = object()


def _set_values(ck, name, fn):
    def f(a):
        a = a.copy()
        fn(a)
        return a
    _rewrite(ck, name, f)


def _nan_fp8_byte(a):
    a.view(np.uint8)[0, 1] = 0x7F  # e4m3fn NaN


def _check_refusal(capsys, argv, needles, ck, out_paths=()):
    before = _digest(ck)
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc != 0, (argv, err)
    assert lines and lines[-1].startswith("error:"), err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])
    assert "Traceback" not in err, err
    for p in out_paths:
        assert not os.path.exists(p), p
    assert _digest(ck) == before
    return lines[-1]


# ---- item 1 (specific reason first) and item 3 (weights): file mutations, total_size kept ---------
FILE_FAULTS = {
    # the 15 fault kinds of the loader tests, each with the index's total_size left as written
    "missing_tensor": (lambda ck: _rewrite(ck, "model.layers.0.attention.A_log", lambda a: None),
                       ["missing tensor", "model.layers.0.attention.A_log"]),
    "unexpected_tensor": (lambda ck: _add(ck, "model.layers.0.bonus.weight"),
                          ["unexpected tensor", "model.layers.0.bonus.weight"]),
    "truncated_embedding": (lambda ck: _rewrite(ck, EMB, lambda a: a[:-3]), [EMB, "[509, 192]", "[512, 192]"]),
    "missing_scale": (lambda ck: _rewrite(ck, QS, lambda a: None), [Q, QS, "missing"]),
    "scale_wrong_shape": (lambda ck: _rewrite(ck, QS, lambda a: np.ones((2, 2), np.float32)), [QS, "[2, 2]"]),
    "shape_vs_config": (lambda ck: _rewrite(ck, "model.layers.0.attention.dt_bias",
                                            lambda a: np.zeros((64,), np.float32)),
                        ["model.layers.0.attention.dt_bias", "[64]", "[128]"]),
    "config_vs_tensors": (lambda ck: _config(ck, intermediate_size=321),
                          ["model.layers.0.mlp.gate_proj.weight", "[321, 192]"]),
    "scale_for_float_weight": (lambda ck: _rewrite(ck, Q, lambda a: a.astype(np.float32)), [Q, QS, "F32"]),
    "int_dtype": (lambda ck: _rewrite(ck, NORM, lambda a: np.ones(a.shape, np.int32)), [NORM, "I32"]),
    "fp8_router": (lambda ck: _rewrite(ck, "model.layers.1.mlp.gate.weight",
                                       lambda a: a.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)),
                   ["model.layers.1.mlp.gate.weight", "F8_E4M3"]),
    "index_lists_absent_tensor": (lambda ck: _index_add(ck, "model.layers.0.extra.weight", S1),
                                  ["model.layers.0.extra.weight", S1]),
    "shard_tensor_not_in_index": (lambda ck: _index_drop(ck, QS), [QS, "index"]),
    "truncated_shard": (lambda ck: _truncate(ck, S2, 100), [S2, "truncated"]),
    "trailing_garbage": (lambda ck: _append(ck, S2, b"\0" * 16), [S2, "trailing"]),
    "missing_shard": (lambda ck: os.remove(ck / S2), [S2, "does not exist"]),
    # item 3: values and dtypes
    "bf16_relabelled_f16": (lambda ck: _relabel(ck, NORM, "F16"), [NORM, "F16", "BF16"]),
    "nan_in_norm": (lambda ck: _set_values(ck, NORM, lambda a: a.__setitem__(3, np.nan)), [NORM, "non-finite"]),
    "inf_in_embedding": (lambda ck: _set_values(ck, EMB, lambda a: a.__setitem__((5, 1), np.inf)), [EMB, "non-finite"]),
    "fp8_nan_byte": (lambda ck: _set_values(ck, Q, _nan_fp8_byte), [Q, "non-finite"]),
    "nan_scale": (lambda ck: _set_values(ck, QS, lambda a: a.__setitem__((0, 0), np.nan)), [QS, "non-finite"]),
    "inf_scale": (lambda ck: _set_values(ck, QS, lambda a: a.__setitem__((0, 1), np.inf)), [QS, "non-finite"]),
    "zero_scale": (lambda ck: _set_values(ck, QS, lambda a: a.__setitem__((0, 0), 0.0)), [QS, "positive"]),
    # issue 24 item 5: what cannot be a float weight is refused by name (F32 / BF16 anywhere is valid:
    # test_float_variants_load_and_give_their_logits)
    "i32_matrix": (lambda ck: _rewrite(ck, "model.layers.0.mlp.gate_proj.weight", lambda a: np.ones(a.shape, np.int32)),
                   ["model.layers.0.mlp.gate_proj.weight", "I32", "integer"]),
    "bool_norm": (lambda ck: _rewrite(ck, NORM, lambda a: np.ones(a.shape, np.bool_)), [NORM, "BOOL"]),
    "f16_norm": (lambda ck: _rewrite(ck, NORM, lambda a: a.astype(np.float16)), [NORM, "F16"]),
    "e5m2_matrix": (lambda ck: _rewrite(ck, Q, lambda a: a.astype(np.float32).astype(ml_dtypes.float8_e5m2)),
                    [Q, "F8_E5M2", "F8_E4M3"]),
    "f16_norm_and_extra_tensor": (lambda ck: (_rewrite(ck, NORM, lambda a: a.astype(np.float16)),
                                              _add(ck, "model.layers.0.bonus.weight")),
                                  [NORM, "F16", "model.layers.0.bonus.weight"]),
}


def _add(ck, name):
    fname = S1
    t = load_file(str(ck / fname))
    t[name] = np.zeros((2, 2), ml_dtypes.bfloat16)
    save_file(t, str(ck / fname))
    idx = json.loads((ck / INDEX).read_text())
    idx["weight_map"][name] = fname
    (ck / INDEX).write_text(json.dumps(idx))


def _index_add(ck, name, fname):
    idx = json.loads((ck / INDEX).read_text())
    idx["weight_map"][name] = fname
    (ck / INDEX).write_text(json.dumps(idx))


def _index_drop(ck, name):
    idx = json.loads((ck / INDEX).read_text())
    del idx["weight_map"][name]
    (ck / INDEX).write_text(json.dumps(idx))


def _truncate(ck, fname, n):
    p = ck / fname
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - n)


def _append(ck, fname, data):
    with open(ck / fname, "ab") as f:
        f.write(data)


@pytest.mark.parametrize("fault", sorted(FILE_FAULTS))
def test_broken_checkpoint_named(fault, pristine, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    mutate, needles = FILE_FAULTS[fault]
    mutate(ck)
    out = tmp_path / "x.npz"
    line = _check_refusal(capsys, ["logits", "--checkpoint", str(ck), "--input-ids", "1,2", "--out", str(out)],
                          needles, ck, [out])
    assert "total_size" not in line  # the specific reason, never the byte-count summary


def test_float_variants_load_and_give_their_logits(pristine, tmp_path):
    """An F32 router gate, an F32 norm and a BF16 A_log (issue 24 item 5) load, and the logits are
    the ones their values imply: those of a reference checkpoint holding the same values in the
    release dtypes (A_log rounded to bf16, stored F32; gate and norm exact in F32)."""
    gate = "model.layers.1.mlp.gate.weight"
    a_log = "model.layers.0.attention.A_log"
    var, ref = tmp_path / "variant", tmp_path / "reference"
    shutil.copytree(pristine, var)
    shutil.copytree(pristine, ref)
    _rewrite(var, gate, lambda a: a.astype(np.float32))
    _rewrite(var, NORM, lambda a: a.astype(np.float32))
    _rewrite(var, a_log, lambda a: a.astype(ml_dtypes.bfloat16))
    _rewrite(ref, a_log, lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32))
    for d in (var, ref):  # the index's total_size follows the new sizes (the rewrite kept the old)
        idx = json.loads((d / INDEX).read_text())
        idx["metadata"].pop("total_size", None)
        (d / INDEX).write_text(json.dumps(idx))
    got = {}
    for d in (var, ref):
        out = tmp_path / f"{d.name}.npz"
        assert main(["logits", "--checkpoint", str(d), "--input-ids", "1,2,3", "--dtype", "float32",
                     "--out", str(out)]) == 0
        with np.load(out) as z:
            got[d.name] = {k: z[k] for k in z.files}
    assert set(got["variant"]) == set(got["reference"])
    for k in got["reference"]:
        np.testing.assert_array_equal(got["variant"][k], got["reference"][k])


def test_total_size_alone_is_reported(pristine, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    idx = json.loads((ck / INDEX).read_text())
    idx["metadata"]["total_size"] += 8
    (ck / INDEX).write_text(json.dumps(idx))
    _check_refusal(capsys, ["logits", "--checkpoint", str(ck), "--input-ids", "1", "--out", str(tmp_path / "x.npz")],
                   [INDEX, "total_size"], ck)


def test_value_checks_can_be_skipped(pristine, tmp_path):
    from ling_jax.checkpoint.reader import CheckpointError, CheckpointReader
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    _set_values(ck, NORM, lambda a: a.__setitem__(3, np.nan))
    with pytest.raises(CheckpointError, match="non-finite"):
        CheckpointReader(str(ck)).get(NORM)
    assert np.isnan(CheckpointReader(str(ck), check_values=False).get(NORM)[3])


# ---- item 2: config.json ------------------------------------------------------------------------
CONFIG_FAULTS = {
    "no_hidden_size": ({"hidden_size": _DROP}, ["config.json", "hidden_size"]),
    "no_num_experts": ({"num_experts": _DROP}, ["config.json", "num_experts"]),
    "eps_nan": ("rms_norm_eps", ["config.json", "rms_norm_eps"]),
    "eps_negative": ({"rms_norm_eps": -1}, ["config.json", "rms_norm_eps"]),
    "scaling_nan": ("routed_scaling_factor", ["config.json", "routed_scaling_factor"]),
    "swiglu_nan": ("expert_swiglu_limit_list", ["config.json", "expert_swiglu_limit_list"]),
    "rope_string": ({"rope_scaling": "yarn"}, ["config.json", "rope_scaling"]),
    "rope_list": ({"rope_scaling": [1, 2]}, ["config.json", "rope_scaling"]),
    "positions_huge": ({"max_position_embeddings": 10**30}, ["config.json", "max_position_embeddings"]),
    "eos_outside_vocab": ({"eos_token_id": 512}, ["config.json", "eos_token_id", "512"]),
    "eos_wrong_type": ({"eos_token_id": "511"}, ["config.json", "eos_token_id"]),
    "pad_outside_vocab": ({"pad_token_id": -1}, ["config.json", "pad_token_id"]),
    "pad_float": ({"pad_token_id": 3.5}, ["config.json", "pad_token_id"]),
    "quant_list": ({"quantization_config": ["fp8"]}, ["config.json", "quantization_config"]),
    "experts_billion": ({"num_experts": 1_000_000_000}, ["config.json", "num_experts=1000000000"]),
    "layers_huge": ({"num_hidden_layers": 2_000_000_000, "expert_swiglu_limit_list": _DROP,
                     "share_expert_swiglu_limit_list": _DROP}, ["config.json", "num_hidden_layers"]),
}


@pytest.mark.parametrize("fault", sorted(CONFIG_FAULTS) + ["list", "string", "null"])
def test_broken_config_named(fault, pristine, tmp_path, capsys):
    import time
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    if fault in ("list", "string", "null"):
        (ck / "config.json").write_text({"list": "[]", "string": '"hello"', "null": "null"}[fault])
        needles = ["config.json", "JSON object"]
    else:
        change, needles = CONFIG_FAULTS[fault]
        if isinstance(change, str):  # a NaN literal, as Python's json writes it
            d = json.loads((ck / "config.json").read_text())
            if isinstance(d[change], list):
                d[change][-1] = float("nan")
            else:
                d[change] = float("nan")
            (ck / "config.json").write_text(json.dumps(d))
        else:
            _config(ck, **change)
    t0 = time.perf_counter()
    _check_refusal(capsys, ["logits", "--checkpoint", str(ck), "--input-ids", "1", "--out", str(tmp_path / "x.npz")],
                   needles, ck, [tmp_path / "x.npz"])
    assert time.perf_counter() - t0 < 10  # the cost is bounded by the files, not by what the config claims


@pytest.mark.parametrize("kw", [{}, dict(num_hidden_layers=2, layer_group_size=2), dict(num_nextn_predict_layers=0),
                                dict(q_lora_rank=None), dict(num_shared_experts=0, num_hidden_layers=11,
                                                             layer_group_size=4)])
def test_expected_tensor_count_closed_form(kw):
    c = tiny_config(**kw)
    for mtp in (True, False):
        assert expected_tensor_count(c, mtp) == len(L.expected_tensors(c, mtp))


# ---- item 4: arguments --------------------------------------------------------------------------
ARG_CASES = [
    ("logits", ["--input-ids", "1,,2"], ["--input-ids", "empty item"]),
    ("logits", ["--input-ids", "1,2,"], ["--input-ids", "empty item"]),
    ("logits", ["--input-ids", "1,x"], ["--input-ids", "comma-separated"]),
    ("logits", ["--input-ids", str(10**20)], ["--input-ids", "out of range"]),
    ("logits", ["--input-ids", str(2**63)], ["--input-ids", "out of range"]),
    ("logits", ["--input-ids", "-1"], ["--input-ids"]),
    ("logits", ["--input-ids", "512"], ["--input-ids", "outside the vocabulary"]),
    ("logits", ["--input-ids", ",".join(["1"] * 4097)], ["--input-ids", "max_position_embeddings=4096"]),
    ("generate", ["--input-ids", "1,,2", "--max-new-tokens", "2"], ["--input-ids", "empty item"]),
    ("generate", ["--input-ids", str(10**20), "--max-new-tokens", "2"], ["--input-ids", "out of range"]),
    ("generate", ["--input-ids", "512", "--max-new-tokens", "2"], ["--input-ids", "outside the vocabulary"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "2", "--stop-ids", str(10**20)], ["--stop-ids"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "2", "--stop-ids", "600"], ["--stop-ids", "vocabulary"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "1000000000000"], ["--max-new-tokens", "bytes"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "5000"], ["--max-new-tokens", "max_position_embeddings"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "2", "--temperature", "inf"], ["--temperature"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "2", "--temperature", "nan"], ["--temperature"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "2", "--temperature", "-1"], ["--temperature"]),
    ("generate", ["--input-ids", "1", "--max-new-tokens", "2", "--top-p", "0"], ["--top-p"]),
    ("generate", ["--input-ids", "1"], ["--max-new-tokens"]),                      # argparse: missing
    ("logits", ["--input-ids", "1", "--bogus"], ["--bogus"]),                       # argparse: unknown
]


@pytest.mark.parametrize("cmd,extra,needles", ARG_CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(ARG_CASES)])
def test_bad_arguments(cmd, extra, needles, pristine, tmp_path, capsys):
    out = tmp_path / "x.npz"
    argv = [cmd, "--checkpoint", str(pristine)] + extra + (["--out", str(out)] if cmd == "logits" else [])
    _check_refusal(capsys, argv, needles, pristine, [out])


def test_cache_estimate_uses_accounting():
    from ling_jax import accounting as A
    from ling_jax.commands.common import generate_cache_bytes
    c = tiny_config(num_hidden_layers=2, layer_group_size=2)
    cb = A.cache_bytes(c, cache_dtype_bytes=4, state_dtype_bytes=4, conv_dtype_bytes=4)
    assert generate_cache_bytes(c, 1, 100, 4, False) == 100 * cb["mla_bytes_per_token"] + \
        cb["kda_state_bytes_per_sequence"] + cb["kda_conv_state_bytes_per_sequence"]


# ---- item 5: outputs never inside, equal to or containing an input --------------------------------
def _out_cases(ck, tmp):
    cfg = str(ck / "config.json")
    return [
        ["logits", "--checkpoint", str(ck), "--input-ids", "1", "--out", str(ck / S2)],
        ["logits", "--checkpoint", str(ck), "--input-ids", "1", "--out", str(ck / "x.npz")],
        ["logits", "--checkpoint", str(tmp / "link"), "--input-ids", "1", "--out", str(ck / "y.npz")],
        ["convert", "--checkpoint", str(ck), "--out", str(ck), "--force"],
        ["convert", "--checkpoint", str(ck), "--out", str(ck / "conv")],
        ["convert", "--checkpoint", str(ck), "--out", str(tmp), "--force"],
        ["convert", "--checkpoint", str(tmp / "link"), "--out", str(ck), "--force"],
        ["export", "--params", str(ck), "--out", str(ck), "--overwrite"],
        ["export", "--params", str(ck), "--out", str(ck / "exp")],
        ["make-checkpoint", "--config", cfg, "--out", str(ck), "--force"],
        ["make-checkpoint", "--config", str(ck), "--out", str(ck / "sub")],
    ]


@pytest.mark.parametrize("case", range(11))
def test_output_inside_input_refused(case, pristine, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    os.symlink(ck, tmp_path / "link")
    argv = _out_cases(ck, tmp_path)[case]
    before_names = sorted(os.listdir(ck))
    _check_refusal(capsys, argv, ["--out"], ck)
    assert sorted(os.listdir(ck)) == before_names


def test_argparse_error_is_last_line(capsys):
    assert main(["logits"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "--checkpoint" in err[-1]
