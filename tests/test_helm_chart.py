"""The Helm chart in helm/specmesh, rendered and linted by Helm's own Go engine.

No Kubernetes cluster runs on our machines, so the chart is rendered offline with Helm's Go
library (PyPI ``helm-python-sdk``, module ``helm_python``) and every manifest is validated
against the Kubernetes OpenAPI schemas shipped by ``kubernetes-validate`` (strict: unknown
fields are errors) for two recent Kubernetes versions.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import helm_python as helm  # noqa: E402
import kubernetes_validate  # noqa: E402
import pytest
import typer.main
import yaml

from specmesh.cli import app

CHART = Path(__file__).resolve().parent.parent / "helm" / "specmesh"
RELEASE, NAMESPACE = "rel", "specmesh"
TIERS = ("gateway", "drafter", "verifier")
KUBE_VERSIONS = ("1.36.0", "1.37.0")
# Custom resources have no schema in kubernetes-validate: the ServiceMonitor is a
# monitoring.coreos.com CRD, checked by shape in test_service_monitor instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

# Env vars the chart sets for the gateway's kubernetes discovery that specmesh/cli.py does not
# read yet (issue 6, part 2). Empty this set once the CLI options exist.
PENDING_CLI_ENVVARS: set[str] = set()

OVERRIDES = {
    "default": {},
    "verifier-cpu": {"verifier": {"gpus": 0, "tolerations": [],
                                  "config": {"device": "cpu"}}},
    "autoscaling-all": {
        "gateway": {"autoscaling": {"enabled": True, "maxReplicas": 6}},
        "drafter": {"autoscaling": {"enabled": True, "metrics": [{
            "type": "Pods", "pods": {
                "metric": {"name": "specmesh_drafter_inflight"},
                "target": {"type": "AverageValue", "averageValue": "4"}}}]}},
        "verifier": {"autoscaling": {
            "enabled": True, "targetCPUUtilizationPercentage": 0, "metrics": [{
                "type": "External", "external": {
                    "metric": {"name": "specmesh_verifier_queue_depth",
                               "selector": {"matchLabels": {"release": RELEASE}}},
                    "target": {"type": "AverageValue", "averageValue": "8"}}}],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}},
    },
    "external-redis": {"redis": {"external": {
        "url": "rediss://:$(REDIS_PASSWORD)@redis.example.com:6380/0",
        "existingSecret": "managed-redis"}}},
    "loadbalancer": {"gateway": {"service": {
        "type": "LoadBalancer",
        "annotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}}}},
    "no-networkpolicy": {"networkPolicy": {"enabled": False}},
    "tls-apikeys": {"security": {"tls": {"secretName": "specmesh-tls", "healthPort": 8090},
                                 "apiKeysSecret": "specmesh-api-keys"}},
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "pvc-models-otel": {
        "drafter": {"models": {"existingClaim": "models"}, "pdb": {"minAvailable": 1}},
        "verifier": {"models": {"existingClaim": "models"},
                     "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}},
        "otel": {"endpoint": "http://otel-collector.observability:4317"},
        "redis": {"persistence": {"enabled": True}},
    },
}


# -- rendering helpers ------------------------------------------------------------------------

@functools.cache
def _chart():
    return helm.Chart.load(CHART)


def render(values: dict | None = None) -> list[dict]:
    """All manifests the chart renders for ``values`` (NOTES.txt excluded)."""
    out = _chart().render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


@functools.cache
def _rendered(case: str) -> tuple[str, ...]:
    return tuple(json.dumps(d, sort_keys=True) for d in render(OVERRIDES[case]))


def rendered(case: str) -> list[dict]:
    return [json.loads(s) for s in _rendered(case)]


def component(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def by_component(docs: list[dict], kind: str) -> dict[str, dict]:
    return {component(d): d for d in of_kind(docs, kind)}


def pod_workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@functools.cache
def cli_envvars() -> dict[str, dict[str, object]]:
    """{subcommand: {envvar: click.Parameter}} from the typer app in specmesh/cli.py."""
    group = typer.main.get_command(app)
    out: dict[str, dict[str, object]] = {}
    for name, command in group.commands.items():
        env = {}
        for param in command.params:
            names = param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar]
            for envvar in names:
                if envvar:
                    env[envvar] = param
        out[name] = env
    return out


# -- Helm's own checks ------------------------------------------------------------------------

def test_chart_metadata_and_every_value_commented():
    meta = _chart().metadata
    assert meta["apiVersion"] == "v2" and meta["appVersion"] == "0.1.0"
    assert _chart().schema is not None
    lines = (CHART / "values.yaml").read_text().splitlines()
    item_indent = None  # inside a list item's body, keys are the item's fields
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("- "):
            item_indent = indent
            continue
        if not stripped or stripped.startswith("#") or ":" not in stripped:
            continue
        if item_indent is not None and indent > item_indent:
            continue
        item_indent = None
        # every key has a comment on the line above
        assert lines[i - 1].strip().startswith("#"), f"values.yaml:{i + 1} {line!r}"


# settings only a verifier has (passes without drafts, its own draft model)
VERIFIER_ONLY = {"plainThreads", "localDrafter", "localDraftTokens", "localDraftSessions"}


def test_tiers_have_the_same_values_shape():
    """The tiers share their templates, so their values have one shape; the model tiers'
    configs differ only by the verifier's own settings."""
    values = _chart().values

    def shape(v):
        return {k: shape(x) for k, x in v.items()} if isinstance(v, dict) else type(v).__name__

    common = {k: shape(v) for k, v in values["gateway"].items() if k != "config"}
    for tier in ("drafter", "verifier"):
        mine = {k: shape(v) for k, v in values[tier].items() if k not in ("config", "gpus")}
        assert mine == common, tier
    verifier = shape(values["verifier"]["config"])
    assert VERIFIER_ONLY <= verifier.keys()
    assert shape(values["drafter"]["config"]) == {k: v for k, v in verifier.items()
                                                  if k not in VERIFIER_ONLY}


