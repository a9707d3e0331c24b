"""A GenerateRequest's token ids without a Python int per token.

upb's repeated-field container makes one Python int per element it hands out, at ~55 ns
each: for an 8k-token prompt ``list(req.token_ids)`` took ~450 µs and ``max()`` ~650 µs,
several times the whole routing decision. Here the field is read as the bytes of its packed
encoding (the request's wire bytes parsed by a one-field view message, in C) and its varints
decoded in C (``core/_native/wire.c``) into an ``array('I')``: 4 bytes per id and no
objects, which the C block hasher reads in place. The wire bytes are the ones gRPC received
(the router and the agent keep them: ``kvroute.core.grpc_util.Received``), else the parsed
request re-serialized (~70 µs for 8k ids), which upb always writes packed.

A client may legally write the ids unpacked, or as several packed records: the view then
finds fewer ids than the parsed request holds, and the next source is used. Without the C
build the ids come from the container (same values, slower).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kvroute.v1 import common_pb2

try:  # the optional C build (setup.py)
    from kvroute.core._wire import unpack_uint32 as _unpack
except ImportError:  # pragma: no cover - depends on the build
    _unpack = None

NATIVE_AVAILABLE = _unpack is not None


def _packed_view(field: str) -> type:
    """A message whose only field is ``field`` of GenerateRequest (same number) as ``bytes``:
    parsing a GenerateRequest with it yields the field's packed payload, and skips the rest
    as unknown fields."""
    number = common_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[field].number
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"kvroute/internal/{field}_view.proto", package="kvroute.internal",
        syntax="proto3")
    msg = fdp.message_type.add(name="PackedView")
    msg.field.add(name="payload", number=number,
                  type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()  # private: nothing else sees this message
    pool.Add(fdp)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("kvroute.internal.PackedView"))


_TOKEN_IDS_VIEW = _packed_view("token_ids")  # built once: a type, like a generated _pb2


def _packed_ids(wire: bytes, count: int) -> tuple[array, int] | None:
    """The token ids in ``wire`` (a serialized GenerateRequest) and the largest, if they are
    all there as one packed record: ``count`` of them."""
    assert _unpack is not None
    data, top = _unpack(_TOKEN_IDS_VIEW.FromString(wire).payload)
    ids = array("I")
    ids.frombytes(data)
    return (ids, top) if len(ids) == count else None


def request_token_ids(req: common_pb2.GenerateRequest, wire: bytes | None = None
                      ) -> tuple[Sequence[int], int]:
    """``(ids, largest id)`` of ``req.token_ids``; ids as an ``array('I')`` when the C
    decoder is built, else a list. ``wire`` is the bytes ``req`` was parsed from, if known.
    The largest is 0 for an empty prompt."""
    n = len(req.token_ids)
    if n and _unpack is not None:
        got = _packed_ids(wire, n) if wire is not None else None
        if got is None:
            got = _packed_ids(req.SerializeToString(), n)
        if got is not None:
            return got
    ids = req.token_ids[:]  # a slice is the container's fastest copy
    return ids, max(ids, default=0)


def with_string_field(wire: bytes, field: str, value: str) -> bytes:
    """``wire`` (a serialized GenerateRequest) with the string ``field`` set to ``value``. A
    parser keeps the last occurrence of a singular field (concatenated messages merge), so
    appending the field sets it; the rest of the request is not serialized again."""
    number = common_pb2.GenerateRequest.DESCRIPTOR.fields_by_name[field].number
    data = value.encode()
    return wire + varint(number << 3 | 2) + varint(len(data)) + data


def varint(v: int) -> bytes:
    """Protobuf's base-128 varint encoding of ``v`` >= 0."""
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)
