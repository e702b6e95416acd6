"""The engine's programs update the donated pools in place (ling_jax/rows.py): no copy of a pool.

XLA:CPU copies a whole donated buffer around a one-index gather / scatter (measured: a 1-row
decode on a 32-slot mid-config engine 161 ms per token against 35 ms on one slot); `take_rows` /
`put_rows` pad a one-row index to two. Checked on the compiled HLO of every one-row program (decode
R=1 of 4 slots, prefill with one row, the snapshot copies of one row) and of a plain donated update,
and the helpers' values against the plain forms.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling_jax.rows import _put_rows_looped, put_rows, take_rows
from ling_jax.serve import Engine
from ling_jax.serve.multihost import OP_DECODE, OP_PREFILL


def _hlo_shape(x) -> str:
    """x's shape as HLO text writes it (f32[2,3], s32[4], u8[5])."""
    dt = jnp.dtype(x.dtype).name.replace('float', 'f').replace('uint', 'u').replace('int', 's')
    return f"{dt}[{','.join(map(str, x.shape))}]"


def _copies(hlo: str, arrays) -> int:
    """Instructions in `hlo` that copy an array of one of `arrays`' shapes."""
    shapes = {_hlo_shape(x) for x in arrays if x.size > 64}
    return sum(1 for line in hlo.splitlines()
               if (m := re.search(r"= (\w+\[[\d,]*\])\S* copy\(", line)) and m.group(1) in shapes)


def test_helpers_equal_the_plain_forms_and_stay_in_place():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6, 5)).astype(np.float32)
    for idx in ([4], [1, 5], [6], [2, 6, 0]):  # 6 is past the end: clipped on read, dropped on write
        i = jnp.asarray(idx, jnp.int32)
        np.testing.assert_array_equal(take_rows(jnp.asarray(x), i, axis=1), np.take(x, np.minimum(idx, 5), axis=1))
        v = rng.standard_normal((3, len(idx), 5)).astype(np.float32)
        want = x.copy()
        for k, j in enumerate(idx):
            if j < 6:
                want[:, j] = v[:, k]
        np.testing.assert_array_equal(put_rows(jnp.asarray(x), i, jnp.asarray(v), axis=1), want)
        # the TPU's form (a dynamic_update_slice per row; tests/test_aot.py compiles it for tpu7x), run here
        np.testing.assert_array_equal(_put_rows_looped(jnp.asarray(x), i, jnp.asarray(v), axis=1), want)

    pool = jnp.zeros((2, 32, 8, 64))

    def step(p, r, use_helpers):
        s = take_rows(p, r, 1) if use_helpers else jnp.take(p, r, axis=1, mode="clip")
        new = s * 0.5 + 1.0
        side = s[0].sum()  # a reader the write does not depend on (as a layer's output is)
        return (put_rows(p, r, new, 1) if use_helpers else p.at[:, r].set(new, mode="drop")), side

    one = jnp.array([3], jnp.int32)
    plain = jax.jit(lambda p, r: step(p, r, False), donate_argnums=(0,)).lower(pool, one).compile().as_text()
    fixed = jax.jit(lambda p, r: step(p, r, True), donate_argnums=(0,)).lower(pool, one).compile().as_text()
    assert _copies(plain, [pool]) > 0  # what the helpers avoid (if XLA stops copying, drop them)
    assert _copies(fixed, [pool]) == 0


_BIG_OPS = ("copy", "copy-start", "concatenate", "broadcast")


