"""The chart's ``epp.enabled``: kvroute as the endpoint picker of an InferencePool. The
rendered InferencePool is checked against the Inference Extension's own CRD schema (vendored
in tests/helm/data), and the parts against each other: the pool selects the worker pods at
their vLLM port, its endpointPickerRef reaches the router pods' ext_proc port, the router
pods run ``kvroute epp`` with a config that parses, the route sends to the pool, and the
network policies let the gateway reach both the picker and the pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvroute.cli import build_parser
from kvroute.core.config import EppConfig
from kvroute.core.settings import from_env
from tests.helm.chart import CHART, RELEASE, Manifests, container, env_of, run_helm, template

CRD = Path(__file__).parent / "data" / "inferencepools.yaml"
EPP_VALUES = CHART / "ci" / "epp-values.yaml"


@pytest.fixture(scope="module")
def epp(helm: Path) -> Manifests:
    return Manifests.parse(template(helm, EPP_VALUES))


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["spec"]["group"] == "inference.networking.k8s.io" and v1["served"]
    return v1["schema"]["openAPIV3Schema"]


def test_the_inference_pool_fits_the_crd_and_selects_the_vllm_ports(epp: Manifests) -> None:
    pool = epp.one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, pool_schema())
    sts = epp.one("StatefulSet", "-worker")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    vllm = {p["name"]: p["containerPort"] for p in container(sts, "vllm")["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": vllm["http"]}]
    # The schema itself refuses what the CRD forbids: the check can fail.
    bad = {**pool, "spec": {**pool["spec"], "targetPorts": []}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, pool_schema())


def test_the_endpoint_picker_ref_reaches_kvroute_epp(epp: Manifests) -> None:
    pool = epp.one("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    svc = [s for s in epp.of("Service") if s["metadata"]["name"] == ref["name"]]
    assert len(svc) == 1
    (port,) = svc[0]["spec"]["ports"]
    assert port["port"] == ref["port"]["number"] == 9002
    dep = epp.one("Deployment", "-router")
    assert svc[0]["spec"]["selector"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()
    c = container(dep, "router")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[port["targetPort"]] == 9002
    assert c["args"][0] == "epp"
    build_parser().parse_args(c["args"])
    env = {k: v for k, v in env_of(c).items() if isinstance(v, str)}
    cfg = from_env(EppConfig, env)
    assert cfg.epp.port == 9002
    assert cfg.epp.target_port == pool["spec"]["targetPorts"][0]["number"]
    assert cfg.workers.discovery == "kubernetes"
    # The picker's discovery watches the pods the pool selects.
    selector = dict(t.split("=", 1) for t in cfg.workers.k8s_selector.split(","))
    assert selector == pool["spec"]["selector"]["matchLabels"]


def test_the_route_sends_the_gateways_traffic_to_the_pool(epp: Manifests) -> None:
    route = epp.one("HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["name"], parent["namespace"], parent["sectionName"]) == (
        "inference-gateway", "gateway", "http")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": "qwen-pool"}]
    assert epp.one("InferencePool")["metadata"]["name"] == "qwen-pool"


def test_network_policies_let_the_gateway_reach_the_picker_and_the_pods(epp: Manifests
                                                                         ) -> None:
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}

    def rule_for(pol: dict[str, Any], port: int) -> dict[str, Any]:
        (rule,) = [r for r in pol["spec"]["ingress"]
                   if any(p["port"] == port for p in r["ports"])]
        return rule

    router = epp.one("NetworkPolicy", "-router")
    assert rule_for(router, 9002)["from"] == [gateway]
    workers = epp.one("NetworkPolicy", "-worker")
    assert rule_for(workers, 8000)["from"] == [gateway]


def test_off_by_default(helm: Path) -> None:
    m = Manifests.parse(template(helm, CHART / "ci" / "defaults-values.yaml"))
    assert not {"InferencePool", "HTTPRoute"} & m.kinds()
    assert container(m.one("Deployment", "-router"), "router")["args"][0] == "router"
    assert not [s for s in m.of("Service") if s["metadata"]["name"].endswith("-epp")]


def test_a_route_needs_its_gateway(helm: Path) -> None:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "epp.enabled=true",
                    "--set", "epp.httpRoute.gateway.name=", check=False)
    assert proc.returncode != 0
    assert "epp.httpRoute.gateway.name" in proc.stderr
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "epp.enabled=true",
                    "--set", "epp.failureMode=Maybe", check=False)
    assert proc.returncode != 0 and "failureMode" in proc.stderr
