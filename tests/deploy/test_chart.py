"""The Helm chart: rendered offline for the example values and compared with the checked-in
output, linted, validated against Kubernetes' schemas, and its schema's typo check."""

from __future__ import annotations

import base64
import difflib
import functools
import importlib
import os
import re
import subprocess
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import referencing
from kubernetes_validate.utils import schema_contents

from services.cli import SERVICES
from services.engine import server as engine_server
from services.common.config import (DisaggregationConfig, EngineServiceConfig, FleetConfig, GatewayConfig,
                                   LoRAConfig, PrefixIndexConfig, RoutingConfig)
from services.common.flags import build
from services.common.lora import LoRAModule
from services.prefix_index.redis_index import REDIS_ACL_COMMANDS
from tests.deploy.chart import CHART_DIR, EXAMPLES, GOLDEN_DIR, NAMESPACE, example_values, find, golden_manifest, manifest, objects, render
from tests.services.procs import free_port

UPDATE_GOLDEN = os.environ.get("KVMESH_UPDATE_GOLDEN") == "1"
# The chart's oldest supported Kubernetes (Chart.yaml kubeVersion) and the newest schemas at hand.
KUBE_VERSIONS = ["1.30", kubernetes_validate.utils.latest_version()]
# Custom resources: kubernetes-validate has no schema for them (they come from the Prometheus
# Operator's and KEDA's CRDs, not from Kubernetes). For these the test validates what Kubernetes
# defines (apiVersion, kind, metadata as a strict ObjectMeta) and what the chart must get right
# (the ports, Services and StatefulSets they name exist in the same render).
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "PodMonitor": "monitoring.coreos.com/v1",
                "ScaledObject": "keda.sh/v1alpha1"}
COMPONENTS = ("gateway", "processor", "engine", "worker")
# test-fast checks the chart's defaults; `make test` every example values file as well.
EXAMPLE_PARAMS = [name if name == "default" else pytest.param(name, marks=pytest.mark.slow) for name in EXAMPLES]


@pytest.fixture(scope="module", params=EXAMPLE_PARAMS)
def example(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    return request.param, render(example_values(request.param))


def test_render_matches_golden(example: tuple[str, dict[str, str]]) -> None:
    name, rendered = example
    golden = GOLDEN_DIR / f"{name}.yaml"
    text = golden_manifest(rendered)
    if UPDATE_GOLDEN:
        golden.write_text(text)
    assert golden.exists(), f"{golden} is missing; create it with KVMESH_UPDATE_GOLDEN=1"
    expected = golden.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{name}.yaml", f"rendered/{name}.yaml"))
        pytest.fail(f"the chart renders differently from {golden.relative_to(CHART_DIR.parents[2])}; if the change is "
                    f"intended, regenerate with: KVMESH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/deploy/test_chart.py"
                    f"\n{diff[:6000]}")


@pytest.mark.parametrize("example_name", EXAMPLE_PARAMS)
def test_lint_is_clean(example_name: str) -> None:
    report = helm.lint(CHART_DIR, example_values(example_name), strict=True, namespace=NAMESPACE)
    # Severity 1 is informational (e.g. "icon is recommended"); warnings and errors fail.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_objects_validate_strictly(example: tuple[str, dict[str, str]], kube_version: str) -> None:
    _, rendered = example
    objs = objects(rendered)
    assert objs
    for obj in objs:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in CUSTOM_KINDS:
            assert obj["apiVersion"] == CUSTOM_KINDS[obj["kind"]], where
            strict_validator(kube_version, "ObjectMeta").validate(obj["metadata"])
            continue
        try:
            strict_validator(kube_version, obj["kind"], obj["apiVersion"]).validate(obj)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where} against Kubernetes {kube_version}: {'.'.join(map(str, e.path))}: {e.message}")


@functools.cache
def strict_validator(kube_version: str, kind: str, api_version: str = "") -> jsonschema.Draft202012Validator:
    """Kubernetes' strict schema of a kind (or of ObjectMeta, which custom resources carry), as
    kubernetes_validate.validate(strict=True) builds it, but built once: that function parses the
    schema files and resolves their references again on every call, a second per example."""
    version = [v for v in kubernetes_validate.utils.all_versions()
               if kubernetes_validate.utils.major_minor(v) <= kube_version][-1]
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    definitions = schema_contents(f"{schema_dir}/_definitions.json", kube_version)
    registry = referencing.Registry().with_resource(definitions["$id"], referencing.Resource.from_contents(definitions))
    if kind == "ObjectMeta":
        schema = {"$schema": definitions["$schema"],
                  "$ref": f"{definitions['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    else:
        # rbac.authorization.k8s.io/v1 -> rbac-v1, as kubernetes-validate names its files.
        api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        schema = schema_contents(f"{schema_dir}/{kind.lower()}-{api}.json", kube_version)
        registry = referencing.Resource.from_contents(schema) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_custom_resources_point_at_what_the_chart_renders(example: tuple[str, dict[str, str]]) -> None:
    _, rendered = example
    objs = objects(rendered)
    for obj in objs:
        kind, spec = obj["kind"], obj.get("spec", {})
        if kind in ("ServiceMonitor", "PodMonitor"):
            component = spec["selector"]["matchLabels"]["app.kubernetes.io/component"]
            endpoints = spec.get("endpoints") or spec.get("podMetricsEndpoints")
            if kind == "ServiceMonitor":
                ports = [p["name"] for p in find(objs, "Service", obj["metadata"]["name"])["spec"]["ports"]]
            else:
                ports = [p["name"] for p in pod_spec(objs, component)["containers"][0]["ports"]]
            assert [e["port"] for e in endpoints if e["port"] not in ports] == [], obj["metadata"]["name"]
            assert spec["jobLabel"] == "app.kubernetes.io/component"  # the dashboards group by job
        if kind == "ScaledObject":
            target = spec["scaleTargetRef"]
            find(objs, target["kind"], target["name"])
            assert "vllm:num_requests_waiting" in spec["triggers"][0]["metadata"]["query"]


def has_role(workload: dict[str, Any], role: str | None) -> bool:
    """Disaggregated prefill/decode: the workload's role label; None: the decode ones or, without
    disaggregation, the only ones."""
    label = workload["spec"]["selector"]["matchLabels"].get("kvmesh.io/role")
    return label in (None, "decode") if role is None else label == role


# The label of a model's engines and workers when the chart serves several (`models`).
MODEL_LABEL = "kvmesh.io/model"


def pools(objs: list[dict[str, Any]], component: str, role: str | None = None) -> list[dict[str, Any]]:
    """A component's workloads (of `role`, see has_role): one, or for engines and workers with
    `models` one per model (a tensor-parallel model: one worker StatefulSet per engine)."""
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
            and o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
            and has_role(o, role)]


def model_of(workload: dict[str, Any]) -> str | None:
    return workload["spec"]["selector"]["matchLabels"].get(MODEL_LABEL)


def pod_spec(objs: list[dict[str, Any]], component: str, role: str | None = None) -> dict[str, Any]:
    [workload] = pools(objs, component, role)
    return workload["spec"]["template"]["spec"]


