"""tools/serve_workload.py: the serving benchmark's shared workload (ours and the HF peer's side
read the same file) is seeded, within its stated ranges, round-trips through JSON, and its
percentiles are numpy's (linear interpolation)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import serve_workload as W  # noqa: E402


def test_workload_seeded_in_range_and_round_trips(tmp_path):
    a, b, c = W.make_workload("quick", 3), W.make_workload("quick", 3), W.make_workload("quick", 4)
    assert a == b and a != c
    n, (p0, p1), (o0, o1) = W.PRESETS["quick"]
    assert len(a["requests"]) == n
    for r in a["requests"]:
        assert p0 <= len(r["prompt"]) <= p1 and o0 <= r["max_tokens"] <= o1
        assert all(0 <= t < W.ID_LIMIT for t in r["prompt"])
    m, plen, (s0, s1), out = W.PREFIX_PRESETS["quick"]
    px = a["prefix"]["requests"]
    assert len(px) == m and all(r["prompt"][:plen] == px[0]["prompt"][:plen] for r in px)
    assert all(s0 <= len(r["prompt"]) - plen <= s1 and r["max_tokens"] == out for r in px)
    W.save(a, tmp_path / "w.json")
    assert W.load(tmp_path / "w.json") == a


def test_bad_workload_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        W.make_workload("huge")
    (tmp_path / "bad.json").write_text('{"requests": [{"prompt": [], "max_tokens": 3}]}')
    with pytest.raises(ValueError, match=r"requests\[0\].*prompt"):
        W.load(tmp_path / "bad.json")


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        v = rng.random(n).tolist()
        for q in (0, 50, 99, 100):
            assert W.percentile(v, q) == pytest.approx(float(np.percentile(v, q)), rel=1e-12)
    assert np.isnan(W.percentile([], 50))


@pytest.mark.slow  # compiles two engine programs (~4 min on a loaded 2-core machine)
def test_bench_serve_closed_loop_on_tiny_model(tiny_model):
    """tools/bench_serve.py's closed loop: every request gets exactly its max_tokens, at most c are
    in flight, TTFT / TPOT come out ordered and positive (the tool itself, on the tiny model)."""
    import bench_serve as B
    a = B.parse_args(["--page-size", "8", "--prefill-chunk", "8", "--prefill-rows", "2",
                      "--prefix-cache-memory", "0.01"])  # the tool's own flags and defaults
    rng = np.random.default_rng(1)
    reqs = [{"prompt": rng.integers(0, tiny_model.cfg.vocab_size, int(n)).tolist(), "max_tokens": int(m)}
            for n, m in zip(rng.integers(1, 30, 7), rng.integers(1, 6, 7))]
    eng, _ = B.make_engine(tiny_model, 2, 40, a)
    run = B.run_closed_loop(eng, reqs, 2, "test")
    assert max(n for _, n, _ in run["steps"]) <= 2
    s = B.summarize(run, reqs)
    assert s["output_tokens"] == sum(r["max_tokens"] for r in reqs)
    assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and 0 < s["tpot_p50_s"] <= s["tpot_p99_s"]
    assert eng.stats()["slots_in_use"] == 0 and eng.stats()["pages_in_use"] == 0
