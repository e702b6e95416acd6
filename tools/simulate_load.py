#!/usr/bin/env python3
"""Replay a serving workload through the engine's own scheduler with a fitted step-cost model:
what concurrency 8 vs 32 (issue 21's batch scaling) can reach under a prefill policy, without the
model.

Why: a load run of `tools/bench_serve.py` takes ~7 minutes and mixes the policy (how prompts are
chunked and batched) with the kernels' speed. The engine's host scheduler (`serve/scheduler.py`)
imports no jax, so the exact sequence of steps a policy produces can be replayed in a second; each
step is then charged what such a step measured on this machine:

  decode over R rows:        a_d + r_d * R + e * E(R)       E(R) = experts a step of R tokens
                                                            touches on average, 64 (1 - (7/8)^R)
  prefill [R, T], v tokens:  a_p + t_p * R * T + v_p * v    (dense work on every row, idle ones
                                                            too; routed experts on fed tokens)

Defaults fitted to the twenty-third session's steps of the mid config (AMD EPYC, 2 cores; after the
experts kernel's GEMM path and prefetches): decode over 8 / 16 / 32 rows 109 / 144 / 208 ms
(`tools/profile_serve_step.py`), prefill [1, 128] 549 ms, [2, 64] 521, [2, 128] 916, [4, 128] 1,695,
[8, 64] 1,764 (an idle row's share as measured by `tools/measure_idle_prefill_row.py`). With them it
reproduces the default policy's load run (128 x 2) within 1.5% (c = 8 62.5 s vs 62.8 measured, c = 32
44.0 vs 44.7) and is optimistic for many-row prefill (512x8rb/64: c = 32 37.9 s vs 42.5 measured).
The nineteenth/twentieth sessions' fit (before those kernel changes): --decode-ms 25 --decode-row-ms 3.74
--expert-ms 2.2 --prefill-ms 270 --prefill-slot-ms 1.7 --prefill-token-ms 1.84.

A policy is CHUNKxROWS, 'rb' = prefill programs per row bucket, '/N' = at most N tokens a row a step
(Engine prefill_row_tokens):

  python tools/simulate_load.py [--workload tools/results/serve_workload_full.json]
                                [--policy 128x2,128x2rb,512x8rb/64] [--prefill-token-ms 1.5]
                                [--order oldest,most-left]

`--order most-left` replays a different prefill order than the scheduler's (oldest prompt first):
the prompts with the most tokens left first, so a burst's backlog drains in fewer steps and the
decodes start together. Each row also reports TTFT p50 / p99 (from when the client sends a request
to the end of the step that emits its first token), since an order trades one against the other
(BENCHMARKS.md, "Thirty-fifth session": not the engine's policy).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ling_jax.serve.allocator import PageAllocator, PoolSizes  # noqa: E402
from ling_jax.serve.request import RequestParams  # noqa: E402
from ling_jax.serve.runner import row_buckets, token_buckets  # noqa: E402
from ling_jax.serve.scheduler import DECODE, PREFILL, Request, Scheduler  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def experts_touched(tokens: int, experts: int = 64, k: int = 8) -> float:
    return experts * (1 - (1 - k / experts) ** tokens)


class MostLeftFirst(Scheduler):
    """The scheduler with prompts being fed ordered by tokens left (most first, then age); decoding
    requests keep their order. A replay-only variant: the pool here never runs out, so the order of
    `running()` decides nothing else (in the engine it also picks the preemption victim)."""

    def running(self) -> list[Request]:
        return sorted(super().running(), key=lambda r: (r.state == PREFILL) * (r.n_fed - len(r.feed)))


ORDERS = {"oldest": Scheduler, "most-left": MostLeftFirst}


def simulate(requests: list, concurrency: int, chunk: int, rows: int, per_row_buckets: bool, cost: dict,
             row_tokens: int | None = None, order: str = "oldest") -> tuple:
    """(wall seconds, steps, TTFT p50 s, TTFT p99 s) of `requests` ([{"prompt", "max_tokens"}]) with at
    most `concurrency` in flight, a request sent as one finishes (as bench_serve's load rows: TTFT
    from when it is sent); `order` names the scheduler (ORDERS)."""
    sizes = PoolSizes(max_slots=concurrency, page_size=16, num_pages=1 << 16, max_seq_len=1 << 12,
                      with_mtp=False, page_bytes=1, slot_bytes=1)
    sched = ORDERS[order](PageAllocator(sizes), concurrency, chunk, rows, prefill_row_tokens=row_tokens)
    decode_rows, prefill_rows = row_buckets(concurrency), row_buckets(rows)
    tbuckets = token_buckets(min(chunk, row_tokens or chunk))
    pending, live, done, wall, steps = list(enumerate(requests)), 0, 0, 0.0, 0
    sent, first = {}, {}  # request id -> when the client sent it (it keeps `concurrency` in flight), its first token
    while done < len(requests):
        while pending and live < concurrency:
            i, r = pending.pop(0)
            sent[i] = wall
            sched.queue.append(Request(i, r["prompt"], RequestParams(max_tokens=r["max_tokens"]), frozenset()))
            live += 1
        plan, ms = sched.schedule(), 0.0

        def emit(req):
            nonlocal done, live
            req.generated.append(0)
            first.setdefault(req.id, wall + ms / 1e3)
            if len(req.generated) >= req.params.max_tokens:
                sched.finish(req, "length")
                done, live = done + 1, live - 1
        if plan.decode:
            R = next(n for n in decode_rows if n >= len(plan.decode))
            ms += cost["decode_ms"] + cost["decode_row_ms"] * R + cost["expert_ms"] * experts_touched(R)
            for req in plan.decode:
                req.n_fed += 1
                emit(req)
        if plan.prefill:
            R = next(n for n in prefill_rows if n >= len(plan.prefill)) if per_row_buckets else rows
            T = next(t for t in tbuckets if t >= max(n for _, n in plan.prefill))
            ms += cost["prefill_ms"] + cost["prefill_slot_ms"] * R * T + cost["prefill_token_ms"] * sum(
                n for _, n in plan.prefill)
            for req, n in plan.prefill:
                req.n_fed += n
                if req.n_fed == len(req.feed):
                    req.state = DECODE
                    emit(req)
        wall += ms / 1e3
        steps += 1
    ttft = sorted(first[i] - sent[i] for i in first)
    return wall, steps, statistics.median(ttft), ttft[round(0.99 * (len(ttft) - 1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=os.path.join(RESULTS, "serve_workload_full.json"))
    ap.add_argument("--policy", default="128x2,128x2rb,256x2rb,512x4rb,512x8rb,512x8rb/64",
                    help="comma list of CHUNKxROWS[rb][/N]: 'rb' = prefill programs per row bucket, "
                         "/N = at most N tokens a row a step")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--order", default="oldest", help=f"comma list of prefill orders: {', '.join(ORDERS)}")
    for name, v in (("decode-ms", 65.7), ("decode-row-ms", 3.84), ("expert-ms", 0.306), ("prefill-ms", 130.0),
                    ("prefill-slot-ms", 1.55), ("prefill-token-ms", 1.5)):
        ap.add_argument(f"--{name}", type=float, default=v)
    a = ap.parse_args()
    with open(a.workload) as f:
        reqs = json.load(f)["requests"]
    cost = {k.replace("-", "_"): getattr(a, k.replace("-", "_")) for k in
            ("decode-ms", "decode-row-ms", "expert-ms", "prefill-ms", "prefill-slot-ms", "prefill-token-ms")}
    out_tokens = sum(r["max_tokens"] for r in reqs)
    conc = [int(c) for c in a.concurrency.split(",")]
    print(f"# {len(reqs)} requests, {out_tokens} output tokens; cost model {cost}")
    orders = a.order.split(",")
    unknown = [o for o in orders if o not in ORDERS]
    if unknown:
        ap.error(f"--order: unknown {unknown}; expected a comma list of {', '.join(ORDERS)}")
    print("| policy | order | " + " | ".join(f"c={c} s (tok/s, steps; TTFT p50 / p99 s)" for c in conc)
          + f" | c={conc[-1]} / c={conc[0]} |")
    print("|---|---|" + "---:|" * (len(conc) + 1))
    for pol in a.policy.split(","):
        shape, _, cap = pol.partition("/")
        rb = shape.endswith("rb")
        chunk, rows = (int(x) for x in shape.removesuffix("rb").split("x"))
        for order in orders:
            res = [simulate(reqs, c, chunk, rows, rb, cost, int(cap) if cap else None, order) for c in conc]
            cells = " | ".join(f"{w:.1f} ({out_tokens / w:.1f}, {s}; {p50:.1f} / {p99:.1f})" for w, s, p50, p99 in res)
            print(f"| {pol} | {order} | {cells} | {res[0][0] / res[-1][0]:.2f}x |")


if __name__ == "__main__":
    main()