def workload_args(workload: dict[str, Any]) -> dict[str, str]:
    """A workload's `--flag=value` arguments (bare flags map to ""; a repeated flag to its last value)."""
    args = workload["spec"]["template"]["spec"]["containers"][0]["args"]
    # The image's entry point is `kvmesh`: the first argument picks the service.
    assert args[0] == workload["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
    return dict(a.removeprefix("--").partition("=")[::2] for a in args[1:])


def args_of(objs: list[dict[str, Any]], component: str, role: str | None = None) -> dict[str, str]:
    """A service's `--flag=value` arguments (bare flags map to "")."""
    [workload] = pools(objs, component, role)
    return workload_args(workload)


def repeated(objs: list[dict[str, Any]], component: str, flag: str) -> list[str]:
    """Every value of a repeatable flag of a service, in order."""
    args = pod_spec(objs, component)["containers"][0]["args"]
    return [a.partition("=")[2] for a in args if a.startswith(f"--{flag}=")]


def pod_names(statefulsets: list[dict[str, Any]]) -> set[str]:
    """The pods StatefulSets create: <name>-<ordinal>."""
    return {f"{o['metadata']['name']}-{i}" for o in statefulsets for i in range(o["spec"].get("replicas", 1))}


def worker_pod_names(objs: list[dict[str, Any]], role: str | None = None) -> set[str]:
    """The pods the worker StatefulSets (of `role`, see has_role) create: <name>-<ordinal>."""
    return pod_names([o for o in pools(objs, "worker", role) if o["kind"] == "StatefulSet"])


def selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    return service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_engine_finds_its_worker(example: tuple[str, dict[str, str]]) -> None:
    """engine-<i> looks for the workers whose hostnames are its own with -engine- -> -worker- (and
    -<rank> appended for a tensor-parallel group), in its worker Service's EndpointSlices: the
    names, the headless Service and the replica counts must line up for that, in each model's pool.
    The processors' one engine Service selects every engine."""
    _, rendered = example
    objs = objects(rendered)
    engine_service = find(objs, "Service", args_of(objs, "processor")["engine-service"])
    assert "grpc" in [p["name"] for p in engine_service["spec"]["ports"]]
    assert pools(objs, "engine")
    for engine in pools(objs, "engine"):
        workers = [w for w in pools(objs, "worker") if model_of(w) == model_of(engine)]
        engine_args = workload_args(engine)
        size = int(engine_args.get("tensor-parallel-size", "1"))
        hostnames = [h for i in range(engine["spec"].get("replicas", 1))
                     for h in engine_server.paired_worker_hostnames(f"{engine['metadata']['name']}-{i}", size)]
        if engine["spec"].get("replicas") is not None:  # KEDA leaves both counts to the scaler
            assert sorted(hostnames) == sorted(pod_names(workers))
        # A pod's hostname is in a Service's EndpointSlices when its StatefulSet names that Service.
        worker_service = find(objs, "Service", engine_args["worker-service"])
        for worker in workers:
            assert engine_args["worker-service"] == worker["spec"]["serviceName"] and selects(worker_service, worker)
        assert worker_service["spec"]["clusterIP"] == "None"
        assert engine["spec"]["serviceName"] == engine_service["metadata"]["name"] and selects(engine_service, engine)
        assert "block-size" not in engine_args  # the engine takes its worker's


def test_every_service_reports_the_served_model_name(example: tuple[str, dict[str, str]]) -> None:
    """model_name on the metrics is what clients send, everywhere: the dashboards and KEDA filter on
    it. The gateway and the processor serve every model; each engine and worker serves one."""
    _, rendered = example
    objs = objects(rendered)
    served = repeated(objs, "gateway", "served-model-name")
    assert repeated(objs, "processor", "served-model-name") == served
    assert len(repeated(objs, "processor", "model")) == len(served)
    for component in ("engine", "worker"):
        assert {workload_args(w)["served-model-name"] for w in pools(objs, component)} == set(served)
    for o in objs:
        if o["kind"] == "ScaledObject":
            target = find(objs, "StatefulSet", o["spec"]["scaleTargetRef"]["name"])
            model_name = workload_args(target)["served-model-name"]
            assert f'model_name="{model_name}"' in o["spec"]["triggers"][0]["metadata"]["query"]


def test_probes_use_grpc_health_and_the_configured_ports() -> None:
    """Ports come from values: move every one of them and nothing keeps the old number."""
    ports = {"processor": 41001, "engine": 41002, "worker": 41003}
    values = {c: {"port": p, "metricsPort": p + 100} for c, p in ports.items()}
    values["worker"]["stepPort"] = 41203  # the worker's step channel
    values["gateway"] = {"port": 41000, "service": {"type": "ClusterIP", "port": 80}}
    values["internalAuth"] = {"tls": {"enabled": False}}  # kubelet's own gRPC probes speak plain text only
    rendered = render(values)
    text = manifest(rendered)
    for default in ("8000", "50051", "50052", "50053", "50063", "9051", "9052", "9053"):
        assert f": {default}\n" not in text and f"={default}\n" not in text and f":{default}\n" not in text, default
    objs = objects(rendered)
    for component, port in ports.items():
        container = pod_spec(objs, component)["containers"][0]
        assert args_of(objs, component)["port"] == str(port)
        step = {"step": port + 200} if component == "worker" else {}
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": port, "metrics": port + 100,
                                                                               **step}
        assert container["readinessProbe"]["grpc"]["port"] == port
    assert args_of(objs, "worker")["step-port"] == "41203"
    assert args_of(objs, "gateway")["processor-address"].endswith(f":{ports['processor']}")
    assert pod_spec(objs, "gateway")["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"


def test_gpu_and_cpu_workers() -> None:
    gpu = objects(render(example_values("gpu")))
    cpu = objects(render(example_values("cpu")))
    gpu_worker = pod_spec(gpu, "worker")["containers"][0]
    assert gpu_worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_worker["image"].endswith("-cuda") and args_of(gpu, "worker")["device"] == "cuda"
    cpu_worker = pod_spec(cpu, "worker")["containers"][0]
    assert "nvidia.com/gpu" not in str(cpu)
    assert cpu_worker["image"].endswith("-cpu") and args_of(cpu, "worker")["device"] == "cpu"
    # Only the workers need the CUDA image.
    assert all(pod_spec(gpu, c)["containers"][0]["image"].endswith("-cpu") for c in ("gateway", "processor", "engine"))


def test_api_keys_arrive_as_a_file_from_the_secret() -> None:
    """The gateway reads its keys from the mounted Secret (--api-key-file), never from an
    environment variable, which `kubectl describe` and /proc show."""
    objs = objects(render(example_values("gpu")))
    pod = pod_spec(objs, "gateway")
    container = pod["containers"][0]
    assert "secretKeyRef" not in str(container.get("env")) and "KVMESH_API_KEY" not in str(container.get("env"))
    path = args_of(objs, "gateway")["api-key-file"]
    volume = volume_of(pod, container, path)
    assert volume["secret"] == {"secretName": "kvmesh-api-key", "defaultMode": 0o440,
                                "items": [{"key": "api-key", "path": path.rsplit("/", 1)[1]}]}
    parser = importlib.import_module(SERVICES["gateway"]).build_parser()
    assert build(parser, GatewayConfig, parser.parse_args(container["args"][1:])).api_key_file == Path(path)
    default = objects(render())
    assert "api-key-file" not in args_of(default, "gateway")
    assert not [v for v in pod_spec(default, "gateway")["volumes"] if v["name"] == "api-key"]


def test_trusted_proxies_reach_the_gateway() -> None:
    objs = objects(render({"gateway": {"trustedProxies": ["10.0.0.0/8", "192.168.1.7"]}}))
    args = pod_spec(objs, "gateway")["containers"][0]["args"]
    parser = importlib.import_module(SERVICES["gateway"]).build_parser()
    assert build(parser, GatewayConfig, parser.parse_args(args[1:])).trusted_proxy == ("10.0.0.0/8", "192.168.1.7")
    assert not [a for a in pod_spec(objects(render()), "gateway")["containers"][0]["args"] if "trusted-proxy" in a]
    with pytest.raises(helm.HelmValuesError):
        render({"gateway": {"trustedProxies": ["proxy.example"]}})


@pytest.mark.parametrize("values, key", [
    ({"gateway": {"replica": 3}}, "replica"),
    ({"monitorng": {}}, "monitorng"),
    ({"worker": {"gpu": 1}}, "gpu"),
    ({"model": {"storage": {"hostpath": {"path": "/x"}}}}, "hostpath"),
])
def test_schema_rejects_a_misspelled_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=f"additional properties '{key}' not allowed"):
        render(values)


