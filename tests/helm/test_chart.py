"""The Helm chart: lint, render for every CI values file, validate each manifest against the
Kubernetes schemas, and check that the rendered parts fit together (the router's selector
finds the worker pods, flags parse with kvroute's own CLI, RBAC is exactly what discovery
uses, Redis URLs resolve to the right Secret and Service)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.connection import parse_url

from kvroute.cli import build_parser
from kvroute.core.config import AgentConfig, EppConfig, RouterConfig
from kvroute.core.policies import make_policy
from kvroute.core.settings import from_env
from tests.helm.chart import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    RELEASE,
    Manifests,
    container,
    env_of,
    expand,
    flag,
    leaf_keys,
    pod_spec,
    run_helm,
    selector_matches,
    template,
)
from tests.tools import ROOT, kubernetes_validate

# No schema offline: checked below instead (the InferencePool against its vendored CRD in
# tests/helm/test_epp_chart.py).
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute", "Certificate"}
VALUES_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, str]:
    return {p.name.removesuffix("-values.yaml"): template(helm, p) for p in CI_VALUES}


def manifests(rendered: dict[str, str], name: str) -> Manifests:
    return Manifests.parse(rendered[name])


def test_ci_values_files_cover_the_cases() -> None:
    assert set(VALUES_IDS) >= {"defaults", "external-redis", "agent-only", "everything"}


@pytest.mark.parametrize("values", CI_VALUES, ids=VALUES_IDS)
def test_lint_strict(helm: Path, values: Path) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("name", VALUES_IDS)
def test_manifests_validate_strictly(rendered: dict[str, str], name: str,
                                     tmp_path: Path) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(rendered[name])
    proc = subprocess.run([kubernetes_validate(), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for line in out.splitlines():
        # Only the Prometheus Operator's CRDs lack a schema here; anything else is a miss.
        if line.startswith("WARN"):
            assert any(f"kind {k} " in line for k in CRD_KINDS), line
    assert "ERROR" not in out and "FATAL" not in out


# -- the router -------------------------------------------------------------------------------


def test_router_deployment(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "defaults")
    dep = m.one("Deployment", "-router")
    assert dep["spec"]["replicas"] == 2
    c = container(dep, "router")
    # Alive while the HTTP front answers; ready while the gRPC Router service is serving.
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "service": "kvroute.v1.Router"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051,
                                                                   "metrics": 9100,
                                                                   "http": 8000}
    aff = pod_spec(dep)["affinity"]["podAntiAffinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in aff
    pdb = m.one("PodDisruptionBudget", "-router")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()
    assert "HorizontalPodAutoscaler" not in m.kinds()
    svc = m.one("Service", "-router")
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        (50051, "grpc"), (8000, "http")]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert m.one("Service", "-router-metrics")["spec"]["ports"][0]["targetPort"] == "metrics"


def test_router_env_is_a_valid_config(rendered: dict[str, str]) -> None:
    """Every KVROUTE_* variable names a RouterConfig field and parses as its type."""
    for name in VALUES_IDS:
        dep = manifests(rendered, name).one("Deployment", "-router")
        c = container(dep, "router")
        # epp.enabled runs the router as the InferencePool's endpoint picker (kvroute epp).
        assert c["command"] == ["kvroute"] and c["args"][0] in ("router", "epp")
        cls = EppConfig if c["args"][0] == "epp" else RouterConfig
        build_parser().parse_args(c["args"])
        env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
        assert not any("$(" in v for v in env.values())  # nothing for the kubelet to expand
        fields = {s.env for s in cls.settings()}
        unknown = {k for k in env if k.startswith("KVROUTE_")} - fields
        assert not unknown, f"{name}: env vars that configure nothing: {unknown}"
        cfg = from_env(cls, env)
        listen = cfg.listen
        assert (listen.host, listen.port, listen.metrics_port) == ("0.0.0.0", 50051, 9100)


def test_discovery_selector_finds_the_worker_pods_and_rbac_is_exact(
        rendered: dict[str, str]) -> None:
    m = manifests(rendered, "defaults")
    dep = m.one("Deployment", "-router")
    c = container(dep, "router")
    env = env_of(c)
    assert env["KVROUTE_DISCOVERY"] == "kubernetes"
    assert env["KVROUTE_K8S_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    sts = m.one("StatefulSet", "-worker")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(env["KVROUTE_K8S_SELECTOR"], pod_labels)
    for other in (m.one("StatefulSet", "-redis"), dep):
        assert not selector_matches(env["KVROUTE_K8S_SELECTOR"],
                                    other["spec"]["template"]["metadata"]["labels"])
    agent_ports = {p["name"]: p["containerPort"] for p in container(sts, "agent")["ports"]}
    assert int(env["KVROUTE_K8S_PORT"]) == agent_ports["grpc"]

    role = m.one("Role", "-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["list", "watch"]}]
    rb = m.one("RoleBinding", "-router")
    sa = pod_spec(dep)["serviceAccountName"]
    assert rb["roleRef"]["name"] == role["metadata"]["name"]
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    assert pod_spec(dep)["automountServiceAccountToken"] is True
    assert pod_spec(sts)["automountServiceAccountToken"] is False

    # With Redis discovery the router gets no API access at all.
    m2 = manifests(rendered, "agent-only")
    assert not m2.of("Role") and not m2.of("RoleBinding")
    assert pod_spec(m2.one("Deployment", "-router"))["automountServiceAccountToken"] is False


# -- the workers ------------------------------------------------------------------------------


def agent_argv(sts: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    c = container(sts, "agent")
    env = env_of(c)
    names = [e["name"] for e in c["env"]]
    # $(VAR) only expands to variables defined earlier in the list.
    for ref in ("POD_NAME", "POD_IP"):
        if ref in names:
            assert names.index(ref) < names.index("KVROUTE_REDIS")
    fake = {"POD_NAME": "rel-kvroute-worker-0", "POD_IP": "10.4.0.7", "POD_NAMESPACE": "kvr"}
    argv = [expand(a, fake) for a in c["args"]]
    plain = {k: expand(v, fake) for k, v in env.items() if isinstance(v, str)}
    fields = {s.env for s in AgentConfig.settings()}
    unknown = {k for k in plain if k.startswith("KVROUTE_")} - fields
    assert not unknown, f"agent env vars that configure nothing: {unknown}"
    from_env(AgentConfig, plain)  # every value parses as its field's type
    return argv, plain


def test_vllm_worker_renders_prefix_caching_and_kv_events(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "defaults")
    sts = m.one("StatefulSet", "-worker")
    vllm = container(sts, "vllm")
    args = vllm["args"]
    assert args[0] == "Qwen/Qwen2.5-7B-Instruct" and vllm["command"] == ["vllm", "serve"]
    assert "--enable-prefix-caching" in args
    assert "--max-num-batched-tokens" not in args  # unset: vLLM's own GPU-dependent default
    kv = json.loads(flag(args, "--kv-events-config"))
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    assert kv["endpoint"] == "tcp://*:5557" and kv["replay_endpoint"] == "tcp://*:5558"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {v["name"] for v in pod_spec(sts)["volumes"]} >= {"dshm", "hf-cache"}

    argv, env = agent_argv(sts)
    ns = build_parser().parse_args(argv)  # kvroute's own CLI accepts every flag
    assert ns.command == "agent" and ns.engine == "vllm"
    assert ns.worker_id == "rel-kvroute-worker-0"  # the pod name is the worker id
    assert ns.advertise == "10.4.0.7:50061"
    assert ns.vllm_url == "http://127.0.0.1:8000"
    assert ns.vllm_events == "tcp://127.0.0.1:5557"
    assert ns.vllm_replay == "tcp://127.0.0.1:5558"
    assert ns.vllm_topic == kv["topic"]
    assert ns.max_batched_tokens == 0  # not told: routers assume their default
    assert ns.vllm_chunked_prefill is True  # vLLM V1 chunks long prefills by default
    assert ns.vllm_long_prefill_threshold == 0 and "--long-prefill-token-threshold" not in args
    cfg = from_env(AgentConfig, env)
    # The one block size is rendered into both vLLM and kvroute.
    assert cfg.model.block_size == int(flag(args, "--block-size")) == 16
    router_env = env_of(container(m.one("Deployment", "-router"), "router"))
    assert router_env["KVROUTE_BLOCK_SIZE"] == env["KVROUTE_BLOCK_SIZE"]
    assert router_env["KVROUTE_MODEL"] == env["KVROUTE_MODEL"]
    agent = container(sts, "agent")
    assert agent["readinessProbe"]["grpc"] == {"port": 50061,
                                               "service": "kvroute.v1.WorkerAgent"}
    headless = m.one("Service", "-worker")
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]


def test_a_mixed_pool_renders_sglang_workers_beside_vllm_ones(rendered: dict[str, str]
                                                              ) -> None:
    m = manifests(rendered, "mixed-pool")
    main, extra = m.one("StatefulSet", "-worker"), m.one("StatefulSet", "-worker-sglang")
    assert (main["spec"]["replicas"], extra["spec"]["replicas"]) == (2, 1)
    # One routing pool: the router's selector and the headless Service find both sets' pods;
    # each StatefulSet selects only its own.
    env = env_of(container(m.one("Deployment", "-router"), "router"))
    labels = [s["spec"]["template"]["metadata"]["labels"] for s in (main, extra)]
    assert all(selector_matches(env["KVROUTE_K8S_SELECTOR"], lb) for lb in labels)
    service = m.one("Service", "-worker")["spec"]["selector"]
    assert all(service.items() <= lb.items() for lb in labels)
    assert extra["spec"]["selector"]["matchLabels"]["kvroute.io/pool"] == "sglang"
    assert not (extra["spec"]["selector"]["matchLabels"].items() <= labels[0].items())
    assert [c["name"] for c in pod_spec(main)["containers"]] == ["vllm", "agent"]
    sglang = container(extra, "sglang")
    args = sglang["args"]
    assert flag(args, "--model-path") == "Qwen/Qwen2.5-7B-Instruct"
    assert "--enable-metrics" in args and flag(args, "--grammar-backend") == "llguidance"
    assert (flag(args, "--chunked-prefill-size"), flag(args, "--context-length")) == \
        ("4096", "8192")
    kv = json.loads(flag(args, "--kv-events-config"))
    assert kv["publisher"] == "zmq" and kv["endpoint"] == "tcp://*:5557"
    assert kv["replay_endpoint"] == "tcp://*:5558"
    # What workers.sglang does not set comes from workers.vllm (a GPU, the caches).
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {v["name"] for v in pod_spec(extra)["volumes"]} >= {"dshm", "hf-cache"}
    argv, agent_env = agent_argv(extra)
    ns = build_parser().parse_args(argv)
    assert ns.engine == "sglang" and ns.sglang_url == "http://127.0.0.1:30000"
    assert (ns.sglang_events, ns.sglang_replay) == ("tcp://127.0.0.1:5557",
                                                     "tcp://127.0.0.1:5558")
    assert ns.sglang_topic == kv["topic"]
    # SGLang's page size is the block size both agents and the router key with.
    cfg = from_env(AgentConfig, agent_env)
    assert cfg.model.block_size == int(flag(args, "--page-size")) == 16
    assert ns.model_source == "hf:Qwen/Qwen2.5-0.5B-Instruct"


def test_a_long_prefill_threshold_goes_to_vllm_and_its_agent(helm: Path) -> None:
    sts = Manifests.parse(template(
        helm, sets=("workers.vllm.longPrefillTokenThreshold=2048",))).one("StatefulSet",
                                                                          "-worker")
    assert flag(container(sts, "vllm")["args"], "--long-prefill-token-threshold") == "2048"
    argv, _ = agent_argv(sts)
    # The agent reports it: routers count only the chunks a request would join.
    assert build_parser().parse_args(argv).vllm_long_prefill_threshold == 2048


def test_the_mask_plugin_is_copied_into_the_pod_loaded_by_vllm_and_told_to_the_agent(
        rendered: dict[str, str], tmp_path: Path) -> None:
    sts = manifests(rendered, "everything").one("StatefulSet", "-worker")
    spec = pod_spec(sts)
    (init,) = spec["initContainers"]
    vllm = container(sts, "vllm")
    mount = {v["name"]: v["mountPath"] for v in init["volumeMounts"]}["kvroute-vllm-plugin"]
    assert {v["name"]: v for v in vllm["volumeMounts"]}["kvroute-vllm-plugin"] == {
        "name": "kvroute-vllm-plugin", "mountPath": mount, "readOnly": True}
    assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}["kvroute-vllm-plugin"]
    assert env_of(vllm)["PYTHONPATH"] == mount
    module, cls = flag(vllm["args"], "--logits-processors").split(":")
    assert build_parser().parse_args(agent_argv(sts)[0]).vllm_mask_plugin is True
    # The init container's own command, run here against this checkout's package, writes
    # the module vLLM is told to import, with the class it names.
    argv = [a.replace(mount, str(tmp_path)) for a in init["command"]]
    assert argv[0] == "python"
    subprocess.run([sys.executable, *argv[1:]], check=True, timeout=60)
    assert f"class {cls}(" in (tmp_path / f"{module}.py").read_text()
    # Off by default (the default image's vLLM predates the interfaces it implements).
    plain = manifests(rendered, "defaults").one("StatefulSet", "-worker")
    assert "initContainers" not in pod_spec(plain)
    assert "--logits-processors" not in container(plain, "vllm")["args"]
    assert "--vllm-mask-plugin" not in container(plain, "agent")["args"]


def test_a_lower_tiers_rate_goes_to_the_agent(helm: Path) -> None:
    sts = Manifests.parse(template(
        helm, sets=("workers.agent.lowerTier.kvBytesPerToken=163840",
                    "workers.agent.lowerTier.gbps=50"))).one("StatefulSet", "-worker")
    argv, _ = agent_argv(sts)
    args = build_parser().parse_args(argv)
    assert (args.tier_kv_bytes_per_token, args.tier_gbps) == (163840, 50.0)
    plain = agent_argv(Manifests.parse(template(helm)).one("StatefulSet", "-worker"))[0]
    assert "--tier-gbps" not in plain  # 0: the agent's defaults


def test_everything_on_uses_block_size_and_gpu_settings(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "everything")
    sts = m.one("StatefulSet", "-worker")
    args = container(sts, "vllm")["args"]
    assert flag(args, "--block-size") == "32" and flag(args, "--tensor-parallel-size") == "2"
    assert flag(args, "--max-model-len") == "16384" and flag(args, "--max-num-seqs") == "128"
    assert args.count("--max-num-seqs") == 1 and "--no-enable-chunked-prefill" in args
    argv, env = agent_argv(sts)
    # vLLM told not to chunk prefills: its agent reports whole-prompt admission to routers.
    assert build_parser().parse_args(argv).vllm_chunked_prefill is False
    assert env["KVROUTE_BLOCK_SIZE"] == "32"
    assert flag(argv, "--max-batch") == "128"  # routers learn the batch from the agent
    assert flag(argv, "--max-batched-tokens") == flag(args, "--max-num-batched-tokens") == "8192"
    assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["hf-cache"]
    assert "hf-cache" not in {v["name"] for v in pod_spec(sts)["volumes"]}
    assert env_of(container(sts, "vllm"))["HF_TOKEN"]["secretKeyRef"]["name"] == "hf-token"
    dep = m.one("Deployment", "-router")
    assert "replicas" not in dep["spec"]  # the HPA owns it
    hpa = m.one("HorizontalPodAutoscaler", "-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert m.one("PodDisruptionBudget", "-router")["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}
    assert "requiredDuringSchedulingIgnoredDuringExecution" in \
        pod_spec(dep)["affinity"]["podAntiAffinity"]


def test_agent_only_mode(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "agent-only")
    sts = m.one("StatefulSet", "-worker")
    assert [c["name"] for c in pod_spec(sts)["containers"]] == ["agent"]
    assert sts["spec"]["replicas"] == 3
    argv, _ = agent_argv(sts)
    ns = build_parser().parse_args(argv)
    assert ns.engine == "vllm"
    assert ns.vllm_url == "http://rel-kvroute-worker-0.vllm-engines.kvr.svc:8000"
    assert ns.vllm_events == "tcp://rel-kvroute-worker-0.vllm-engines.kvr.svc:5557"
    assert "volumes" not in pod_spec(sts)
    # One router replica: a PDB would block every node drain, so there is none.
    assert not m.of("PodDisruptionBudget")
    assert "--capacity-blocks" not in argv  # a sim-engine flag
    # An external Redis Cluster: router and agents get a URL kvroute opens as a cluster.
    router_env = env_of(container(m.one("Deployment", "-router"), "router"))
    agent_env = env_of(container(sts, "agent"))
    for env in (router_env, agent_env):
        assert env["KVROUTE_REDIS"] == "redis+cluster://redis-cluster.data.svc:6379"


def test_the_http_front_takes_the_models_tokenizer_from_a_volume_or_the_hub(
        helm: Path) -> None:
    m = Manifests.parse(template(helm, sets=(
        "router.modelSource=/models/qwen", "router.modelVolume.persistentVolumeClaim.claimName=m")))
    dep = m.one("Deployment", "-router")
    c = container(dep, "router")
    ns = build_parser().parse_args(c["args"])
    assert ns.model == "Qwen/Qwen2.5-7B-Instruct=/models/qwen"  # the name, then its source
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "m"}} in \
        pod_spec(dep)["volumes"]
    m = Manifests.parse(template(helm, sets=(
        "router.modelSource=hf:Qwen/Qwen2.5-7B-Instruct", "router.hfTokenSecret.name=hf")))
    c = container(m.one("Deployment", "-router"), "router")
    env = env_of(c)
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert {"name": "hf-cache", "mountPath": env["HF_HOME"]} in c["volumeMounts"]
    # Every agent is given the same SOURCE, its volume or the hub's cache and token: it
    # reports that tokenizer, so the router routes to it (no vocabulary size worked out).
    for sets, mount in (
            (("router.modelSource=/models/qwen",
              "router.modelVolume.persistentVolumeClaim.claimName=m"),
             {"name": "models", "mountPath": "/models", "readOnly": True}),
            (("router.modelSource=hf:Qwen/Qwen2.5-7B-Instruct", "router.hfTokenSecret.name=hf"),
             {"name": "agent-hf-cache", "mountPath": "/var/cache/huggingface"})):
        sts = Manifests.parse(template(helm, sets=sets)).one("StatefulSet", "-worker")
        agent = container(sts, "agent")
        source = sets[0].split("=", 1)[1]
        assert build_parser().parse_args(agent["args"]).model_source == source
        assert mount in agent["volumeMounts"]
        assert mount["name"] in {v["name"] for v in pod_spec(sts)["volumes"]}
        if source.startswith("hf:"):
            env = env_of(agent)
            assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
            assert env["HF_HOME"] == mount["mountPath"]
    plain = Manifests.parse(template(helm)).one("StatefulSet", "-worker")
    assert "--model-source" not in container(plain, "agent")["args"]
    off = Manifests.parse(template(helm, sets=("router.httpPort=0",)))
    c = container(off.one("Deployment", "-router"), "router")
    assert c["livenessProbe"]["grpc"]["port"] == 50051 and env_of(c)["KVROUTE_HTTP_PORT"] == "0"
    assert [p["name"] for p in off.one("Service", "-router")["spec"]["ports"]] == ["grpc"]


def test_the_router_serves_several_models_and_lora_adapters(helm: Path) -> None:
    m = Manifests.parse(template(helm, sets=(
        "router.extraModels[0].name=llama", "router.extraModels[0].source=hf:meta/llama",
        "router.loras[0].name=sql", "router.loras[0].base=Qwen/Qwen2.5-7B-Instruct")))
    c = container(m.one("Deployment", "-router"), "router")
    ns = build_parser().parse_args(c["args"])
    # model.name first (the default), bare: its workers' model; then each pool's source.
    assert ns.model == "Qwen/Qwen2.5-7B-Instruct,llama=hf:meta/llama"
    assert ns.lora == "sql=Qwen/Qwen2.5-7B-Instruct"
    assert "HF_HOME" in env_of(c)  # an hf: source of an extra model needs the hub's cache


def test_router_policy_takes_a_spec_with_parameter_overrides(helm: Path) -> None:
    m = Manifests.parse(template(helm, sets=("router.policy=kvroute:delay=2:reuse=0.25",)))
    env = env_of(container(m.one("Deployment", "-router"), "router"))
    assert env["KVROUTE_POLICY"] == "kvroute:delay=2:reuse=0.25"
    policy = make_policy(env["KVROUTE_POLICY"])  # what the router builds at start
    assert (policy.delay, policy.reuse) == (2.0, 0.25)  # type: ignore[attr-defined]


def test_agent_only_sim_engine(helm: Path) -> None:
    m = Manifests.parse(template(helm, sets=("workers.mode=agentOnly",
                                             "workers.agent.engine=sim")))
    argv, _ = agent_argv(m.one("StatefulSet", "-worker"))
    ns = build_parser().parse_args(argv)
    assert ns.engine == "sim" and ns.capacity_blocks == 4096 and "--vllm-url" not in argv


# -- Redis --------------------------------------------------------------------------------------


def test_builtin_redis_with_generated_password(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "defaults")
    secret = m.one("Secret", "-redis")
    assert set(secret["data"]) == {"redis-password", "router-password", "agent-password"}
    assert len({v for v in secret["data"].values()}) == 3  # one password per user
    redis_sts = m.one("StatefulSet", "-redis")
    rc = container(redis_sts, "redis")
    # The users (and their passwords' hashes) come from the ACL file, not the command line.
    assert "--requirepass" not in rc["args"] and flag(rc["args"], "--aclfile") == \
        "/run/redis/users.acl"
    assert env_of(rc)["REDISCLI_AUTH"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"], "key": "redis-password"}
    svc = m.one("Service", "-redis")
    assert svc["spec"]["selector"].items() <= \
        redis_sts["spec"]["template"]["metadata"]["labels"].items()
    for obj, name, user in ((m.one("StatefulSet", "-worker"), "agent", "agent"),
                            (m.one("Deployment", "-router"), "router", "router")):
        env = env_of(container(obj, name))
        url = parse_url(env["KVROUTE_REDIS"])
        assert url["host"] == svc["metadata"]["name"] and url["port"] == 6379
        assert "password" not in url and "username" not in url
        # Each part logs in as its own ACL user, its password from the Secret.
        assert env["KVROUTE_REDIS_USERNAME"] == user
        assert env["KVROUTE_REDIS_PASSWORD"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"], "key": f"{user}-password"}


def test_external_redis_tls_and_secret(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "external-redis")
    assert not m.of("Secret") and not [s for s in m.of("StatefulSet")
                                       if s["metadata"]["name"].endswith("-redis")]
    for obj in (m.one("Deployment", "-router"), m.one("StatefulSet", "-worker")):
        c = container(obj, "router" if obj["kind"] == "Deployment" else "agent")
        env = env_of(c)
        assert env["KVROUTE_REDIS_PASSWORD"]["secretKeyRef"] == {"name": "kvroute-redis-auth",
                                                                 "key": "password"}
        assert env["KVROUTE_REDIS_USERNAME"] == "kvroute"
        raw = env["KVROUTE_REDIS"]
        assert raw.startswith("rediss://")
        url = parse_url(raw)
        assert (url["host"], url["port"], url["db"]) == ("redis.data.svc.cluster.local", 6380, 2)
        assert "password" not in url  # never in the URL (logs, errors)
        mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
        vols = {v["name"]: v["secret"]["secretName"] for v in pod_spec(obj)["volumes"]
                if "secret" in v}
        ca = Path(url["ssl_ca_certs"])
        assert vols[mounts[str(ca.parent)]] == "redis-ca" and ca.name == "ca.crt"
        cert = Path(url["ssl_certfile"])
        assert vols[mounts[str(cert.parent)]] == "kvroute-redis-client-tls"


# -- network policy and monitoring -----------------------------------------------------------


def test_network_policies(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "everything")
    pols = {p["metadata"]["name"]: p for p in m.of("NetworkPolicy")}
    router_labels = m.one("Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
    worker_labels = m.one("StatefulSet", "-worker")["spec"]["template"]["metadata"]["labels"]
    redis_labels = m.one("StatefulSet", "-redis")["spec"]["template"]["metadata"]["labels"]

    def allowed(pol: dict[str, Any], port: int, labels: dict[str, str]) -> bool:
        for rule in pol["spec"]["ingress"]:
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            if any("podSelector" in p and p["podSelector"]["matchLabels"].items()
                   <= labels.items() for p in peers):
                return True
        return False

    workers = pols["kvr-worker"]
    assert workers["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert allowed(workers, 50061, router_labels)
    assert not allowed(workers, 50061, redis_labels)
    assert not allowed(workers, 8000, router_labels)  # vLLM stays private to its pod
    redis = pols["kvr-redis"]
    assert allowed(redis, 6379, router_labels) and allowed(redis, 6379, worker_labels)
    assert not allowed(redis, 6379, {"app": "something-else"})
    router = pols["kvr-router"]
    assert router["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "gateway"}
    # The HTTP front is open to the same peers as the gRPC port.
    assert [p["port"] for p in router["spec"]["ingress"][0]["ports"]] == [50051, 8000]


def test_service_monitors_select_the_metrics_services(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "everything")
    services = m.of("Service")
    for sm in m.of("ServiceMonitor"):
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        sel = sm["spec"]["selector"]["matchLabels"]
        hits = [s for s in services if sel.items() <= s["metadata"]["labels"].items()]
        assert len(hits) == 1, sm["metadata"]["name"]
        ports = {p["name"] for p in hits[0]["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports
    workers = m.one("ServiceMonitor", "-worker")
    relabel = workers["spec"]["endpoints"][0]["relabelings"][0]
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    assert relabel["targetLabel"] == "worker"


def test_dashboards_ship_as_labelled_configmaps(rendered: dict[str, str]) -> None:
    m = manifests(rendered, "everything")
    cms = [c for c in m.of("ConfigMap") if "-dash-" in c["metadata"]["name"]]
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(k for c in cms for k in c["data"]) == files and len(files) >= 2
    for c in cms:
        assert c["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert c["metadata"]["namespace"] == "monitoring"
        for name, body in c["data"].items():
            assert json.loads(body) == json.loads((CHART / "dashboards" / name).read_text())
    # Only the `helm test` hook's (the health .proto) without dashboards.
    assert not [c for c in manifests(rendered, "defaults").of("ConfigMap")
                if "helm.sh/hook" not in c["metadata"].get("annotations", {})]


# -- values: schema, README, NOTES ------------------------------------------------------------


@pytest.mark.parametrize(("sets", "message"), [
    (("router.replicas=two",), "replicas"),
    (("router.replica=2",), "replica"),  # a typo is rejected, not ignored
    (("router.discovery=consul",), "discovery"),
    (("model.blockSize=0",), "blockSize"),
    (("router.policy=kvroute:hold",), "policy"),
    (("workers.mode=sidecar",), "mode"),
    (("redis.mode=external",), "redis.mode=external needs redis.external.host"),
    (("workers.agent.engine=sim",), "workers.mode=vllm runs the vllm engine"),
    (("router.autoscaling.enabled=true", "router.autoscaling.minReplicas=9",
      "router.autoscaling.maxReplicas=3"), "minReplicas must not exceed maxReplicas"),
])
def test_bad_values_are_rejected_with_a_clear_error(helm: Path, sets: tuple[str, ...],
                                                    message: str) -> None:
    args = ["template", RELEASE, str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_readme_documents_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    missing = [k for k in leaf_keys(values) if k not in documented]
    assert not missing, f"values not in helm/kvroute/README.md: {missing}"
    stale = documented - set(leaf_keys(values))
    assert not stale, f"README documents values that do not exist: {stale}"


def test_schema_describes_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in leaf_keys(values):
        node = schema
        for part in key.split("."):
            assert part in node.get("properties", {}), f"{key} missing from the schema"
            node = node["properties"][part]


def render_notes(helm: Path, tmp_path: Path, *values: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm install --dry-run` wants a cluster, so
    a copy of the chart renders NOTES.txt through `tpl` in a throwaway template."""
    chart = tmp_path / "kvroute"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    out = run_helm(helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE,
                   "--show-only", "templates/zz-notes.yaml", *values).stdout
    return str(yaml.safe_load(out)["notes"])