def test_the_model_tiers_default_to_the_replicas_own_defaults():
    """The chart's drafter and verifier settings that the replicas' config also defaults
    (services/config.py ModelServiceConfig) have the same values there, and so do the
    `specmesh drafter` and `specmesh verifier` options: a default changed in one place is
    changed everywhere (a max-batch change once had to be made in five)."""
    import re

    from services.config import ModelServiceConfig
    from specmesh.cli import app

    defaults = {f.name: f.default for f in dataclasses.fields(ModelServiceConfig)}
    values = _chart().values
    checked = set()
    for tier in ("drafter", "verifier"):
        for key, value in values[tier]["config"].items():
            name = re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()
            if name in defaults and name not in ("model", "device"):  # (per tier, by design)
                assert value == defaults[name], (tier, key, value, defaults[name])
                checked.add(name)
    assert {"max_batch", "max_queue", "max_sessions", "prefix_cache_mb"} <= checked
    commands = typer.main.get_command(app).commands
    for command in ("drafter", "verifier"):
        for param in commands[command].params:
            if param.name in defaults and param.name not in ("model", "device"):
                assert param.default == defaults[param.name], (command, param.name)


@pytest.mark.parametrize("case", sorted(OVERRIDES))
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_lint_passes(case, kube_version):
    report = helm.lint(CHART, OVERRIDES[case], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{kube_version}")
    assert report["errors"] == []
    # severity 3 = error, 2 = warning (strict makes warnings fatal too)
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@functools.cache
def _validate(manifest_json: str, version: str) -> None:
    kubernetes_validate.validate(json.loads(manifest_json), version, strict=True)


@pytest.mark.parametrize("case", sorted(OVERRIDES))
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(case, kube_version):
    docs = rendered(case)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            _validate(json.dumps(doc, sort_keys=True), kube_version)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{case} {key(doc)} on {kube_version}: {exc.message} at "
                        f"{'/'.join(map(str, exc.path))}")


