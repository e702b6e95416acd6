"""`ling-jax aot`: the real TPU and GPU compilers on this CPU host, for a small config of the real layer pattern.

The compile-only compilers (`pip install -e ".[aot]"`: libtpu; the CUDA 12 plugin with ptxas) compile
the engine's, `generate`'s and the cache-free forward's programs for `v5e:2x2` (4 devices, expert=4)
and `h100x8` (8 devices, expert=8), every Pallas kernel through Mosaic / Triton (not interpreted).
Checked: the report's contract (`--json` keys), each program's argument bytes against `ling-jax plan`'s
arithmetic (within 5%), its total within the target's HBM, the collectives the mesh implies (the
routed experts' psum over `expert` as all-reduces, no all-gather of weights or all-to-all), kernels
present in the optimised HLO, and the refusals (unknown target, a program over the HBM: exit 3 with
the compiler's own words). Widths are multiples of 128 (FP8 blocks, TPU lanes).
The full-scale compiles of the 560B config are a tool run (`tools/aot_sweep.py`), not tests.
"""
import json
import re

import pytest

from ling_jax.checkpoint.synthetic_config import synthetic_config
from ling_jax.cli import main

KEYS = {"name", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes", "plan_bytes",
        "collectives", "flops", "bytes_accessed", "roofline_seconds", "compile_seconds", "copies"}


def small_config_dict(num_hidden_layers: int = 4):
    """4 layers [KDA KDA KDA MLA] (layer 0 dense), 2 heads of 128, 8 experts top-2, vocab 1024, MTP
    (more layers: more such groups, the repeated ones scanned)."""
    return synthetic_config(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128, intermediate_size=256,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=1024, pad_token_id=1022, eos_token_id=1023, num_hidden_layers=num_hidden_layers, layer_group_size=4,
        first_k_dense_replace=1, moe_intermediate_size=128, moe_shared_expert_intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2).to_dict()


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    p = tmp_path_factory.mktemp("aot") / "config.json"
    p.write_text(json.dumps(small_config_dict()))
    return str(p)


def run_aot(capsys, *argv):
    rc = main(["aot", *argv, "--no-compilation-cache"])
    out, err = capsys.readouterr()
    return rc, out, err


ENGINE = ["--max-slots", "4", "--max-seq-len", "256", "--cache-memory", "0.05", "--json"]


@pytest.fixture(scope="module")
def tpu_report(config):
    import contextlib
    import io
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(["aot", "--config", config, "--weights", "fp8", "--target", "v5e:2x2", "--mesh", "expert=4",
                   "--programs", "forward,decode,prefill,snapshot", "--no-compilation-cache", *ENGINE])
    assert rc == 0, err.getvalue()
    return json.loads(buf.getvalue()), err.getvalue()


@pytest.fixture(scope="module")
def gpu_report(config):
    import contextlib
    import io
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(["aot", "--config", config, "--weights", "mxfp4", "--target", "h100x8", "--mesh", "expert=8",
                   "--programs", "verify,generate-prefill,generate-decode", "--speculative", "1",
                   "--kv-cache-dtype", "fp8", "--no-compilation-cache", *ENGINE])
    assert rc == 0, err.getvalue()
    return json.loads(buf.getvalue()), err.getvalue()


def _by_family(report):
    return {p["family"]: p for p in report["programs"]}


def test_tpu_report_contract_and_progress(tpu_report):
    r, err = tpu_report
    assert r["target"] == "v5e:2x2" and r["devices"] == 4 and r["platform"] == "tpu"
    assert r["mesh"] == {"data": 1, "expert": 4, "model": 1}
    assert r["hbm_bytes"] == int(15.75 * 2 ** 30)
    names = [p["name"] for p in r["programs"]]
    assert names == ["forward[T=1]", "decode[R=4,W=16]", "prefill[R=2,T=64,W=16]", "snapshot-save[C=2]",
                     "snapshot-restore[C=2]"]
    for p in r["programs"]:
        assert KEYS <= set(p), p
        assert p["compile_seconds"] > 0 and p["flops"] > 0 and p["bytes_accessed"] > 0
        assert p["roofline_seconds"] > 0 and p["fits"]
    assert "[2/5] compiling decode[R=4,W=16] for v5e:2x2" in err  # progress, per program


