"""Multi-host serving: 2 processes x 4 CPU devices run `ling-jax batch` on a written checkpoint
(KDA + MLA + MoE), process 0 scheduling and broadcasting each step's program and inputs, process 1
following; every request's tokens (mixed prompt lengths, greedy and a seeded sampled one, more
requests than slots) equal one process on one device (8 devices in one process give the same:
tests/test_engine_sharded.py). Plus the
message format (pack/unpack bit-exact) and the single-process behaviour of follow/shutdown."""
import json
import os

import jax
import numpy as np
import pytest

from ling_jax.loader import load_model
from ling_jax.serve import Engine, RequestParams
from ling_jax.serve.multihost import HEADER, OP_DECODE, OP_PREFILL, pack, packed_size, unpack
from test_multihost import not_gloo, run_two_processes
from test_sharding import write_small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = dict(max_slots=4, page_size=8, prefill_chunk=8, max_seq_len=64)
PREFIX_GIB = 0.0005  # ~25 snapshot rows of this model: the default (half the tiny page pool) holds one


def _requests(vocab=295):
    rng = np.random.default_rng(3)
    out = []
    for i, n in enumerate([1, 5, 9, 17, 30, 12]):  # one token .. several pages, one prompt in 4 chunks
        r = {"input_ids": rng.integers(0, vocab, n).tolist(), "max_tokens": int(rng.integers(3, 12))}
        if i == 4:
            r.update(temperature=0.8, top_k=20, seed=7)
        out.append(r)
    # two requests continuing earlier prompts: prefix-cache hits (page 8, chunk 8: snapshots every 8
    # tokens), so the snapshot copy programs run on every process too
    out.append({"input_ids": out[3]["input_ids"] + [5, 6, 7], "max_tokens": 4})
    out.append({"input_ids": out[4]["input_ids"][:24] + [9], "max_tokens": 5})
    return out


def _engine_tokens(model, requests):
    eng = Engine(model, num_pages=32, prefix_cache_memory_gib=PREFIX_GIB, **ENGINE)
    hs = [eng.submit(r["input_ids"], RequestParams(**{k: v for k, v in r.items() if k != "input_ids"}))
          for r in requests]
    eng.run_until_done()
    eng.shutdown()  # single process: nothing to release
    assert eng.stats()["prefix_hits"] >= 1  # the same schedule runs on the two processes' leader
    return [h.generated for h in hs]


def _batch_on_two_processes(args, timeout, meanwhile=None):
    """`ling-jax batch ARGS` on 2 processes x 4 CPU devices (test_multihost.run_two_processes);
    returns ([(returncode, stdout, stderr)] per process, meanwhile()'s result)."""
    procs, outs, extra = run_two_processes(args, timeout, meanwhile, command=["-m", "ling_jax.cli", "batch"])
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)], extra


@pytest.mark.slow
def test_two_processes_serve_the_same_tokens_as_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_small(ckpt, seed=21)
    requests = _requests()
    (tmp_path / "reqs.jsonl").write_text("\n".join(json.dumps(r) for r in requests) + "\n")

    def reference():  # computed while the two processes run, on one device (8 devices in one process
        # serve the one-device tokens: tests/test_engine_sharded.py)
        return _engine_tokens(load_model(str(ckpt), "float32", with_mtp=False, progress=False), requests)

    results, one_device = _batch_on_two_processes(
        ["--checkpoint", str(ckpt), "--requests", str(tmp_path / "reqs.jsonl"), "--out", str(tmp_path / "out.jsonl"),
         "--dtype", "float32", "--mesh", "expert=4,model=2", "--max-slots", "4", "--page-size", "8",
         "--prefill-chunk", "8", "--max-seq-len", "64", "--prefix-cache-memory", str(PREFIX_GIB)],
        timeout=400, meanwhile=reference)
    for rc, _, e in results:
        assert rc == 0, e[-4000:]
    outs = [(o, e) for _, o, e in results]
    lead_err = outs[0][1]
    assert "processes=2 devices=8" in lead_err and "compiles while serving: 0" in lead_err, lead_err[-2000:]
    assert "the smallest of 2 processes" in lead_err  # the default pool size, agreed by both
    assert "cache pools" in lead_err  # the start-up report, from process 0 only
    # process 1 prints nothing of ours (the Gloo transport's connection messages, which may arrive
    # split across lines, even a lone number on a line of its own, are not ours)
    ours = not_gloo(outs[1][0])
    assert "cache pools" not in outs[1][1] and not ours, outs[1][0][-2000:]
    got = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [g["index"] for g in got] == list(range(len(requests)))
    multi = [g["token_ids"] for g in got]
    assert all(1 <= len(t) <= r["max_tokens"] for t, r in zip(multi, requests))
    assert multi == one_device


