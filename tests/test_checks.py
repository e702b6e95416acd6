"""`ling_jax.checks.check_int`: the one integer-argument check. Its message names the argument and
what was expected, its FieldError carries the bare field name, and it accepts exactly the ints
(Python or numpy, never a bool) within its bounds."""
import numpy as np
import pytest

from ling_jax.checks import FieldError, check_int, expected_int, is_int


def test_accepts_ints_in_bounds_and_returns_a_python_int():
    assert check_int(3, "n", low=1) == 3
    v = check_int(np.int64(4), "n", low=0, high=4)
    assert v == 4 and type(v) is int
    assert check_int(32, "interval", low=1, multiple_of=16) == 32
    assert is_int(np.int32(1)) and not is_int(True) and not is_int(1.0) and not is_int("1")


@pytest.mark.parametrize("value", [0, -1, True, 1.0, 2.5, "3", None, np.float32(2)])
def test_refusal_names_the_argument_and_what_was_expected(value):
    with pytest.raises(FieldError, match=r"^Engine prefill_chunk must be a positive int, got ") as e:
        check_int(value, "Engine prefill_chunk", field="prefill_chunk", low=1)
    assert e.value.field == "prefill_chunk" and isinstance(e.value, ValueError)


def test_expected_wording_and_overrides():
    assert (expected_int(1), expected_int(0), expected_int(2), expected_int(0, 3), expected_int(None, 5),
            expected_int()) == ("a positive int", "an int >= 0", "an int >= 2", "an int in [0, 3]", "an int <= 5",
                                "an int")
    with pytest.raises(ValueError, match=r"^max_queue must be an int >= 0, got -1$"):
        check_int(-1, "max_queue", low=0)
    with pytest.raises(ValueError, match=r"^--speculative must be 0\.\.3, got 4$"):
        check_int(4, "--speculative", low=0, high=3, expected="0..3")
    with pytest.raises(ValueError, match=r"multiple of page_size=16.*got 24$"):
        check_int(24, "Engine snapshot_interval", low=1, multiple_of=16,
                  expected="a positive multiple of page_size=16")


def test_other_error_classes_get_the_message_alone():
    class Refusal(Exception):
        pass

    with pytest.raises(Refusal, match=r"^f: total must be an integer, got 'x'$"):
        check_int("x", "f: total", expected="an integer", error=Refusal)

    class Named(FieldError):
        pass

    with pytest.raises(Named) as e:
        check_int(0, "RequestParams.max_tokens", field="max_tokens", low=1, error=Named)
    assert e.value.field == "max_tokens"


@pytest.mark.parametrize("kwargs,message", [({"max_new_tokens": 0}, r"^max_new_tokens must be a positive int, got 0$"),
                                            ({"max_new_tokens": 2.0}, r"^max_new_tokens must be a positive int"),
                                            ({"speculative": 4}, r"^speculative must be an int in \[0, 3\], got 4$"),
                                            ({"stream": lambda t: None, "stream_chunk": 0},
                                             r"^stream_chunk must be a positive int, got 0$")])
def test_generate_refuses_bad_ints_by_name(tiny_model, kwargs, message):
    """`generate`'s own integer arguments go through the same check (before anything compiles)."""
    from ling_jax.generate import generate

    kwargs = {"max_new_tokens": 1, **kwargs}
    with pytest.raises(FieldError, match=message):
        generate(tiny_model, [[1, 2]], kwargs.pop("max_new_tokens"), **kwargs)
