#!/usr/bin/env bash
# The serving benchmark of BENCHMARKS.md "Serving", in the order it was meant to run: on a QUIET
# machine (nothing else running: every row is compared with the HF peer run right before or after).
#   bash tools/bench_serving_all.sh            # ~45-60 min on 2 cores
#   HF_PY=/path/to/hfvenv/bin/python PAIRS=3 bash tools/bench_serving_all.sh
# The peer's venv: python3 -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch==2.13.0 &&
#   /work/hfvenv/bin/pip install transformers==5.23.0 numpy   (../shared/bench/bench_hf.py's docstring)
set -euo pipefail
cd "$(dirname "$0")/.."
HF_PY=${HF_PY:-/work/hfvenv/bin/python}
PAIRS=${PAIRS:-3}
R=tools/results
export PYTHONPATH=$PWD
WL=$R/serve_workload_full.json
# JAX persistent compilation cache: the repeated engine builds (pairs, levels) compile once
CC="--compilation-cache ${JAX_CC:-$HOME/.cache/ling-jax/jax-compile-cache}"
[ -f "$WL" ] || python tools/serve_workload.py --preset full --seed 0 "$WL"

# 1. back-to-back pairs: the peer's batch-8 decode (64 steps after 128 tokens), then the engine's
#    batched decode step on the same shape (8 requests of 128 tokens, 64 steps)
for i in $(seq 1 "$PAIRS"); do
  "$HF_PY" ../shared/bench/bench_hf.py --no-forward --no-generate --prefill-shapes "" --decode-batches 8 \
      --json "$R/bench_hf_decode8_pair$i.json" | tail -n 25
  python tools/bench_serve.py $CC --rows decode --json "$R/bench_serve_decode_pair$i.json"
done

# 2. the load rows (concurrency 1, 8, 32) and the shared-prefix rows, then the same workload
#    through the peer's generate in static batches of 8
python tools/bench_serve.py $CC --rows load,prefix --concurrency 1,8,32 --workload "$WL" --json "$R/bench_serve_mid_cpu.json"
"$HF_PY" tools/bench_serve_hf.py --workload "$WL" --json "$R/bench_serve_hf_mid_cpu_full.json"

# 3. (needs `ling-jax serve`, issue 13) the HTTP overhead row: a checkpoint with a tokenizer and no MTP
#    layer (as the in-process rows load it), served with 32 slots, driven with the openai client
if [ "${HTTP:-0}" = 1 ]; then
  CK=${HTTP_CKPT:-$HOME/.cache/ling-jax/bench-config.mid-tok}
  [ -f "$CK/config.json" ] || python -m ling_jax.cli make-checkpoint --config ../shared/bench/config.mid.json --out "$CK" --no-mtp --quiet
  python -m ling_jax.cli serve --checkpoint "$CK" --dtype float32 --max-slots 32 --prefill-chunk 128 --max-seq-len 384 \
      --port 8123 --no-prefix-cache &
  SERVER=$!
  trap 'kill $SERVER' EXIT
  for _ in $(seq 1 600); do curl -sf http://127.0.0.1:8123/v1/models >/dev/null && break; sleep 1; done
  python tools/bench_serve.py --http http://127.0.0.1:8123 --concurrency 1,8,32 --workload "$WL" \
      --json "$R/bench_serve_mid_cpu_http.json"
fi
