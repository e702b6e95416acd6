"""tools/bench_kernels.py --smoke (tiny shapes, interpret mode) keeps running and agreeing with the twins."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(ROOT, "tools", "bench_kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| kernel | shape |" in table and "FAIL" not in table
    res = json.loads(out.read_text())
    assert res["meta"]["smoke"] and res["meta"]["hbm_tbps"] == 4.8
    names = {r["name"] for r in res["results"]}
    assert names == {"kda_chunk", "kda_step", "mla_decode", "fp8_linear"}
    assert all(r["ok"] and r["pallas_ms"] > 0 and r["floor_ms"] > 0 for r in res["results"])
