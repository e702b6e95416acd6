"""`ling-jax make-checkpoint` end to end, and its size overrides."""
import json
import os
import subprocess
import sys

import pytest

from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.cli import main
from ling_jax.commands.make_checkpoint import apply_overrides
from ling_jax.config import LingConfig

REAL = "/work/shared/spec/config.ling-3.1-flash.json"
MID = "/work/shared/bench/config.mid.json"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--layers", "3", "--experts", "4", "--hidden", "128", "--vocab", "512"]


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "ck"
    rc = main(["make-checkpoint", "--config", MID, "--out", str(out), *SMALL, "--seed", "7"])
    assert rc == 0
    assert "wrote fp8 checkpoint" in capsys.readouterr().out
    r = CheckpointReader(str(out))
    r.validate()
    c = r.config
    assert (c.num_hidden_layers, c.num_experts, c.hidden_size, c.vocab_size) == (3, 4, 128, 512)
    assert c.eos_token_id == (511,) and c.pad_token_id == 510
    assert c.quantization_config["modules_to_not_convert"][:2] == ["lm_head", "model.word_embeddings"]
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).is_file()


def test_cli_bf16_header_only_and_module_entry(tmp_path):
    out = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-m", "ling_jax.cli", "make-checkpoint", "--config", MID, "--out", str(out),
                        "--dtype", "bf16", "--header-only", "--layers", "2", "--experts", "8"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = CheckpointReader(str(out))
    r.validate()
    assert r.header_only and r.config.quantization_config is None
    assert all(os.path.getsize(out / f) < 1_000_000 for f in os.listdir(out))


def test_tools_wrapper(tmp_path):
    out = tmp_path / "ck"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_checkpoint.py"), "--config", MID,
                        "--out", str(out), *SMALL, "--no-tokenizer", "--shards", "3", "--no-mtp"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = CheckpointReader(str(out))
    r.validate()
    assert not r.config.has_mtp
    assert len({os.path.basename(r.file_of(n)) for n in r.names()}) == 3
    assert not (out / "tokenizer.json").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--layers", "0"], "--layers"),
    (["--experts", "1"], "--experts"),
    (["--experts", "-3"], "--experts"),
    (["--shards", "0"], "--shards"),
    (["--fp8-layout", "C"], "--fp8-layout"),
    (["--conv-dtype", "F16"], "--conv-dtype"),
])
def test_cli_bad_input(tmp_path, capsys, argv, needle):
    rc = main(["make-checkpoint", "--config", MID, "--out", str(tmp_path / "ck"), *SMALL[:0], *argv])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err
    assert not (tmp_path / "ck").exists()


def test_cli_missing_config_and_busy_out(tmp_path, capsys):
    assert main(["make-checkpoint", "--config", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    assert "none.json" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("1")
    assert main(["make-checkpoint", "--config", MID, "--out", str(tmp_path / "busy"), *SMALL]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["make-checkpoint", "--config", MID, "--out", str(tmp_path / "busy"), *SMALL, "--force"]) == 0
    CheckpointReader(str(tmp_path / "busy")).validate()


def test_layers_override_keeps_clamp_on_last_layers():
    real = LingConfig.from_json(REAL)
    c = apply_overrides(real, layers=4)
    assert c.expert_swiglu_limit_list == (4.0,) * 4
    assert c.share_expert_swiglu_limit_list == (5.0, 5.0, 5.0, 7.0)
    assert c.first_k_dense_replace == 3
    c = apply_overrides(real, layers=16)
    assert c.expert_swiglu_limit_list == (0.0,) * 9 + (4.0,) * 7
    assert c.share_expert_swiglu_limit_list == (0.0,) * 8 + (5.0,) * 7 + (7.0,)
    assert c.first_k_dense_replace == 4
    c = apply_overrides(real, layers=80)
    assert len(c.expert_swiglu_limit_list) == 80 and c.expert_swiglu_limit_list[-7:] == (4.0,) * 7
    assert sum(x > 0 for x in c.expert_swiglu_limit_list) == 7
    c = apply_overrides(real, layers=1)
    assert c.first_k_dense_replace == 0 and c.share_expert_swiglu_limit_list == (7.0,)


@pytest.mark.parametrize("e", [2, 4, 6, 8, 12, 16, 64, 512, 7])
def test_experts_override_keeps_router_valid(e):
    real = LingConfig.from_json(REAL)
    c = apply_overrides(real, experts=e)
    assert c.num_experts == e and e % c.n_group == 0 and e // c.n_group >= 2
    assert 1 <= c.topk_group <= c.n_group and 1 <= c.num_experts_per_tok <= e
    assert c.num_experts_per_tok <= c.topk_group * (e // c.n_group)
    if e >= 4:
        assert c.num_experts_per_tok < e  # routing still selects
    if e in (64, 512):
        assert (c.n_group, c.topk_group, c.num_experts_per_tok) == (8, 4, 8)


def test_vocab_override_moves_special_ids():
    real = LingConfig.from_json(REAL)
    c = apply_overrides(real, vocab=1000)
    assert c.vocab_size == 1000 and c.eos_token_id == (999,) and c.pad_token_id == 998
    c = apply_overrides(real, vocab=200000)
    assert c.eos_token_id == (156895,) and c.pad_token_id == 156892


def test_overrides_written_config_is_consistent(tmp_path):
    out = tmp_path / "ck"
    assert main(["make-checkpoint", "--config", REAL, "--out", str(out), "--layers", "9", "--experts", "4",
                 "--hidden", "64", "--vocab", "300", "--no-tokenizer", "--header-only"]) == 0
    d = json.loads((out / "config.json").read_text())
    assert d["num_hidden_layers"] == 9 and len(d["expert_swiglu_limit_list"]) == 9
    mods = d["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.9.mlp.gate" in mods and "model.layers.71.mlp.gate" not in mods
    assert "model.layers.9.attention.g_proj" in mods and "model.layers.8.attention.g_proj" in mods
    CheckpointReader(str(out)).validate()


def test_cli_fp8_layout_and_conv_dtype(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["make-checkpoint", "--config", MID, "--out", str(out), *SMALL[2:], "--layers", "9",
                 "--fp8-layout", "a", "--conv-dtype", "f32", "--no-tokenizer"]) == 0
    assert "(layout A, conv taps F32)" in capsys.readouterr().out
    r = CheckpointReader(str(out))
    r.validate()
    mods = r.config.quantization_config["modules_to_not_convert"]
    mla = [i for i, t in enumerate(r.config.layer_types) if t == "mla"] + [r.config.num_hidden_layers]
    assert "kda" in r.config.layer_types and len(mla) == 3
    assert all(f"model.layers.{i}.attention.kv_a_proj_with_mqa" in mods for i in mla)
    assert not any(m.endswith("attention.g_proj") for m in mods)
    for i in mla:
        assert r.spec(f"model.layers.{i}.attention.kv_a_proj_with_mqa.weight")[1] == "BF16"
        assert r.is_quantized(f"model.layers.{i}.attention.g_proj.weight")
    assert r.spec("model.layers.0.attention.q_conv1d.weight")[1] == "F32"