def test_schema_rejects_bad_values():
    for bad in ({"verifier": {"image": {"tag": "latest"}}},
                {"drafter": {"service": {"type": "LoadBalancer"}}},
                {"verifier": {"gpus": -1}},
                {"gateway": {"config": {"discovery": "dns"}}},
                {"drafter": {"config": {"dtype": "int8"}}}):
        with pytest.raises(helm.HelmError):
            render(bad)
    with pytest.raises(helm.HelmError, match="only verifiers request nvidia.com/gpu"):
        render({"drafter": {"resources": {"limits": {"nvidia.com/gpu": 1}}}})


# -- structure of what renders ----------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_standard_labels_and_one_deployment_service_per_tier(case):
    docs = rendered(case)
    for doc in docs:
        labels = doc["metadata"]["labels"]
        for name in ("name", "instance", "component", "part-of", "version", "managed-by"):
            assert f"app.kubernetes.io/{name}" in labels, (key(doc), name)
        assert doc["metadata"]["name"].startswith(f"{RELEASE}-specmesh")
    assert set(by_component(docs, "Deployment")) == set(TIERS)
    assert set(TIERS) <= set(by_component(docs, "Service"))
    for d in pod_workloads(docs):
        for c in containers(d):
            assert not c["image"].endswith(":latest") and ":" in c["image"]


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_only_verifier_pods_request_gpus(case):
    docs = rendered(case)
    gpus_wanted = OVERRIDES[case].get("verifier", {}).get("gpus", 1)
    for d in pod_workloads(docs):
        for c in containers(d):
            res = c.get("resources", {})
            gpus = {s: res.get(s, {}).get("nvidia.com/gpu") for s in ("requests", "limits")}
            if component(d) == "verifier" and gpus_wanted:
                assert gpus == {"requests": gpus_wanted, "limits": gpus_wanted}
            else:
                assert gpus == {"requests": None, "limits": None}, (case, key(d))


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_probes_are_grpc_with_drain(case):
    docs = rendered(case)
    for tier, d in by_component(docs, "Deployment").items():
        (c,) = containers(d)
        port = c["ports"][0]["containerPort"]
        if case == "tls-apikeys":  # TLS on the service port: probes use the plaintext health port
            port = 8090
        probes = ["livenessProbe", "readinessProbe"]
        if tier != "gateway":
            probes.append("startupProbe")  # model tiers load a model first
        for probe in probes:
            assert c[probe]["grpc"] == {"port": port}, (tier, probe)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                assert set(c[probe]) & {"httpGet", "tcpSocket", "exec"} == set()
        pod = d["spec"]["template"]["spec"]
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > sleep > 0
        assert c["command"][0] == "specmesh" and c["command"][1] == tier
        assert c["command"][1] in cli_envvars()


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_pods_are_non_root_with_read_only_root(case):
    docs = rendered(case)
    for d in pod_workloads(docs):
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1) != 0
        mounts_by_volume = {}
        for c in containers(d):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, key(d)
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts_by_volume.update({m["name"]: m for m in c["volumeMounts"]})
        assert mounts_by_volume["tmp"]["mountPath"] == "/tmp"
        if component(d) in TIERS:
            assert mounts_by_volume["models"]["readOnly"] is True
            env = {e["name"]: e.get("value") for e in containers(d)[0]["env"]}
            assert env["HF_HOME"].startswith(mounts_by_volume["cache"]["mountPath"])
            volumes = {v["name"]: v for v in pod["volumes"]}
            claim = OVERRIDES[case].get(component(d), {}).get("models", {}).get("existingClaim")
            if claim:
                assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim
            else:
                assert "emptyDir" in volumes["models"]


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_services_headless_for_model_tiers(case):
    services = by_component(rendered(case), "Service")
    for tier in ("drafter", "verifier"):
        assert services[tier]["spec"]["clusterIP"] == "None"
        assert services[tier]["spec"]["type"] == "ClusterIP"
    gateway = services["gateway"]["spec"]
    assert "clusterIP" not in gateway
    want = OVERRIDES[case].get("gateway", {}).get("service", {}).get("type", "ClusterIP")
    assert gateway["type"] == want


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_each_hpa_targets_its_own_deployment(case):
    docs = rendered(case)
    deployments = by_component(docs, "Deployment")
    hpas = by_component(docs, "HorizontalPodAutoscaler")
    enabled = {t for t in TIERS
               if OVERRIDES[case].get(t, {}).get("autoscaling", {}).get("enabled")}
    assert set(hpas) == enabled
    for tier, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "name": deployments[tier]["metadata"]["name"]}
        assert "replicas" not in deployments[tier]["spec"]  # the HPA owns it
        assert hpa["spec"]["metrics"]
    for tier in set(TIERS) - enabled:
        assert deployments[tier]["spec"]["replicas"] >= 1
    if case == "autoscaling-all":
        types = {t: [m["type"] for m in hpas[t]["spec"]["metrics"]] for t in TIERS}
        assert types == {"gateway": ["Resource"], "drafter": ["Resource", "Pods"],
                         "verifier": ["External"]}