def _materialised(hlo: str, pools, weights, relayout_ok: bool = False) -> list[str]:
    """Instructions of `hlo` (fused computations included) that build a new array of the shape of a
    pool (`pools`: with a copy, a concatenation or a broadcast: a copied pool, or a scan output buffer
    standing in for a carried one) or of a stacked weight matrix (`weights`: with a copy or a
    concatenation, i.e. a restack). relayout_ok: allow a copy that only changes the layout of a value
    the step computed (the speculative verify's rolled-back conv states, serve/README.md "Left")."""
    # checked: the stacked pools ([repeats, n, ...] slot and page pools, the snapshot rows) of two or
    # more layers, and the stacked weight matrices ([repeats, n, rows, cols]). Not: a per-slot row
    # array ([slots, V] token statistics, [slots, D] hidden: an all-slot decode's own activations have
    # that shape; the one-row test below covers them), a "stack" of one layer ([1, 1, ...]: the tiny
    # model's first, dense KDA layer, whose state the step rewrites whole; the real schedule has no
    # such run), stacked vectors ([1, n, D] norms: the shape of a verify's [R, T, D] activations)
    pool_shapes = {_hlo_shape(x) for x in pools if x.size > 64 and x.ndim >= 3 and x.shape[0] * x.shape[1] > 1}
    weight_shapes = {_hlo_shape(x) for x in weights if x.ndim >= 4 and x.shape[0] * x.shape[1] > 1}
    out, lines = [], hlo.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"= (\w+\[[\d,]*\])(\{[\d,]*\})?\S* ([\w-]+)\(", line)
        if not m:
            continue
        shape, layout, op = m.groups()
        if op == "copy" and relayout_ok and i > 0:
            # a copy whose operand is the computation's parameter in another layout: a relayout of a
            # value computed in this step (the verify's rolled-back conv states), not a kept pool
            p = re.search(r"= (\w+\[[\d,]*\])(\{[\d,]*\}) parameter", lines[i - 1])
            if p and p.group(1) == shape and p.group(2) != layout:
                continue
        if (shape in pool_shapes and op in _BIG_OPS) or (shape in weight_shapes and op in ("copy", "copy-start",
                                                                                           "concatenate")):
            out.append(line.strip()[:160])
    return out