@pytest.mark.parametrize("values", [
    {"worker": {"dtype": "fp16"}},
    {"engine": {"port": 70000}},
    {"model": {"storage": {"type": "nfs"}}},
    {"keda": {"waitingRequestsPerReplica": 0}},
    {"processor": {"routing": "random"}},
    {"redis": {"url": "http://redis:6379"}},
    {"redis": {"heartbeatTtl": 0}},
])
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)


def test_one_monitor_kind_at_a_time() -> None:
    both = {"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    with pytest.raises(helm.HelmRenderError, match="serviceMonitor or podMonitor, not both"):
        render(both)


def test_every_component_has_a_pdb_and_the_scalers_their_targets() -> None:
    objs = objects(render(example_values("gpu")))
    pdbs = {o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for o in objs
            if o["kind"] == "PodDisruptionBudget"}
    assert pdbs == set(COMPONENTS)
    hpas = {o["spec"]["scaleTargetRef"]["name"] for o in objs if o["kind"] == "HorizontalPodAutoscaler"}
    assert hpas == {"kvmesh-gateway", "kvmesh-processor"}
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in objs if o["kind"] == "ScaledObject"}
    assert scaled == {"kvmesh-engine", "kvmesh-worker"}
    # Autoscaled workloads leave replicas to their scaler (a fixed count would fight it).
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] in hpas | scaled:
            assert "replicas" not in o["spec"], o["metadata"]["name"]


def test_the_services_accept_the_chart_arguments(example: tuple[str, dict[str, str]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pod's command line and environment parse with that service's own parser (flags or
    variables renamed in the code would otherwise surface only as crash-looping pods, or as
    settings silently ignored)."""
    _, rendered = example
    objs = objects(rendered)
    for component in COMPONENTS:
        for workload in pools(objs, component):
            container = workload["spec"]["template"]["spec"]["containers"][0]
            env = env_of(container)
            prefix = f"KVMESH_{component.upper()}_"
            with monkeypatch.context() as patch:
                for name, value in env.items():
                    patch.setenv(name, value)
                parser = importlib.import_module(SERVICES[component]).build_parser()
                parsed = parser.parse_args(container["args"][1:])
            assert parsed.port == int(workload_args(workload)["port"])
            for name, value in env.items():
                if name.startswith(prefix):  # a variable the service reads: it must name one of its flags
                    dest = name.removeprefix(prefix).lower()
                    assert dest in vars(parsed), f"{component} has no flag for ${name}"
                    for config_class in (PrefixIndexConfig, RoutingConfig, EngineServiceConfig):
                        if dest in {f.name for f in fields(config_class)}:
                            built = getattr(build(parser, config_class, parsed), dest)
                            assert built == type(built)(value), name


POD_IP = "10.1.2.3"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet gives it: `$(VAR)` of an earlier variable expanded,
    the pod's IP from the downward API, a Secret's key as a placeholder."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == POD_INDEX:
            env[var["name"]] = "1"  # a StatefulSet's second pod
        else:
            env[var["name"]] = "from-a-secret"
    return env


# ----------------------------------------------------------------------------- the prefix index


@pytest.mark.parametrize("values, url", [
    (example_values("fleet"), "redis://kvmesh-redis:6379/0"),
    ({"redis": {"url": "rediss://index.example:6380/2", "heartbeatTtl": 4.5},
      "processor": {"routing": "least-load"}}, "rediss://index.example:6380/2"),
    ({}, None),
], ids=["fleet", "external", "none"])
def test_engines_and_processors_get_the_prefix_index(values: dict[str, Any], url: str | None) -> None:
    """The chart's Redis or an external one reaches every engine and processor as the variables
    their PrefixIndexConfig reads; engines advertise their pod's address (their id in the index)."""
    objs = objects(render(values))
    redis = values.get("redis", {})
    routing = values.get("processor", {}).get("routing", "kv-aware")
    engine_port = args_of(objs, "engine")["port"]
    for component in ("engine", "processor"):
        env = env_of(pod_spec(objs, component)["containers"][0])
        prefix = f"KVMESH_{component.upper()}_"
        assert env.get(f"{prefix}PREFIX_INDEX") == url
        if url is not None:
            assert float(env[f"{prefix}HEARTBEAT_TTL"]) == redis.get("heartbeatTtl", 10)
        else:
            assert f"{prefix}HEARTBEAT_TTL" not in env
        if component == "engine":
            assert env["KVMESH_ENGINE_ADVERTISE_ADDRESS"] == f"{POD_IP}:{engine_port}"
        else:
            assert env["KVMESH_PROCESSOR_ROUTING"] == routing
    assert "KVMESH_REDIS_URL" not in manifest(render(values))


def test_the_fleet_example_runs_two_model_replicas_on_the_charts_redis() -> None:
    objs = objects(render(example_values("fleet")))
    engine, worker = (find(objs, "StatefulSet", f"kvmesh-{c}") for c in ("engine", "worker"))
    assert engine["spec"]["replicas"] == worker["spec"]["replicas"] == 2
    redis = find(objs, "Service", "kvmesh-redis")
    assert env_of(pod_spec(objs, "engine")["containers"][0])["KVMESH_ENGINE_PREFIX_INDEX"] == \
        f"redis://kvmesh-redis:{redis['spec']['ports'][0]['port']}/0"
    assert "nvidia.com/gpu" not in str(objs)


# ----------------------------------------------------------------------------- internal security

INTERNAL = ("processor", "engine", "worker")
TOKEN_FILE = "/var/run/kvmesh/internal-token/token"


def volume_of(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod volume mounted at the directory of `path` in `container`."""
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly") is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


# The role tokens each component holds: its own, to call with, and its callers', to check them.
HELD_TOKENS = {"gateway": ["gateway"], "processor": ["gateway", "processor"], "engine": ["processor", "engine"],
               "worker": ["engine"]}


def test_each_component_holds_only_its_role_tokens() -> None:
    """One Secret per caller role, each mounted only where it is sent or checked: the gateway's pod
    holds no token that opens an engine or a worker."""
    objs = objects(render())
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-token")}
    assert set(secrets) == {"kvmesh-gateway-token", "kvmesh-processor-token", "kvmesh-engine-token"}
    assert len({s["data"]["token"] for s in secrets.values()}) == 3
    assert all(len(base64.b64decode(s["data"]["token"])) == 48 for s in secrets.values())
    for component, roles in HELD_TOKENS.items():
        pod = pod_spec(objs, component)
        container = pod["containers"][0]
        args = args_of(objs, component)
        assert [flag for flag in args if flag.endswith("token-file")] == [f"{role}-token-file" for role in roles]
        for role in roles:
            volume = volume_of(pod, container, args[f"{role}-token-file"])
            assert volume["secret"]["secretName"] == f"kvmesh-{role}-token"
            assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
            assert volume["secret"]["defaultMode"] == 0o440  # root and the fsGroup
        mounted = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert mounted & set(secrets) == {f"kvmesh-{role}-token" for role in roles}, component
        assert "KVMESH_INTERNAL_TOKEN" not in str(container.get("env"))


def test_an_existing_shared_token_goes_to_every_component() -> None:
    objs = objects(render({"internalAuth": {"existingSecret": "my-token", "key": "secret"}}))
    assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-token")]
    for component in COMPONENTS:
        pod = pod_spec(objs, component)
        args = args_of(objs, component)
        assert args["internal-token-file"] == TOKEN_FILE
        assert not [flag for flag in args if flag.endswith("token-file") and flag != "internal-token-file"]
        volume = volume_of(pod, pod["containers"][0], TOKEN_FILE)
        assert volume["secret"]["secretName"] == "my-token"
        assert volume["secret"]["items"] == [{"key": "secret", "path": "token"}]


def test_each_install_draws_its_own_token() -> None:
    tokens = {find(objects(render(fresh=True)), "Secret", "kvmesh-gateway-token")["data"]["token"] for _ in range(2)}
    assert len(tokens) == 2


def policy_for(objs: list[dict[str, Any]], component: str, egress: bool = False) -> dict[str, Any]:
    """A component's ingress policy, or with `egress` its egress one."""
    [policy] = [o for o in objs if o["kind"] == "NetworkPolicy"
                and o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
                and o["metadata"]["name"].endswith("-egress") == egress]
    return policy["spec"]


def test_network_policies_admit_only_the_next_hop_and_prometheus() -> None:
    """gateway -> processor -> engine -> worker on the gRPC ports (and the worker's step port),
    Prometheus on the metrics ports: each policy selects exactly its component's pods, names ports
    its container has, and admits the pods of the component before it."""
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}},
                  "podSelector": {"matchLabels": {"app": "prom"}}}
    # Helm merges maps with the defaults: null drops the default's label.
    values = {"namespaceSelector": prometheus["namespaceSelector"],
              "podSelector": {"matchLabels": {"app": "prom", "app.kubernetes.io/name": None}}}
    objs = objects(render({"redis": {"enabled": True}, "networkPolicy": {"enabled": True, "prometheus": values}}))
    for component, caller in zip(INTERNAL, ("gateway", "processor", "engine")):
        pod = pod_spec(objs, component)
        spec = policy_for(objs, component)
        workload = next(o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                        and o["metadata"]["name"] == f"kvmesh-{component}")
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
        assert spec["policyTypes"] == ["Ingress"]
        grpc_rule, metrics_rule = spec["ingress"]
        # The worker's engine also drives it over the step channel.
        calls = [{"port": "grpc"}, {"port": "step"}] if component == "worker" else [{"port": "grpc"}]
        assert grpc_rule["ports"] == calls and metrics_rule["ports"] == [{"port": "metrics"}]
        [peer] = grpc_rule["from"]
        caller_labels = next(o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                                          and o["metadata"]["name"] == f"kvmesh-{caller}")
        assert peer["podSelector"]["matchLabels"].items() <= caller_labels["spec"]["template"]["metadata"][
            "labels"].items()
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == caller
        assert metrics_rule["from"] == [prometheus]
        assert {p["port"] for p in calls} | {"metrics"} <= {p["name"] for p in pod["containers"][0]["ports"]}
    gateway = policy_for(objs, "gateway")
    assert gateway["ingress"] == [{"ports": [{"port": "http"}]}]  # the API: anyone, on that port only
    redis = policy_for(objs, "redis")
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in redis["ingress"][0]["from"]] \
        == ["processor", "engine"]
    assert not [o for o in objects(render({"networkPolicy": {"enabled": False, "prometheus": {}}}))
                if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("secret_name", ["kvmesh-tls", ""], ids=["existing", "generated"])
def test_mutual_tls_mounts_the_certificates_and_probes_with_them(secret_name: str) -> None:
    tls = {"enabled": True, "secretName": secret_name, "serverName": "internal.kvmesh"}
    objs = objects(render({"internalAuth": {"existingSecret": "", "key": "token", "tls": tls}}))
    for obj in objs:
        if obj["kind"] not in CUSTOM_KINDS:
            strict_validator(KUBE_VERSIONS[0], obj["kind"], obj["apiVersion"]).validate(obj)
    secret = secret_name or "kvmesh-internal-tls"
    for component in COMPONENTS:
        pod = pod_spec(objs, component)
        container = pod["containers"][0]
        args = args_of(objs, component)
        assert args["tls-server-name"] == "internal.kvmesh"
        for flag in ("tls-cert-file", "tls-key-file", "tls-ca-file"):
            assert volume_of(pod, container, args[flag])["secret"]["secretName"] == secret
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "grpc" in container.get(probe, {}) or "exec" in container.get(probe, {}):
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["python", "-m", "services.common.rpc.health_probe"]
                assert f"--tls-ca-file={args['tls-ca-file']}" in command
                assert f"--port={args['port']}" in command
    generated = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "kvmesh-internal-tls"]
    assert len(generated) == (0 if secret_name else 1)


