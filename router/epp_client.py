"""An ext_proc client that sends what Envoy sends an endpoint picker for one HTTP request: for
the tests and bench/epp.py (no Envoy binary runs here), and to try a deployed ``kvroute
epp`` by hand::

    python -m kvroute.router.epp_client HOST:PORT body.json [--path /v1/completions]

The message sequence of Envoy's ext_proc filter in FULL_DUPLEX_STREAMED mode (the mode the
Inference Extension's gateways configure): the request headers (with the protocol
configuration, as recent Envoy versions send it on the first message, and the
``envoy.lb.subset_hint`` metadata when given), the body in chunks, the last with
``end_of_stream``; then it waits for the picker's headers and body responses; once the
upstream answers, the response headers (``envoy.lb`` /
``x-gateway-destination-endpoint-served`` in the metadata context) and the response body
chunks, each answered before the next is sent on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import struct_pb2

from kvroute.envoy_api.envoy.config.core.v3 import base_pb2
from kvroute.envoy_api.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from kvroute.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvroute.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from kvroute.router.epp_protocol import (
    DESTINATION,
    FALLBACK,
    LB_NAMESPACE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
)

_MODE = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _MODE.FULL_DUPLEX_STREAMED
BUFFERED = _MODE.BUFFERED


@dataclass
class Upstream:
    """What the model server answered: status, headers, body chunks."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {
        "content-type": "application/json"})
    chunks: Sequence[bytes] = ()


# The upstream the gateway sends to, given the picked endpoint and the body sent on.
Serve = Callable[[str, bytes], Awaitable[Upstream]]


@dataclass
class Outcome:
    """What the picker answered, in the order it came."""

    responses: list[ep.ProcessingResponse] = field(default_factory=list)
    immediate: ep.ImmediateResponse | None = None
    endpoint: str = ""  # the destination header
    metadata_endpoint: str = ""  # the same in the dynamic metadata
    fallback: list[str] = field(default_factory=list)
    clear_route_cache: bool = False
    body_sent: bytes = b""  # the request body the gateway forwards (what the picker sent back)
    response_body: bytes = b""  # the response body the client gets

    @property
    def status(self) -> int:
        return self.immediate.status.code if self.immediate is not None else 0

    def error(self) -> dict[str, object]:
        assert self.immediate is not None
        return json.loads(self.immediate.body)


def _headers(pairs: dict[str, str], end: bool) -> ep.HttpHeaders:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                     for k, v in pairs.items()])
    return ep.HttpHeaders(headers=hm, end_of_stream=end)


def _metadata(namespace: str, values: dict[str, object]) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update(values)
    md = base_pb2.Metadata()
    md.filter_metadata[namespace].CopyFrom(s)
    return md


def _take(out: Outcome, resp: ep.ProcessingResponse) -> None:
    out.responses.append(resp)
    kind = resp.WhichOneof("response")
    if kind == "immediate_response":
        out.immediate = resp.immediate_response
        return
    common = getattr(resp, kind).response
    for h in common.header_mutation.set_headers:
        if h.header.key == DESTINATION:
            out.endpoint = (h.header.raw_value.decode() if h.header.raw_value
                            else h.header.value)
    if common.clear_route_cache:
        out.clear_route_cache = True
    lb = resp.dynamic_metadata.fields.get(LB_NAMESPACE)
    if lb is not None:
        fields = lb.struct_value.fields
        if DESTINATION in fields:
            out.metadata_endpoint = fields[DESTINATION].string_value
        if FALLBACK in fields:
            out.fallback = [e for e in fields[FALLBACK].string_value.split(",") if e]
    if common.body_mutation.HasField("streamed_response"):
        body = common.body_mutation.streamed_response.body
        if kind == "request_body":
            out.body_sent += body
        elif kind == "response_body":
            out.response_body += body


