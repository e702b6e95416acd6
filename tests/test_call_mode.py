"""`CallMode` (what kind of model call) apart from `ExecConfig` (how to compute): validation by field
name, hashable and static under jit, the KDA form each kind picks, and no call-kind field left in
ExecConfig. That each kind computes the right thing is checked where it is used (test_modules: the
KDA forms and boundary states against the float64 reference; test_generate / test_engine: prefill,
decode and verify against the full forward)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from ling_jax.call_mode import CALL_KINDS, DECODE, FORWARD, PREFILL, TRAIN, VERIFY, CallMode
from ling_jax.exec_config import ExecConfig


@pytest.mark.parametrize("kwargs,field", [({"kind": "score"}, "kind"),
                                          ({"kind": "prefill", "snapshot_every": -1}, "snapshot_every"),
                                          ({"kind": "prefill", "snapshot_every": 2.5}, "snapshot_every"),
                                          ({"kind": "decode", "snapshot_every": 16}, "snapshot_every"),
                                          ({"logits": 1}, "logits")])
def test_bad_values_are_refused_by_field_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"CallMode\.{field} "):
        CallMode(**kwargs)


def test_each_kind_picks_its_kda_form():
    assert [k for k in CALL_KINDS if CallMode(k).kda_recurrent] == ["decode", "verify"]
    assert [k for k in CALL_KINDS if CallMode(k).kda_states] == ["verify"]
    assert not PREFILL.logits and PREFILL.kind == "prefill" and CallMode.prefill(32).snapshot_every == 32
    assert DECODE.logits and not CallMode.decode(logits=False).logits
    assert FORWARD.logits and TRAIN.logits and VERIFY.logits and CallMode() == FORWARD


def test_exec_config_keeps_only_how_to_compute():
    fields = {f.name for f in dataclasses.fields(ExecConfig)}
    assert not fields & {"kda_mode", "kda_states", "kda_boundary_states", "skip_logits"}, fields


def test_frozen_hashable_and_static_under_jit():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DECODE.kind = "prefill"
    assert hash(CallMode.prefill(16)) == hash(CallMode.prefill(16)) and CallMode.prefill(16) != PREFILL
    traces = []
    f = jax.jit(lambda x, m: (traces.append(m), x * (2 if m.kda_recurrent else 3))[1], static_argnums=1)
    assert float(f(jnp.ones(()), DECODE)) == 2 and float(f(jnp.ones(()), CallMode("decode"))) == 2
    assert float(f(jnp.ones(()), PREFILL)) == 3
    assert len(traces) == 2  # one trace per distinct mode
