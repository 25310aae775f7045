"""The gateway's OpenAI-compatible HTTP port in the Helm chart: container port, Service
port, NetworkPolicy and the CLI's environment variable (issue #13)."""

from __future__ import annotations

from tests.test_helm_chart import by_component, containers, render


def _gateway(values: dict | None = None) -> tuple[dict, dict, dict]:
    docs = render(values)
    return tuple(by_component(docs, kind)["gateway"]
                 for kind in ("Deployment", "Service", "NetworkPolicy"))


def test_http_port_is_on_the_gateway_container_service_and_network_policy():
    deployment, service, policy = _gateway()
    (c,) = containers(deployment)
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    assert {"name": "SPECMESH_HTTP_PORT", "value": "8000"} in c["env"]
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (8000, "http", "http")
    (rule,) = policy["spec"]["ingress"]
    assert {"port": 8000, "protocol": "TCP"} in rule["ports"]


def test_http_port_zero_turns_it_off_and_tls_makes_it_https():
    deployment, service, policy = _gateway({"gateway": {"config": {"httpPort": 0}}})
    (c,) = containers(deployment)
    assert all(p["name"] != "http" for p in c["ports"])
    assert all(p["name"] != "http" for p in service["spec"]["ports"])
    assert {"name": "SPECMESH_HTTP_PORT", "value": "0"} in c["env"]
    _, service, _ = _gateway({"gateway": {"config": {"httpPort": 8443}},
                              "security": {"tls": {"secretName": "mesh-tls"}}})
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert (http["port"], http["appProtocol"]) == (8443, "https")


def test_model_tiers_have_no_http_port():
    docs = render()
    for tier in ("drafter", "verifier"):
        (c,) = containers(by_component(docs, "Deployment")[tier])
        assert all(p["name"] != "http" for p in c["ports"])
