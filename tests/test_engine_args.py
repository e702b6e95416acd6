"""The engine's command-line flags: refusals by flag name, the default cache memory (accelerator
fraction of free memory, CPU cap), the page arithmetic (= the engine's own plan_pools), the
start-up report, the prefix/speculative keywords of the flags, and `ling-jax batch`'s
request-file checks."""
import argparse
import io
import types

import pytest

from ling_jax.cli import main
from ling_jax.commands.batch import parse_requests
from ling_jax.commands.common import ArgumentValueError
from ling_jax.commands.engine_args import (CPU_CACHE_CAP_GIB, add_engine_flags, check_engine_args,
                                           default_cache_budget, engine_from_args, engine_options,
                                           plan_engine_memory)
from ling_jax.serve.pools import GIB, plan_pools
from test_sharding import write_small


def flags(*argv):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p.parse_args(list(argv))


def test_defaults():
    a = flags()
    assert (a.max_slots, a.page_size, a.speculative, a.warmup) == (8, 16, 0, "full")
    assert a.prefill_chunk is a.prefill_rows is a.prefill_row_tokens is a.prefill_row_buckets is None  # the platform's
    assert a.cache_memory is a.max_seq_len is a.prefix_cache_memory is None and not a.no_prefix_cache
    assert flags("--no-warmup").warmup == flags("--warmup", "off").warmup == "off"
    assert flags("--warmup").warmup == "full" and flags("--warmup", "lazy").warmup == "lazy"


