"""Property-based fuzz of the three parsers that read untrusted files (issue 15).

Any bytes / JSON in: the safetensors header parser, the index parser and the config parser raise
only the project's own error type (CheckpointError / ConfigError), or accept, within a time bound.
Bounded (150 examples per target, a per-example deadline) so the suite stays lean.
"""
import json
import os
import struct
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from ling_jax.checkpoint.reader import CheckpointReader  # noqa: E402
from ling_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, read_index  # noqa: E402
from ling_jax.checkpoint.writer import tiny_config, write_checkpoint  # noqa: E402
from ling_jax.config import ConfigError, LingConfig  # noqa: E402

FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
TIME_BOUND = 2.0  # seconds per input

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)

HEADER_KEYS = ["dtype", "shape", "data_offsets"]
entry = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "F16", "F8_E4M3", "I8", "Q7", ""]) | json_values,
    "shape": st.lists(st.integers(-3, 2**40), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-5, 2**62), min_size=0, max_size=3) | json_values,
})
headers = st.dictionaries(st.text(max_size=10), entry | json_values, max_size=4)


def _timed(fn, *ok_errors):
    t0 = time.perf_counter()
    try:
        fn()
    except ok_errors:
        pass
    assert time.perf_counter() - t0 < TIME_BOUND


@FUZZ
@given(header=headers, data=st.binary(max_size=64), pad=st.integers(0, 7), raw=st.none() | st.binary(max_size=96))
def test_safetensors_header_parser(tmp_path_factory, header, data, pad, raw):
    p = tmp_path_factory.mktemp("st") / "x.safetensors"
    if raw is not None:  # arbitrary bytes, header length included
        p.write_bytes(raw)
    else:
        js = json.dumps(header).encode() + b" " * pad
        p.write_bytes(struct.pack("<Q", len(js)) + js + data)

    def parse():
        f = SafetensorsFile(str(p))
        for n in f.names():  # reading what the header describes must also fail cleanly
            f.read(n)
    _timed(parse, CheckpointError)


@pytest.fixture(scope="module")
def small_ck(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "ck"
    write_checkpoint(tiny_config(num_hidden_layers=1, layer_group_size=1, num_nextn_predict_layers=0), str(d),
                     num_shards=1, progress=False, tokenizer=False)
    return d


@FUZZ
@given(index=json_values | st.fixed_dictionaries({"weight_map": json_values, "metadata": json_values}),
       raw=st.none() | st.binary(max_size=64))
def test_index_parser(small_ck, index, raw):
    p = small_ck / "model.safetensors.index.json"
    original = p.read_bytes()
    try:
        p.write_bytes(raw if raw is not None else json.dumps(index).encode())
        _timed(lambda: read_index(str(p)), CheckpointError)

        def full():
            r = CheckpointReader(str(small_ck))
            r.validate()
        _timed(full, CheckpointError)
    finally:
        p.write_bytes(original)


def _base_config():
    return tiny_config(num_hidden_layers=2, layer_group_size=2).to_dict()


CONFIG_KEYS = sorted(_base_config()) + ["rope_parameters", "num_local_experts", "qk_head_dim"]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), json_values, max_size=4),
       drop=st.lists(st.sampled_from(CONFIG_KEYS), max_size=2), whole=st.none() | json_values)
def test_config_parser(changes, drop, whole):
    d = _base_config()
    d.update(changes)
    for k in drop:
        d.pop(k, None)
    _timed(lambda: LingConfig.from_dict(d if whole is None else whole, "fuzz/config.json"), ConfigError)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_config_file_bytes(tmp_path_factory, raw):
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_bytes(raw)
    _timed(lambda: LingConfig.from_json(str(p)), ConfigError)
    os.remove(p)
