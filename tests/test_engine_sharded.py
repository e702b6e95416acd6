"""The engine on a mesh: pools (and snapshot rows) split by head over `model`, tokens as on one device.

8 simulated CPU devices (conftest), mesh expert=4 x model=2, the tiny KDA + MLA + MTP model placed
by `shard_model`. The KDA recurrent and conv states of every slot and snapshot row are split by
head (1/2 per device), the latent pages, hidden and token statistics replicated; requests with
shared prefixes (hits restoring snapshots taken inside a prefill chunk and at chunk ends) give the
one-device engine's greedy tokens; nothing compiles after warm-up; every program keeps the
placement.
"""
import jax
import numpy as np
from flax import nnx

import sharding as S
from conftest import load_from_dict, xla_compiles
from ling_jax.config import KDA
from ling_jax.layer_stack import layer_plan
from ling_jax.placement import shard_model
from ling_jax.serve import Engine, RequestParams
from ling_jax.serve.pools import per_device_bytes

KW = dict(max_slots=2, page_size=8, num_pages=24, prefill_chunk=16, prefill_rows=2, max_seq_len=64,
          buckets=(16,), snapshot_interval=8, prefix_cache_memory_gib=2 ** -10)


def _specs(tree, cfg):
    """{kind: set of PartitionSpec tuples} over the KDA runs ("recurrent", "conv") and the rest."""
    out = {"recurrent": set(), "conv": set(), "other": set()}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        kind = "recurrent" if name.endswith(".recurrent") else "conv" if ".conv_" in name else "other"
        out[kind].add(tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec)))
    return out


def _serve(eng, prompts):
    hs = [eng.submit(p, RequestParams(max_tokens=6, stop_ids=())) for p in prompts]
    eng.run_until_done()
    return [h.generated for h in hs]


def test_pools_split_by_head_serve_the_one_device_tokens(tiny_cfg, tiny_params, tiny_model):
    mesh = S.parse_mesh("expert=4,model=2")
    model = shard_model(load_from_dict(tiny_cfg, tiny_params), mesh)
    eng = Engine(model, **KW)
    assert tiny_cfg.num_attention_heads % 2 == 0
    specs = _specs(eng.runner.pools, tiny_cfg)
    assert specs["recurrent"] == {(None, None, None, "model", None, None)}  # [repeats, n, slots, H, dk, dv]
    assert specs["conv"] == {(None, None, None, None, "model")}              # [repeats, n, slots, K-1, H*dk]
    assert all(set(s) == {None} for s in specs["other"])                      # pages, hidden, stats
    snap = _specs(eng.runner.snapshots.snaps, tiny_cfg)
    assert snap["recurrent"] == specs["recurrent"] and snap["conv"] == specs["conv"]
    total = sum(x.nbytes for x in jax.tree.leaves(eng.runner.pools))
    kda = sum(x.nbytes for b, block in enumerate(layer_plan(tiny_cfg)) for r, run in enumerate(block.runs)
              if run.attn == KDA for x in jax.tree.leaves(eng.runner.pools.layers[b][r]))
    assert per_device_bytes(eng.runner.pools) == total - kda // 2
    assert "KDA states split by head over 'model'" in eng.describe()
    eng.warmup()

    rng = np.random.default_rng(3)
    A = rng.integers(0, tiny_cfg.vocab_size, 40).tolist()
    tail = lambda n: rng.integers(0, tiny_cfg.vocab_size, n).tolist()
    prompts = [A, A[:27] + tail(5), A[:13] + tail(3), A[:33] + tail(4), tail(20)]
    with xla_compiles() as events:
        got = [_serve(eng, [p])[0] for p in prompts]  # one after another: the later ones hit
    assert events == []
    assert eng.stats()["prefix_hits"] >= 3 and eng.stats()["pages_in_use"] == 0
    for tree in (eng.runner.pools, eng.runner.snapshots.snaps):  # every program returned the placement it got
        after = _specs(tree, tiny_cfg)
        assert after["recurrent"] == specs["recurrent"] and after["conv"] == specs["conv"]

    one = Engine(tiny_model, **KW)
    assert per_device_bytes(one.runner.pools) == total  # one device holds everything
    assert got == [_serve(one, [p])[0] for p in prompts]


def test_penalised_requests_on_a_vocabulary_split_give_the_one_device_tokens():
    """With the vocabulary split over `model` (the LM head, so the logits and the penalties), the
    per-slot token statistics are pinned replicated where they are updated (`token_stats.update_rows`;
    that the TPU decode program then gathers none of them is tests/test_aot.py's check: XLA:CPU's
    partitioner never did): requests with presence, frequency and repetition penalties give the
    one-device engine's tokens."""
    import np_reference as R
    cfg = R.tiny_config(vocab_size=98, pad_token_id=96, eos_token_id=97)  # even: the vocabulary splits over model=2
    params = R.random_params(cfg, seed=4)
    model = shard_model(load_from_dict(cfg, params), S.parse_mesh("expert=4,model=2"))
    kw = dict(KW, prefix_cache=False)
    kw.pop("snapshot_interval"), kw.pop("prefix_cache_memory_gib")
    head = jax.tree.leaves(nnx.state(model.lm_head))[0]
    assert "model" in str(head.sharding.spec)  # the logits are split over the vocabulary
    rp = RequestParams(max_tokens=6, stop_ids=(), presence_penalty=0.7, frequency_penalty=0.4,
                       repetition_penalty=1.3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (9, 21)]

    def serve(e):
        hs = [e.submit(p, rp) for p in prompts]
        e.run_until_done()
        return [h.generated for h in hs]
    assert serve(Engine(model, **kw)) == serve(Engine(load_from_dict(cfg, params), **kw))