def test_notes_tell_how_to_send_a_first_request(helm: Path, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path)
    assert "kubectl -n kvr port-forward svc/rel-kvroute-router 50051:50051" in notes
    # Reflection is off in the chart: grpcurl is given the .proto files of a checkout.
    assert "grpcurl -plaintext -import-path proto -proto kvroute/v1/router.proto -d" in notes
    assert "kvroute.v1.Router/Generate" in notes
    assert (ROOT / "proto" / "kvroute" / "v1" / "router.proto").is_file()
    bodies = re.findall(r"-d '(\{.*?\})' \\\n +localhost:50051", notes)
    assert len(bodies) == 2
    from google.protobuf import json_format

    from kvroute.router.openai_schema import parse_completion
    from kvroute.v1 import common_pb2

    (http,) = re.findall(
        r"curl -N http://localhost:8000/v1/completions .*\\\n +-d '(\{.*?\})'", notes)
    assert parse_completion(json.loads(http)).model == "Qwen/Qwen2.5-7B-Instruct"
    assert "port-forward svc/rel-kvroute-router 8000:8000" in notes
    for body in bodies:  # each request body is a valid GenerateRequest in JSON
        req = json_format.ParseDict(json.loads(body), common_pb2.GenerateRequest())
        assert req.model == "Qwen/Qwen2.5-7B-Instruct"


def test_notes_with_tls_give_the_ca_not_plaintext(helm: Path, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path, "-f", str(CHART / "ci" / "hardened-values.yaml"),
                         "--set", "router.httpPort=8000")
    assert "-plaintext" not in notes
    assert "grpcurl -cacert ca.crt" in notes
    assert "curl -N --cacert ca.crt https://localhost:8000/v1/completions" in notes