def test_pdbs_select_their_own_tier():
    docs = rendered("default")
    deployments = by_component(docs, "Deployment")
    for tier, pdb in by_component(docs, "PodDisruptionBudget").items():
        assert pdb["spec"]["selector"]["matchLabels"] == \
            deployments[tier]["spec"]["selector"]["matchLabels"]
    assert by_component(rendered("pvc-models-otel"), "PodDisruptionBudget")["drafter"][
        "spec"] == {"minAvailable": 1, "selector": deployments["drafter"]["spec"]["selector"]}


def test_network_policies():
    docs = rendered("default")
    policies = by_component(docs, "NetworkPolicy")
    assert set(policies) == {*TIERS, "redis"}
    gateway_labels = by_component(docs, "Deployment")["gateway"]["spec"]["selector"][
        "matchLabels"]
    for tier in ("drafter", "verifier"):
        (rule,) = policies[tier]["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": gateway_labels}}]
    (rule,) = policies["redis"]["spec"]["ingress"]
    (peer,) = rule["from"]
    (expr,) = peer["podSelector"]["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/component" and set(expr["values"]) == set(TIERS)
    assert of_kind(rendered("no-networkpolicy"), "NetworkPolicy") == []


def test_rbac_lets_the_gateway_watch_endpointslices():
    docs = rendered("default")
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    (binding,) = of_kind(docs, "RoleBinding")
    gateway_pod = by_component(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == gateway_pod["serviceAccountName"]
    for tier in ("drafter", "verifier"):
        pod = by_component(docs, "Deployment")[tier]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] != gateway_pod["serviceAccountName"]
        assert pod["automountServiceAccountToken"] is False


def test_redis_bundled_or_external():
    docs = rendered("default")
    (secret,) = of_kind(docs, "Secret")
    assert of_kind(docs, "StatefulSet")
    env = {e["name"]: e for e in containers(by_component(docs, "Deployment")["gateway"])[0]["env"]}
    names = list(env)
    assert names.index("REDIS_PASSWORD") < names.index("SPECMESH_REDIS_URL")  # $(VAR) order
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    host = by_component(docs, "Service")["redis"]["metadata"]["name"]
    assert env["SPECMESH_REDIS_URL"]["value"] == \
        f"redis://:$(REDIS_PASSWORD)@{host}.{NAMESPACE}.svc.cluster.local:6379/0"

    docs = rendered("external-redis")
    assert not of_kind(docs, "StatefulSet") and not of_kind(docs, "Secret")
    assert "redis" not in by_component(docs, "NetworkPolicy")
    env = {e["name"]: e for e in containers(by_component(docs, "Deployment")["gateway"])[0]["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "managed-redis"
    assert env["SPECMESH_REDIS_URL"]["value"] == OVERRIDES["external-redis"]["redis"]["external"][
        "url"]


def test_replicas_publish_their_prefix_index_under_the_address_gateways_dial():
    """Drafters and verifiers get the gateway's Redis (to register and publish the blocks
    their prefix caches hold) and advertise their pod IP and port: the address an
    EndpointSlice gives the gateway, hence the name of their index set."""
    docs = rendered("default")
    deployments = by_component(docs, "Deployment")
    gateway = {e["name"]: e for e in containers(deployments["gateway"])[0]["env"]}
    assert gateway["SPECMESH_PREFIX_AFFINITY"]["value"] == "4"
    for tier in ("drafter", "verifier"):
        env = {e["name"]: e for e in containers(deployments[tier])[0]["env"]}
        names = list(env)
        assert env["SPECMESH_REDIS_URL"] == gateway["SPECMESH_REDIS_URL"]
        assert env["REDIS_PASSWORD"] == gateway["REDIS_PASSWORD"]
        assert names.index("REDIS_PASSWORD") < names.index("SPECMESH_REDIS_URL")
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert names.index("POD_IP") < names.index("SPECMESH_ADVERTISE")
        port = by_component(docs, "Service")[tier]["spec"]["ports"][0]["port"]
        assert env["SPECMESH_ADVERTISE"]["value"] == f"$(POD_IP):{port}"
        assert (env["SPECMESH_PREFIX_CACHE_MB"]["value"], env["SPECMESH_PREFIX_BLOCK"]["value"],
                env["SPECMESH_PREFILL_CHUNK"]["value"],
                env["SPECMESH_PREFILL_THREADS"]["value"]) == ("256", "16", "256", "0")
        # passes without drafts are the verifier's alone
        assert (env["SPECMESH_PLAIN_THREADS"]["value"] == "0") if tier == "verifier" else (
            "SPECMESH_PLAIN_THREADS" not in env)


def test_otel_env_and_service_monitor():
    docs = rendered("pvc-models-otel")
    for d in by_component(docs, "Deployment").values():
        env = {e["name"]: e.get("value") for e in containers(d)[0]["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    default_env = {e["name"] for d in of_kind(rendered("default"), "Deployment")
                   for e in containers(d)[0]["env"]}
    assert not any(n.startswith("OTEL_") for n in default_env)

    assert not of_kind(rendered("default"), "ServiceMonitor")
    docs = rendered("servicemonitor")
    (sm,) = of_kind(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    for tier in TIERS:
        ports = [p["name"] for p in by_component(docs, "Service")[tier]["spec"]["ports"]]
        assert ports == (["grpc", "http", "metrics"] if tier == "gateway" else ["grpc", "metrics"])


# -- one source of truth for the environment ---------------------------------------------------

@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_chart_env_names_are_read_by_the_cli(case):
    cli = cli_envvars()
    for tier, d in by_component(rendered(case), "Deployment").items():
        (c,) = containers(d)
        env = {e["name"]: e for e in c["env"]}
        chart_names = {n for n in env if n.startswith("SPECMESH_")}
        read = set(cli[tier])
        allowed = read | (PENDING_CLI_ENVVARS if tier == "gateway" else set())
        assert chart_names <= allowed, (tier, sorted(chart_names - allowed))
        # Every option the CLI requires (no default) is set by the chart.
        required = {n for n, p in cli[tier].items() if p.required}
        assert required <= chart_names, (tier, sorted(required - chart_names))
        # ... and every literal value parses as the CLI option's type (int, float, str).
        for name in chart_names & read:
            value = env[name].get("value")
            annotation = _option_type(cli[tier][name])
            if value is not None and "$(" not in value and annotation in (int, float):
                annotation(value)


def _option_type(param) -> type | None:
    """The Python type of a typer option (typer's click params carry a type descriptor)."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        return descriptor.annotation
    return getattr(getattr(param, "type", None), "func", None)


def test_pending_cli_envvars_are_still_pending():
    """Fails once the CLI reads one of them: then drop it from PENDING_CLI_ENVVARS."""
    assert PENDING_CLI_ENVVARS.isdisjoint(cli_envvars()["gateway"]), \
        "the CLI reads these now; remove them from PENDING_CLI_ENVVARS"


def test_gateway_points_at_the_headless_services():
    docs = rendered("default")
    services = by_component(docs, "Service")
    env = {e["name"]: e for e in containers(by_component(docs, "Deployment")["gateway"])[0]["env"]}
    for tier, var in (("verifier", "SPECMESH_VERIFIERS"), ("drafter", "SPECMESH_DRAFTERS")):
        svc = services[tier]
        port = svc["spec"]["ports"][0]["port"]
        assert env[var]["value"] == \
            f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}"
        assert env[f"SPECMESH_{tier.upper()}_SERVICE"]["value"] == svc["metadata"]["name"]
        assert env[f"SPECMESH_{tier.upper()}_PORT"]["value"] == str(port)
    assert env["SPECMESH_DISCOVERY"]["value"] == "kubernetes"
    assert env["SPECMESH_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


# -- tier independence ------------------------------------------------------------------------

def _masked(docs: list[dict]) -> dict[tuple[str, str], dict]:
    """Objects by (kind, name); the generated Redis password is random per render."""
    out = {}
    for d in docs:
        d = copy.deepcopy(d)
        if d["kind"] == "Secret" and component(d) == "redis":
            d["data"] = {k: "<generated>" for k in d["data"]}
        out[key(d)] = d
    return out


CHANGES = [
    ("verifier", {"verifier": {"replicaCount": 5}}),
    ("verifier", {"verifier": {"autoscaling": {"enabled": True, "minReplicas": 2,
                                               "maxReplicas": 9}}}),
    ("verifier", {"verifier": {"autoscaling": {"enabled": True, "metrics": [{
        "type": "External", "external": {"metric": {"name": "specmesh_verifier_queue_depth"},
                                         "target": {"type": "Value", "value": "10"}}}]}}}),
    ("drafter", {"drafter": {"replicaCount": 7}}),
    ("drafter", {"drafter": {"autoscaling": {"enabled": True}}}),
    ("gateway", {"gateway": {"replicaCount": 4, "autoscaling": {"enabled": True}}}),
]


@pytest.mark.parametrize("tier,change", CHANGES, ids=lambda x: json.dumps(x) if isinstance(
    x, dict) else x)
def test_scaling_one_tier_changes_only_its_objects(tier, change):
    before, after = _masked(rendered("default")), _masked(render(change))
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed, "the change rendered nothing different"
    for k in changed:
        obj = after.get(k) or before[k]
        assert component(obj) == tier, (k, component(obj))


def test_tls_and_api_keys_are_mounted_and_passed_to_the_cli():
    """The TLS Secret reaches every tier as SPECMESH_TLS_* files; the API key Secret only the
    gateway; without them no tier gets either."""
    for case in ("tls-apikeys", "default"):
        on = case == "tls-apikeys"
        for tier, d in by_component(rendered(case), "Deployment").items():
            (c,) = containers(d)
            env = {e["name"]: e.get("value") for e in c["env"]}
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
            if not on:
                assert not {"SPECMESH_TLS_CERT", "SPECMESH_API_KEYS"} & set(env)
                assert "tls" not in volumes and "api-keys" not in volumes
                continue
            assert volumes["tls"]["secret"]["secretName"] == "specmesh-tls"
            for name, file in (("SPECMESH_TLS_CERT", "tls.crt"), ("SPECMESH_TLS_KEY", "tls.key"),
                               ("SPECMESH_TLS_CA", "ca.crt")):
                assert env[name] == f"{mounts['tls']}/{file}"
            assert env["SPECMESH_HEALTH_PORT"] == "8090"
            if tier == "gateway":
                assert env["SPECMESH_API_KEYS"] == f"{mounts['api-keys']}/keys.json"
                assert volumes["api-keys"]["secret"]["secretName"] == "specmesh-api-keys"
            else:
                assert "SPECMESH_API_KEYS" not in env and "api-keys" not in volumes