class _Stream:
    """One ``Process`` stream as Envoy runs it: the answers are read while the request still
    goes out (an immediate response may come before the last chunk is sent, and then nothing
    more is sent), each taken into ``out``."""

    def __init__(self, stub: ep_grpc.ExternalProcessorStub, timeout_s: float) -> None:
        self.call = stub.Process(timeout=timeout_s)
        self.out = Outcome()
        self._answers: asyncio.Queue[ep.ProcessingResponse | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read_all())

    async def _read_all(self) -> None:
        try:
            while (resp := await self.call.read()) is not grpc.aio.EOF:
                _take(self.out, resp)
                await self._answers.put(resp)
        except grpc.aio.AioRpcError:
            pass  # the stream failed or was cancelled: no more answers
        finally:
            await self._answers.put(None)

    async def answer(self) -> ep.ProcessingResponse | None:
        """The next answer; None once the stream has ended."""
        return await self._answers.get()

    async def ended(self) -> bool:
        """Wait for an answer: True when there is none or it was an immediate response."""
        return await self.answer() is None or self.out.immediate is not None

    async def send(self, msg: ep.ProcessingRequest) -> bool:
        """False when the picker has ended the stream (an immediate response)."""
        if self.out.immediate is not None:
            return False
        try:
            await self.call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False
        return True

    async def request(self, body: bytes, path: str, mode: int, subset: Sequence[str] | None,
                      chunk_bytes: int) -> bool:
        """The request phase: headers (with the protocol's configuration and the subset
        hint), then the body in chunks. False when the picker ended the stream."""
        first = ep.ProcessingRequest(
            request_headers=_headers({":method": "POST", ":path": path,
                                      ":authority": "gateway", ":scheme": "http",
                                      "content-type": "application/json",
                                      "content-length": str(len(body))}, end=not body),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=mode,
                                                     response_body_mode=mode))
        if subset is not None:
            first.metadata_context.CopyFrom(_metadata(SUBSET_NAMESPACE,
                                                      {SUBSET: list(subset)}))
        await self.send(first)
        if mode != FULL_DUPLEX and body and await self.ended():
            return False  # BUFFERED: the headers are answered before the body goes
        pieces = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)]
        for i, piece in enumerate(pieces):
            if not await self.send(ep.ProcessingRequest(request_body=ep.HttpBody(
                    body=piece, end_of_stream=i == len(pieces) - 1))):
                break
            if mode != FULL_DUPLEX and i < len(pieces) - 1 and await self.ended():
                return False
        # The request phase ends with the body response (after the headers response, in
        # duplex mode), the headers response for a request without a body, or an
        # immediate response.
        want = "request_body" if body else "request_headers"
        while self.out.immediate is None:
            resp = await self.answer()
            if resp is None:
                return False
            if resp.WhichOneof("response") == want:
                break
        return self.out.immediate is None

    async def response(self, up: Upstream, served: str,
                       after_headers: Callable[[], Awaitable[None]] | None) -> None:
        """The response phase: the upstream's headers (with the endpoint the gateway reports
        as having served it), then its body chunks; the stream then closes."""
        headers = {":status": str(up.status), **up.headers}
        msg = ep.ProcessingRequest(response_headers=_headers(headers, end=not up.chunks))
        msg.metadata_context.CopyFrom(_metadata(LB_NAMESPACE, {SERVED: served}))
        if await self.send(msg):
            await self.answer()
        if after_headers is not None:
            await after_headers()
        for i, piece in enumerate(up.chunks):
            if not await self.send(ep.ProcessingRequest(response_body=ep.HttpBody(
                    body=piece, end_of_stream=i == len(up.chunks) - 1))):
                break
            await self.answer()
        await self.call.done_writing()
        while await self.answer() is not None:
            pass

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def exchange(stub: ep_grpc.ExternalProcessorStub, body: bytes, *,
                   path: str = "/v1/chat/completions", chunk_bytes: int = 16384,
                   mode: int = FULL_DUPLEX, subset: Sequence[str] | None = None,
                   serve: Serve | None = None, served: str | None = None,
                   after_headers: Callable[[], Awaitable[None]] | None = None,
                   timeout_s: float = 30.0) -> Outcome:
    """One HTTP request through the picker, as Envoy runs it. ``serve`` plays the upstream
    (none: the exchange stops after the request phase, as when the client goes away);
    ``served``: the endpoint the gateway reports as having served it (default: the picked
    one); ``after_headers``: awaited once the response headers are answered, before the
    response body goes (a test looks at the picker's state mid-response there)."""
    stream = _Stream(stub, timeout_s)
    out = stream.out
    try:
        if not await stream.request(body, path, mode, subset, chunk_bytes) or serve is None:
            return out
        up = await serve(out.endpoint, out.body_sent if mode == FULL_DUPLEX else body)
        await stream.response(up, served if served is not None else out.endpoint,
                              after_headers)
        return out
    finally:
        await stream.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Send one request body to an endpoint picker as "
                                "Envoy does; print what it picked.")
    p.add_argument("target", help="HOST:PORT of kvroute epp")
    p.add_argument("body", help="a JSON request body file ('-': stdin)")
    p.add_argument("--path", default="/v1/chat/completions")
    args = p.parse_args(argv)
    raw = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()

    async def run() -> Outcome:
        async with grpc.aio.insecure_channel(args.target) as ch:
            return await exchange(ep_grpc.ExternalProcessorStub(ch), raw, path=args.path)

    out = asyncio.run(run())
    if out.immediate is not None:
        print(json.dumps({"status": out.status, "body": out.error()}))
        return 1
    print(json.dumps({"endpoint": out.endpoint, "fallback": out.fallback}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
