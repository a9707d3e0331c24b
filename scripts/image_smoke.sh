#!/usr/bin/env bash
# Run the kvroute image as the Helm chart runs it (UID 10001, read-only root filesystem): two
# tiny agents and a router on the host network, a Redis on the host, then the controller
# program examples through the router and a look at every metrics endpoint.
#
#   scripts/image_smoke.sh [IMAGE]          (default kvroute/kvroute:0.1.0, from `make image`)
#
# CONTAINER picks the engine command, global flags allowed (default: docker if it is on PATH,
# else podman; e.g. "podman --runtime runc"); RUN_FLAGS adds flags to each `run` (a sandbox
# may need e.g. "--ulimit nofile=1024:1024"). Needs
# redis-server on PATH and the repository's venv (`make setup`) for the examples' client.
set -euo pipefail
IMAGE=${1:-kvroute/kvroute:0.1.0}
CONTAINER=${CONTAINER:-$(command -v docker >/dev/null && echo docker || echo podman)}
RUN_FLAGS=${RUN_FLAGS:-}
cd "$(dirname "$0")/.."
PY=.venv/bin/python
REDIS_PORT=16379 ROUTER_PORT=15051 ROUTER_METRICS=15100 AGENT_PORT=1506 AGENT_METRICS=1511
names=(kvr-smoke-a0 kvr-smoke-a1 kvr-smoke-router)

cleanup() {
  for n in "${names[@]}"; do
    $CONTAINER logs "$n" > "/tmp/$n.log" 2>&1 || true
    $CONTAINER rm -f "$n" >/dev/null 2>&1 || true
  done
  [ -f /tmp/kvr-smoke-redis.pid ] && kill "$(cat /tmp/kvr-smoke-redis.pid)" 2>/dev/null || true
}
trap cleanup EXIT

redis-server --port $REDIS_PORT --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile /tmp/kvr-smoke-redis.pid
run() {
  # shellcheck disable=SC2086  # RUN_FLAGS is a list of flags
  $CONTAINER run -d --network host --read-only --user 10001:10001 $RUN_FLAGS --name "$@" >/dev/null
}
for i in 0 1; do
  run kvr-smoke-a$i "$IMAGE" agent --engine tiny --tokenizer byte --vocab-size 258 \
    --redis redis://127.0.0.1:$REDIS_PORT --host 127.0.0.1 --port $AGENT_PORT$i \
    --metrics-port $AGENT_METRICS$i --worker-id a$i --advertise 127.0.0.1:$AGENT_PORT$i
done
run kvr-smoke-router "$IMAGE" router --redis redis://127.0.0.1:$REDIS_PORT --host 127.0.0.1 \
  --port $ROUTER_PORT --metrics-port $ROUTER_METRICS --vocab-size 258 --tokenizer byte

for port in $ROUTER_METRICS ${AGENT_METRICS}0 ${AGENT_METRICS}1; do
  for _ in $(seq 50); do curl -fs "127.0.0.1:$port/metrics" >/dev/null && break; sleep 0.2; done
done
timeout 120 $PY examples/run_all.py --router 127.0.0.1:$ROUTER_PORT
for port in $ROUTER_METRICS ${AGENT_METRICS}0 ${AGENT_METRICS}1; do
  echo "metrics on :$port: $(curl -fs "127.0.0.1:$port/metrics" | grep -c '^kvroute_') kvroute series"
done
curl -fs "127.0.0.1:$ROUTER_METRICS/metrics" | grep '^kvroute_router_requests_total'
# SIGTERM (what Kubernetes sends) must stop each container well within its grace period.
for n in "${names[@]}"; do
  start=$(date +%s)
  $CONTAINER stop -t 20 "$n" >/dev/null
  echo "$n stopped in $(( $(date +%s) - start )) s"
done
echo "image smoke test passed: $IMAGE"
