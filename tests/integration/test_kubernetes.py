"""deploy/: the kustomize base and overlay render, every object is a valid Kubernetes object, the
config they carry is accepted by router-serve, and the container recipe is the one CI runs."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes.client
import pytest
import yaml

from router.config import load
from router.tenancy.clients import Client, ClientKeys

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = ("kubernetes/base", "kubernetes/overlays/production")
SCALE_FROM_ZERO = "../../components/scale-from-zero"
MODELS = {  # (apiVersion, kind) -> the kubernetes package's model
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Service"): "V1Service",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
}

KUBECTL = shutil.which("kubectl")
if KUBECTL is None and os.environ.get("KVAR_CI"):
    raise RuntimeError("under CI kubectl must be installed (.ci/run installs it)")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


def render(path: str) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a copy of deploy/kubernetes, with the admin token file an operator writes."""
    assert KUBECTL is not None
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "kubernetes"
        shutil.copytree(DEPLOY / "kubernetes", tree)
        # as `openssl rand -hex 32 > admin-token` writes it: with its newline (the router strips it)
        (tree / "overlays" / "production" / "admin-token").write_text("0123456789abcdef\n")
        out = subprocess.run(
            [KUBECTL, "kustomize", str(tree / path.removeprefix("kubernetes/"))],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def strict(value: Any, kind: str, where: str) -> None:
    """`value` is a `kind` (a model's name, or an OpenAPI type such as List[V1Container]), with no
    field the model does not have; the models' own checks (required fields, types) run after."""
    container = re.fullmatch(r"(?:List\[|list\[)(.*)\]", kind)
    if container:
        assert isinstance(value, list), f"{where}: expected a list"
        for i, item in enumerate(value):
            strict(item, container[1], f"{where}[{i}]")
        return
    mapping = re.fullmatch(r"(?:Dict\[|dict\()str, (.*)[\])]", kind)
    if mapping:
        assert isinstance(value, dict), f"{where}: expected a mapping"
        for k, item in value.items():
            strict(item, mapping[1], f"{where}.{k}")
        return
    simple: dict[str, Any] = {"str": str, "int": int, "bool": bool, "float": (int, float), "bytes": str}
    if kind in simple:
        assert isinstance(value, simple[kind]) and (kind == "bool") == isinstance(value, bool), (
            f"{where}: expected {kind}, got {value!r}"
        )
        return
    if kind in ("object", "datetime"):  # int-or-string fields, times
        return
    model = getattr(kubernetes.client, kind)
    assert isinstance(value, dict), f"{where}: expected an object ({kind})"
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        assert key in by_json, f"{where}: {kind} has no field {key!r}"
        strict(item, model.openapi_types[by_json[key]], f"{where}.{key}")


def validate(obj: dict[str, Any]) -> Any:
    """The object as its kubernetes model (strictly: unknown fields are errors)."""
    name = MODELS[(obj["apiVersion"], obj["kind"])]
    strict(obj, name, f"{obj['kind']}/{obj['metadata']['name']}")
    return kubernetes.client.ApiClient().deserialize(json.dumps(obj), name, "application/json")


def validate_service_monitor(obj: dict[str, Any]) -> None:
    """The Prometheus Operator's ServiceMonitor (a CRD, not in the kubernetes package): the fields used here."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    strict(obj["metadata"], "V1ObjectMeta", "ServiceMonitor.metadata")
    spec = obj["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    strict(spec["selector"], "V1LabelSelector", "ServiceMonitor.spec.selector")
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert re.fullmatch(r"\d+(ms|s|m)", endpoint["interval"])


def validate_scaled_object(obj: dict[str, Any]) -> None:
    """KEDA's ScaledObject (a CRD): the fields used here, and a metrics-api trigger's metadata,
    which KEDA reads as strings (an unquoted `true` or `1` would not pass its CRD's schema)."""
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
    strict(obj["metadata"], "V1ObjectMeta", "ScaledObject.metadata")
    spec = obj["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "triggers",
    }, set(spec)
    assert set(spec["scaleTargetRef"]) <= {"apiVersion", "kind", "name"} and "name" in spec["scaleTargetRef"]
    for field in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        strict(spec.get(field, 0), "int", f"ScaledObject.spec.{field}")
    assert spec["triggers"], "ScaledObject.spec.triggers: empty"
    for trigger in spec["triggers"]:
        assert set(trigger) <= {"type", "metricType", "metadata", "authenticationRef"}, set(trigger)
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
        assert set(trigger.get("authenticationRef", {"name": ""})) == {"name"}
        strict(trigger["metadata"], "dict(str, str)", "ScaledObject.spec.triggers.metadata")
        assert trigger["type"] == "metrics-api", trigger["type"]
        metadata = trigger["metadata"]
        assert (
            {"url", "valueLocation", "targetValue"}
            <= set(metadata)
            <= {
                "url",
                "format",
                "valueLocation",
                "targetValue",
                "activationTargetValue",
                "aggregateFromKubeServiceEndpoints",
                "aggregationType",
                "authMode",
            }
        ), set(metadata)
        for number in ("targetValue", "activationTargetValue"):  # KEDA parses them as floats
            float(metadata.get(number, "0"))
        assert metadata.get("format", "json") in ("json", "xml", "yaml", "prometheus")
        assert metadata.get("aggregateFromKubeServiceEndpoints", "false") in ("true", "false")
        assert metadata.get("aggregationType", "average") in ("average", "sum", "max", "min")
        assert metadata.get("authMode", "bearer") in ("apiKey", "basic", "tls", "bearer")


def validate_trigger_authentication(obj: dict[str, Any]) -> None:
    """KEDA's TriggerAuthentication (a CRD): parameters from Secrets' keys, the one source used here."""
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "TriggerAuthentication"
    strict(obj["metadata"], "V1ObjectMeta", "TriggerAuthentication.metadata")
    assert set(obj["spec"]) == {"secretTargetRef"}, set(obj["spec"])
    for ref in obj["spec"]["secretTargetRef"]:
        assert set(ref) == {"parameter", "name", "key"}, set(ref)
        strict(ref, "dict(str, str)", "TriggerAuthentication.spec.secretTargetRef")


CRDS = {
    "ServiceMonitor": validate_service_monitor,
    "ScaledObject": validate_scaled_object,
    "TriggerAuthentication": validate_trigger_authentication,
}


def validate_any(obj: dict[str, Any]) -> None:
    """A Kubernetes object by its model, or one of the CRDs by its hand-written validator."""
    if obj["kind"] in CRDS:
        CRDS[obj["kind"]](obj)
    else:
        validate(obj)


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    return render(request.param)


def expanded(env: list[dict[str, Any]], namespace: str) -> dict[str, str]:
    """A container's plain environment as the kubelet gives it: $(VAR) of earlier variables
    expanded, the pod's namespace from its fieldRef (values from Secrets and resources left out)."""
    out: dict[str, str] = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            out[e["name"]] = namespace
    return out


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of `kind` named `name` (a generated ConfigMap's name has a hash after it)."""
    found = [o for o in objs if o["kind"] == kind and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", o["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in objs])
    return found[0]


@needs_kubectl
def test_every_object_validates(rendered: list[dict[str, Any]]) -> None:
    kinds = set()
    for obj in rendered:
        kinds.add(obj["kind"])
        validate_any(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "kv-affinity-router", obj["metadata"]["name"]
    assert {"Namespace", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds


def test_strictness_catches_a_misspelt_field() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"spec": {"containers": [{"name": "c", "imagePullPolicy": "Always", "readinesProbe": {}}]}},
        },
    }
    with pytest.raises(AssertionError, match="has no field 'readinesProbe'"):
        validate(deployment)
    deployment["spec"]["template"]["spec"]["containers"][0].pop("readinesProbe")
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "8080"}]
    with pytest.raises(AssertionError, match="expected int"):
        validate(deployment)
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 8080}]
    validate(deployment)
    del deployment["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):  # required, by the model's own check
        validate(deployment)


@needs_kubectl
def test_the_deployment_probes_drains_and_sizes_its_workers(rendered: list[dict[str, Any]]) -> None:
    deployment = one(rendered, "Deployment", "kv-affinity-router")
    pod = deployment["spec"]["template"]["spec"]
    (router,) = [c for c in pod["containers"] if c["name"] == "router"]
    config = tomllib.loads(one(rendered, "ConfigMap", "kv-affinity-router-config")["data"]["router.toml"])
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"http": config["port"], "admin": config["admin_port"]} and ports["http"] != ports["admin"]
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    env = {e["name"]: e for e in router["env"]}
    cpu = env["ROUTER_WORKERS"]["valueFrom"]["resourceFieldRef"]
    assert (
        cpu["resource"] == "requests.cpu"
        and cpu["containerName"] == "router"
        and "cpu" in router["resources"]["requests"]
    )
    pause = int(router["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pause + config["balance"]["drain_timeout_s"] + 5
    assert pod["securityContext"]["runAsNonRoot"] and router["securityContext"]["readOnlyRootFilesystem"]
    mounts = {m["mountPath"] for m in router["volumeMounts"]}
    assert {"/etc/kv-affinity-router", "/tmp", "/dev/shm", config["state"].removeprefix("file:")} <= mounts
    pdb = one(rendered, "PodDisruptionBudget", "kv-affinity-router")
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # the replicas' headless Service is the one the router discovers, in the pod's own namespace
    headless = one(rendered, "Service", "inference-replicas")
    assert headless["spec"]["clusterIP"] == "None"
    discovery = expanded(router["env"], deployment["metadata"]["namespace"])["ROUTER_DISCOVERY"]
    name = f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    assert discovery == f"dns:{name}:{headless['spec']['ports'][0]['port']}"
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a drain never waits on unready pods


@needs_kubectl
def test_the_overlay_shares_state_through_redis_and_is_scraped() -> None:
    objs = render("kubernetes/overlays/production")
    deployment = one(objs, "Deployment", "kv-affinity-router")
    (router,) = deployment["spec"]["template"]["spec"]["containers"]
    env = expanded(router["env"], deployment["metadata"]["namespace"])
    redis = one(objs, "Service", "kv-affinity-router-redis")
    assert env["ROUTER_STATE"] == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
    assert deployment["spec"]["replicas"] == 3
    monitor = one(objs, "ServiceMonitor", "kv-affinity-router")
    service = one(objs, "Service", "kv-affinity-router")
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # the admin token: the generated Secret, which the Deployment reads under its generated name
    secret = one(objs, "Secret", "kv-affinity-router-admin")
    token = next(e for e in router["env"] if e["name"] == "ROUTER_ADMIN_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token["name"] == secret["metadata"]["name"] and token["key"] in secret["data"]
    value = base64.b64decode(secret["data"][token["key"]]).decode()
    config = load(None, {"ROUTER_ADMIN_TOKEN": value}, {"replicas": ["http://h:1"]})
    assert config.admin_token == "0123456789abcdef"  # the file's newline is not part of the token


@needs_kubectl
def test_the_client_keys_component_mounts_its_secret_as_a_directory_the_router_reads(tmp_path: Path) -> None:
    """The client-keys component on the production overlay, as its comment tells an operator to add it."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "kubernetes"
        shutil.copytree(DEPLOY / "kubernetes", tree)
        overlay = tree / "overlays" / "production"
        (overlay / "admin-token").write_text("0123456789abcdef\n")
        digest = hashlib.sha256(b"sk-team-a").hexdigest()
        (overlay / "client-keys.toml").write_text(f'[[keys]]\nid = "ci"\ntenant = "team-a"\nsha256 = "{digest}"\n')
        (overlay / "replica-api-keys").write_text("*=vllm-key")
        kustomization = overlay / "kustomization.yaml"
        kustomization.write_text(
            kustomization.read_text()
            .replace("components:\n", "components:\n  - ../../components/client-keys\n")
            .replace(
                "secretGenerator:\n",
                "secretGenerator:\n"
                "  - name: kv-affinity-router-client-keys\n    files:\n      - keys.toml=client-keys.toml\n"
                "    options:\n      disableNameSuffixHash: true\n"
                "  - name: kv-affinity-router-replica-keys\n    files:\n      - keys=replica-api-keys\n",
            )
        )
        assert KUBECTL is not None
        out = subprocess.run([KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    objs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for obj in objs:
        if obj["kind"] != "ServiceMonitor":
            validate(obj)
    deployment = one(objs, "Deployment", "kv-affinity-router")
    spec = deployment["spec"]["template"]["spec"]
    (router,) = spec["containers"]
    env = {e["name"]: e for e in router["env"]}
    mount = next(m for m in router["volumeMounts"] if m["name"] == "client-keys")
    assert "subPath" not in mount  # a subPath mount never sees the kubelet's updates
    assert env["ROUTER_CLIENT_KEYS_FILE"]["value"] == mount["mountPath"] + "/keys.toml"
    volume = next(v for v in spec["volumes"] if v["name"] == "client-keys")
    keys = one(objs, "Secret", "kv-affinity-router-client-keys")
    assert volume["secret"]["secretName"] == keys["metadata"]["name"] and "keys.toml" in keys["data"]
    # its name stays as it is: a change of keys changes the Secret, not the pod template (no rollout)
    assert keys["metadata"]["name"] == "kv-affinity-router-client-keys"
    replica = env["ROUTER_REPLICA_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert replica["name"] == one(objs, "Secret", "kv-affinity-router-replica-keys")["metadata"]["name"]
    # router-serve takes what the pod gets: the keys file as mounted, the admin token, the replica key
    (tmp_path / "keys.toml").write_bytes(base64.b64decode(keys["data"]["keys.toml"]))
    admin = base64.b64decode(one(objs, "Secret", "kv-affinity-router-admin")["data"]["token"]).decode()
    config = load(
        None,
        {
            "ROUTER_CLIENT_KEYS_FILE": str(tmp_path / "keys.toml"),
            "ROUTER_ADMIN_TOKEN": admin,
            "ROUTER_REPLICA_API_KEYS": "*=vllm-key",
        },
        {"replicas": ["http://h:1"]},
    )
    assert ClientKeys(config.client_keys_file).client({"x-api-key": "sk-team-a"}) == Client("team-a", "ci")


def render_scale_from_zero(over: str) -> list[dict[str, Any]]:
    """`over` (base or production) with the scale-from-zero component, as its README tells an
    operator to add it: an overlay of its own beside production's, the token file written without
    a newline (KEDA sends the Secret's bytes as they are)."""
    assert KUBECTL is not None
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "kubernetes"
        shutil.copytree(DEPLOY / "kubernetes", tree)
        overlay = tree / "overlays" / "scale-from-zero"
        overlay.mkdir()
        if over == "production":
            kustomization = (tree / "overlays" / "production" / "kustomization.yaml").read_text()
            (overlay / "admin-token").write_text("0123456789abcdef")
        else:
            kustomization = "resources:\n  - ../../base\ncomponents:\n"
        kustomization = kustomization.replace("components:\n", f"components:\n  - {SCALE_FROM_ZERO}\n")
        (overlay / "kustomization.yaml").write_text(kustomization)
        out = subprocess.run([KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@needs_kubectl
@pytest.mark.parametrize("over", ["base", "production"])
def test_the_scale_from_zero_component_scales_inference_on_the_routers_signal(over: str) -> None:
    objs = render_scale_from_zero(over)
    for obj in objs:
        validate_any(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "kv-affinity-router", obj["metadata"]["name"]
    scaled = one(objs, "ScaledObject", "inference")["spec"]
    assert scaled["minReplicaCount"] == 0 < scaled["maxReplicaCount"]
    assert scaled["scaleTargetRef"] == {"kind": "Deployment", "name": "inference"}
    assert scaled["pollingInterval"] <= 30 and scaled["cooldownPeriod"] >= 300  # a cold start costs minutes
    (trigger,) = scaled["triggers"]
    metadata = trigger["metadata"]
    # desired replicas = ceil(value / 1): the number the router recommends
    assert trigger["metricType"] == "AverageValue" and float(metadata["targetValue"]) == 1
    assert metadata["valueLocation"] == "recommended_replicas" and metadata.get("format", "json") == "json"
    assert float(metadata["activationTargetValue"]) == 0  # any recommendation above 0 wakes the fleet
    # the router Service's admin port, which serves /admin/scale; KEDA asks each ready pod behind the
    # Service on the URL's port (an EndpointSlice lists the pods' ports), so it is the container's too
    deployment = one(objs, "Deployment", "kv-affinity-router")
    (router,) = deployment["spec"]["template"]["spec"]["containers"]
    config = tomllib.loads(one(objs, "ConfigMap", "kv-affinity-router-config")["data"]["router.toml"])
    service = one(objs, "Service", "kv-affinity-router")
    admin = next(p for p in service["spec"]["ports"] if p["name"] == "admin")
    container = {p["name"]: p["containerPort"] for p in router["ports"]}[admin["targetPort"]]
    url = urlsplit(metadata["url"])
    assert url.scheme == "http" and url.path == "/admin/scale"
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert url.port == admin["port"] == container == config["admin_port"]
    # every router answers for itself: the largest answer, so that one router holding a request wakes the fleet
    assert metadata["aggregateFromKubeServiceEndpoints"] == "true" and metadata["aggregationType"] == "max"
    # the bearer token: the TriggerAuthentication in the render, from the Secret the router reads its token from
    assert metadata["authMode"] == "bearer"
    auth = one(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["metadata"]["name"] == trigger["authenticationRef"]["name"]
    (ref,) = auth["spec"]["secretTargetRef"]
    env = {e["name"]: e for e in router["env"]}
    token = env["ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"parameter": "token", "name": token["name"], "key": token["key"]}
    if over == "production":  # generated, with a hash in its name that kustomize carries into the reference
        secret = one(objs, "Secret", "kv-affinity-router-admin")
        assert ref["name"] == secret["metadata"]["name"] != "kv-affinity-router-admin" and ref["key"] in secret["data"]
    # the router holds a request while no replica is ready, and stays in its Service while none is
    wait = env["ROUTER_SCALE_FROM_ZERO_S"]["value"]
    settings = load(None, {"ROUTER_SCALE_FROM_ZERO_S": wait}, {"replicas": ["http://h:1"]})
    assert settings.scale_from_zero_s == float(wait) > 0
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # ready at zero (app.py)


def test_the_keda_validators_catch_a_misspelt_field_and_an_unquoted_value() -> None:
    scaled: dict[str, Any] = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {
            "scaleTargetRef": {"name": "inference"},
            "minReplicas": 0,
            "triggers": [{"type": "metrics-api", "metadata": {"url": "http://r:1/", "valueLocation": "v"}}],
        },
    }
    with pytest.raises(AssertionError, match="minReplicas"):
        validate_scaled_object(scaled)
    scaled["spec"]["minReplicaCount"] = scaled["spec"].pop("minReplicas")
    scaled["spec"]["triggers"][0]["metadata"]["targetValue"] = 1
    with pytest.raises(AssertionError, match="expected str"):
        validate_scaled_object(scaled)
    scaled["spec"]["triggers"][0]["metadata"]["targetValue"] = "1"
    validate_scaled_object(scaled)
    auth = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "TriggerAuthentication",
        "metadata": {"name": "x"},
        "spec": {"secretTargetRef": [{"parameter": "token", "name": "s", "secretKey": "token"}]},
    }
    with pytest.raises(AssertionError, match="secretKey"):
        validate_trigger_authentication(auth)


@needs_kubectl
def test_router_serve_accepts_the_config_the_cluster_gets(tmp_path: Path) -> None:
    renders = [(path, render(path)) for path in KUSTOMIZATIONS]
    renders.append(("production with scale-from-zero", render_scale_from_zero("production")))
    for path, objs in renders:
        toml = tmp_path / "router.toml"
        toml.write_text(one(objs, "ConfigMap", "kv-affinity-router-config")["data"]["router.toml"])
        deployment = one(objs, "Deployment", "kv-affinity-router")
        (router,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {"ROUTER_WORKERS": "2"} | expanded(router["env"], deployment["metadata"]["namespace"])
        out = subprocess.run(
            [sys.executable, "-m", "router.proxy.cli", *router["args"][:1], str(toml), "--check-config"],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("ROUTER_")} | env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "configuration is valid" in out.stdout and "2 worker processes" in out.stdout
        assert "discovered through dns:inference-replicas.kv-affinity-router.svc.cluster.local:8000" in out.stdout
        if "production" in path:
            assert "routing state shared through redis://" in out.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('admin_port = 8080\nport = 8080\ndiscovery = "dns:x:1"\n')
    out = subprocess.run(
        [sys.executable, "-m", "router.proxy.cli", "--config", str(bad), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "admin_port" in out.stderr


def test_the_container_recipe_runs_the_scripts_ci_runs() -> None:
    dockerfile = (DEPLOY / "container" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", dockerfile, re.M)
    assert len(stages) == 2 and stages[0][1] == "build"  # the compiled core is built in the first stage
    runs = " ".join(re.findall(r"^RUN (.*(?:\\\n.*)*)", dockerfile, re.M))
    assert "deploy/container/build-wheels.sh /wheels" in runs
    assert "install.sh /wheels /opt/kv-affinity-router" in runs
    assert re.search(r"^COPY --from=build /wheels /wheels$", dockerfile, re.M)
    user = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert re.search(r'^ENTRYPOINT \["router-serve"\]$', dockerfile, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "deploy/container/build-wheels.sh" in ci and "deploy/container/install.sh" in ci
    for script in ("build-wheels.sh", "install.sh"):
        assert os.access(DEPLOY / "container" / script, os.X_OK), script
    # the state directory the image points XDG_STATE_HOME at belongs to the user it runs as
    state = re.search(r"XDG_STATE_HOME=(\S+)", dockerfile)
    assert state and re.search(rf"install -d -o {user[-1].split(':')[0]} -g \S+ {state[1]}\b", dockerfile)
    # the build context leaves local builds out: their compiled core may not match the sources
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "src/*.c", "src/*.so"} <= set(ignored)
