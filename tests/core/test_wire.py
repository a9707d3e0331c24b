"""Token ids off the wire: the same ids as the protobuf container, in an array('I')."""

from __future__ import annotations

import random
from array import array

import pytest

from kvroute.core import wire
from kvroute.core.wire import request_token_ids, varint, with_string_field
from kvroute.v1 import common_pb2, program_pb2
from tests.support import token_ids_wire


def received(**fields: object) -> common_pb2.GenerateRequest:
    """A request as a server gets it: serialized, then parsed."""
    sent = common_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    return common_pb2.GenerateRequest.FromString(sent.SerializeToString())


def test_same_ids_and_max_as_the_container() -> None:
    assert wire.NATIVE_AVAILABLE, "kvroute.core._wire was not built; see setup.py"
    rng = random.Random(3)
    for n in (1, 2, 127, 128, 8192):
        toks = [rng.choice([0, 1, 127, 128, 16383, 16384, 2**21, 2**28, 2**32 - 1,
                            rng.randrange(2**32)]) for _ in range(n)]
        req = received(token_ids=toks, model="m", cache_salt="s", session_id="x",
                       sampling=common_pb2.SamplingParams(max_tokens=3, stop_token_ids=[7, 9]),
                       program=program_pb2.ControllerProgram())
        ids, top = request_token_ids(req)
        assert isinstance(ids, array) and ids.typecode == "I"
        assert list(ids) == toks and top == max(toks)


def test_an_empty_prompt() -> None:
    ids, top = request_token_ids(received(text="hi"))
    assert list(ids) == [] and top == 0


@pytest.mark.parametrize("how", ["packed", "unpacked", "split"])
def test_every_valid_encoding_of_the_ids_reads_the_same(how: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # proto3 parsers must accept a repeated scalar written unpacked (a record per value) or
    # in several packed records; the view then sees fewer ids than the request holds, and
    # the ids are read from the request re-serialized (upb writes them as one record).
    toks = [5, 300, 2**32 - 1, 0, 17]
    wire_bytes = token_ids_wire(toks, how) + b"\x1a\x01m"  # + model="m"
    req = common_pb2.GenerateRequest.FromString(wire_bytes)
    assert list(req.token_ids) == toks and req.model == "m"
    serialized = 0
    real = common_pb2.GenerateRequest.SerializeToString

    def counting(msg: common_pb2.GenerateRequest) -> bytes:
        nonlocal serialized
        serialized += 1
        return real(msg)

    monkeypatch.setattr(common_pb2.GenerateRequest, "SerializeToString", counting)
    ids, top = request_token_ids(req, wire_bytes)
    assert list(ids) == toks and top == 2**32 - 1 and isinstance(ids, array)
    assert serialized == (0 if how == "packed" else 1)  # the received bytes served when whole


def test_without_the_c_decoder_the_container_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "_unpack", None)
    ids, top = request_token_ids(received(token_ids=[4, 9, 2]))
    assert ids == [4, 9, 2] and top == 9


def test_the_decoder_reads_uint32_varints_as_protobuf_does() -> None:
    unpack = wire._unpack
    assert unpack is not None
    values = [0, 1, 127, 128, 2**32 - 1, 2**40 + 5, 2**64 - 1]
    payload = b"".join(varint(v) for v in values)
    data, top = unpack(payload)
    got = array("I")
    got.frombytes(data)
    # A uint32 field keeps a longer varint's low 32 bits: upb parses the same payload so.
    parsed = common_pb2.GenerateRequest.FromString(b"\x0a" + varint(len(payload)) + payload)
    assert list(got) == list(parsed.token_ids) == [v & 0xFFFFFFFF for v in values]
    assert top == 2**32 - 1
    assert unpack(b"") == (b"", 0)
    with pytest.raises(ValueError, match="truncated varint at value 1"):
        unpack(b"\x05\x80")
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        unpack(b"\xff" * 11 + b"\x01")
    with pytest.raises(TypeError):
        unpack("not bytes")  # type: ignore[arg-type]


def test_a_string_field_appended_to_the_wire_sets_it() -> None:
    sent = common_pb2.GenerateRequest(token_ids=[1, 2, 3], model="m", session_id="s",
                                      sampling=common_pb2.SamplingParams(max_tokens=4))
    for rid in ("r1", "é" * 100, ""):  # a length past 127 takes a two-byte varint
        got = common_pb2.GenerateRequest.FromString(
            with_string_field(sent.SerializeToString(), "request_id", rid))
        want = common_pb2.GenerateRequest()
        want.CopyFrom(sent)
        want.request_id = rid
        assert got == want
    assert [varint(v) for v in (0, 127, 128, 300)] == [b"\x00", b"\x7f", b"\x80\x01",
                                                        b"\xac\x02"]
