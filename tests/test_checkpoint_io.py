"""Writer -> reader round trips, validation, sliced reads, tokenizer, header-only accounting."""
import json
import os

import ml_dtypes
import numpy as np
import pytest

from fixtures import generate_tensor
from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint import writer as W
from ling_jax.checkpoint.fp8 import block_dequant_fp8, block_quant_fp8
from ling_jax.checkpoint.reader import CheckpointError, CheckpointReader
from ling_jax.checkpoint.safetensors_io import SafetensorsFile, load_file, save_file
from ling_jax.checkpoint.synthetic_config import synthetic_config
from ling_jax.checkpoint.tokenizer_files import build_tokenizer
from ling_jax.checkpoint.writer import write_checkpoint
from ling_jax.config import LingConfig

REAL = "/work/shared/spec/config.ling-3.1-flash.json"


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8 if a.dtype.itemsize == 1 else
                                        {2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    cfg = synthetic_config()
    out = tmp_path_factory.mktemp("ck") / "fp8"
    write_checkpoint(cfg, str(out), dtype="fp8", seed=3, num_shards=3, progress=False)
    return cfg, str(out)


def test_fp8_roundtrip_bit_exact(fp8_ckpt):
    cfg, out = fp8_ckpt
    r = CheckpointReader(out)
    r.validate()
    specs = L.expected_tensors(cfg)
    assert set(r.names()) == {n for n, _, _ in L.release_tensors(cfg, "fp8")}
    for name, spec in specs.items():
        shape, dt = r.spec(name)
        assert shape == spec.shape
        ref = generate_tensor(cfg, name, seed=3)
        if spec.quantizable:
            assert dt == "F8_E4M3" and r.is_quantized(name)
            wq, s = r.get_raw(name), r.get_scale(name)
            rq, rs = block_quant_fp8(ref)
            np.testing.assert_array_equal(_bits(wq), _bits(rq))
            np.testing.assert_array_equal(s, rs)
            np.testing.assert_array_equal(r.get(name), block_dequant_fp8(wq, s))
        else:
            assert dt == spec.dtype
            raw = r.get_raw(name)
            np.testing.assert_array_equal(_bits(raw), _bits(ref.astype(raw.dtype)))
            np.testing.assert_array_equal(r.get(name), raw.astype(np.float32))
    r.close()


def test_bf16_roundtrip_exact(tmp_path):
    cfg = synthetic_config()
    out = tmp_path / "bf16"
    write_checkpoint(cfg, str(out), dtype="bf16", seed=1, num_shards=2, progress=False)
    r = CheckpointReader(str(out))
    r.validate()
    assert not any(n.endswith(L.SCALE_SUFFIX) for n in r.names())
    assert r.config.quantization_config is None
    with open(out / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    for name, spec in L.expected_tensors(cfg).items():
        ref = generate_tensor(cfg, name, seed=1)
        want = "F32" if spec.dtype == "F32" else "BF16"
        assert r.spec(name) == (spec.shape, want)
        np.testing.assert_array_equal(_bits(r.get_raw(name)), _bits(ref.astype(r.get_raw(name).dtype)))
        got = r.get(name, dtype=ml_dtypes.bfloat16)
        assert got.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("kw", [
    dict(q_lora_rank=None),
    dict(num_hidden_layers=10, layer_group_size=4),          # trailing remainder group: 8, 9 MLA
    dict(hidden_size=136, intermediate_size=200, moe_intermediate_size=72, kv_lora_rank=40),
    dict(num_nextn_predict_layers=0, num_shared_experts=0),
])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_validate_variants(tmp_path, kw, dtype):
    cfg = synthetic_config(**kw)
    out = tmp_path / "ck"
    s = write_checkpoint(cfg, str(out), dtype=dtype, progress=False, tokenizer=False)
    with CheckpointReader(str(out)) as r:
        r.validate()
        assert r.config == cfg.replace(quantization_config=r.config.quantization_config)
        assert len(r.names()) == s["num_tensors"] == len(L.release_tensors(cfg, dtype))
        assert r.total_size == s["total_size"]


def test_config_json_contents(fp8_ckpt):
    cfg, out = fp8_ckpt
    with open(os.path.join(out, "config.json")) as f:
        d = json.load(f)
    q = d["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["weight_block_size"] == [128, 128]
    assert q["activation_scheme"] == "dynamic"
    assert q["modules_to_not_convert"] == L.modules_to_not_convert(cfg)
    assert d["model_type"] == "bailing_hybrid" and d["num_hidden_layers"] == 9
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 511
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    assert sorted(set(idx["weight_map"].values())) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    total = sum(os.path.getsize(os.path.join(out, f)) for f in set(idx["weight_map"].values()))
    assert idx["metadata"]["total_size"] < total


def test_sliced_reads_match_full(fp8_ckpt):
    cfg, out = fp8_ckpt
    r = CheckpointReader(out)
    for name in ["model.layers.7.attention.kv_b_proj.weight",      # FP8, 1024x48
                 "model.layers.0.attention.q_proj.weight",          # FP8, 128x192 (partial col block)
                 "model.word_embeddings.weight",                    # BF16
                 "model.layers.0.attention.q_conv1d.weight",        # 3-D
                 "model.layers.0.attention.dt_bias"]:               # F32 1-D
        full = r.get(name)
        for idx in [(slice(3, 77),), (slice(100, None), slice(5, 130)), 5, (-1,), (slice(None, None, 3),),
                    (Ellipsis, 0), (slice(0, 0),)]:
            try:
                want = full[idx]
            except IndexError:
                continue
            got = r.get(name, index=idx)
            assert got.shape == want.shape, (name, idx)
            np.testing.assert_array_equal(got, want)
    with pytest.raises(IndexError):
        r.get("model.layers.0.attention.dt_bias", index=([1, 2],))


def test_deterministic_and_chunking_independent(tmp_path, monkeypatch):
    cfg = synthetic_config(num_hidden_layers=2)
    write_checkpoint(cfg, str(tmp_path / "a"), seed=5, progress=False, tokenizer=False)
    monkeypatch.setattr(W, "CHUNK_ELEMENTS", 1000)  # many small row chunks
    write_checkpoint(cfg, str(tmp_path / "b"), seed=5, progress=False, tokenizer=False)
    write_checkpoint(cfg, str(tmp_path / "c"), seed=6, progress=False, tokenizer=False)
    for f in sorted(os.listdir(tmp_path / "a")):
        a, b, c = ((tmp_path / d / f).read_bytes() for d in "abc")
        assert a == b, f
        if f.endswith(".safetensors"):
            assert a != c


def test_values_are_non_degenerate(fp8_ckpt):
    cfg, out = fp8_ckpt
    r = CheckpointReader(out)
    x = np.random.default_rng(0).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    scores = 1 / (1 + np.exp(-(x @ r.get("model.layers.2.mlp.gate.weight").T)))
    assert scores.std() > 0.2                       # sigmoid router scores spread
    assert len(set(np.argmax(scores, 1).tolist())) > 2  # different tokens prefer different experts
    y = x @ r.get("model.layers.0.attention.q_proj.weight").T
    assert 0.5 < y.std() < 2.0                      # linear layers keep activations O(1)
    a = np.concatenate([r.get(f"model.layers.{i}.attention.A_log") for i in range(7)])
    assert np.all((a >= 0) & (a <= np.log(16) + 1e-6)) and a.std() > 0.3
    norm = r.get("model.layers.0.input_layernorm.weight")
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.2
    assert abs(r.get("model.layers.2.mlp.gate.expert_bias")).max() < 0.1


def test_tokenizer(fp8_ckpt):
    from tokenizers import Tokenizer
    import jinja2

    cfg, out = fp8_ckpt
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tok.token_to_id(tc["eos_token"]) == cfg.eos_token_id[0] == 511
    assert tok.token_to_id(tc["pad_token"]) == cfg.pad_token_id == 510
    ids = tok.encode("Hello world, the river ran 42 times!").ids
    assert max(ids) < cfg.vocab_size and len(ids) < 30
    assert tok.decode(ids) == "Hello world, the river ran 42 times!"
    ids = tok.encode("hi" + tc["eos_token"]).ids
    assert ids[-1] == 511
    text = jinja2.Template(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True, eos_token=tc["eos_token"])
    assert text == "user: hi<|endoftext|>\nassistant: "


def test_tokenizer_with_real_ids():
    cfg = LingConfig.from_json(REAL)
    text, tc = build_tokenizer(cfg)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(text)
    assert tok.token_to_id(tc["eos_token"]) == 156895
    assert tok.token_to_id(tc["pad_token"]) == 156892


def test_header_only_real_config(tmp_path):
    cfg = LingConfig.from_json(REAL)
    out = tmp_path / "real"
    s = write_checkpoint(cfg, str(out), header_only=True, progress=False)
    assert s["num_tensors"] == 214_025
    size = sum(os.path.getsize(out / f) for f in os.listdir(out))
    assert size < 50_000_000
    r = CheckpointReader(str(out))
    assert r.header_only
    assert len(r.names()) == 214_025
    assert sum(n.endswith(L.SCALE_SUFFIX) for n in r.names()) == 106_632
    assert r.num_params() == 572_120_680_768
    assert r.spec("model.layers.71.attention.kv_a_proj_with_mqa.weight_scale_inv") == ((5, 32), "F32")
    assert r.total_size == s["total_size"]
    r.validate()
    with pytest.raises(CheckpointError, match="header-only"):
        r.get("model.norm.weight")


def test_single_file_checkpoint(tmp_path):
    cfg = synthetic_config(num_hidden_layers=2, num_nextn_predict_layers=0)
    write_checkpoint(cfg, str(tmp_path / "a"), num_shards=1, progress=False, tokenizer=False)
    os.makedirs(tmp_path / "b")
    os.rename(tmp_path / "a" / "model-00001-of-00001.safetensors", tmp_path / "b" / "model.safetensors")
    os.rename(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    r = CheckpointReader(str(tmp_path / "b"))
    r.validate()
    assert r.get("model.layers.1.attention.dense.weight").shape == (192, 64)


def test_reader_never_writes(fp8_ckpt):
    cfg, out = fp8_ckpt
    before = {f: (os.stat(os.path.join(out, f)).st_mtime_ns, os.path.getsize(os.path.join(out, f)))
              for f in os.listdir(out)}
    with CheckpointReader(out) as r:
        r.validate()
        for n in r.names():
            r.get(n)
    after = {f: (os.stat(os.path.join(out, f)).st_mtime_ns, os.path.getsize(os.path.join(out, f)))
             for f in os.listdir(out)}
    assert before == after


def test_safetensors_io_compatible_with_reference_lib(tmp_path):
    """Our files parse with the `safetensors` library (numpy-representable dtypes compared)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file as st_save

    a = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.ones((2,), np.int32)}
    save_file({**a, "z": np.zeros((5, 3), ml_dtypes.float8_e4m3fn), "w": np.ones(7, ml_dtypes.bfloat16)},
              str(tmp_path / "ours.safetensors"))
    with safe_open(str(tmp_path / "ours.safetensors"), "np") as f:
        assert set(f.keys()) == {"x", "y", "z", "w"}
        np.testing.assert_array_equal(f.get_tensor("x"), a["x"])
    st_save(a, str(tmp_path / "theirs.safetensors"))
    got = load_file(str(tmp_path / "theirs.safetensors"))
    np.testing.assert_array_equal(got["x"], a["x"])
    np.testing.assert_array_equal(got["y"], a["y"])
    with SafetensorsFile(str(tmp_path / "ours.safetensors")) as f:
        assert f.read("z").dtype == ml_dtypes.float8_e4m3fn
        assert f.read("w", index=slice(2, 4)).tolist() == [1, 1]


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    cfg = synthetic_config(num_hidden_layers=2)
    calls = []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("disk full (simulated)")
        return real(*a, **k)

    real = W.write_tensor
    monkeypatch.setattr(W, "write_tensor", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        write_checkpoint(cfg, str(tmp_path / "out"), progress=False)
    assert os.listdir(tmp_path) == []
    # an existing checkpoint is left intact when the overwrite fails
    monkeypatch.setattr(W, "write_tensor", real)
    write_checkpoint(cfg, str(tmp_path / "out"), progress=False, tokenizer=False)
    before = sorted(os.listdir(tmp_path / "out"))
    calls.clear()
    monkeypatch.setattr(W, "write_tensor", boom)
    with pytest.raises(RuntimeError):
        write_checkpoint(cfg, str(tmp_path / "out"), progress=False, overwrite=True)
    assert os.listdir(tmp_path) == ["out"] and sorted(os.listdir(tmp_path / "out")) == before
    CheckpointReader(str(tmp_path / "out")).validate()


def test_writer_refusals(tmp_path):
    cfg = synthetic_config(num_hidden_layers=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        write_checkpoint(cfg, str(tmp_path / "busy"), progress=False)
    with pytest.raises(ValueError, match="dtype"):
        write_checkpoint(cfg, str(tmp_path / "x"), dtype="int8", progress=False)
    with pytest.raises(ValueError, match="600"):  # refused by the config parser (id outside the vocabulary)
        write_checkpoint(synthetic_config(num_hidden_layers=2, eos_token_id=600), str(tmp_path / "x"), progress=False)
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(synthetic_config(vocab_size=200, eos_token_id=199, pad_token_id=198))
    assert sorted(os.listdir(tmp_path)) == ["busy"]
