"""Shared bits of the controller-program examples: build steps, call the router, print."""

from __future__ import annotations

import argparse
from typing import Any

import grpc

from kvroute.core.tokenizer import ByteTokenizer
from kvroute.v1 import common_pb2, router_pb2_grpc
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders

TOK = ByteTokenizer()  # the tiny agents' vocabulary (--tokenizer byte --vocab-size 258)


def gen(max_tokens: int, **kw: Any) -> P.Step:
    return P.Step(gen=P.Gen(max_tokens=max_tokens, **kw))


def ff(text: str) -> P.Step:
    return P.Step(fast_forward=P.FastForward(text=text))


def backtrack(k: int) -> P.Step:
    return P.Step(backtrack=P.Backtrack(tokens=k))


def fork(*subs: list[P.Step], n: int = 0, select: int = P.SELECT_MODE_ALL) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=s) for s in subs], n=n,
                              select=select))


async def run_program(router: str, prompt: str, steps: list[P.Step],
                      seed: int = 0) -> list[common_pb2.GenerateResponse]:
    """Send ``prompt`` (as byte token ids) with the program to the router; collect the
    stream. Every chunk names its worker, branch and cached_tokens."""
    req = common_pb2.GenerateRequest(token_ids=TOK.encode(prompt),
                                     program=P.ControllerProgram(steps=steps),
                                     sampling=common_pb2.SamplingParams(seed=seed))
    async with grpc.aio.insecure_channel(router) as ch:
        return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(req)]


def show(resps: list[common_pb2.GenerateResponse]) -> None:
    last = resps[-1]
    print(f"  worker {last.worker_id}, {len(resps)} chunks, prompt cached_tokens "
          f"{last.usage.cached_tokens}, decoded {last.usage.completion_tokens} tokens")
    for r in last.results:
        mark = "*" if r.selected else " "
        vars_ = ", ".join(f"{k}={v.text!r}{'' if v.complete else ' (incomplete)'}"
                          for k, v in sorted(r.variables.items()))
        print(f"  {mark} branch {r.branch_id:<6} logprob {r.logprob:8.2f}  cached "
              f"{r.cached_tokens:4d}  prefilled {r.prefill_tokens:4d}  {vars_}")


def router_arg() -> str:
    p = argparse.ArgumentParser()
    p.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    return str(p.parse_args().router)
