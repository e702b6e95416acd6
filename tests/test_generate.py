"""Generation: cached decode = full-sequence forward, batching, carried caches, speculative, sampling."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as R
from conftest import is_compile_event, load_from_dict
from ling_jax.cli import main as cli_main
from ling_jax.generate import DecodeState, cache_length, decode_loop, generate, length_bucket, prefill
from ling_jax.model import init_cache
from ling_jax.forward import forward
from ling_jax.sampling import SamplingParams


def _check_greedy_against_full_forward(model, prompts, result):
    """Every generated token is the argmax of the full-sequence logits of what precedes it."""
    seqs = [list(p) + list(t) for p, t in zip(prompts, result.tokens)]
    lens = np.array([len(s) for s in seqs])
    ids = np.zeros((len(seqs), lens.max()), np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
    logits = np.asarray(forward(model, ids, n_valid=lens)["logits"])
    for b, (p, t) in enumerate(zip(prompts, result.tokens)):
        pred = logits[b, len(p) - 1:len(p) - 1 + len(t)].argmax(-1)
        assert pred.tolist() == list(t), b


@pytest.mark.slow
def test_cached_greedy_equals_full_forward_long_prompts(tiny_model, tiny_cfg):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, n).tolist() for n in (1, 7, 64, 200)]
    res = generate(tiny_model, prompts, 32, stop_ids=())
    assert all(len(t) == 32 for t in res.tokens)
    _check_greedy_against_full_forward(tiny_model, prompts, res)


def test_cached_greedy_other_checkpoint_and_chunking(tiny_params):
    """A second config (no q-LoRA, yarn, 9 layers) and a chunk size that splits the prompt."""
    cfg = R.tiny_config(q_lora_rank=None, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 16})
    params = R.random_params(cfg, seed=4)
    model = load_from_dict(cfg, params)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7]]
    res = generate(model, prompts, 33, stop_ids=(), exec=model.exec.replace(kda_chunk=4))
    _check_greedy_against_full_forward(model, prompts, res)


def test_batch_equals_each_alone(tiny_model):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]
    both = generate(tiny_model, prompts, 10, stop_ids=())
    for p, t in zip(prompts, both.tokens):
        assert generate(tiny_model, [p], 10, stop_ids=()).tokens[0] == t


def test_two_prefill_calls_with_carried_cache_equal_one(tiny_model, tiny_cfg):
    from flax import nnx
    graphdef, params = nnx.split(tiny_model)
    ids = np.random.default_rng(1).integers(0, tiny_cfg.vocab_size, (2, 12)).astype(np.int32)
    g = SamplingParams()
    h0 = jnp.zeros((2, tiny_cfg.hidden_size), jnp.float32)

    def run(splits):
        cache = init_cache(tiny_cfg, 2, 40, jnp.float32)
        hid, start = h0, 0
        for i, end in enumerate(splits):
            cache, logits, tok, hid = prefill(graphdef, params, cache, jnp.asarray(ids[:, start:end]),
                                              jnp.full((2,), end - start, jnp.int32), hid,
                                              sampling=g,
                                              with_mtp=True)
            start = end
        st = DecodeState(cache, tok, hid, jnp.zeros((2,), bool), jnp.zeros((2, 8), jnp.int32),
                         jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32),
                         jnp.zeros((2,), jnp.int32))
        st = decode_loop(graphdef, params, st, sampling=g, stop_ids=(), max_new=8, speculative=2)
        return np.asarray(logits), np.asarray(st.out)

    l1, out1 = run([12])
    l2, out2 = run([5, 12])
    np.testing.assert_allclose(l1, l2, rtol=1e-4, atol=1e-4)
    assert np.array_equal(out1, out2)


def _predictable_params(cfg, eps, seed):
    """Weights under which the next token is mostly a function of the current one, and the MTP
    layer (eh_proj ≈ [I, 0]) mostly predicts it: drafts get partially accepted."""
    p = R.random_params(cfg, seed)
    for n in list(p):
        if n.endswith(("o_proj.weight", "dense.weight", "down_proj.weight")):
            p[n] = p[n] * eps
    D = cfg.hidden_size
    eh = f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"
    p[eh] = np.concatenate([np.eye(D), np.zeros((D, D))], 1) + 0.15 * p[eh]
    return p


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_greedy_equals_plain_greedy(tiny_cfg, k):
    model = load_from_dict(tiny_cfg, _predictable_params(tiny_cfg, 0.5, 7))
    prompts = [[1, 2, 3, 4, 5], [17, 3]]
    plain = generate(model, prompts, 20, stop_ids=())
    spec = generate(model, prompts, 20, stop_ids=(), speculative=k)
    assert spec.tokens == plain.tokens
    # drafts were partly accepted and partly rejected, so rollback was exercised
    assert 1.2 < spec.acceptance_length < k + 1


def test_sampling_reproducible_and_seeded(tiny_model):
    s = lambda seed: generate(tiny_model, [[1, 2, 3]], 12, stop_ids=(),
                              sampling=SamplingParams(temperature=1.0, top_k=30, top_p=0.9, seed=seed)).tokens
    a, b, c = s(3), s(3), s(4)
    assert a == b and a != c


def test_speculative_sampling_runs_and_is_seeded(tiny_cfg):
    model = load_from_dict(tiny_cfg, _predictable_params(tiny_cfg, 0.5, 7))
    sp = SamplingParams(temperature=0.7, top_k=20, seed=5)
    a = generate(model, [[1, 2, 3]], 15, stop_ids=(), sampling=sp, speculative=2)
    b = generate(model, [[1, 2, 3]], 15, stop_ids=(), sampling=sp, speculative=2)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 15 and a.acceptance_length > 1


def test_stop_ids_and_streaming(tiny_model):
    base = generate(tiny_model, [[1, 2, 3]], 12, stop_ids=()).tokens[0]
    stop = base[4]
    got = []
    res = generate(tiny_model, [[1, 2, 3]], 12, stop_ids=(stop,),
                   stream=lambda t, n: got.extend(t[0, :n[0]].tolist()))
    assert res.tokens[0] == base[:base.index(stop) + 1] and res.finished == [True]
    assert got == res.tokens[0]


# 13 tokens in calls of 1, and of 3 (a last call of 1): every call boundary and a partial last call
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_by_chunks_equals_unstreamed(tiny_cfg, chunk):
    """Streaming runs the decode loop in calls of `stream_chunk` steps (no host callback inside the
    program): the streamed tokens, the result and the logprobs equal the unstreamed run's, sampled
    with penalties, batched with different lengths and with speculation."""
    model = load_from_dict(tiny_cfg, _predictable_params(tiny_cfg, 0.5, 7))
    prompts = [[1, 2, 3, 4, 5], [17, 3]]
    for kw in (dict(sampling=SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.3, seed=2), logprobs=2),
               dict(speculative=2, sampling=SamplingParams(temperature=0.7, top_k=20, seed=5))):
        base = generate(model, prompts, 13, stop_ids=(), **kw)
        got = [[], []]

        def stream(t, n):
            for b in range(2):
                got[b].extend(t[b, :n[b]].tolist())
        res = generate(model, prompts, 13, stop_ids=(), stream=stream, stream_chunk=chunk, **kw)
        assert res.tokens == base.tokens == got and all(len(t) == 13 for t in got)
        assert res.logprobs == base.logprobs and res.acceptance_length == base.acceptance_length
    with pytest.raises(ValueError, match="stream_chunk"):
        generate(model, prompts, 4, stream=stream, stream_chunk=0)


def test_generate_errors(tiny_model, tiny_cfg):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_model, [[]], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(tiny_model, [[1, tiny_cfg.vocab_size]], 4)
    with pytest.raises(ValueError, match="does not fit"):
        generate(tiny_model, [[1] * 10], 4, max_len=12)
    with pytest.raises(ValueError, match="speculative"):
        generate(tiny_model, [[1]], 4, speculative=4)


def test_cli_generate(tmp_path, capsys):
    from ling_jax.checkpoint.writer import write_checkpoint
    cfg = R.tiny_config(vocab_size=300, eos_token_id=295, pad_token_id=296)
    d = str(tmp_path / "ck")
    write_checkpoint(cfg, d, dtype="fp8", seed=2, progress=False)
    assert cli_main(["generate", "--checkpoint", d, "--prompt", "Hello there", "--max-new-tokens", "6",
                     "--json", "--stop-ids", "299"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 6 and isinstance(out["text"], str)
    assert cli_main(["generate", "--checkpoint", d, "--input-ids", "1,2,3", "--max-new-tokens", "6",
                     "--json", "--speculative", "2", "--stop-ids", "299"]) == 0
    out2 = json.loads(capsys.readouterr().out)
    assert "acceptance_length" in out2 and len(out2["token_ids"]) == 6
    # errors: no tokenizer with --prompt, bad ids
    d2 = str(tmp_path / "ck2")
    write_checkpoint(cfg, d2, dtype="bf16", seed=2, tokenizer=False, progress=False)
    assert cli_main(["generate", "--checkpoint", d2, "--prompt", "hi", "--max-new-tokens", "2"]) != 0
    assert "no tokenizer" in capsys.readouterr().err
    assert cli_main(["generate", "--checkpoint", d2, "--input-ids", "1,999", "--max-new-tokens", "2"]) != 0
    assert "outside the vocabulary" in capsys.readouterr().err


@pytest.mark.slow
def test_scanned_layers_equal_unrolled_layers():
    """The two layer loops (scan over stacked layers, used for deep or narrow schedules; unrolled,
    the default for shallow wide ones, see `ExecConfig.for_backend`) give the same logits, and cached
    decoding with unrolled layers, plain and speculative (whose verify step returns the per-position
    KDA states), gives the full forward's greedy tokens."""
    n = 6  # [KDA KDA KDA MLA][MLA MLA]: a dense and an MoE run, and a trailing all-MLA group
    cfg = R.tiny_config(num_hidden_layers=n, expert_swiglu_limit_list=[0.0] * (n - 1) + [0.6],
                        share_expert_swiglu_limit_list=[0.0] * (n - 1) + [0.8])
    model = load_from_dict(cfg, _predictable_params(cfg, 0.5, 3))
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 19)).astype(np.int32)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42, 3]]
    out = {}
    for mode in ("scan", "unroll"):  # unrolled last: generation below uses it
        model.set_layer_loop(mode)  # the layers are stored for the loop: stacked per run, or per layer
        assert (model.model.layers.runs is None) == (mode == "unroll") and model.exec.layer_loop == mode
        out[mode] = np.asarray(forward(model, ids, n_valid=np.array([19, 11]))["logits"])
    # cached decoding (plain and speculative) with unrolled layers = the full forward's argmax; the
    # scanned ones are what the other tests run (tiny models scan)
    assert model.exec.layer_loop == "unroll"
    plain = generate(model, prompts, 8, stop_ids=())
    spec = generate(model, prompts, 8, stop_ids=(), speculative=2)
    np.testing.assert_allclose(out["scan"], out["unroll"], rtol=1e-5, atol=1e-5)
    assert plain.tokens == spec.tokens
    _check_greedy_against_full_forward(model, prompts, plain)


def test_new_lengths_within_buckets_do_not_recompile(tiny_model):
    """Prompt widths, cache lengths and max_new_tokens are bucketed (`length_bucket`): after one call,
    another prompt length and max_new_tokens in the same buckets compile nothing, and stay exact."""
    assert [length_bucket(n) for n in (1, 16, 17, 24, 25, 33, 49, 100)] == [16, 16, 24, 24, 32, 48, 64, 128]
    assert cache_length(5, 6) == 16 and cache_length(7, 8) == 16 and cache_length(20, 1) == 24
    generate(tiny_model, [[1, 2, 3, 4, 5], [9]], 6, stop_ids=())
    events = []
    listener = lambda name, *a, **k: events.append(name) if is_compile_event(name) else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = [[4, 8, 15, 16, 23, 42, 7], [3, 3]]
        res = generate(tiny_model, prompts, 8, stop_ids=())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == []
    assert [len(t) for t in res.tokens] == [8, 8]
    _check_greedy_against_full_forward(tiny_model, prompts, res)
