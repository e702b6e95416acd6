"""A bounded soak (issue 24 item 6): about a minute of mixed valid, invalid, malformed and cancelled
traffic from 6 clients against one in-process server (tools/soak_server.py; longer runs: run the tool).

Afterwards: no 5xx, no broken stream, no transport error; no leak (the engine's slots, pages and
queue and the server's requests in flight back to 0); the greedy reference exact; and this
process's RSS grown by less than RSS_BOUND_MIB over the run (after a warm-up run, so compiled
programs and pools are already there).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import soak_server as S  # noqa: E402

SOAK_S = float(os.environ.get("LING_JAX_SOAK_S", "60"))
RSS_BOUND_MIB = 64


@pytest.mark.slow
def test_soak_mixed_traffic_no_leak_reference_exact(tmp_path):
    srv = S.tiny_server(str(tmp_path), max_queue=8)
    try:
        driver = srv.app.state.driver
        ref = S.greedy(srv.url)
        S.Soak(srv.url, 10, workers=6, seed=1).run()  # warm-up: every path once, allocator settled
        S.wait_idle(driver)
        rss0 = S.rss_bytes()
        res = S.Soak(srv.url, SOAK_S, workers=6, seed=0).run()
        idle = S.wait_idle(driver)
        growth = (S.rss_bytes() - rss0) / 2 ** 20
        print(f"soak: {res['requests']} requests in {SOAK_S:.0f} s {res['counts']}; RSS growth {growth:.1f} MiB")
        assert not res["failures"], res["failures"]
        assert res["requests"] > 2 * SOAK_S, res  # every worker kept going until the end
        c = res["counts"]
        assert c.get("cancelled", 0) > 0 and c.get("stream 200", 0) > 0 and c.get("valid 200", 0) > 0
        assert sum(v for k, v in c.items() if k.startswith("invalid 4")) > 0
        assert idle["slots_in_use"] == idle["pages_in_use"] == idle["queue_depth"] == idle["in_flight"] == 0
        assert S.greedy(srv.url) == ref
        assert driver.alive
        assert growth < RSS_BOUND_MIB, f"RSS grew {growth:.1f} MiB over the soak (bound {RSS_BOUND_MIB} MiB)"
    finally:
        srv.stop()
