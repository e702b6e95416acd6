"""Export: model → release-layout checkpoint → load_model → same logits (within storage rounding).

Bounds (float32 forward, 2-layer model of test_train, 4×24 tokens):
* loaded checkpoint vs the in-memory model passed through the same rounding (`quantize_like_export`):
  identical weights, so logits agree to 1e-6 (relative L2).
* FP8 export vs the original float32 model: E4M3 keeps 3 mantissa bits, so each quantized weight is
  off by at most 2^-4 of its magnitude (≈2.5 % RMS), BF16 (2^-9) elsewhere. With the original's
  expert choices forced, logits agree to 15 % relative L2 (measured 7 % main, 8 % MTP on this random
  2-layer model, whose errors compound over ~10 quantized matmuls); unforced, 8-10 % of the top-k
  choices flip and the error is 13 % / 20 % (not asserted beyond < 0.4).
* BF16 export (2^-9 relative rounding per weight) vs the original: 3 % relative L2 (measured 1.0 %,
  including a few flipped expert choices).
"""
import json
import os

import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.export import export_checkpoint, model_tensors, quantize_like_export
from ling_jax.forward import forward
from ling_jax.loader import load_model
from ling_jax.tokenizer import Tokenizer
from test_train import small_cfg, small_model, synthetic_tokens


@pytest.fixture(scope="module")
def setup():
    cfg = small_cfg()
    model = small_model(cfg, 0)
    ids = synthetic_tokens(cfg).reshape(4, 24)
    ref = forward(model, ids, mtp=True)
    return cfg, model, ids, ref


def _logits_in_graph(model, loaded, ids):
    """Forward the loaded parameters through `model`'s graph (shares its compiled forward)."""
    graphdef, _ = nnx.split(model)
    return forward(nnx.merge(graphdef, nnx.state(loaded)), ids, mtp=True)


def test_export_fp8_roundtrip(setup, tmp_path):
    cfg, model, ids, ref = setup
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")  # copied verbatim (content not checked here)
    (tok / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "ckpt"
    s = export_checkpoint(model, str(out), dtype="fp8", tokenizer_dir=str(tok), progress=False)
    assert s["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt")]  # temp dir renamed away
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization_config"]["weight_block_size"] == [128, 128]
    r = CheckpointReader(str(out))
    r.validate()
    assert r.info("model.layers.1.mlp.experts.3.up_proj.weight").dtype == "F8_E4M3"
    assert r.info("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv").dtype == "F32"
    assert r.info("model.layers.1.mlp.gate.expert_bias").dtype == "F32"
    assert r.info("model.layers.0.attention.A_log").dtype == "F32"
    assert r.info("model.layers.1.mlp.gate.weight").dtype == "BF16"
    # expert_bias (F32) survives exactly
    np.testing.assert_array_equal(r.get("model.layers.2.mlp.gate.expert_bias"),
                                  model_tensors(model)["model.layers.2.mlp.gate.expert_bias"])
    r.close()

    loaded = load_model(str(out), "float32", progress=False)
    got = _logits_in_graph(model, loaded, ids)
    want = forward(quantize_like_export(model, "fp8"), ids, mtp=True)
    assert rel_err(got["logits"], want["logits"]) < 1e-6
    assert rel_err(got["mtp_logits"], want["mtp_logits"]) < 1e-6
    assert rel_err(got["logits"], ref["logits"]) < 0.4 and rel_err(got["mtp_logits"], ref["mtp_logits"]) < 0.4
    graphdef, _ = nnx.split(model)
    forced = forward(nnx.merge(graphdef, nnx.state(loaded)), ids, mtp=True, forced_routing=ref["routing"])
    e_main, e_mtp = rel_err(forced["logits"], ref["logits"]), rel_err(forced["mtp_logits"], ref["mtp_logits"])
    assert e_main < 0.15 and e_mtp < 0.15, (e_main, e_mtp)


def test_export_bf16_roundtrip_and_overwrite(setup, tmp_path):
    cfg, model, ids, ref = setup
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "junk").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_checkpoint(model, str(out), dtype="bf16", progress=False)
    export_checkpoint(model, str(out), dtype="bf16", progress=False, overwrite=True, num_shards=3)
    assert not (out / "junk").exists()
    conf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in conf
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) == 3
    loaded = load_model(str(out), "float32", progress=False)
    got = _logits_in_graph(model, loaded, ids)
    want = forward(quantize_like_export(model, "bf16"), ids, mtp=True)
    assert rel_err(got["logits"], want["logits"]) < 1e-6
    assert rel_err(got["mtp_logits"], want["mtp_logits"]) < 1e-6
    e = rel_err(got["logits"], ref["logits"])
    assert e < 3e-2, e
    assert rel_err(got["mtp_logits"], ref["mtp_logits"]) < 3e-2


@pytest.mark.slow
def test_cli_train_export_eval(tmp_path):
    """`ling-jax train` on a tiny corpus, then `export` of its Orbax state and `eval`."""
    from ling_jax.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun".split()
    rng = np.random.default_rng(0)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 200)) + "\n")
    cfg = small_cfg(vocab_size=300, eos_token_id=299, pad_token_id=298)
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "run"
    rc = main(["train", "--text", str(corpus), "--pattern", "*.txt", "--out", str(out), "--config", str(cfg_path),
               "--steps", "3", "--batch", "2", "--seq", "16", "--save-every", "2", "--export-dtype", "bf16",
               "--quiet"])
    assert rc == 0
    for f in ("loss.png", "metrics.jsonl", "tokenizer/tokenizer.json", "checkpoint/config.json",
              "checkpoint/tokenizer.json", "checkpoint/model.safetensors.index.json"):
        assert (out / f).exists(), f
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert sorted(os.listdir(out / "orbax")) == ["2", "3"]

    exp = tmp_path / "exported"
    assert main(["export", "--params", str(out), "--out", str(exp), "--dtype", "bf16", "--json"]) == 0
    assert (exp / "tokenizer.json").exists()
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(rng.choice(words, 120)))
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["eval", "--checkpoint", str(exp), "--text-file", str(text), "--json", "--window", "32"]) == 0
    res = json.loads(buf.getvalue().strip().splitlines()[-1])
    n_tok = len(Tokenizer.from_dir(str(exp)).encode(text.read_text()))
    assert res["tokens"] == n_tok - 1  # every token but the first is scored once
    assert np.isfinite(res["perplexity"]) and res["perplexity"] > 1.0


def test_eval_windows_score_every_token_once():
    from ling_jax.commands.eval import window_batches

    ids = list(range(100, 111))  # 11 tokens -> 10 targets
    seen = []
    for rows, n_valid in window_batches(ids, window=4, batch=2):
        assert rows.shape == (2, 5)
        for r, n in zip(rows, n_valid):
            seen += [int(t) for t in r[1:n]]  # targets of this window
    assert seen == ids[1:]