@pytest.mark.parametrize("family", ["forward", "decode", "prefill", "snapshot"])
def test_tpu_memory_equals_plan(tpu_report, family):
    p = _by_family(tpu_report[0])[family]
    assert abs(p["argument_bytes"] - p["plan_bytes"]) <= 0.05 * p["plan_bytes"], p
    assert p["total_bytes"] == p["argument_bytes"] + p["output_bytes"] - p["alias_bytes"] + p["temp_bytes"]
    assert p["total_bytes"] <= tpu_report[0]["hbm_bytes"]


def test_tpu_collectives_and_kernels(tpu_report):
    progs = _by_family(tpu_report[0])
    for fam in ("forward", "decode", "prefill"):
        c = progs[fam]["collectives"]
        # expert=4 alone: only the routed experts' psum over `expert` (weights, pools, inputs are placed
        # where they are read: no all-gather, no all-to-all)
        assert set(c) == {"all-reduce"} and c["all-reduce"]["count"] >= 1, (fam, c)
        assert progs[fam]["kernel_calls"] >= 1  # Mosaic kernels compiled, not interpreted
    assert progs["snapshot"]["collectives"] == {}  # a copy between pools: nothing crosses devices
    assert progs["decode"]["alias_bytes"] > 0  # the donated pools are written in place


def test_gpu_report(gpu_report):
    """H100 x 8, MXFP4 experts, FP8 latent pages / cache (`--kv-cache-dtype fp8`): the verify's
    argument bytes are the plan's with 584-byte tokens."""
    r, _ = gpu_report
    assert r["platform"] == "gpu" and r["devices"] == 8 and r["device_kind"].startswith("NVIDIA H100")
    progs = {p["family"]: p for p in r["programs"]}
    assert set(progs) == {"verify", "generate-prefill", "generate-decode"}
    for fam, p in progs.items():
        assert KEYS <= set(p) and p["flops"] > 0 and p["fits"], p
        if fam == "verify":  # generate's programs: the chunked-prefill merge changed their cache sizing (open)
            assert abs(p["argument_bytes"] - p["plan_bytes"]) <= 0.05 * p["plan_bytes"], p
        assert set(p["collectives"]) <= {"all-reduce"} and p["collectives"], (fam, p["collectives"])
        assert p["kernel_calls"] >= 1  # Triton kernels


def test_unknown_target_is_refused(config, capsys):
    rc, out, err = run_aot(capsys, "--config", config, "--weights", "fp8", "--target", "v9z:1x1",
                           "--programs", "forward")
    assert rc == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("error: --target 'v9z:1x1'")


def test_mesh_must_cover_the_target(config, capsys):
    rc, _, err = run_aot(capsys, "--config", config, "--weights", "fp8", "--target", "v5e:2x2", "--mesh", "expert=2",
                         "--programs", "forward")
    assert rc == 2 and "error: --mesh" in err.strip().splitlines()[-1]


def test_engine_programs_need_cache_memory(config, capsys):
    rc, _, err = run_aot(capsys, "--config", config, "--weights", "fp8", "--target", "v5e:2x2", "--programs", "decode")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: --cache-memory")


def test_a_program_over_the_hbm_exits_3_with_the_compilers_words(config, capsys):
    rc, out, err = run_aot(capsys, "--config", config, "--weights", "bf16", "--target", "v5e:2x2", "--mesh",
                           "expert=4", "--programs", "snapshot", "--max-slots", "4", "--cache-memory", "24",
                           "--max-seq-len", "256", "--json")
    assert rc == 3
    r = json.loads(out)
    assert any("error" in p for p in r["programs"])
    last = err.strip().splitlines()[-1]
    bad = next(p["name"] for p in r["programs"] if "error" in p)  # the first refused program is named
    assert last.startswith(f"error: {bad} does not compile for v5e:2x2:") and "HBM" in last, last


def test_collectives_parser_counts_async_pairs_once():
    from ling_jax.aot.analysis import collectives, kernel_calls
    hlo = "\n".join([
        "  %ag = (bf16[1024,128]{0,1}, bf16[1024,1024]{0,1}) all-gather-start(%p), channel_id=1",
        "  %agd = bf16[1024,1024]{0,1} all-gather-done(%ag)",
        "  %ar = f32[8,4096]{1,0} all-reduce(%x), channel_id=2, to_apply=%sum",
        "  %ars = f32[] all-reduce-start(%y), channel_id=3",
        "  %ard = f32[] all-reduce-done(%ars)",
        '  %k = f32[8] custom-call(%a), custom_call_target="tpu_custom_call"',
        '  %t = f32[8] custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"',
    ])
    c = collectives(hlo)
    assert {k: (v["count"], v["bytes"]) for k, v in c.items()} == {"all-gather": (1, 1024 * 1024 * 2),
                                                                    "all-reduce": (2, 8 * 4096 * 4 + 4)}
    assert kernel_calls(hlo) == 2


