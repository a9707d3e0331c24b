"""--grpc-reflection (core/grpc_util.py add_standard_services): off, neither the router nor
an agent answers reflection (the real grpcurl cannot list them) while health checks and
calls with the .proto files still work; the default (on) is tests/test_grpc_surface.py's."""

from __future__ import annotations

import asyncio
import subprocess

from tests.support import wait_for
from tests.test_grpc_surface import grpcurl
from tests.tools import ROOT


async def grpcurl_rc(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        grpcurl(), "-plaintext", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, (out + err).decode()


async def test_reflection_off_hides_the_methods_but_not_the_service(cluster) -> None:
    agent = await cluster.agent("w0", grpc_reflection=False)
    router = await cluster.router(grpc_reflection=False)
    await wait_for(lambda: set(router.registry.loads) == {"w0"}, what="w0 registered")
    for port in (router.port, agent.port):
        rc, out = await grpcurl_rc(f"127.0.0.1:{port}", "list")
        assert rc != 0 and "reflection" in out.lower(), out
    # The service itself is unchanged: a call with the .proto files is answered.
    proto = ["-import-path", str(ROOT / "proto"), "-proto", "kvroute/v1/router.proto"]
    rc, out = await grpcurl_rc(*proto, "-d", '{"model": "default", "token_ids": [1, 2, 3]}',
                               f"127.0.0.1:{router.port}", "kvroute.v1.Router/Route")
    assert rc == 0 and "w0" in out, out