@pytest.mark.parametrize("argv, message", [
    (["--max-slots", "0"], "argument --max-slots: expected a positive integer, got '0'"),
    (["--page-size", "x"], "argument --page-size: expected a positive integer"),
    (["--prefill-chunk", "-4"], "argument --prefill-chunk: expected a positive integer"),
    (["--prefill-row-buckets", "2,1"], "argument --prefill-row-buckets: expected ascending positive integers"),
    (["--prefill-row-buckets", "0,2"], "argument --prefill-row-buckets: expected ascending positive integers"),
    (["--cache-memory", "0"], "argument --cache-memory: expected a size in GiB > 0, got '0'"),
    (["--cache-memory", "inf"], "argument --cache-memory: expected a finite number"),
    (["--prefix-cache-memory", "-1"], "argument --prefix-cache-memory: expected a size in GiB > 0"),
    (["--max-seq-len", "1.5"], "argument --max-seq-len: expected a positive integer"),
    (["--speculative", "two"], "argument --speculative: invalid int value"),
    (["--speculative", "5"], "error: --speculative: expected 0..3 MTP draft tokens, got 5"),
    (["--no-prefix-cache", "--prefix-cache-memory", "1"], "error: --prefix-cache-memory and --no-prefix-cache"),
    (["--snapshot-interval", "0"], "argument --snapshot-interval: expected a positive integer, got '0'"),
    (["--snapshot-interval", "24"], "error: --snapshot-interval: 24 is not a multiple of --page-size 16"),
    (["--no-prefix-cache", "--snapshot-interval", "32"], "error: --snapshot-interval and --no-prefix-cache"),
])
def test_bad_values_refused_by_name(argv, message, capsys, tmp_path):
    rc = main(["batch", "--checkpoint", str(tmp_path), "--requests", "-", *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and message in err, err


def test_combinations_refused_by_name(tiny_model, tiny_cfg):
    with pytest.raises(ArgumentValueError, match=r"--speculative: expected 0\.\.3"):
        check_engine_args(flags("--speculative", "4"), tiny_model)
    no_mtp = types.SimpleNamespace(cfg=tiny_cfg, mtp=None)
    with pytest.raises(ArgumentValueError, match="--speculative: the model has no MTP layer"):
        check_engine_args(flags("--speculative", "1"), no_mtp)
    with pytest.raises(ArgumentValueError, match="--prefix-cache-memory and --no-prefix-cache contradict"):
        check_engine_args(flags("--no-prefix-cache", "--prefix-cache-memory", "1"), tiny_model)
    with pytest.raises(ArgumentValueError, match="--max-seq-len: expected >= 2"):
        check_engine_args(flags("--max-seq-len", "1"), tiny_model)
    over = tiny_cfg.max_position_embeddings + 1
    with pytest.raises(ArgumentValueError, match=f"--max-seq-len: {over} exceeds the model's max_position_embeddings"):
        check_engine_args(flags("--max-seq-len", str(over)), tiny_model)


def test_default_budget_from_device_memory():
    b, how = default_cache_budget("tpu", free_bytes=10 * GIB, host_bytes=None, param_bytes=123)
    assert b == 5 * GIB and "50% of the 10.00 GiB free per tpu device" in how
    b, _ = default_cache_budget("gpu", free_bytes=-5, host_bytes=None, param_bytes=0)
    assert b == 0
    # CPU: a quarter of the host minus the parameters, at most the cap
    b, how = default_cache_budget("cpu", None, host_bytes=8 * GIB, param_bytes=GIB)
    assert b == GIB and "min(4 GiB, 25% of 8.00 GiB host memory - 1.00 GiB parameters)" in how
    assert default_cache_budget("cpu", None, host_bytes=512 * GIB, param_bytes=GIB)[0] == CPU_CACHE_CAP_GIB * GIB
    assert default_cache_budget("cpu", None, host_bytes=GIB, param_bytes=GIB)[0] == 0
    assert default_cache_budget("cpu", None, host_bytes=None, param_bytes=GIB)[0] == CPU_CACHE_CAP_GIB * GIB


def test_page_arithmetic(tiny_model, tiny_cfg):
    dtype, mtp = tiny_model.dtype, tiny_model.mtp is not None
    # an explicit --cache-memory: exactly the engine's own sizing from cache_memory_gib
    g = 0.001
    mem, line = plan_engine_memory(flags("--cache-memory", str(g), "--max-slots", "2", "--page-size", "8"), tiny_model)
    want = plan_pools(tiny_cfg, dtype, max_slots=2, page_size=8, cache_memory_gib=g, with_mtp=mtp)
    assert mem["num_pages"] == want.num_pages > 0 and mem["max_seq_len"] == want.max_seq_len
    assert f"{want.num_pages} pages x 8 tokens" in line and "--cache-memory 0.001 GiB" in line
    # a large default budget: no more pages than every slot at max_seq_len can use
    mem, line = plan_engine_memory(flags("--max-slots", "3", "--page-size", "8", "--max-seq-len", "50"), tiny_model,
                                   budget=(GIB, "test budget"))
    assert mem == {"num_pages": 3 * 7, "max_seq_len": 50} and "capped at 3 slots x 7 pages of 50 tokens" in line
    # a small default budget: max_seq_len shrinks to the pool
    unit = plan_pools(tiny_cfg, dtype, max_slots=2, page_size=8, num_pages=1, max_seq_len=2, with_mtp=mtp)
    small = 2 * unit.slot_bytes + 5 * unit.page_bytes
    mem, _ = plan_engine_memory(flags("--max-slots", "2", "--page-size", "8"), tiny_model, budget=(small, "small"))
    assert mem == {"num_pages": 5, "max_seq_len": min(40, tiny_cfg.max_position_embeddings)}
    with pytest.raises(ArgumentValueError, match="--max-seq-len: 41 tokens do not fit the page pool"):
        plan_engine_memory(flags("--max-slots", "2", "--page-size", "8", "--max-seq-len", "41"), tiny_model,
                           budget=(small, "small"))
    with pytest.raises(ArgumentValueError, match="--cache-memory: .* does not cover 2 slots"):
        plan_engine_memory(flags("--max-slots", "2"), tiny_model, budget=(2 * unit.slot_bytes, "tiny"))


def test_engine_options_from_the_flags():
    auto = {"kv_cache_dtype": "auto", "prefill_chunk": 512, "prefill_rows": 8, "prefill_row_tokens": 64,
            "prefill_row_buckets": (1, 2, 4, 8)}  # no --prefill-* flag on CPU: 8 rows x 64 tokens
    assert engine_options(flags()) == {"prefix_cache": True, "prefix_cache_memory_gib": None,
                                       "snapshot_interval": None, "speculative": 0, **auto}  # the Engine's defaults
    assert engine_options(flags("--no-prefix-cache", "--speculative", "2")) == \
        {"prefix_cache": False, "prefix_cache_memory_gib": None, "snapshot_interval": None, "speculative": 2, **auto}
    assert engine_options(flags("--prefix-cache-memory", "0.5", "--snapshot-interval", "32")) == \
        {"prefix_cache": True, "prefix_cache_memory_gib": 0.5, "snapshot_interval": 32, "speculative": 0, **auto}
    assert engine_options(flags("--kv-cache-dtype", "fp8"))["kv_cache_dtype"] == "fp8"
    steady = {"prefill_chunk": 64, "prefill_rows": 2, "prefill_row_tokens": None, "prefill_row_buckets": None}
    assert {k: engine_options(flags("--prefill-rows", "4"))[k] for k in steady} == {**steady, "prefill_rows": 4}
    assert {k: engine_options(flags("--prefill-row-tokens", "32"))[k] for k in steady} == \
        {**steady, "prefill_row_tokens": 32}
    assert {k: engine_options(flags("--prefill-row-buckets", "1,4"))[k] for k in steady} == \
        {**steady, "prefill_rows": 4, "prefill_row_buckets": (1, 4)}  # rows: the largest bucket
    assert {k: engine_options(flags(), platform="tpu")[k] for k in steady} == steady  # accelerators: 64 over 2
    assert {k: engine_options(flags("--max-slots", "2"))[k] for k in steady} == \
        {"prefill_chunk": 128, "prefill_rows": 2, "prefill_row_tokens": 64, "prefill_row_buckets": (1, 2)}
    with pytest.raises(ArgumentValueError, match="--prefill-row-buckets: 1,2 must end at --prefill-rows 4"):
        check_engine_args(flags("--prefill-rows", "4", "--prefill-row-buckets", "1,2"), types.SimpleNamespace(
            mtp=None, cfg=types.SimpleNamespace(max_position_embeddings=64)))


def test_default_cpu_policy_builds_its_engine(tiny_model):
    """No --prefill-* flag on CPU: the engine feeds min(8, slots) rows of at most 64 tokens, one program
    per row bucket (serve/prefill_policy.py), and a backlog of prompts gets one batched step."""
    from ling_jax.serve import RequestParams
    args = flags("--max-slots", "4", "--page-size", "8", "--max-seq-len", "40", "--no-warmup", "--no-prefix-cache")
    out = io.StringIO()
    eng = engine_from_args(args, tiny_model, report=out, budget=(GIB, "test budget"))
    assert (eng.prefill_chunk, eng.prefill_row_tokens, eng.runner.prefill_row_buckets) == (256, 64, (1, 2, 4))
    assert "prefill 256 tokens over 4 row(s) a step, at most 64 a prompt, row buckets 1,2,4 (cpu default)" in \
        out.getvalue()
    for n in (20, 21, 22):
        eng.submit(list(range(1, n + 1)), RequestParams(max_tokens=2))
    plan = eng.sched.schedule()
    assert sorted(n for _, n in plan.prefill) == [20, 21, 22]  # three prompts, one step


def test_engine_from_args_reports_on_stderr(tiny_model):
    out = io.StringIO()
    args = flags("--max-slots", "2", "--page-size", "8", "--prefill-chunk", "16", "--max-seq-len", "40",
                 "--no-warmup")
    eng = engine_from_args(args, tiny_model, report=out, budget=(GIB, "test budget"))
    text = out.getvalue()
    assert (eng.sizes.max_slots, eng.sizes.page_size, eng.sizes.num_pages, eng.sizes.max_seq_len) == (2, 8, 10, 40)
    assert eng.prefill_chunk == 16 and eng.compiled_shapes() == 0  # --no-warmup: nothing compiled
    assert text.startswith("engine memory: 10 pages x 8 tokens") and "from default: test budget" in text
    assert "\nprefill 16 tokens over 2 row(s) a step (the flags)\n" in text
    assert eng.describe() in text and "warm-up" not in text


def test_warmup_prints_one_progress_line_per_program(tiny_model, capsys):
    """Start-up progress: `warm-up i/N: <program> <s> s (k left)` per compiled program, the ones a
    first short request needs first; `batch --warmup lazy` is refused by name."""
    import re
    out = io.StringIO()
    args = flags("--max-slots", "2", "--page-size", "8", "--prefill-chunk", "16", "--max-seq-len", "40",
                 "--no-prefix-cache")
    eng = engine_from_args(args, tiny_model, report=out, budget=(GIB, "test budget"))
    lines = [l for l in out.getvalue().splitlines() if re.match(r"warm-up \d+/\d+: ", l)]
    items = eng.warmup_items()
    assert len(lines) == len(items) >= 3, out.getvalue()
    n = len(items)
    for i, (line, (label, _)) in enumerate(zip(lines, items)):
        assert re.fullmatch(rf"warm-up {i + 1}/{n}: {re.escape(label)} \d+\.\d s \({n - i - 1} left\)", line), line
    assert lines[0].startswith(f"warm-up 1/{n}: prefill") and lines[1].startswith(f"warm-up 2/{n}: decode 1 row(s)")
    assert "warm-up: " in out.getvalue() and eng.compiled_shapes() > 0
    assert main(["batch", "--checkpoint", "x", "--requests", "-", "--warmup", "lazy"]) == 2
    assert "--warmup lazy: only `ling-jax serve`" in capsys.readouterr().err


def test_output_may_not_overwrite_the_requests(tmp_path, capsys):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"input_ids": [1]}\n')
    ckpt = tmp_path / "ckpt"
    write_small(ckpt)
    rc = main(["batch", "--checkpoint", str(ckpt), "--requests", str(reqs), "--out", str(reqs)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith("error: --out:") and "is the input" in err, err
    assert reqs.read_text() == '{"input_ids": [1]}\n'


def test_request_file_checks(tiny_cfg):
    V = tiny_cfg.vocab_size
    ok = parse_requests(['{"input_ids": [1, 2], "max_tokens": 3, "temperature": 0.5, "seed": 9}', "",
                         '{"input_ids": [4], "stop_ids": [7]}'], tiny_cfg, None, 5)
    assert [ids for ids, _ in ok] == [[1, 2], [4]]
    assert (ok[0][1].max_tokens, ok[0][1].temperature, ok[0][1].seed) == (3, 0.5, 9)
    assert (ok[1][1].max_tokens, ok[1][1].stop_ids) == (5, (7,))
    for line, message in (
            ("[1, 2]", "line 1: expected a JSON object, got list"),
            ("{nope", "line 1: not JSON"),
            ('{"input_ids": [1], "temp": 1}', "line 1: unknown field 'temp'"),
            ('{"max_tokens": 3}', "line 1: give exactly one of input_ids or prompt"),
            ('{"input_ids": [1], "prompt": "a"}', "line 1: give exactly one of input_ids or prompt"),
            ('{"prompt": "a"}', "line 1: prompt needs the checkpoint's tokenizer.json"),
            ('{"input_ids": "1,2"}', "line 1: input_ids must be a list of integers"),
            (f'{{"input_ids": [{V}]}}', f"line 1: input_ids: token id {V} is outside the vocabulary"),
            ('{"input_ids": []}', "line 1: input_ids: empty prompt"),
            ('{"input_ids": [1], "max_tokens": 0}', "line 1: RequestParams.max_tokens must be an int >= 1"),
            ('{"input_ids": [1], "temperature": -1}', "line 1: .*temperature"),
            ('{"input_ids": [1], "stop_ids": 3}', "line 1: stop_ids must be a list of integers")):
        with pytest.raises(ArgumentValueError, match=f"--requests {message}"):
            parse_requests([line], tiny_cfg, None, 5)
    tok = types.SimpleNamespace(encode=lambda text, add_special_tokens: [len(text), 1] if add_special_tokens else [])
    assert parse_requests(['{"prompt": "abc"}'], tiny_cfg, tok, 5)[0][0] == [3, 1]
    with pytest.raises(ArgumentValueError, match="line 1: prompt must be a string"):
        parse_requests(['{"prompt": 3}'], tiny_cfg, tok, 5)
    with pytest.raises(ArgumentValueError, match="--requests: no requests"):
        parse_requests(["", " "], tiny_cfg, None, 5)


@pytest.mark.parametrize("command", ["batch", "serve", "generate", "logits"])
def test_every_command_builds_its_exec_config_one_way(tiny_model, command):
    """`--impl` reaches the command's ExecConfig through `common.exec_for_args` (batch included), and
    the engine runs with that config while the loaded model's own `exec` is left as loaded."""
    from ling_jax.cli import build_parser
    from ling_jax.commands.common import exec_for_args

    extra = {"batch": ["--requests", "-"], "serve": [], "generate": ["--input-ids", "1", "--max-new-tokens", "1"],
             "logits": ["--input-ids", "1", "--out", "x.npz"]}[command]
    args = build_parser().parse_args([command, "--checkpoint", "x", "--impl", "pallas", *extra])
    before = tiny_model.exec
    ex = exec_for_args(args, tiny_model)
    assert ex == before.replace(kernels="pallas") and tiny_model.exec is before
    assert exec_for_args(build_parser().parse_args([command, "--checkpoint", "x", *extra]), tiny_model) is before
    if command in ("batch", "serve"):
        eflags = flags("--max-slots", "2", "--page-size", "8", "--prefill-chunk", "16", "--max-seq-len", "40",
                       "--no-warmup")
        eng = engine_from_args(eflags, tiny_model, report=None, budget=(GIB, "test budget"), exec=ex)
        assert eng.exec == ex and tiny_model.exec is before