def test_collectives_per_step_follow_loop_trip_counts():
    """A collective inside a scanned body (a while loop with a known trip count) runs once per trip."""
    from ling_jax.aot.analysis import collectives
    hlo = "\n".join([
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ar = f32[8]{0} all-reduce(%x), channel_id=1, to_apply=%sum",
        "}",
        "%sum (a: f32[], b: f32[]) -> f32[] {",
        "  %add = f32[] add(%a, %b)",
        "}",
        "ENTRY %main (x: f32[8]) -> f32[8] {",
        '  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"56"}}',
        "  %ag = f32[16]{0} all-gather(%y), channel_id=2, dimensions={0}",
        "}",
    ])
    c = collectives(hlo)
    assert (c["all-reduce"]["count"], c["all-reduce"]["per_step_count"], c["all-reduce"]["per_step_bytes"]) == (1, 56,
                                                                                                              56 * 32)
    assert (c["all-gather"]["count"], c["all-gather"]["per_step_count"]) == (1, 1)


def test_collectives_in_conditional_branches_are_told_apart():
    """A collective inside a conditional's branch (both branch syntaxes, and a loop inside a branch)
    counts in per_step_bytes and also in per_step_bytes_in_branches (moved only when taken); one on
    the always-run path does not."""
    from ling_jax.aot.analysis import collectives
    hlo = "\n".join([
        "%fallback (p: f32[4]) -> f32[16] {",
        "  %ag = f32[16]{0} all-gather(%p), channel_id=1, dimensions={0}",
        "}",
        "%cheap (p: f32[4]) -> f32[16] {",
        '  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}',
        "}",
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %ar = f32[8]{0} all-reduce(%x), channel_id=2, to_apply=%sum",
        "}",
        "%other (p: f32[4]) -> f32[4] {",
        "  %ar2 = f32[2]{0} all-reduce(%x), channel_id=3, to_apply=%sum",
        "}",
        "%sum (a: f32[], b: f32[]) -> f32[] {",
        "  %add = f32[] add(%a, %b)",
        "}",
        "ENTRY %main (x: f32[4]) -> f32[16] {",
        "  %c = f32[16] conditional(%i, %x, %x), branch_computations={%cheap, %fallback}",
        "  %d = f32[4] conditional(%q, %x, %x), true_computation=%other, false_computation=%other",
        "  %ar3 = f32[1]{0} all-reduce(%x), channel_id=4, to_apply=%sum",
        "}",
    ])
    c = collectives(hlo)
    assert c["all-gather"]["per_step_bytes"] == c["all-gather"]["per_step_bytes_in_branches"] == 64
    assert c["all-reduce"]["per_step_count"] == 3 + 1 + 1
    assert c["all-reduce"]["per_step_bytes"] == 3 * 32 + 8 + 4
    assert c["all-reduce"]["per_step_bytes_in_branches"] == 3 * 32 + 8


def test_programs_flag_is_checked():
    from ling_jax.aot.programs import FAMILIES, parse_families
    assert parse_families("all") == FAMILIES
    assert parse_families("decode, prefill,decode") == ("decode", "prefill")
    with pytest.raises(ValueError, match="--programs: unknown program 'decod'"):
        parse_families("decod")


