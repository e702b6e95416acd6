"""Every way a checkpoint can be wrong yields a CheckpointError naming the file and the tensor."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

from ling_jax.checkpoint.reader import CheckpointError, CheckpointReader
from ling_jax.checkpoint.safetensors_io import SafetensorsFile, load_file, save_file
from ling_jax.checkpoint.synthetic_config import synthetic_config
from ling_jax.checkpoint.writer import write_checkpoint

INDEX = "model.safetensors.index.json"
S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"
Q = "model.layers.0.attention.q_proj.weight"          # FP8 with scale, in shard 1
QS = "model.layers.0.attention.q_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    out = tmp_path_factory.mktemp("pristine") / "ck"
    write_checkpoint(synthetic_config(num_hidden_layers=2, layer_group_size=2), str(out), num_shards=2, progress=False, tokenizer=False)
    return out


@pytest.fixture
def ck(pristine, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(pristine, d)
    return d


def _index(ck):
    with open(ck / INDEX) as f:
        return json.load(f)


def _write_index(ck, idx):
    with open(ck / INDEX, "w") as f:
        json.dump(idx, f)


def _rewrite(ck, fname, fn):
    """Load a shard, let fn mutate its tensor dict, save it back and fix the index."""
    t = load_file(str(ck / fname))
    fn(t)
    save_file(t, str(ck / fname))
    idx = _index(ck)
    wm = {n: f for n, f in idx["weight_map"].items() if f != fname or n in t}
    wm.update({n: fname for n in t})
    idx["weight_map"] = wm
    idx["metadata"].pop("total_size", None)
    _write_index(ck, idx)


def _raises(ck, *needles, validate=True):
    with pytest.raises(CheckpointError) as ei:
        r = CheckpointReader(str(ck))
        if validate:
            r.validate()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_pristine_is_valid(ck):
    CheckpointReader(str(ck)).validate()


def test_missing_config(ck):
    os.remove(ck / "config.json")
    _raises(ck, "config.json")


def test_bad_config(ck):
    (ck / "config.json").write_text("{not json")
    _raises(ck, "config.json")


def test_missing_index(ck):
    os.remove(ck / INDEX)
    _raises(ck, INDEX, str(ck))


def test_missing_directory(tmp_path):
    _raises(tmp_path / "nope", "nope")


def test_index_points_at_missing_shard(ck):
    os.remove(ck / S2)
    _raises(ck, INDEX, S2, "does not exist")


def test_index_bad_shard_name(ck):
    idx = _index(ck)
    idx["weight_map"][Q] = "../evil.safetensors"
    _write_index(ck, idx)
    _raises(ck, INDEX, Q, "../evil")


def test_index_lists_tensor_absent_from_shard(ck):
    idx = _index(ck)
    idx["weight_map"]["model.layers.0.extra.weight"] = S1
    _write_index(ck, idx)
    _raises(ck, S1, "model.layers.0.extra.weight", "not in this shard")


def test_shard_tensor_not_in_index(ck):
    idx = _index(ck)
    del idx["weight_map"][QS]
    _write_index(ck, idx)
    _raises(ck, S1, QS, "index")


def test_missing_tensor(ck):
    _rewrite(ck, S1, lambda t: t.pop("model.layers.0.attention.A_log"))
    _raises(ck, "missing tensor", "model.layers.0.attention.A_log", "[2]", INDEX)


def test_unexpected_tensor(ck):
    _rewrite(ck, S1, lambda t: t.__setitem__("model.layers.0.attention.bonus.weight", np.zeros((2, 2), np.float32)))
    _raises(ck, "unexpected tensor", "model.layers.0.attention.bonus.weight", S1)


def test_unexpected_scale(ck):
    _rewrite(ck, S1, lambda t: t.__setitem__("model.layers.0.mystery.weight_scale_inv", np.ones((1, 1), np.float32)))
    _raises(ck, "unexpected tensor", "model.layers.0.mystery.weight_scale_inv", S1)


def test_shape_disagrees_with_config(ck):
    _rewrite(ck, S1, lambda t: t.__setitem__("model.layers.0.attention.dt_bias", np.zeros((64,), np.float32)))
    _raises(ck, "model.layers.0.attention.dt_bias", "[64]", "[128]", "config.json", S1)


def test_config_disagrees_with_tensors(ck):
    d = json.loads((ck / "config.json").read_text())
    d["intermediate_size"] = 321
    (ck / "config.json").write_text(json.dumps(d))
    _raises(ck, "model.layers.0.mlp.gate_proj.weight", "[321, 192]", "config.json")


def test_scale_shape_wrong(ck):
    _rewrite(ck, S1, lambda t: t.__setitem__(QS, np.ones((2, 2), np.float32)))
    msg = _raises(ck, QS, "[2, 2]", "[1, 2]", S1)
    assert "ceil grid" in msg
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        CheckpointReader(str(ck)).get(Q)


def test_scale_for_unquantized_weight(ck):
    def f(t):
        t[Q] = t[Q].astype(np.float32)
    _rewrite(ck, S1, f)
    _raises(ck, QS, "F32", "not F8_E4M3")


def test_dtype_not_allowed(ck):
    _rewrite(ck, S1, lambda t: t.__setitem__("model.layers.0.input_layernorm.weight", np.ones((192,), np.int32)))
    _raises(ck, "model.layers.0.input_layernorm.weight", "I32", S1)


GATE = "model.layers.1.mlp.gate.weight"
NORM = "model.layers.0.input_layernorm.weight"
A_LOG = "model.layers.0.attention.A_log"


def _shard(ck, name):
    return _index(ck)["weight_map"][name]


def _retype(ck, name, fn):
    _rewrite(ck, _shard(ck, name), lambda t: t.__setitem__(name, fn(t[name])))


def test_f32_and_bf16_accepted_for_every_float_tensor(ck):
    """Issue 24 item 5: an F32 router gate (what a framework keeping routers in float32 writes), an
    F32 norm and a BF16 A_log (released F32) are valid: converted to the model's dtype on load."""
    import ml_dtypes
    _retype(ck, GATE, lambda a: a.astype(np.float32))
    _retype(ck, NORM, lambda a: a.astype(np.float32))
    _retype(ck, A_LOG, lambda a: a.astype(ml_dtypes.bfloat16))
    r = CheckpointReader(str(ck))
    assert r.spec(GATE)[1] == "F32" and r.spec(A_LOG)[1] == "BF16"
    r.validate()
    assert r.get(GATE).dtype == np.float32 and r.get(A_LOG, np.float32).dtype == np.float32