def test_tls_is_on_by_default_with_a_certificate_the_chart_makes(tmp_path) -> None:
    """Helm's own CA and a certificate for the server name, for server and client authentication:
    the pair the services' mutual TLS accepts (checked with openssl)."""
    objs = objects(render())
    assert all(args_of(objs, component)["tls-server-name"] == "kvmesh-internal" for component in COMPONENTS)
    data = find(objs, "Secret", "kvmesh-internal-tls")["data"]
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(data[key]))
    verify = subprocess.run(["openssl", "verify", "-purpose", "sslclient", "-CAfile", tmp_path / "ca.crt",
                             tmp_path / "tls.crt"], capture_output=True, text=True, timeout=30)
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(["openssl", "x509", "-in", tmp_path / "tls.crt", "-noout", "-text"], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    assert "DNS:kvmesh-internal" in text and "TLS Web Server Authentication" in text


def test_tls_with_cert_manager_issues_the_certificate_the_pods_mount() -> None:
    objs = objects(render({"internalAuth": {"tls": {"certManager": True}}}))
    assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "kvmesh-internal-tls"]
    issuers = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Issuer"}
    certificates = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Certificate"}
    ca, leaf = certificates["kvmesh-internal-ca"]["spec"], certificates["kvmesh-internal-tls"]["spec"]
    assert ca["isCA"] and ca["issuerRef"]["name"] in issuers and "selfSigned" in issuers[ca["issuerRef"]["name"]]["spec"]
    assert issuers[leaf["issuerRef"]["name"]]["spec"]["ca"]["secretName"] == ca["secretName"]
    assert leaf["secretName"] == "kvmesh-internal-tls" and leaf["dnsNames"] == ["kvmesh-internal"]
    assert set(leaf["usages"]) == {"server auth", "client auth"}
    pod = pod_spec(objs, "worker")
    assert volume_of(pod, pod["containers"][0], args_of(objs, "worker")["tls-ca-file"])["secret"]["secretName"] == \
        "kvmesh-internal-tls"


# ----------------------------------------------------------------------------- tensor parallel


