"""Policy specs: a registry name with parameter overrides, checked before anything runs."""

from __future__ import annotations

import pytest

from kvroute.core.policies import REGISTRY, Kvroute, make_policy, parameters
from kvroute.core.policies.spec import parse_spec


def test_a_spec_is_a_name_and_overrides() -> None:
    assert parse_spec(" kvroute : delay=2 :reuse= 0.25") == \
        ("kvroute", {"delay": "2", "reuse": "0.25"})
    assert parse_spec("llmd") == ("llmd", {})


def test_overrides_are_typed_and_name_the_variant() -> None:
    p = make_policy("kvroute:delay=2:reuse=0.25")
    assert isinstance(p, Kvroute)
    assert (p.delay, p.reuse) == (2.0, 0.25) and isinstance(p.delay, float)
    assert p.name == "kvroute:delay=2:reuse=0.25"
    assert p.attn == Kvroute().attn  # the rest keeps its defaults
    assert make_policy("kvroute").name == "kvroute"


def test_the_seed_reaches_randomised_policies_unless_the_spec_sets_it() -> None:
    from kvroute.simulations.policies import make_replay_policy

    assert make_replay_policy("random", seed=7).seed == 7  # type: ignore[attr-defined]
    assert make_replay_policy("random", seed=7).name == "random"
    assert make_replay_policy("random:seed=5", seed=7).seed == 5  # type: ignore[attr-defined]
    assert make_policy("kvroute", seed=7) == Kvroute()  # no seed to take


@pytest.mark.parametrize(("spec", "error"), [
    ("nope", "unknown policy 'nope'; choose one of: "),
    ("kvroute:delay", "expected kvroute:PARAM=VALUE, got 'delay'"),
    ("kvroute:=2", "expected kvroute:PARAM=VALUE"),
    ("kvroute:nope=1", "no parameter nope; kvroute takes: attn, decode, unit_s, delay, "
                       "most_busy, reuse"),
    ("round_robin:x=1", "round_robin takes: none"),
    ("kvroute:delay=x", "delay takes a number, got 'x'"),
    ("kvroute:delay=-1", "must be a finite number >= 0"),
    ("kvroute:delay=inf", "must be a finite number >= 0"),
    ("kvroute:delay=1:delay=2", "delay given twice"),
    ("kvroute:name=x", "no parameter name"),
    ("kvroute:reuse=1.5", "reuse must be a finite number in [0, 1] (chance an evicted cache "
                          "block is asked for again"),
])
def test_bad_specs_say_what_is_wrong(spec: str, error: str) -> None:
    with pytest.raises(ValueError) as err:
        make_policy(spec)
    assert error in str(err.value)


def test_a_peers_spec_is_checked_by_the_replay() -> None:
    from kvroute.simulations.policies import make_replay_policy

    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        make_replay_policy("chwbl:load_factor=0.9")
    with pytest.raises(ValueError, match="whole number"):
        make_replay_policy("chwbl:replication=2.5")


def test_every_registered_policy_lists_parameters_that_can_be_set_back() -> None:
    from kvroute.simulations.policies import REPLAY_REGISTRY, make_replay_policy

    assert REPLAY_REGISTRY.keys() >= REGISTRY.keys()
    for name, factory in REPLAY_REGISTRY.items():
        params = parameters(factory())
        assert "name" not in params and not any(k.startswith("_") for k in params)
        if params:  # each default, given back as an override, builds the same policy
            spec = ":".join([name, *(f"{k}={v}" for k, v in params.items())])
            again = make_replay_policy(spec)
            assert parameters(again) == params and again.name == spec
