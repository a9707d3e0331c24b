"""``kvroute redis-acl`` (kvroute/cli.py): acl_rules on one line, ACL-file lines with the
password's hash read from the environment, clear errors. The chart's use of it, against a
real redis-server, is tests/helm/test_chart_hardening.py's."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.core.redis_schema import acl_rules

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVROUTE, "redis-acl", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_rules_are_acl_rules_on_one_line() -> None:
    out = run("--role", "agent", "--model", "m", "--worker", "w-1")
    # A selector, "(~key +command)", is one rule with a space: Redis merges its words back
    # (ACL SETUSER as an aclfile line).
    assert out.returncode == 0 and out.stdout.split() == " ".join(
        acl_rules("agent", "m", "w-1")).split()
    assert "(~kvr:{m}:feed +xadd)" in out.stdout


def test_a_router_of_two_models_resets_once_and_keeps_both_models_keys() -> None:
    words = run("--role", "router", "--model", "a", "--model", "b").stdout.split()
    assert words.count("resetkeys") == 1 and words[0] == "resetkeys"
    assert set(acl_rules("router", "a")) | set(acl_rules("router", "b")) == set(words)


def test_a_user_line_holds_the_hash_not_the_password() -> None:
    out = run("--role", "router", "--model", "m", "--user", "router", "--password-env", "PW",
              PW="s3cret pw")
    assert out.returncode == 0, out.stderr
    digest = hashlib.sha256(b"s3cret pw").hexdigest()
    assert out.stdout.split()[:5] == ["user", "router", "reset", "on", f"#{digest}"]
    assert "s3cret" not in out.stdout


@pytest.mark.parametrize("args,env,message", [
    (("--role", "agent"), {}, "needs --model"),
    (("--role", "router", "--model", "m", "--worker", "w"), {}, "--worker is for --role agent"),
    (("--role", "admin", "--user", "u"), {}, "needs --password-env"),
    (("--role", "admin", "--user", "u", "--password-env", "NOPE_UNSET"), {}, "empty or unset"),
    (("--role", "agent", "--model", "m", "--worker", "a b"), {}, "worker"),
])
def test_bad_input_is_a_clear_error(args: tuple[str, ...], env: dict[str, str],
                                    message: str) -> None:
    out = run(*args, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not out.stdout