def test_a_tensor_parallel_group_is_a_statefulset_per_engine_with_rank_names() -> None:
    """worker.tensorParallelSize 2, two engines: engine-<i>'s ranks are the pods worker-<i>-<r> of the
    StatefulSet worker-<i> (its own selector), each taking its rank from its pod index, all
    dialling rank 0's rendezvous Service, which resolves before rank 0 is ready."""
    values = example_values("tp2")
    values["engine"] = {**values["engine"], "replicas": 2}
    objs = objects(render(values))
    assert int(args_of(objs, "engine")["tensor-parallel-size"]) == 2
    assert worker_pod_names(objs) == {"kvmesh-worker-0-0", "kvmesh-worker-0-1", "kvmesh-worker-1-0",
                                      "kvmesh-worker-1-1"}
    for group in (0, 1):
        statefulset = find(objs, "StatefulSet", f"kvmesh-worker-{group}")
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        selector = statefulset["spec"]["selector"]["matchLabels"]
        assert selector["kvmesh.io/worker-group"] == f"kvmesh-worker-{group}" and selector.items() <= labels.items()
        container = statefulset["spec"]["template"]["spec"]["containers"][0]
        args = dict(a.removeprefix("--").partition("=")[::2] for a in container["args"][1:])
        assert args["tensor-parallel-size"] == "2"
        host, port = args["distributed-address"].rsplit(":", 1)
        rendezvous = find(objs, "Service", host)["spec"]
        assert rendezvous["clusterIP"] == "None" and rendezvous["publishNotReadyAddresses"] is True
        assert rendezvous["selector"]["statefulset.kubernetes.io/pod-name"] == f"kvmesh-worker-{group}-0"
        assert rendezvous["ports"][0]["port"] == int(port)
        assert {"name": "distributed", "containerPort": int(port)} in container["ports"]
        [rank] = [v for v in container["env"] if v["name"] == "KVMESH_WORKER_RANK"]
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    policy = policy_for(objs, "worker")
    assert {"from": [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]} \
        in policy["ingress"]  # the ranks reach each other on any port (gloo, NCCL)


def test_without_tensor_parallelism_the_workers_stay_one_statefulset() -> None:
    objs = objects(render({}))
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"] == ["kvmesh-engine", "kvmesh-worker"]
    assert "tensor-parallel-size" not in args_of(objs, "engine") and "tensor-parallel-size" not in args_of(objs, "worker")
    assert not any(o["metadata"]["name"].endswith("-rendezvous") for o in objs)


def test_tensor_parallelism_refuses_keda() -> None:
    with pytest.raises(helm.HelmRenderError, match="tensorParallelSize above 1 does not go with keda.enabled"):
        render({"worker": {"tensorParallelSize": 2}, "keda": {"enabled": True}})


def test_the_pd_example_runs_a_prefill_and_a_decode_pair_that_find_each_other() -> None:
    """values-pd.yaml: engine-prefill-0 pairs with worker-prefill-0 (its hostname, -engine- -> -worker-,
    in the one worker Service), the processors route to the decode engine only and name the prefill
    engine by its pod's DNS name, the workers' KV-transfer endpoints listen on their pod IP's
    transfer port (declared), the roles reach the services, and every such command line parses."""
    objs = objects(render(example_values("pd")))
    prefill = find(objs, "StatefulSet", "kvmesh-engine-prefill")
    assert prefill["spec"]["replicas"] == 1 and prefill["spec"]["serviceName"] == "kvmesh-engine-prefill"
    assert engine_server.paired_worker_hostnames("kvmesh-engine-prefill-0") == ("kvmesh-worker-prefill-0",)
    assert worker_pod_names(objs, "prefill") == {"kvmesh-worker-prefill-0"}
    assert worker_pod_names(objs) == {"kvmesh-worker-0"}
    assert find(objs, "StatefulSet", "kvmesh-worker-prefill")["spec"]["serviceName"] == "kvmesh-worker"
    # Services: the engine Service selects the decode engines; engine-prefill (headless) the prefill ones.
    assert find(objs, "Service", "kvmesh-engine")["spec"]["selector"]["kvmesh.io/role"] == "decode"
    headless = find(objs, "Service", "kvmesh-engine-prefill")["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"]["kvmesh.io/role"] == "prefill"
    processor = pod_spec(objs, "processor")["containers"][0]["args"]
    assert [a for a in processor if a.startswith("--prefill-")] == [
        "--prefill-engine-address=kvmesh-engine-prefill-0.kvmesh-engine-prefill:50052", "--prefill-threshold=512"]
    for role in ("decode", "prefill"):
        assert args_of(objs, "engine", role)["engine-role"] == role
        worker = pod_spec(objs, "worker", role)["containers"][0]
        args = dict(a.removeprefix("--").partition("=")[::2] for a in worker["args"][1:])
        assert args["kv-transfer-address"] == "$(POD_IP):29600"
        assert {"name": "kv-transfer", "containerPort": 29600} in worker["ports"]
        assert env_of(worker)["POD_IP"] == POD_IP
        for component in ("engine", "worker"):
            argv = [a.replace("$(POD_IP)", POD_IP) for a in pod_spec(objs, component, role)["containers"][0]["args"]]
            parser = importlib.import_module(SERVICES[component]).build_parser()
            config = build(parser, DisaggregationConfig, parser.parse_args(argv[1:]))
            assert config.kv_transfer_timeout == 5
            if component == "engine":
                assert (config.engine_role, config.kv_lease) == (role, 30)
            else:
                assert config.kv_transfer_address == f"{POD_IP}:29600"
    parser = importlib.import_module(SERVICES["processor"]).build_parser()
    config = build(parser, DisaggregationConfig, parser.parse_args(processor[1:]))
    assert config.prefill_engine_address == ("kvmesh-engine-prefill-0.kvmesh-engine-prefill:50052",)
    # Network policies: prefill engines take Engine.Prefill from decode engines; workers reach each other.
    engine_policy = policy_for(objs, "engine")
    assert {"ports": [{"port": "grpc"}], "from": [{"podSelector": {"matchLabels": {
        **engine_policy["podSelector"]["matchLabels"], "kvmesh.io/role": "decode"}}}]} in engine_policy["ingress"]
    worker_policy = policy_for(objs, "worker")
    assert {"from": [{"podSelector": {"matchLabels": worker_policy["podSelector"]["matchLabels"]}}]} \
        in worker_policy["ingress"]


def test_disaggregation_refuses_tensor_parallelism_and_keda() -> None:
    for values in ({"worker": {"tensorParallelSize": 2}}, {"keda": {"enabled": True}}):
        with pytest.raises(helm.HelmRenderError, match="disaggregation.enabled goes with"):
            render({**values, "disaggregation": {"enabled": True}})


# ----------------------------------------------------------------------------- several models