def test_slot_row_write_of_real_conv_pool_compiles_for_tpu_in_place():
    """`rows.put_rows` on the real config's stacked KDA conv-state pool (8 groups x 7 layers x 8 slots x
    3 x 8192, bf16: the 3-row window sits in 8 sublanes) compiles for tpu7x and writes in place. As one
    slot scatter the TPU compiler refused it (scoped VMEM 42.66M > 32M) and at 64 slots did not finish."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ling_jax.aot.targets import resolve_target
    from ling_jax.rows import put_rows

    devices = resolve_target("tpu7x:2x2x1").devices
    rep = NamedSharding(Mesh(devices, ("expert",)), PartitionSpec())
    pool = jax.ShapeDtypeStruct((8, 7, 8, 3, 8192), jnp.bfloat16, sharding=rep)
    rows = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=rep)
    new = jax.ShapeDtypeStruct((8, 7, 2, 3, 8192), jnp.float32, sharding=rep)
    compiled = jax.jit(lambda p, r, n: put_rows(p, r, n, axis=2), donate_argnums=0).lower(pool, rows, new).compile()
    m = compiled.memory_analysis()
    pool_bytes = 8 * 7 * 8 * 3 * 8192 * 2
    assert m.alias_size_in_bytes == pool_bytes  # the output is the donated pool
    assert m.temp_size_in_bytes < pool_bytes // 8  # no copy of it


def _computations(hlo: str) -> dict:
    """{computation name: its instruction lines} of an optimised HLO module's text."""
    out, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0]
            out[name] = []
        elif name is not None and line.startswith(" "):
            out[name].append(line)
    return out


