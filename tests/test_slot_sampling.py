"""`serve.slot_sampling.SlotSampling`: each slot's static sampling parameters written once per
admission (and again when another request, or a preempted one re-admitted elsewhere, takes the
slot), gathered per step; the padding row is neutral. That the engine samples with them is checked
end to end in test_engine (mixed penalties / logprobs / seeds equal `generate` alone)."""
import numpy as np

from ling_jax.serve.request import RequestParams
from ling_jax.serve.slot_sampling import FIELDS, SlotSampling


class Req:
    def __init__(self, id, slot, params, prompt):
        self.id, self.slot, self.params, self.prompt = id, slot, params, prompt


def test_rows_gather_admitted_parameters_and_neutral_padding():
    ss = SlotSampling(3)
    a = Req(0, 2, RequestParams(temperature=0.7, top_k=5, top_p=0.9, seed=11, presence_penalty=0.5,
                                frequency_penalty=-0.25, repetition_penalty=1.2, logprobs=3), [1, 2, 3])
    b = Req(1, 0, RequestParams(), [4])
    rows = ss.rows([a, None, b])
    assert set(rows) == {name for name, _, _ in FIELDS}
    for name, dtype, _ in FIELDS:
        assert rows[name].dtype == dtype and rows[name].shape == (3,)
    np.testing.assert_allclose(rows["temperature"], [0.7, 0.0, 0.0], rtol=1e-6)
    assert rows["top_k"].tolist() == [5, 0, 0] and rows["seed"].tolist() == [11, 0, 0]
    np.testing.assert_allclose(rows["top_p"], [0.9, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(rows["presence"], [0.5, 0, 0])
    np.testing.assert_allclose(rows["frequency"], [-0.25, 0, 0])
    np.testing.assert_allclose(rows["repetition"], [1.2, 1.0, 1.0], rtol=1e-6)
    assert rows["prompt_len"].tolist() == [3, 0, 1] and rows["logprobs"].tolist() == [True, False, False]
    assert ss.owner.tolist() == [1, -1, 0, -1]


def test_written_once_per_admission_and_rewritten_for_a_new_owner():
    ss = SlotSampling(2)
    a = Req(0, 1, RequestParams(temperature=0.5, seed=3), [1, 2])
    ss.rows([a])
    ss.arrays["seed"][1] = 99  # a step gathers what admission wrote: no rewrite while `a` holds the slot
    assert ss.rows([a])["seed"].tolist() == [99]
    b = Req(1, 1, RequestParams(seed=7, logprobs=0), [5])  # another request takes slot 1
    rows = ss.rows([b])
    assert rows["seed"].tolist() == [7] and rows["temperature"].tolist() == [0.0] and rows["logprobs"].tolist() == [True]
    a.slot = 0  # `a` re-admitted after a preemption, into slot 0
    rows = ss.rows([a, b])
    assert rows["seed"].tolist() == [3, 7] and ss.owner.tolist() == [0, 1, -1]
