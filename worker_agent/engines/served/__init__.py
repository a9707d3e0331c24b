"""What the agent needs of an inference server it follows from outside: vLLM's and SGLang's
adapters both build on it.

Modules, one job each:

* :mod:`.wire` -- KV-event frames and msgpack payloads (vLLM's design, which SGLang adopted),
  every released layout of both
* :mod:`.blockmap` -- engine block hashes -> kvroute keys; what the engine holds, per tier
* :mod:`.subscriber` -- ZMQ SUB + replay, seq tracking, gap healing, resets
* :mod:`.poller` -- the server's ``/metrics``, polled in the background
* :mod:`.metrics` -- the adapter families it adds to the agent's ``/metrics``
* :mod:`.stream` -- a generation's chunks and the server-sent-events reader
* :mod:`.engine` -- :class:`~.engine.EventedEngine`, the Engine protocol on top of these
"""
