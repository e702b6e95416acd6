"""The prefill policy's platform defaults and how the --prefill-* flags resolve against them
(ling_jax/serve/prefill_policy.py; host only)."""
import pytest

from ling_jax.serve.prefill_policy import PrefillPolicy, default_prefill_policy, resolve_prefill_policy


@pytest.mark.parametrize("slots, rows, buckets", [(32, 8, (1, 2, 4, 8)), (8, 8, (1, 2, 4, 8)), (6, 6, (1, 2, 4, 6)),
                                                  (2, 2, (1, 2)), (1, 1, (1,))])
def test_cpu_default_feeds_a_backlog_in_rows_of_64(slots, rows, buckets):
    pol = default_prefill_policy("cpu", slots)
    assert pol == PrefillPolicy(chunk=64 * rows, rows=rows, row_tokens=64, row_buckets=buckets)
    assert pol.engine_kwargs() == {"prefill_chunk": 64 * rows, "prefill_rows": rows, "prefill_row_tokens": 64,
                                   "prefill_row_buckets": buckets}


@pytest.mark.parametrize("platform", ["tpu", "gpu", "cuda"])
def test_accelerators_keep_64_over_2_rows(platform):
    assert default_prefill_policy(platform, 32) == PrefillPolicy(64, 2)


def test_any_flag_given_takes_the_engine_defaults_for_the_rest():
    assert resolve_prefill_policy("cpu", 8) == default_prefill_policy("cpu", 8)
    assert resolve_prefill_policy("cpu", 8, chunk=128) == PrefillPolicy(128, 2)
    assert resolve_prefill_policy("cpu", 8, rows=4) == PrefillPolicy(64, 4)
    assert resolve_prefill_policy("cpu", 8, row_tokens=32) == PrefillPolicy(64, 2, 32)
    assert resolve_prefill_policy("cpu", 8, row_buckets=[1, 4]) == PrefillPolicy(64, 4, None, (1, 4))
    assert resolve_prefill_policy("tpu", 8, 512, 8, 64, (1, 2, 4, 8)) == default_prefill_policy("cpu", 8)
    again = resolve_prefill_policy("cpu", 8, **{k: v for k, v in zip(("chunk", "rows", "row_tokens", "row_buckets"),
                                                                      (512, 8, 64, (1, 2, 4, 8)))})
    assert again == default_prefill_policy("cpu", 8)  # resolving a resolved policy changes nothing


def test_describe_names_the_policy():
    assert default_prefill_policy("cpu", 8).describe() == \
        "prefill 512 tokens over 8 row(s) a step, at most 64 a prompt, row buckets 1,2,4,8"
    assert PrefillPolicy(64, 2).describe() == "prefill 64 tokens over 2 row(s) a step"