def matches(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    """Whether a label selector picks a workload's pods."""
    return selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def fleet_of(objs: list[dict[str, Any]], component: str) -> FleetConfig:
    """The models a service's command line serves, as its own parser reads them."""
    parser = importlib.import_module(SERVICES[component]).build_parser()
    args = parser.parse_args(pod_spec(objs, component)["containers"][0]["args"][1:])
    if component == "gateway":  # it takes the served names only, as services/gateway/server.py builds them
        return build(parser, FleetConfig, args, model=tuple(args.served_model_name))
    return build(parser, FleetConfig, args)


def test_the_models_example_runs_each_model_on_pools_of_its_own() -> None:
    """values-models.yaml: each model's engines and workers are StatefulSets of their own that select
    only their own pods, with the entry's replicas and worker settings; the gateway and the processor
    serve both; each engine's worker Service and network policies reach its own model's workers only,
    and the processors reach every engine."""
    objs = objects(render(example_values("models")))
    keys = ("smollm2", "gemma3-270m")
    statefulsets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    assert set(statefulsets) == {f"kvmesh-{c}-{key}" for c in ("engine", "worker") for key in keys}
    for a in statefulsets.values():
        for b in statefulsets.values():
            assert matches(a["spec"]["selector"]["matchLabels"], b) == (a is b), (a["metadata"]["name"], b["metadata"]["name"])
    assert fleet_of(objs, "processor") == FleetConfig(model=keys, served_model_name=keys)
    assert fleet_of(objs, "gateway").names == keys
    policies = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    [to_engines] = [r for r in policies["kvmesh-processor-egress"]["egress"]
                    if r.get("to", [{}])[0].get("podSelector", {}).get("matchLabels", {}).get(
                        "app.kubernetes.io/component") == "engine"]
    for key, other, replicas, kv_cache, memory in (("smollm2", "gemma3-270m", 2, "268435456", "2Gi"),
                                                   ("gemma3-270m", "smollm2", 1, "134217728", "3Gi")):
        engine, worker = statefulsets[f"kvmesh-engine-{key}"], statefulsets[f"kvmesh-worker-{key}"]
        assert engine["spec"]["replicas"] == worker["spec"]["replicas"] == replicas
        args = workload_args(worker)
        assert (args["model"], args["served-model-name"], args["kv-cache-memory"]) == (key, key, kv_cache)
        assert worker["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] == memory
        worker_service = find(objs, "Service", workload_args(engine)["worker-service"])
        assert selects(worker_service, worker) and not selects(worker_service, statefulsets[f"kvmesh-worker-{other}"])
        # Network policies: the processors reach the engine; the engine, and only it, its workers.
        assert matches(to_engines["to"][0]["podSelector"]["matchLabels"], engine)
        processor = find(objs, "Deployment", "kvmesh-processor")
        assert matches(policies[f"kvmesh-engine-{key}"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"],
                       processor)
        worker_ingress = policies[f"kvmesh-worker-{key}"]
        assert matches(worker_ingress["podSelector"]["matchLabels"], worker)
        callers = worker_ingress["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert matches(callers, engine) and not matches(callers, statefulsets[f"kvmesh-engine-{other}"])
        [to_workers] = [r for r in policies[f"kvmesh-engine-{key}-egress"]["egress"]
                        if {"port": "step"} in r.get("ports", [])]
        workers = to_workers["to"][0]["podSelector"]["matchLabels"]
        assert matches(workers, worker) and not matches(workers, statefulsets[f"kvmesh-worker-{other}"])


def test_each_model_brings_its_own_parallelism_scaling_gpus_and_storage() -> None:
    """An entry's engine, worker and keda keys replace the top-level ones (a zero or false too): one
    model tensor parallel on CPUs with two engines, the other on a GPU scaled by KEDA on its own
    queue, from a claim of its own that the processor mounts beside the release's volume."""
    storage = {"type": "pvc", "mountPath": "/big", "cacheDir": "/big/.kvmesh-cache",
               "pvc": {"existingClaim": "", "size": "100Gi", "accessModes": ["ReadWriteMany"]}}
    values = {"worker": {"gpus": 1}, "models": [
        {"name": "small", "model": "smollm2", "engine": {"replicas": 2, "pdb": {"enabled": False, "maxUnavailable": 1}},
         "worker": {"gpus": 0, "tensorParallelSize": 2}},
        {"name": "big", "model": "/big/Qwen2.5-7B-Instruct", "servedModelName": "qwen2.5-7b-instruct",
         "maxModelLen": 8192, "keda": {"enabled": True}, "storage": storage}]}
    objs = objects(render(values))
    for obj in objs:
        if obj["kind"] not in CUSTOM_KINDS:
            strict_validator(KUBE_VERSIONS[0], obj["kind"], obj["apiVersion"]).validate(obj)
    assert fleet_of(objs, "processor") == FleetConfig(model=("smollm2", "/big/Qwen2.5-7B-Instruct"),
                                                      served_model_name=("small", "qwen2.5-7b-instruct"))
    small = [w for w in pools(objs, "worker") if model_of(w) == "small"]
    engines = find(objs, "StatefulSet", "kvmesh-engine-small")
    assert int(workload_args(engines)["tensor-parallel-size"]) == 2
    assert pod_names(small) == {h for i in range(2) for h in engine_server.paired_worker_hostnames(
        f"kvmesh-engine-small-{i}", 2)} == {"kvmesh-worker-small-0-0", "kvmesh-worker-small-0-1",
                                            "kvmesh-worker-small-1-0", "kvmesh-worker-small-1-1"}
    for group in (0, 1):
        args = workload_args(find(objs, "StatefulSet", f"kvmesh-worker-small-{group}"))
        assert args["device"] == "cpu" and "max-model-len" not in args
        host = args["distributed-address"].rsplit(":", 1)[0]
        assert find(objs, "Service", host)["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == \
            f"kvmesh-worker-small-{group}-0"
    big = find(objs, "StatefulSet", "kvmesh-worker-big")
    container = big["spec"]["template"]["spec"]["containers"][0]
    args = workload_args(big)
    assert (args["device"], args["max-model-len"], container["resources"]["limits"]["nvidia.com/gpu"]) == \
        ("cuda", "8192", 1)
    # KEDA scales the big model's pair only, on its own queue; the small one keeps its replicas.
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "ScaledObject"}
    assert set(scaled) == {"kvmesh-engine-big", "kvmesh-worker-big"}
    assert all('model_name="qwen2.5-7b-instruct"' in o["spec"]["triggers"][0]["metadata"]["query"]
               for o in scaled.values())
    assert "replicas" not in big["spec"] and engines["spec"]["replicas"] == 2
    pdbs = {o["metadata"]["name"] for o in objs if o["kind"] == "PodDisruptionBudget"}
    assert {name for name in pdbs if "-engine-" in name or "-worker-" in name} == \
        {"kvmesh-engine-big", "kvmesh-worker-small", "kvmesh-worker-big"}
    # Storage: the big model's claim, on its engine, its worker and the processor (beside /models).
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"] == ["kvmesh-models-big"]
    for pod in (big["spec"]["template"]["spec"], find(objs, "StatefulSet", "kvmesh-engine-big")["spec"]["template"]["spec"],
                pod_spec(objs, "processor")):
        volume = volume_mounted_at(pod, "/big")
        assert volume["persistentVolumeClaim"] == {"claimName": "kvmesh-models-big"}
    assert "emptyDir" in volume_mounted_at(pod_spec(objs, "processor"), "/models")
    assert "emptyDir" in volume_mounted_at(small[0]["spec"]["template"]["spec"], "/models")


def volume_mounted_at(pod: dict[str, Any], path: str) -> dict[str, Any]:
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == path]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


@pytest.mark.parametrize("models, error, message", [
    ([{"name": "Qwen", "model": "x"}], helm.HelmValuesError, "does not match pattern"),
    ([{"name": "a" * 31, "model": "x"}], helm.HelmValuesError, "maxLength"),
    ([{"name": "a"}], helm.HelmValuesError, "missing property 'model'"),
    ([{"name": "a", "model": "x", "engine": {"port": 1}}], helm.HelmValuesError, "'port' not allowed"),
    ([{"name": "a", "model": "x"}, {"name": "a", "model": "y"}], helm.HelmRenderError, 'two entries are named "a"'),
    ([{"name": "a", "model": "x", "servedModelName": "s"}, {"name": "b", "model": "y", "servedModelName": "s"}],
     helm.HelmRenderError, 'two entries are served as "s"'),
    ([{"name": "a-engine", "model": "x"}], helm.HelmRenderError, "must not contain"),
    ([{"name": "a-1", "model": "x"}, {"name": "a", "model": "y"}], helm.HelmRenderError, "would name the same objects"),
    ([{"name": "a", "model": "x", "storage": {"type": "emptyDir", "mountPath": "/models", "cacheDir": "/models/c"}}],
     helm.HelmRenderError, "mountPath of its own"),
], ids=["upper-case", "long", "no-model", "port", "same-name", "same-served-name", "engine-in-name", "group-name",
        "same-mount"])
def test_a_bad_models_entry_fails_with_a_clear_message(models: list[dict[str, Any]], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        render({"models": models})


def test_several_models_refuse_disaggregation() -> None:
    with pytest.raises(helm.HelmRenderError, match="disaggregation.enabled serves one model"):
        render({"models": [{"name": "a", "model": "x"}], "disaggregation": {"enabled": True}})


# ----------------------------------------------------------------------------- pod hardening, egress, Redis

DOCKERFILE = CHART_DIR.parents[2] / "docker" / "Dockerfile.cpu"


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def image_cache_dir() -> str:
    """KVMESH_CACHE_DIR as the images set it (a service without the variable in its pod writes there)."""
    [path] = re.findall(r"KVMESH_CACHE_DIR=(\S+)", DOCKERFILE.read_text())
    return path


def test_every_container_runs_read_only_and_unprivileged(example: tuple[str, dict[str, str]]) -> None:
    """Every container (init containers and Redis too): a read-only root filesystem, the runtime's
    default seccomp profile, no root, no privilege escalation, no capabilities. What a kvmesh
    service writes (temporary files, HOME's caches: Triton, Hugging Face, CUDA; KVMESH_CACHE_DIR:
    native kernels, converted models) lies on a writable volume."""
    _, rendered = example
    objs = objects(rendered)
    assert workloads(objs)
    for workload in workloads(objs):
        pod = workload["spec"]["template"]["spec"]
        where = workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (where, container["name"])
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
            assert context.get("seccompProfile", {"type": "RuntimeDefault"}) == {"type": "RuntimeDefault"}
        container = pod["containers"][0]
        if container["name"] not in COMPONENTS:
            continue
        env = env_of(container)
        writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
        for path in ("/tmp", env["HOME"], env.get("KVMESH_CACHE_DIR", image_cache_dir())):
            assert any(path == m or path.startswith(m + "/") for m in writable), (where, path, writable)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_a_token_seed_gives_the_same_role_tokens_on_every_render() -> None:
    """helm template and GitOps tools render without a cluster: from a seed, two renders give the
    same three Secrets (still one token per role), another seed others; a user's Secret leaves no
    token in the chart's output at all."""
    seed = {"internalAuth": {"tokenSeed": "s" * 40}}

    def tokens(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {o["metadata"]["name"]: o for o in objects(render(values, fresh=True))
                if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-token")}

    first, second = tokens(seed), tokens(seed)
    assert set(first) == {"kvmesh-gateway-token", "kvmesh-processor-token", "kvmesh-engine-token"}
    assert first == second
    assert len({s["data"]["token"] for s in first.values()}) == 3
    assert all(len(base64.b64decode(s["data"]["token"])) >= 32 for s in first.values())
    other = tokens({"internalAuth": {"tokenSeed": "t" * 40}})
    assert not {s["data"]["token"] for s in first.values()} & {s["data"]["token"] for s in other.values()}
    assert tokens({"internalAuth": {"existingSecret": "mine"}}) == {}
    with pytest.raises(helm.HelmValuesError):
        render({"internalAuth": {"tokenSeed": "short"}})


def egress_peers(objs: list[dict[str, Any]], component: str) -> set[tuple[str, tuple[Any, ...]]]:
    """(peer, ports) per rule of a component's egress policy: peer is a component, "dns", "api",
    or the rule's `to` as text; ports as (port, protocol) pairs, () for any."""
    peers = set()
    for rule in policy_for(objs, component, egress=True)["egress"]:
        ports = tuple(sorted((p["port"], p.get("protocol", "TCP")) for p in rule.get("ports", [])))
        for to in rule.get("to", [{}]):
            labels = to.get("podSelector", {}).get("matchLabels", {})
            if "namespaceSelector" in to and labels.get("k8s-app") == "kube-dns":
                peers.add(("dns", ports))
            elif to.get("ipBlock", {}).get("cidr") == "0.0.0.0/0" and ports == ((443, "TCP"), (6443, "TCP")):
                peers.add(("api", ports))
            elif "app.kubernetes.io/component" in labels and "namespaceSelector" not in to:
                assert labels["app.kubernetes.io/instance"] == "kvmesh"
                peers.add((labels["app.kubernetes.io/component"], ports))
            else:
                peers.add((str(to), ports))
    return peers


DNS = ("dns", ((53, "TCP"), (53, "UDP")))
API = ("api", ((443, "TCP"), (6443, "TCP")))


@pytest.mark.parametrize("values, expected", [
    ({"redis": {"enabled": True}}, {
        "gateway": {("processor", (("grpc", "TCP"),)), DNS},
        "processor": {("engine", (("grpc", "TCP"),)), ("redis", (("redis", "TCP"),)), API, DNS},
        "engine": {("worker", (("grpc", "TCP"), ("step", "TCP"))), ("redis", (("redis", "TCP"),)), API, DNS},
        "worker": {DNS}}),
    (example_values("pd"), {
        "gateway": {("processor", (("grpc", "TCP"),)), DNS},
        "processor": {("engine", (("grpc", "TCP"),)), API, DNS},
        "engine": {("worker", (("grpc", "TCP"), ("step", "TCP"))), ("engine", (("grpc", "TCP"),)), API, DNS},
        "worker": {("worker", ()), DNS}}),
    (example_values("tp2"), {
        "gateway": {("processor", (("grpc", "TCP"),)), DNS},
        "processor": {("engine", (("grpc", "TCP"),)), API, DNS},
        "engine": {("worker", (("grpc", "TCP"), ("step", "TCP"))), API, DNS},
        "worker": {("worker", ()), DNS}}),
], ids=["redis", "pd", "tp2"])
def test_egress_policies_allow_exactly_the_next_hops(values: dict[str, Any], expected: dict[str, set]) -> None:
    """Each component may open connections to the next hop, Redis and the API server where it uses
    them, and DNS; workers reach other workers only when they have peers (tensor parallel, KV
    transfer). Named ports exist on the peers' containers."""
    objs = objects(render(values))
    for component, peers in expected.items():
        spec = policy_for(objs, component, egress=True)
        assert spec["policyTypes"] == ["Egress"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert egress_peers(objs, component) == peers, component
        for peer, ports in peers:
            if peer in COMPONENTS:
                names = {p["name"] for p in pod_spec(objs, peer)["containers"][0]["ports"]}
                assert {p for p, _ in ports} <= names, (component, peer)
    if values.get("redis", {}).get("enabled"):
        redis = policy_for(objs, "redis")
        assert redis["policyTypes"] == ["Ingress", "Egress"] and "egress" not in redis  # Redis dials no one


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_egress_policies_can_be_turned_off_and_extended() -> None:
    off = objects(render({"redis": {"enabled": True}, "networkPolicy": {"egress": {"enabled": False}}}))
    assert not [o for o in off if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-egress")]
    assert policy_for(off, "redis")["policyTypes"] == ["Ingress"]
    assert all(policy_for(off, c) for c in COMPONENTS)  # ingress stays
    collector = {"to": [{"ipBlock": {"cidr": "10.7.0.0/16"}}], "ports": [{"port": 4317}]}
    objs = objects(render({"networkPolicy": {"egress": {"extra": {"gateway": [collector]}}}}))
    assert collector in policy_for(objs, "gateway", egress=True)["egress"]
    assert collector not in policy_for(objs, "processor", egress=True)["egress"]


def test_an_external_redis_gets_its_port_peers_password_file_and_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = {"ipBlock": {"cidr": "10.9.0.0/16"}}
    values = {"redis": {"url": "rediss://index.example:6380/1", "auth": {"existingSecret": "redis-pass",
                                                                          "passwordKey": "pw", "username": "kv"},
                        "tls": {"existingSecret": "redis-ca", "clientCertificate": True}},
              "networkPolicy": {"egress": {"externalRedis": [peer]}}}
    objs = objects(render(values))
    for component in ("engine", "processor"):
        assert {"to": [peer], "ports": [{"port": 6380, "protocol": "TCP"}]} in \
            policy_for(objs, component, egress=True)["egress"]
        pod = pod_spec(objs, component)
        container = pod["containers"][0]
        env = env_of(container)
        prefix = f"KVMESH_{component.upper()}_"
        assert volume_of(pod, container, env[f"{prefix}PREFIX_INDEX_PASSWORD_FILE"])["secret"]["items"] == \
            [{"key": "pw", "path": "password"}]
        for name in ("CA_FILE", "CERT_FILE", "KEY_FILE"):
            assert volume_of(pod, container, env[f"{prefix}PREFIX_INDEX_{name}"])["secret"]["secretName"] == "redis-ca"
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            parser = importlib.import_module(SERVICES[component]).build_parser()
            config = build(parser, PrefixIndexConfig, parser.parse_args(container["args"][1:]))
        assert (config.prefix_index, config.prefix_index_username) == ("rediss://index.example:6380/1", "kv")
        assert config.prefix_index_password_file == Path("/var/run/kvmesh/redis-auth/password")
        assert config.prefix_index_cert_file == Path("/var/run/kvmesh/redis-tls/tls.crt")
    # No peers given: the port, to anywhere.
    anywhere = objects(render({"redis": {"url": "redis://index.example/0"}}))
    assert {"ports": [{"port": 6379, "protocol": "TCP"}]} in policy_for(anywhere, "engine", egress=True)["egress"]
    assert "PASSWORD_FILE" not in str(pod_spec(anywhere, "engine")["containers"][0]["env"])
    with pytest.raises(helm.HelmRenderError, match="rediss://"):
        render({"redis": {"enabled": True, "tls": {"existingSecret": "redis-ca", "clientCertificate": False}}})


def test_the_charts_redis_caps_its_memory_and_lets_kvmesh_run_only_its_commands() -> None:
    objs = objects(render({"redis": {"enabled": True, "auth": {"existingSecret": "redis-pass",
                                                                "passwordKey": "password", "username": "kvmesh"}}}))
    pod = find(objs, "Deployment", "kvmesh-redis")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == "768mb"
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    [init] = pod["initContainers"]
    [rule] = [line for line in init["command"][2].splitlines() if '"user kvmesh' in line]
    assert tuple(word.strip('"')[1:] for word in rule.split() if word.startswith("+")) == REDIS_ACL_COMMANDS
    for component in ("engine", "processor"):
        env = env_of(pod_spec(objs, component)["containers"][0])
        assert env[f"KVMESH_{component.upper()}_PREFIX_INDEX_USERNAME"] == "kvmesh"
    plain = find(objects(render({"redis": {"enabled": True}})), "Deployment", "kvmesh-redis")["spec"]["template"]
    assert "--aclfile" not in plain["spec"]["containers"][0]["args"] and "initContainers" not in plain["spec"]


def test_the_charts_redis_acl_works_on_a_real_redis(tmp_path: Path) -> None:
    """The init container's script (real sh) writes an ACL file a real redis-server loads with the
    chart's arguments: kvmesh's user logs in with the password file, the default user may only PING."""
    objs = objects(render({"redis": {"enabled": True, "auth": {"existingSecret": "redis-pass",
                                                                "passwordKey": "password", "username": "kvmesh"}}}))
    pod = find(objs, "Deployment", "kvmesh-redis")["spec"]["template"]["spec"]
    (tmp_path / "auth").mkdir()
    (tmp_path / "acl").mkdir()
    (tmp_path / "auth" / "password").write_text("pass word with spaces\n")
    script = pod["initContainers"][0]["command"][2].replace("/var/run/redis/auth", str(tmp_path / "auth")) \
        .replace("/etc/redis/acl", str(tmp_path / "acl"))
    subprocess.run(["sh", "-ec", script], check=True, timeout=30)
    assert "pass word" not in (tmp_path / "acl" / "users.acl").read_text()  # only its hash
    port = free_port()
    args = [a.replace("/etc/redis/acl", str(tmp_path / "acl")) for a in pod["containers"][0]["args"]]
    args[args.index("--port") + 1] = str(port)
    server = subprocess.Popen(["redis-server", *args, "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cli(*command: str, user: str | None = None) -> str:
        auth = ["--user", user, "--pass", "pass word with spaces", "--no-auth-warning"] if user else []
        return subprocess.run(["redis-cli", "-p", str(port), *auth, *command], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        deadline = time.monotonic() + 10
        while cli("PING") != "PONG":
            assert server.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        assert "NOPERM" in cli("GET", "kvmesh:pi:engines")  # the default user: PING only
        assert cli("SADD", "kvmesh:pi:engines", "e", user="kvmesh") == "1"
        assert "NOPERM" in cli("SET", "elsewhere", "1", user="kvmesh")
        assert "NOPERM" in cli("CONFIG", "GET", "maxmemory", user="kvmesh")
        assert "NOPERM" in cli("FLUSHALL", user="kvmesh")
    finally:
        server.kill()
        server.wait(10)


def test_lora_adapters_reach_every_component_from_their_volume() -> None:
    """values-lora.yaml: each service's own parser reads the flags the chart gives it; engines and
    workers mount the adapters' claim read-only; without lora.enabled nothing of it renders."""
    objs = objects(render(example_values("lora")))
    modules = (LoRAModule("sql", "/adapters/sql"), LoRAModule("chat", "/adapters/chat"))
    for component in COMPONENTS:
        args = pod_spec(objs, component)["containers"][0]["args"]
        parser = importlib.import_module(SERVICES[component]).build_parser()
        lora = build(parser, LoRAConfig, parser.parse_args(args[1:]))
        assert lora.enable_lora and lora.lora_modules == modules, component
        sizes = (2, 16, 4 if component == "worker" else None) if component in ("engine", "worker") else (1, 16, None)
        assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == sizes, component
        assert lora.allow_runtime_lora_updating == (component == "gateway"), component
    for component in ("engine", "worker"):
        pod = pod_spec(objs, component)
        volume = volume_of(pod, pod["containers"][0], "/adapters/sql")
        assert volume["persistentVolumeClaim"] == {"claimName": "kvmesh-adapters", "readOnly": True}
    for component in ("gateway", "processor"):
        assert not [v for v in pod_spec(objs, component)["volumes"] if v["name"] == "lora-adapters"]
    default = objects(render())
    for component in COMPONENTS:
        assert not [a for a in pod_spec(default, component)["containers"][0]["args"] if "lora" in a], component
    for values in ({"lora": {"adapters": [{"name": "sql"}]}}, {"lora": {"maxLoras": 0}},
                   {"lora": {"adaptors": []}}, {"lora": {"storage": {"mountPath": "adapters"}}}):
        with pytest.raises(helm.HelmValuesError):
            render(values)
