"""The keys file's formats and checks, and the token bucket (router/auth.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.router.auth import AuthError, KeyRing, KeysFileError, hash_key, parse_keys

H1, H2 = hash_key("one"), hash_key("two")


@pytest.mark.parametrize("text", [
    f'{{"name": "a", "sha256": "{H1}"}}\n{{"name": "b", "sha256": "{H2}", "rate": 2}}\n',
    json.dumps([{"name": "a", "sha256": H1}, {"name": "b", "sha256": H2, "rate": 2}]),
    f"keys:\n  - name: a\n    sha256: {H1}\n  - name: b\n    sha256: {H2}\n    rate: 2\n",
    f"- {{name: a, sha256: {H1.upper()}}}\n- {{name: b, sha256: {H2}, rate: 2}}\n",
])
def test_formats(text: str) -> None:
    keys = parse_keys(text, "f")
    assert {k.name for k in keys.values()} == {"a", "b"}
    assert keys[H2].rate == 2 and keys[H2].burst == 2 and keys[H1].rate == 0


@pytest.mark.parametrize("rec, words", [
    ({"name": "a", "sha256": "one"}, "64 hex digits"),
    ({"name": "", "sha256": H1}, "name must be"),
    ({"name": "a", "sha256": H1, "rate": -1}, "rate must be"),
    ({"name": "a", "sha256": H1, "rate": float("nan")}, "rate must be"),
    ({"name": "a", "sha256": H1, "rate": True}, "rate must be"),
    ({"name": "a", "sha256": H1, "burst": 3}, "burst needs a rate"),
    ({"name": "a", "sha256": H1, "models": "m"}, "models must be"),
    ({"name": "a", "sha256": H1, "key": "one"}, "unknown fields"),
    ("just a string", "must be a mapping"),
])
def test_bad_records_are_named(rec: object, words: str) -> None:
    with pytest.raises(KeysFileError, match=words) as err:
        parse_keys(json.dumps([rec]), "keys.json")
    assert "record 1" in str(err.value)


def test_json_numbers_are_numbers_in_a_one_line_file() -> None:
    (key,) = parse_keys(f'{{"name": "a", "sha256": "{H1}", "rate": 1e6}}\n', "f").values()
    assert key.rate == 1e6


def test_a_key_or_name_twice_is_refused() -> None:
    with pytest.raises(KeysFileError, match="given twice"):
        parse_keys(json.dumps([{"name": "a", "sha256": H1}, {"name": "a", "sha256": H2}]), "f")
    with pytest.raises(KeysFileError, match="not JSON lines, JSON or YAML"):
        parse_keys("{: [", "f")


def test_bucket_refills_at_its_rate(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps([{"name": "a", "sha256": H1, "rate": 2, "burst": 3,
                              "models": ["m"]}]))
    ring = KeyRing(str(f))
    key = ring.check("Bearer one", "m")
    for _ in range(3):
        ring.admit(key, now=100.0)
    with pytest.raises(AuthError) as err:
        ring.admit(key, now=100.0)
    assert err.value.reason == "rate" and err.value.retry_after == pytest.approx(0.5)
    assert err.value.retry_after_s == 1
    ring.admit(key, now=100.5)  # one token back after 1/rate s
    with pytest.raises(AuthError):
        ring.admit(key, now=100.6)
    ring.admit(key, now=110.0)  # full again, never more than the burst
    ring.admit(key, now=110.0)
    ring.admit(key, now=110.0)
    with pytest.raises(AuthError):
        ring.admit(key, now=110.0)
    with pytest.raises(AuthError) as denied:
        ring.check("Bearer one", "other")
    assert denied.value.reason == "model"
    for header, reason in ((None, "missing"), ("", "missing"), ("Bearer", "missing"),
                           ("Token one", "missing"), ("Bearer two", "invalid")):
        with pytest.raises(AuthError) as e:
            ring.check(header, None)
        assert e.value.reason == reason and "one" not in e.value.message
