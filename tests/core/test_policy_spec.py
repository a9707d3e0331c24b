"""Policy specs: a registry name with parameter overrides, checked before anything runs."""

from __future__ import annotations

import pytest

from kvroute.core.policies import REGISTRY, KvrouteCost, make_policy, parameters
from kvroute.core.policies.spec import parse_spec


def test_a_spec_is_a_name_and_overrides() -> None:
    assert parse_spec(" kvroute : hold=2 :batch_weight= 1.5") == \
        ("kvroute", {"hold": "2", "batch_weight": "1.5"})
    assert parse_spec("llmd") == ("llmd", {})


def test_overrides_are_typed_and_name_the_variant() -> None:
    p = make_policy("kvroute:hold=2:batch_tokens=2048:hold_min=0.25")
    assert isinstance(p, KvrouteCost)
    assert (p.hold, p.batch_tokens, p.hold_min) == (2.0, 2048, 0.25)
    assert isinstance(p.batch_tokens, int) and isinstance(p.hold, float)
    assert p.name == "kvroute:hold=2:batch_tokens=2048:hold_min=0.25"
    assert p.miss_weight == KvrouteCost().miss_weight  # the rest keeps its defaults
    # A registry variant keeps its own settings under the overrides.
    f = make_policy("kvroute_fetch:hold=1")
    assert (f.transfer_cost, f.hold, f.name) == (0.122, 1.0, "kvroute_fetch:hold=1")
    assert make_policy("kvroute").name == "kvroute"


def test_the_seed_reaches_randomised_policies_unless_the_spec_sets_it() -> None:
    assert make_policy("random", seed=7).seed == 7
    assert make_policy("random", seed=7).name == "random"
    assert make_policy("random:seed=5", seed=7).seed == 5
    assert make_policy("kvroute", seed=7) == KvrouteCost()  # no seed to take


@pytest.mark.parametrize(("spec", "error"), [
    ("nope", "unknown policy 'nope'; choose one of: "),
    ("kvroute:hold", "expected kvroute:PARAM=VALUE, got 'hold'"),
    ("kvroute:=2", "expected kvroute:PARAM=VALUE"),
    ("kvroute:nope=1", "no parameter nope; kvroute takes: miss_weight, "),
    ("round_robin:x=1", "round_robin takes: none"),
    ("kvroute:hold=x", "hold takes a number, got 'x'"),
    ("kvroute:batch_tokens=2.5", "batch_tokens takes a whole number"),
    ("kvroute:hold=-1", "must be a finite number >= 0"),
    ("kvroute:hold=inf", "must be a finite number >= 0"),
    ("kvroute:hold=1:hold=2", "hold given twice"),
    ("kvroute:name=x", "no parameter name"),
    ("kvroute:hold_min=1.5", "hold_min is a fraction of the prompt, in [0, 1]"),
    ("kvroute:transfer_cost=0", "transfer_cost is a fetch's cost"),
    ("kvroute:batch_tokens=0", "batch_tokens must be >= 1"),
    ("chwbl:load_factor=0.9", "load_factor must be >= 1"),
])
def test_bad_specs_say_what_is_wrong(spec: str, error: str) -> None:
    with pytest.raises(ValueError) as err:
        make_policy(spec)
    assert error in str(err.value)


def test_every_registered_policy_lists_parameters_that_can_be_set_back() -> None:
    for name, factory in REGISTRY.items():
        params = parameters(factory())
        assert "name" not in params and not any(k.startswith("_") for k in params)
        if params:  # each default, given back as an override, builds the same policy
            spec = ":".join([name, *(f"{k}={v}" for k, v in params.items())])
            again = make_policy(spec)
            assert parameters(again) == params and again.name == spec
