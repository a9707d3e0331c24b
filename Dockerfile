# The kvroute image: the router and the worker agents (`kvroute router`, `kvroute agent`).
# The Helm chart runs it as kvroute/kvroute:<appVersion>, as UID/GID 10001 on a read-only
# root filesystem, with `kvroute` as the command.
#
#   docker build -t kvroute/kvroute:0.1.0 .
#
# tests/test_packaging.py builds and checks the same wheel this file installs, and that this
# file agrees with the chart (user, command, extras), since no Docker engine runs in CI.

ARG PYTHON=3.11

# The wheels: kvroute's own (its C builds compiled here) and every dependency's.
FROM python:${PYTHON}-slim-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
# The one kvroute package, one top-level folder per part (pyproject.toml's package-dir).
COPY kvroute ./kvroute
COPY proto ./proto
COPY core ./core
COPY vendor ./vendor
COPY router ./router
COPY worker_agent ./worker_agent
COPY simulations ./simulations
# kubernetes: the chart's default worker discovery watches pods; models: router.modelSource
# (the router's tokenizer and chat template, and its agents' --model-source).
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[kubernetes,models]"

FROM python:${PYTHON}-slim-bookworm
COPY --from=build /wheels /wheels
# pip compiles the bytecode as it installs (the root filesystem is read-only at run time);
# the check fails the build unless every C build of the routing hot path is in (without
# them the router logs a warning and runs the slower pure-Python paths).
RUN pip install --no-cache-dir --no-index --find-links /wheels "kvroute[kubernetes,models]" \
    && rm -rf /wheels \
    && python -c "from kvroute.core.native import native_builds as n; b = n(); assert all(b.values()), b"
RUN groupadd --gid 10001 kvroute && useradd --uid 10001 --gid 10001 --no-create-home kvroute
# malloc's heap on transparent huge pages (where the node's THP mode is madvise or always):
# the prefix index's per-key holder lists and masks live there, and a routing walk reads
# one per block at random; with 4 KiB pages those reads also miss the TLB (a 1,000-worker
# decision: p50 -5%, p99 -18%, six runs each alternated on 2026-12-07; docs/scaling.md).
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
USER 10001:10001
# router gRPC, metrics; agent gRPC, metrics (the chart's defaults)
EXPOSE 50051 9100 50061 9101
ENTRYPOINT ["kvroute"]
CMD ["--help"]
