"""Free loopback ports for the processes one run starts (the demo, the tests)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field


@dataclass
class PortPool:
    """Hands out free 127.0.0.1 ports, never the same one twice.

    A port is only reserved once its server binds it, so two ports picked before either
    binds can be the same number (the OS reuses a just-closed one); gRPC binds with
    SO_REUSEPORT, so two of our servers given one port would even both start. Remembering
    every port handed out rules that out.
    """

    _taken: set[int] = field(default_factory=set)

    def take(self) -> int:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in self._taken:
                self._taken.add(port)
                return port