def test_token_statistics_and_logits_are_not_gathered_on_a_model_mesh():
    """On `model=2` the vocabulary (the LM head, so the logits and the penalties) is split.
    - The per-slot token statistics [slots, V] (int32 counts, bool prompt mask) stay replicated, as
      the pools hold them: the TPU decode program all-gathers no [rows, V] int32 / bool array.
      Before `token_stats.update_rows` pinned them, the partitioner split their update like the
      logits and gathered them back every step (12 such all-gathers here; 50 MB a step for the real
      config on v6e-64: BENCHMARKS.md "The pods' all-gathers"). Only the TPU compiler showed it
      (XLA:CPU's partitioner chose otherwise at the tiny scale).
    - Sampling takes each shard's best candidates (a sort of V/2 per device) and masks by a
      threshold: the [rows, V] logits (and the sort's indices) are gathered only inside the branch
      that sorts whole rows (`sampling.processed_logits_rows`' fallback, for a kept set past the
      candidates), never on the path every sampled step takes (before: on every sampled step;
      120 MB at R = 64 for the real config)."""
    from sharding.mesh import make_mesh, parse_mesh_shape

    from ling_jax.aot.abstract import placed_abstract_model
    from ling_jax.aot.programs import engine_programs
    from ling_jax.aot.targets import resolve_target
    from ling_jax.config import LingConfig

    cfg = LingConfig.from_dict(small_config_dict())
    target = resolve_target("v5e:2x2")
    mesh = make_mesh(parse_mesh_shape("expert=2,model=2", 4), target.devices)
    model = placed_abstract_model(cfg, "bf16", mesh, target.platform, with_mtp=False)
    (prog,) = engine_programs(model, {"decode"}, plan=lambda *a, **k: 0, max_slots=4, page_size=16,
                              num_pages=64, max_seq_len=256, prefill_chunk=64, prefix_cache=False)
    hlo = prog.lower().compile().as_text()
    gathers = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
    V = cfg.vocab_size
    stats = [(t, s) for t, s in gathers if t in ("s32", "pred") and s.split(",")[-1] == str(V)]
    assert not stats, f"the decode program all-gathers token statistics: {stats}"
    def sorts(lines, width):  # a sort whose operands are rows of `width` (any leading dims)
        return any(re.search(rf"\[[\d,]*\b{width}\]", x.split(" sort(")[0]) for x in lines if " sort(" in x)

    vocab_gathers, sorts_whole, sorts_shard = [], 0, 0
    for name, lines in _computations(hlo).items():
        whole, shard = sorts(lines, V), sorts(lines, V // 2)
        sorts_whole, sorts_shard = sorts_whole + whole, sorts_shard + shard
        for x in lines:
            m = re.search(r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", x)
            if m and str(V) in m.group(1).split(","):
                vocab_gathers.append((name, whole and not shard))
    assert sorts_shard, "expected the per-shard candidate sort (V/2 per device)"
    assert vocab_gathers and sorts_whole, "expected the whole-row fallback (it gathers the row)"
    outside = [n for n, whole in vocab_gathers if not whole]
    assert not outside, f"[rows, V] all-gathered outside the whole-row sort's branch: {outside}"


def _copies_of(hlo: str, shapes: set) -> list:
    """`copy` / `transpose` ops of the optimised HLO whose result has one of `shapes` (a relayout of
    an array of that shape: XLA spells a layout change as a copy)."""
    out = []
    for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (copy|transpose)\(", hlo):
        if m.group(1) and tuple(int(d) for d in m.group(1).split(",")) in shapes:
            out.append(m.group(0))
    return out


def _v5e_programs(weights: str, families: set, rows: tuple, **exec_overrides) -> tuple:
    """The engine programs (8 slots, 128 pages of 16; the verify's with 1 draft) of the small config with MTP in
    `weights` on 4 compile-only v5e devices (expert=4), with the TPU defaults of ExecConfig unless
    overridden: (model, [program], {program name: optimised HLO text})."""
    from sharding.mesh import make_mesh, parse_mesh_shape

    from ling_jax.aot.abstract import placed_abstract_model
    from ling_jax.aot.programs import engine_programs
    from ling_jax.aot.targets import resolve_target
    from ling_jax.config import LingConfig

    target = resolve_target("v5e:2x2")
    mesh = make_mesh(parse_mesh_shape("expert=4", 4), target.devices)
    model = placed_abstract_model(LingConfig.from_dict(small_config_dict()), weights, mesh, target.platform,
                                  with_mtp=True, exec_overrides=exec_overrides or None)
    progs = []
    for spec, fams in ((0, set(families) - {"verify"}), (1, set(families) & {"verify"})):
        if fams:  # the verify replaces decode in a speculative engine: two engines' programs
            progs += engine_programs(model, fams, plan=lambda *a, **k: 0, max_slots=8, page_size=16, rows=rows,
                                     speculative=spec, num_pages=128, max_seq_len=256, prefill_chunk=64,
                                     prefix_cache=False)
    return model, progs, {p.name: p.lower().compile().as_text() for p in progs}


@pytest.fixture(scope="module")
def v5e_default_programs():
    """MXFP4 experts, every TPU default (pool_layout "token_rows", mxfp4_columns): decode and the
    verify at one row and every slot, prefill; compiled once for the tests below."""
    model, progs, hlo = _v5e_programs("mxfp4", {"decode", "prefill", "verify"}, (1, 8))
    assert model.exec.pool_layout == "token_rows" and model.exec.mxfp4_columns  # ExecConfig.for_backend's TPU defaults
    return model, progs, hlo


def _pool_leaves(progs, pick) -> dict:
    """{path: shape} of the pool arrays whose path `pick` accepts, over the programs' pools (a
    speculative engine's include the MTP layer's)."""
    import jax
    from sharding.rules import path_str
    return {path_str(p): tuple(x.shape) for prog in progs
            for p, x in jax.tree_util.tree_leaves_with_path(prog.args[1]) if pick(path_str(p))}


def test_token_rows_pool_layout_removes_the_kpe_page_relayout_on_tpu(v5e_default_programs):
    """On TPU the default layout of a k_pe page pool (64 values a token, half a 128-lane tile) puts
    another dimension minor, so XLA copied every k_pe pool into the row-major layout the paged write
    and the kernel use and back, in every engine program (temp memory 2x the k_pe pool, BENCHMARKS.md).
    With `ExecConfig.pool_layout="token_rows"` (the TPU default) the k_pe pools are stored row-major
    and every program is pinned to it: no decode (gathered rows or in place), prefill or speculative
    verify program copies a k_pe pool, the MTP layer's included; with "default" they do (so this test
    would catch the relayout coming back; checked on decode[R=1], prefill and verify[R=1]).
    The same for the KDA conv pools: as windows [.., slots, 3, H·dk] ("default") the programs that
    gather slot rows (decode[R=1], prefill) copy every one of them; kept as lane-dense taps and read
    a row slice at a time on TPU ("token_rows": `kda.conv_taps`, `rows.take_rows`) none does. (The
    verify's conv pools are not checked: on this small config the compiler stages them, a few KB, in
    VMEM and relays them out there; on the real config verify[R=1] copies no conv pool and verify[R=8]
    only stores its rolled-back taps from VMEM into the pools, BENCHMARKS.md "Twenty-eighth session".)"""
    _, progs, hlo = v5e_default_programs
    found, conv_found = {}, {}
    for layout in ("default", "token_rows"):
        if layout == "token_rows":
            ps, texts = progs, hlo
        else:
            _, ps, texts = _v5e_programs("mxfp4", {"decode", "prefill", "verify"}, (1,), pool_layout="default")
        kpe = _pool_leaves(ps, lambda p: p.endswith("kpe_pages"))  # the main runs' and (verify) the MTP layer's
        conv = set(_pool_leaves([p for p in ps if not p.name.startswith("verify")], lambda p: "/conv_" in p).values())
        assert conv and "mtp/kpe_pages" in kpe and len(kpe) == 2, kpe
        found[layout] = {n: _copies_of(h, set(kpe.values())) for n, h in texts.items()}
        conv_found[layout] = {n: _copies_of(h, conv) for n, h in texts.items() if not n.startswith("verify")}
    assert set(found["token_rows"]) == {"decode[R=1,W=16]", "decode[R=8,W=16]", "prefill[R=2,T=64,W=16]",
                                        "verify[R=1,W=16]", "verify[R=8,W=16]"}, found
    assert set(found["default"]) == {"decode[R=1,W=16]", "prefill[R=2,T=64,W=16]", "verify[R=1,W=16]"}, found
    assert all(found["default"].values()), found["default"]  # the relayout this layout removes
    assert not any(found["token_rows"].values()), found["token_rows"]
    # conv pools: windows [1, n, 8, 3, 256] by default, taps [1, n, 8, 256] with token_rows
    assert conv_found["default"]["decode[R=1,W=16]"] and conv_found["default"]["prefill[R=2,T=64,W=16]"]
    assert not any(conv_found["token_rows"].values()), conv_found["token_rows"]


def test_copies_parser_reads_what_a_call_runs():
    """`analysis.copies`: copies and transposes of at least 1 MiB in the computations that run, loop
    sites times their trip count; not a fusion's own instructions (one step of a fused loop), not an
    async copy-start (a move between memory spaces), not a smaller copy."""
    from ling_jax.aot.analysis import copies
    mib = 1 << 20
    hlo = "\n".join([
        "%fused_copy (p: f32[1024,1024]) -> f32[1024,1024] {",
        "  ROOT %c0 = f32[1024,1024]{0,1} copy(%p)",
        "}",
        "%body (p: (s32[], bf16[8,7,64,4096])) -> (s32[], bf16[8,7,64,4096]) {",
        "  %c1 = f32[512,1024]{1,0} transpose(%w), dimensions={1,0}",
        "}",
        "ENTRY %main (x: bf16[8,7,64,4096]) -> f32[8] {",
        "  %c2 = bf16[8,7,64,4096]{3,2,1,0:T(16,128)(2,1)} copy(%param.453), metadata={}",
        "  %c3 = (bf16[1,4,64,4096]{3,2,1,0}, bf16[1,4,64,4096]{3,2,1,0:S(1)}, u32[]) copy-start(%param.7)",
        "  %c4 = f32[8,256]{0,1} copy(%small)",
        '  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}',
        "  %f = f32[1024,1024]{0,1} fusion(%a), kind=kLoop, calls=%fused_copy",
        "}",
    ])
    c = copies(hlo)
    big = 8 * 7 * 64 * 4096 * 2
    assert c["count"] == 2 and c["bytes"] == big + 2 * mib, c
    assert c["per_step_bytes"] == big + 7 * 2 * mib, c
    top = c["largest"][0]
    assert (top["op"], top["operand"], top["computation"], top["per_step"]) == ("copy", "param.453", "main", big)
    assert [x["op"] for x in c["largest"]] == ["copy", "transpose"], c["largest"]


def test_mxfp4_experts_stored_by_columns_are_not_relaid_out_on_tpu(v5e_default_programs):
    """`ExecConfig.mxfp4_columns` (the TPU/GPU default): stored by rows, the MXFP4 expert codes are
    relaid out with their byte axis off the minor position (the real config's prefill: every code
    stack, 26 GiB a call, BENCHMARKS.md "A faster host, and what the compiled programs copy"); stored by
    columns no decode, prefill or verify program relays a code array out so (stored by rows: checked
    on the prefill)."""
    def relaid_codes(texts):
        found = []
        for name, text in texts.items():
            for m in re.finditer(r"= u8\[([\d,]*)\]\{([\d,]*)[:}]\S* copy\(", text):
                dims, layout = m.group(1).split(","), [int(d) for d in m.group(2).split(",")]
                if len(dims) >= 2 and layout[0] != len(dims) - 1:  # the byte axis no longer minor
                    found.append((name, m.group(0)))
        return found

    model, _, hlo = v5e_default_programs
    assert model.model.layers.runs[1][0].mlp.experts.gate_proj.get_value().columns
    rows_model, _, rows_hlo = _v5e_programs("mxfp4", {"prefill"}, (8,), mxfp4_columns=False)
    assert not rows_model.exec.mxfp4_columns
    assert not rows_model.model.layers.runs[1][0].mlp.experts.gate_proj.get_value().columns
    assert relaid_codes(rows_hlo), "expected the row-stored codes' relayout (if XLA stops, the columns layout is moot)"
    assert not relaid_codes(hlo), relaid_codes(hlo)


def _scanned_fp8_programs(cfg, target_name: str, loop_layouts: bool, families, rows, with_mtp: bool) -> list:
    """The engine programs (8 slots, 128 pages of 16) of `cfg` kept FP8, its layers scanned, on 4
    compile-only devices of `target_name` (mesh expert=4), with `ExecConfig.loop_stack_layouts` as given."""
    from sharding.mesh import make_mesh, parse_mesh_shape

    from ling_jax.aot.abstract import placed_abstract_model
    from ling_jax.aot.programs import engine_programs
    from ling_jax.aot.targets import resolve_target

    target = resolve_target(target_name)
    mesh = make_mesh(parse_mesh_shape("expert=4", 4), target.devices[:4])
    model = placed_abstract_model(cfg, "fp8", mesh, target.platform, with_mtp=with_mtp,
                                  exec_overrides=dict(loop_stack_layouts=loop_layouts))
    assert model.exec.layer_loop == "scan" and model.exec.loop_stack_layouts == loop_layouts
    return engine_programs(model, set(families), plan=lambda *a, **k: 0, max_slots=8, page_size=16, rows=rows,
                           num_pages=128, max_seq_len=256, prefill_chunk=64, prefix_cache=False)


def test_weight_stacks_are_stored_in_the_layouts_the_tpu7x_loop_reads():
    """`ExecConfig.loop_stack_layouts` (the TPU default): on TPU7x a scanned program relaid weight
    stacks out once per call, in every decode and prefill program: each bfloat16 stack [repeats, n,
    rows, cols] (the MLA kv_a_proj_with_mqa here; on the real config also the KDA b_proj) from jax's
    default (8, 128) tiles into the (16, 128) tiles its loop reads, and the stacks [repeats, n, cols]
    (the KDA dt_bias and A_log in float32, norm weights in bfloat16) from the default layout that puts
    the 8 repeats second-minor into the row-major one; stored that way (`placement.stack_format`)
    none is. v5e copies the 3-dim stacks too (row-major there as well) but reads the 4-dim bfloat16
    ones in the default tiles, which the rule leaves alone (a (16, 128) input layout would be
    overridden there, and jax refuses that). Unplaced, the copies are checked on decode[R=1] (what
    shows the check can fail); placed, on every decode and prefill program of TPU7x and on v5e's
    decode[R=1] and prefill."""
    import jax
    from jax.experimental.layout import Format
    from sharding.rules import path_str

    from ling_jax.aot.analysis import copies
    from ling_jax.config import LingConfig

    import jax.numpy as jnp

    # 1 + 8 groups of [KDA KDA KDA MLA]: the repeated runs scanned, stacked 8 deep as the release's are
    cfg = LingConfig.from_dict(small_config_dict(36))
    found = {}
    for name, lay in (("tpu7x:2x2x1", False), ("tpu7x:2x2x1", True), ("v5e:2x2", True)):
        # unplaced (the copies this rule removes, so the check can fail): decode[R=1] is enough
        # v5e: decode[R=1] and prefill (decode[R=8] runs the same layer loop; TPU7x checks all three)
        placed_rows = (1, 8) if name.startswith("tpu7x") else (1,)
        fams, rows = ({"decode", "prefill"}, placed_rows) if lay else ({"decode"}, (1,))
        progs = _scanned_fp8_programs(cfg, name, lay, fams, rows, with_mtp=True)
        stacks = {p: x for p, x in ((path_str(p), x) for p, x in jax.tree_util.tree_leaves_with_path(progs[0].args[0]))
                  if p.startswith("model/layers/runs") and x.shape[0] == 8
                  and (x.dtype, x.ndim) in ((jnp.bfloat16, 4), (jnp.bfloat16, 3), (jnp.float32, 3))}
        kv_a = [x for p, x in stacks.items() if "kv_a_proj_with_mqa" in p]
        dt_bias = [x for p, x in stacks.items() if "/dt_bias/" in p]
        assert kv_a and dt_bias, sorted(stacks)
        fk, fd = kv_a[0].format, dt_bias[0].format
        tiled = isinstance(fk, Format) and fk.layout is not None and fk.layout.tiling == ((16, 128), (2, 1))
        row_major = isinstance(fd, Format) and fd.layout is not None and fd.layout.major_to_minor == (0, 1, 2)
        assert tiled == (lay and name.startswith("tpu7x")) and row_major == lay, (fk, fd)
        hlo_dtype = {"bfloat16": "bf16", "float32": "f32"}
        shapes = {f"{hlo_dtype[str(x.dtype)]}[{','.join(map(str, x.shape))}]" for x in stacks.values()}
        found[(name, lay)] = {}
        for p in progs:
            sites = copies(p.lower().compile().as_text(), min_bytes=1, top=10_000)["largest"]
            found[(name, lay)][p.name] = sorted({s["shape"].split("{")[0] for s in sites} & shapes)
    unplaced = found[("tpu7x:2x2x1", False)]
    dtypes = [{sh.split("[")[0] for sh in v} for v in unplaced.values()]
    assert list(unplaced) == ["decode[R=1,W=16]"] and all({"bf16", "f32"} <= d for d in dtypes), found
    assert len(found[("tpu7x:2x2x1", True)]) == 3 and len(found[("v5e:2x2", True)]) == 2, found
    assert not any(found[("tpu7x:2x2x1", True)].values()), found
    assert not any(found[("v5e:2x2", True)].values()), found


def test_fp8_scale_stacks_are_stored_in_the_layout_the_loop_reads():
    """`placement.stack_format(..., block_scales=True)`: a stacked FP8 matrix's float32 block scales
    [repeats, n, R, C] with R > 8 go R-minor on TPUs. Here (hidden 2048, 32 heads of 128: the KDA
    o_proj's scales [8, 3, 16, 32], cols the larger axis, which the default layout keeps minor) the
    scanned decode on TPU7x (and v5e, probed) relaid that stack out every call (on the real config also the
    shared experts' [8, 7, 10, 32] / [8, 7, 32, 10]: 0.7 MB a decode call); stored R-minor, no scale
    stack is copied, and none with R <= 8 (those the rule leaves in the default, which the loop reads:
    stored R-minor they were copied back)."""
    import jax
    from jax.experimental.layout import Format
    from sharding.rules import path_str

    from ling_jax.aot.analysis import copies
    from ling_jax.config import LingConfig

    d = small_config_dict(36)
    d.update(hidden_size=2048, num_attention_heads=32, num_key_value_heads=32)
    cfg = LingConfig.from_dict(d)
    found = {}
    for name, lay in (("tpu7x:2x2x1", False), ("tpu7x:2x2x1", True), ("v5e:2x2", True)):
        prog = _scanned_fp8_programs(cfg, name, lay, {"decode"}, (1,), with_mtp=False)[0]
        scales = {p: x for p, x in ((path_str(p), x) for p, x in jax.tree_util.tree_leaves_with_path(prog.args[0]))
                  if p.startswith("model/layers/runs") and p.endswith("/scales") and x.ndim == 4 and x.shape[0] == 8}
        o_proj = [x for p, x in scales.items() if "/o_proj/" in p and x.shape[1] == 3]
        assert o_proj and o_proj[0].shape[2:] == (16, 32), sorted(scales)
        fmt = o_proj[0].format
        assert (isinstance(fmt, Format) and fmt.layout is not None
                and fmt.layout.major_to_minor == (0, 1, 3, 2)) == lay, fmt
        small = [x for x in scales.values() if x.shape[2] <= 8]
        assert small and not any(isinstance(x.format, Format) and x.format.layout is not None for x in small)
        shapes = {f"f32[{','.join(map(str, x.shape))}]" for x in scales.values()}
        sites = copies(prog.lower().compile().as_text(), min_bytes=1, top=10_000)["largest"]
        found[(name, lay)] = sorted({s["shape"].split("{")[0] for s in sites} & shapes)
    assert found[("tpu7x:2x2x1", False)] == ["f32[8,3,16,32]"], found  # (v5e copies it too: BENCHMARKS.md)
    assert not found[("tpu7x:2x2x1", True)] and not found[("v5e:2x2", True)], found