def test_a_refused_request_file_stops_both_processes(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_small(ckpt, seed=21)
    (tmp_path / "reqs.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1], "temp": 0.5}\n')
    results, _ = _batch_on_two_processes(["--checkpoint", str(ckpt), "--requests", str(tmp_path / "reqs.jsonl")],
                                         timeout=120)
    (rc0, o0, e0), (rc1, o1, e1) = results
    # the verdict travels through the coordination service: the device backend (and with it the Gloo
    # collectives, whose teardown with a peer already gone could hang process 0 at exit) never starts
    assert "Gloo" not in o0 + o1, (o0 + o1)[-2000:]
    assert rc0 == 2 and e0.strip().splitlines()[-1] == ("error: --requests line 2: unknown field 'temp' (fields: "
                                                        "input_ids, prompt, max_tokens, temperature, top_k, top_p, "
                                                        "seed, stop_ids)"), e0[-2000:]
    assert rc1 == 2 and e1.strip().splitlines()[-1] == ("error: --requests: process 0 refused the request file "
                                                        "(its error says why)"), e1[-2000:]


# ---- the message and the single-process API ------------------------------------------------------
@pytest.fixture(scope="module")
def small_engine(tiny_model):
    return Engine(tiny_model, num_pages=32, **ENGINE)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_message_round_trip_is_bit_exact(small_engine):
    eng = small_engine
    rng = np.random.default_rng(0)
    S = eng.sizes.max_slots
    for op, R, T, W in ((OP_DECODE, 1, 1, eng.runner.widths[0]), (OP_DECODE, S, 1, eng.runner.widths[-1]),
                        (OP_PREFILL, eng.runner.prefill_rows, eng.runner.buckets[-1], eng.sizes.max_blocks)):
        tmpl = eng.runner.padding_inputs(op, R, T, W)
        assert np.asarray(tmpl.ids).shape == (R, T) and np.asarray(tmpl.block_table).shape == (R, W)
        leaves = []
        for x in _leaves(tmpl):
            if x.dtype == np.float32:
                leaves.append(rng.standard_normal(x.shape).astype(np.float32))
            elif x.dtype == np.uint32:
                leaves.append(rng.integers(0, 2 ** 32, x.shape, dtype=np.uint64).astype(np.uint32))
            else:
                leaves.append(rng.integers(-2 ** 31, 2 ** 31, x.shape).astype(x.dtype))
        real = jax.tree.unflatten(jax.tree.structure(tmpl), leaves)
        size = HEADER + packed_size(real) + 5
        buf = pack((op, R, T, W, 7), real, size)
        assert buf.shape == (size,) and buf.dtype == np.int32 and list(buf[:HEADER]) == [op, R, T, W, 7]
        back = unpack(buf, tmpl)
        for a, b in zip(_leaves(back), leaves):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        with pytest.raises(ValueError, match="exceed the message size"):
            pack((op, R, T, W, 0), real, size - 6)
    small = (np.array([True, False, True]), np.array([-3, 0, 100], np.int8))  # carried through int32
    back = unpack(pack((0, 0, 0, 0, 0), small, HEADER + 6), small)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(back, small))
    with pytest.raises(TypeError, match="cannot broadcast a float64"):
        pack((0, 0, 0, 0, 0), (np.zeros(2),), HEADER + 2)


def test_single_process_follow_refused_shutdown_harmless(small_engine):
    assert not small_engine.is_follower
    with pytest.raises(RuntimeError, match="processes > 0"):
        small_engine.follow()
    small_engine.shutdown()
    small_engine.shutdown()