def _expert_slices(hlo: str, model) -> list[str]:
    """Instructions of `hlo` that build one layer's routed-expert weight ([E, I, D] gate/up, [E, D, I]
    down) by slicing or copying: on XLA:CPU a scanned layer's weight slice is copied before the
    custom call that reads it, unless the native kernel reads the run's table in place
    (`moe.ExpertTable`)."""
    cfg = model.cfg
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {f"f32[{E},{I},{D}]", f"f32[{E},{D},{I}]"}
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\w+\[[\d,]*\])(\{[\d,]*\})?\S* ([\w-]+)\(", line)
        if m and m.group(1) in shapes and m.group(3) in ("fusion", "dynamic-slice", "copy", "gather"):
            out.append(line.strip()[:160])
    return out


def _linear_slices(hlo: str, model) -> list[str]:
    """Instructions of `hlo` that build one layer's dense weight (a Linear's [out, in] or the router's
    [E, D], float32) as a dynamic slice of its run's stack (XLA:CPU materialises one, alone or as a
    fusion, before the dot that reads it; matched by shape and op, so activations of a coinciding shape
    are not mistaken for it): on XLA:CPU the native kernel reads
    them in place (`linear.TableRows`, `ExecConfig.native_linear`), the MLA kv_b_proj included (the
    absorbed attention's W_UK and W_UV per head, `mla.absorbed_kv_b`)."""
    from ling_jax.linear import Linear
    from ling_jax.moe import Router
    shapes = set()
    for block in model.model.layers.runs or ():
        for run in block:
            for _, node in nnx.iter_graph(run):
                if isinstance(node, (Linear, Router)):
                    w = node.weight.get_value()
                    if getattr(w, "ndim", 0) == 4:
                        shapes.add(f"f32[{w.shape[2]},{w.shape[3]}]")
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\w+\[[\d,]*\])(\{[\d,]*\})?\S* ([\w-]+)\(", line)
        name = line.split("=")[0]
        if m and m.group(1) in shapes and (m.group(3) == "dynamic-slice" or "dynamic-slice" in name
                                           or "dynamic_slice" in name):
            out.append(line.strip()[:160])
    return out


def _stacked_weights(eng) -> list:
    """The parameters of the runs stored stacked [repeats, n, ...] (none when unrolled)."""
    runs = nnx.merge(eng.runner.graphdef, eng.runner.params).model.layers.runs
    return [] if runs is None else jax.tree.leaves(nnx.state(runs))


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_no_engine_program_copies_a_pool_or_a_weight_stack(tiny_model, loop):
    """Issue 21: every program an engine compiles (decode and the speculative verify at one row and
    at every slot, prefill at one row and two, the prefix cache's save and restore) writes the
    donated pools in place, the MLA page pools included (carried through the layer scan, written at
    [layer, page, offset]), and reads the stored parameter stacks without restacking them: no copy,
    concatenation or broadcast of a pool-, snapshot- or weight-stack-sized array in the compiled HLO;
    on a scanned and an unrolled layer loop. And no layer's routed experts are sliced out of their
    stack: the native CPU kernel reads them in place (`moe.ExpertTable`), nor its dense weights
    (Linear and router: `linear.TableRows`, at every row count; MLA's kv_b_proj per head)."""
    model = tiny_model if loop == "scan" else nnx.clone(tiny_model).set_layer_loop("unroll")
    assert model.model.layers.loop == loop
    for spec in (0, 1):
        # prefill [R=2, T=16]: 32 rows, past the kernel's dot form (the GEMM form reads in place too)
        eng = Engine(model, max_slots=4, page_size=8, num_pages=12, prefill_chunk=16, max_seq_len=32,
                     decode_rows=(1, 4), buckets=(8, 16), snapshot_interval=8, prefix_cache_memory_gib=2 ** -10,
                     speculative=spec, prefill_rows=2, prefill_row_buckets=(1, 2))
        run = eng.runner
        pools = jax.tree.leaves(run.pools) + jax.tree.leaves(run.snapshots.snaps)
        assert any(x.ndim == 5 and x.shape[2] == 12 for x in jax.tree.leaves(run.pools))  # the page pools are checked
        if loop == "scan":
            assert _stacked_weights(eng)
        names = []
        for name, program, args in eng.program_calls():
            names.append(name)
            hlo = program.lower(*args).compile().as_text()
            bad = _materialised(hlo, pools, _stacked_weights(eng),
                                relayout_ok=name.startswith("verify"))
            assert not bad, f"{loop}: {name} materialises a pool or weight stack:\n" + "\n".join(bad[:5])
            sliced = _expert_slices(hlo, model)
            assert not sliced, f"{loop}: {name} copies a layer's experts:\n" + "\n".join(sliced[:5])
            sliced = _linear_slices(hlo, model)
            assert not sliced, f"{loop}: {name} copies a layer's dense weights:\n" + "\n".join(sliced[:5])
        kind = "verify" if spec else "decode"
        want = {f"{kind}[R=1,W=4]", f"{kind}[R=4,W=4]", "prefill[R=1,T=8,W=4]", "prefill[R=2,T=16,W=4]"}
        assert want <= set(names), names
        assert any(n.startswith("snapshot") for n in names) and len(names) >= 5, names


def test_one_row_programs_do_not_copy_the_pools(tiny_model):
    eng = Engine(tiny_model, max_slots=4, page_size=8, num_pages=16, prefill_chunk=8, prefill_rows=1,
                 max_seq_len=32, snapshot_interval=8, prefix_cache_memory_gib=2 ** -10)
    # (many snapshot rows: their shapes must not coincide with a gathered row's)
    run = eng.runner
    assert run.decode_rows[0] == 1 and run.snapshots.copies == 1 and run.snapshots.rows > 4
    pools, snaps = run.pools, run.snapshots.snaps
    # the slot rows (KDA states, hidden, token statistics), the MLA page pools and the snapshot rows
    arrays = jax.tree.leaves(pools) + jax.tree.leaves(snaps)
    assert len(arrays) > 10
    dec = run.decode_fn.lower(run.params, pools, run.padding_inputs(OP_DECODE, 1, 1, run.widths[0])).compile()
    assert _copies(dec.as_text(), arrays) == 0
    pre = run.prefill_fn.lower(run.params, pools, run.padding_inputs(OP_PREFILL, 1, 8), snaps).compile()
    assert _copies(pre.as_text(), arrays) == 0
    one = np.zeros(1, np.int32)
    save = run.snapshots._save.lower(snaps, pools, one, one).compile()
    assert _copies(save.as_text(), arrays) == 0
    from ling_jax.serve.snapshots import _restore
    restore = jax.jit(_restore, donate_argnums=(0,)).lower(pools, snaps, one, one, one, one).compile()
    assert _copies(restore.as_text(), arrays) == 0


def test_cache_free_forward_reads_the_layer_weights_in_place(tiny_model):
    """The cache-free forward (`forward`, the `logits` command; MLA in the expanded form) on a scanned
    layer loop slices no layer's dense weight out of its stack either: kv_b_proj's up-projection of the
    latents runs the native kernel over the stored rows (`linear.TableRows.apply`)."""
    assert tiny_model.model.layers.loop == "scan"
    graphdef, state = nnx.split(tiny_model)

    def logits(state, ids, n_valid):
        model = nnx.merge(graphdef, state)
        return model(ids, n_valid=n_valid, exec=model.exec)["logits"]

    ids = jnp.zeros((2, 16), jnp.int32)
    hlo = jax.jit(logits).lower(state, ids, jnp.full((2,), 16, jnp.int32)).compile().as_text()
    assert "ling_table_linear" in hlo  # the kernel runs (so the check below has something to see)
    sliced = _linear_slices(hlo, tiny_model)
    assert not sliced, "the cache-free forward copies a layer's dense weights:\n" + "\n".join(sliced[:5])