@pytest.mark.parametrize("name,make,needles", [
    (GATE, lambda a: np.ones(a.shape, np.int32), ["I32", "integer"]),
    (Q, lambda a: np.ones(a.shape, np.int32), ["I32", "integer"]),
    (NORM, lambda a: np.ones(a.shape, np.bool_), ["BOOL", "boolean"]),
    (NORM, lambda a: a.astype(np.float16), ["F16", "refused"]),
    (Q, lambda a: a.astype(np.float32).astype("float8_e5m2"), ["F8_E5M2", "F8_E4M3"]),
])
def test_unrepresentable_dtypes_refused_by_name(ck, name, make, needles):
    import ml_dtypes  # noqa: F401  (registers the float8 dtypes by name)
    _retype(ck, name, make)
    msg = _raises(ck, name, _shard(ck, name), *needles)
    assert msg.index(name) < 200  # the tensor is named in the first problem


def test_two_problems_all_listed_most_specific_first(ck):
    """An F16 norm and an extra tensor: the broken tensor first, the extra one listed after it."""
    extra = "model.layers.0.bonus.weight"

    def f(t):
        t[NORM] = t[NORM].astype(np.float16)
        t[extra] = np.zeros((2, 2), np.float32)
    _rewrite(ck, _shard(ck, NORM), f)
    r = CheckpointReader(str(ck))
    probs = r.problems()
    assert len(probs) == 2 and NORM in probs[0] and "F16" in probs[0] and extra in probs[1]
    msg = _raises(ck, NORM, extra, "1 more problem")
    assert msg.index(NORM) < msg.index(extra)


