"""tools/bench_mla_cpu.py --cold: the paged decode call out of cache, checked against the XLA form, beside
its two floors (in cache; a streaming read of its bytes), "of floor" = cold over the larger."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("order", ["inorder", "shuffled"])
def test_cold_decode_rows(order, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_mla_cpu", os.path.join(ROOT, "tools", "bench_mla_cpu.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cold.json"
    assert bench.main(["--cold", "--order", order, "--keys", "1024,2048", "--reps", "2", "--heads", "2",
                       "--out", str(out)]) == 0
    assert f"| decode | {order} | 2,048 |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["keys"] for r in rows] == [1024, 2048] and all(r["order"] == order for r in rows)
    for r in rows:
        assert r["cold_ms"] > 0 and r["warm_ms"] > 0 and r["stream_ms"] > 0
        assert r["of_floor"] == pytest.approx(r["cold_ms"] / max(r["warm_ms"], r["stream_ms"]))
