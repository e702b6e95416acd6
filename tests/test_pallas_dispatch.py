"""`pallas_kernels` dispatch: default implementation per backend; "xla" routes to the twins."""
import jax
import pytest

import ling_jax.checkpoint.fp8 as fp8_mod
import ling_jax.kda as kda_mod
import ling_jax.mla as mla_mod
import pallas_kernels as pk
import pallas_kernels.fp8_matmul as fp8_kernel_mod


def test_default_impl_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert pk.default_impl() == "xla"
    with pytest.raises(ValueError):
        pk.kda_recurrent_step("triton", None, None, None, None, None, None)


def test_xla_branch_calls_the_twins(monkeypatch):
    calls = []

    def spy(name):
        return lambda *a, **k: calls.append((name, a, k)) or name

    monkeypatch.setattr(kda_mod, "kda_chunk_scan", spy("chunk"))
    monkeypatch.setattr(kda_mod, "kda_recurrent_step", spy("step"))
    monkeypatch.setattr(kda_mod, "kda_recurrent_scan", spy("scan"))
    monkeypatch.setattr(mla_mod, "latent_attention", spy("mla"))
    monkeypatch.setattr(mla_mod, "attention_mask", spy("mask"))
    monkeypatch.setattr(fp8_kernel_mod, "block_dequant_fp8_jax", spy("dequant"))
    monkeypatch.setattr(fp8_kernel_mod, "linear", spy("linear"))
    for impl in ("xla", "auto", None):  # auto/None resolve to xla on CPU
        assert pk.kda_chunk_scan(impl, 1, 2, 3, 4, 5, 6, 32) == "chunk"
        assert calls[-1][1] == (1, 2, 3, 4, 5, 6, 32)
        assert pk.kda_recurrent_step(impl, "S", 1, 2, 3, 4, 5) == "step"
        assert calls[-1][1] == ("S", 1, 2, 3, 4, 5)
        assert pk.kda_recurrent_scan(impl, 1, 2, 3, 4, 5, "S") == "scan"
        assert pk.kda_recurrent_scan("pallas", 1, 2, 3, 4, 5, "S", return_all_states=True) == "scan"
        assert calls[-1][2] == {"return_all_states": True}

        class C:  # stands for the cache: only .shape[1] is read
            shape = (1, 7, 4)

        assert pk.latent_attention(impl, "qh", "qp", C, "kp", "kvlen", "qpos", 0.5) == "mla"
        assert calls[-2][1] == ("qpos", 7, "kvlen") and calls[-1][1] == ("qh", "qp", C, "kp", "mask", 0.5)
        assert pk.fp8_linear(impl, "x", "wq", "s") == "linear"
        assert calls[-2][1] == ("wq", "s", (128, 128)) and calls[-1][1] == ("x", "dequant")
    assert fp8_mod.block_dequant_fp8_jax is not None