def test_fp8_not_allowed_for_router(pristine, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(pristine, ck)
    name = "model.layers.1.mlp.gate.weight"
    shard = _index(ck)["weight_map"][name]

    def f(t):
        t[name] = t[name].astype(np.float32).astype(t[Q].dtype if Q in t else np.dtype("float8_e4m3fn"))
    import ml_dtypes  # noqa: F401  (registers float8 dtypes by name)
    _rewrite(ck, shard, f)
    _raises(ck, name, "F8_E4M3", shard)


def test_fp8_without_scale(ck):
    _rewrite(ck, S1, lambda t: t.pop(QS))
    _raises(ck, Q, QS, "missing", S1)
    r = CheckpointReader(str(ck))
    with pytest.raises(CheckpointError) as ei:
        r.get(Q)
    assert Q in str(ei.value) and QS in str(ei.value) and S1 in str(ei.value)


def test_truncated_shard(ck):
    p = ck / S2
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    _raises(ck, S2, "truncated", validate=False)


def test_trailing_garbage(ck):
    with open(ck / S2, "ab") as f:
        f.write(b"\0" * 16)
    _raises(ck, S2, "trailing", validate=False)


def test_tiny_file(ck):
    (ck / S2).write_bytes(b"\x01\x02")
    _raises(ck, S2, "truncated", validate=False)


def test_absurd_header_length(ck):
    with open(ck / S2, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 60))
    _raises(ck, S2, "header length", validate=False)


def test_header_length_beyond_file(ck):
    size = os.path.getsize(ck / S2)
    with open(ck / S2, "r+b") as f:
        f.write(struct.pack("<Q", size))
    _raises(ck, S2, "exceeds the file size", validate=False)


def test_bad_json_header(ck):
    with open(ck / S2, "r+b") as f:
        f.seek(8)
        f.write(b"[{:,")
    _raises(ck, S2, "JSON", validate=False)


def _craft(path, header: dict, data: bytes):
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    path.write_bytes(struct.pack("<Q", len(js)) + js + data)


@pytest.mark.parametrize("offsets,data_len,needle", [
    ([[0, 16], [8, 24]], 24, "overlap"),
    ([[0, 16], [24, 40]], 40, "gap"),
    ([[0, 16], [16, 32]], 20, "truncated"),          # offsets exceed the file
    ([[8, 24], [24, 40]], 40, "gap"),                # first tensor does not start at 0
    ([[0, 16], [16, 30]], 32, "needs 16"),           # span disagrees with shape
    ([[0, 16], [16, 32]], 40, "trailing"),
])
def test_bad_offsets(tmp_path, offsets, data_len, needle):
    h = {"__metadata__": {"format": "pt"},
         "a.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": offsets[0]},
         "b.weight": {"dtype": "F32", "shape": [4], "data_offsets": offsets[1]}}
    p = tmp_path / "x.safetensors"
    _craft(p, h, b"\0" * data_len)
    with pytest.raises(CheckpointError) as ei:
        SafetensorsFile(str(p))
    msg = str(ei.value)
    assert needle in msg and str(p) in msg
    assert "a.weight" in msg or "b.weight" in msg


@pytest.mark.parametrize("entry,needle", [
    ({"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "bad shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "bad data_offsets"),
    ({"dtype": "F32", "shape": [1]}, "needs dtype, shape and data_offsets"),
])
def test_bad_header_entries(tmp_path, entry, needle):
    p = tmp_path / "x.safetensors"
    _craft(p, {"t.weight": entry}, b"\0" * 4)
    with pytest.raises(CheckpointError) as ei:
        SafetensorsFile(str(p))
    assert needle in str(ei.value) and "t.weight" in str(ei.value) and str(p) in str(ei.value)


def test_total_size_mismatch(ck):
    idx = _index(ck)
    idx["metadata"]["total_size"] += 1
    _write_index(ck, idx)
    _raises(ck, INDEX, "total_size")  # reported by validate(), after (and only without) per-tensor problems


def test_validate_reports_all_problems(ck):
    def f(t):
        t.pop("model.layers.0.attention.A_log")
        t["model.layers.0.attention.dt_bias"] = np.zeros((3,), np.float32)
    _rewrite(ck, S1, f)
    r = CheckpointReader(str(ck))
    probs = r.problems()
    assert len(probs) == 2
    with pytest.raises(CheckpointError, match="1 more problem") as ei:
        r.validate()
    assert ei.value.problems == probs


def test_no_mtp_validation(ck):
    idx = _index(ck)
    mtp = [n for n in idx["weight_map"] if n.startswith("model.layers.2.")]
    assert mtp
    for fname in (S1, S2):
        _rewrite(ck, fname, lambda t: [t.pop(n) for n in mtp if n in t])
    _raises(ck, "missing tensor", "model.layers.2.")
    CheckpointReader(str(ck)).validate(include_mtp=False)
