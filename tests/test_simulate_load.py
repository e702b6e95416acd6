"""The load replay (`tools/simulate_load.py`): the scheduler's steps charged by the cost model, the
TTFTs it reports, and the prefill order it can replay instead (most tokens left first), on a workload
small enough to follow by hand."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("simulate_load", os.path.join(ROOT, "tools", "simulate_load.py"))
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

# a step costs a fixed 100 ms per program it runs (decode, prefill); nothing scales with rows or tokens
COST = dict(decode_ms=100.0, decode_row_ms=0.0, expert_ms=0.0, prefill_ms=100.0, prefill_slot_ms=0.0,
            prefill_token_ms=0.0)
# the older request has 8 prompt tokens, the younger 64; one prompt row a step, of at most 64 tokens
REQS = [{"prompt": list(range(8)), "max_tokens": 2}, {"prompt": list(range(64)), "max_tokens": 2}]


@pytest.mark.parametrize("order, first_fed", [("oldest", (0, 8)), ("most-left", (1, 64))])
def test_replay_orders_prefill_and_times_first_tokens(order, first_fed):
    sched = sim.ORDERS[order](sim.PageAllocator(sim.PoolSizes(
        max_slots=2, page_size=16, num_pages=64, max_seq_len=128, with_mtp=False, page_bytes=1, slot_bytes=1)),
        2, 64, 1, prefill_row_tokens=64)
    for i, r in enumerate(REQS):
        sched.queue.append(sim.Request(i, r["prompt"], sim.RequestParams(max_tokens=2), frozenset()))
    plan = sched.schedule()
    assert [(q.id, n) for q, n in plan.prefill] == [first_fed] and plan.decode == []
    # step 1 prefills one prompt (its first token at 0.1 s), step 2 decodes it beside the other's prefill
    # (0.2 s: the second first token at 0.3), step 3 decodes the second's last token: 0.4 s in 3 steps
    wall, steps, p50, p99 = sim.simulate(REQS, 2, 64, 1, False, COST, 64, order)
    assert steps == 3 and wall == pytest.approx(0.4)
    assert p50 == pytest.approx(0.2) and p99 == pytest.approx(0.3)  # TTFTs 0.1 and 0.3 s
