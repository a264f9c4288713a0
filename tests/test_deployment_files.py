"""Static checks of the deployment files: docker-compose.yml, Dockerfile, platform/k8s.

No Docker, cluster or database is needed. Where kubectl (or kustomize) is installed, the
production overlay is also built with kustomize and its output checked.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PLATFORM = ROOT / "platform"
K8S = PLATFORM / "k8s"
MONITORING = PLATFORM / "monitoring"
COMPOSE = ROOT / "docker-compose.yml"
PRODUCTION = K8S / "overlays" / "production"

# Files that configure kustomize itself rather than describe Kubernetes objects.
KUSTOMIZE_FILES = {"kustomization.yaml", "kustomization.yml", "kustomizeconfig.yaml"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
SPOT_TAINT_KEYS = {
    "inferplane.io/spot",
    "cloud.google.com/gke-spot",
    "kubernetes.azure.com/scalesetpriority",
}
APP_IMAGE = "inferplane"

Doc = dict[str, Any]


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Overrides the suite's autouse Redis cleaner: these tests read files, nothing else."""


# --- helpers ---------------------------------------------------------------------------------


def _load_all(path: Path) -> list[Doc]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _k8s_yaml_files() -> list[Path]:
    """Every Kubernetes file: k8s/ and the monitoring component (platform/monitoring, whose
    other files are Prometheus' and Grafana's own)."""
    monitoring = [MONITORING / "kustomization.yaml", *(MONITORING / "k8s").glob("*.yaml")]
    found = [*K8S.rglob("*"), *monitoring]
    return sorted(p for p in found if p.suffix in {".yaml", ".yml"} and p.is_file())


def _manifest_files() -> list[Path]:
    return [p for p in _k8s_yaml_files() if p.name not in KUSTOMIZE_FILES]


def _kustomizations() -> list[Path]:
    return [p for p in _k8s_yaml_files() if p.name in {"kustomization.yaml", "kustomization.yml"}]


def _base_docs() -> list[Doc]:
    docs: list[Doc] = []
    for path in sorted((K8S / "base").glob("*.yaml")):
        if path.name not in KUSTOMIZE_FILES:
            docs.extend(_load_all(path))
    return docs


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d.get("kind") == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def _pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def _containers(pod_spec: Doc) -> list[Doc]:
    return list(pod_spec.get("initContainers", [])) + list(pod_spec["containers"])


def _engine(docs: list[Doc], pool: str) -> Doc:
    found = [
        d
        for d in docs
        if d.get("kind") in WORKLOAD_KINDS and d["metadata"]["name"] == f"vllm-{pool}"
    ]
    assert len(found) == 1, f"expected one workload vllm-{pool}, found {len(found)}"
    return found[0]


def _compose() -> Doc:
    with COMPOSE.open() as f:
        doc: Doc = yaml.safe_load(f)
    return doc


def _compose_default(value: str) -> str:
    """What Compose substitutes for ``${VAR:-default}`` when VAR is unset."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _command(service: Doc) -> str:
    command = service.get("command", "")
    return " ".join(command) if isinstance(command, list) else str(command)


def _env(service: Doc) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _is_app_image(image: str) -> bool:
    return image.split("/")[-1].split(":")[0] == APP_IMAGE


# --- docker-compose.yml ----------------------------------------------------------------------


def test_compose_has_every_service() -> None:
    services = set(_compose()["services"])
    expected = {
        "postgres",
        "redis",
        "migrate",
        "web",
        "worker",
        "worker-adapters",
        "worker-batch",
        "beat",
        "drains",
        "vllm-online",
        "vllm-batch",
    }
    assert expected <= services, f"missing: {sorted(expected - services)}"


@pytest.mark.parametrize("name", ["vllm-online", "vllm-batch"])
def test_compose_engines_reserve_a_gpu(name: str) -> None:
    service = _compose()["services"][name]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    gpus = [
        d
        for d in devices
        if d.get("driver") == "nvidia"
        and "gpu" in d.get("capabilities", [])
        and (int(d.get("count", 0)) >= 1 or d.get("device_ids"))
    ]
    assert gpus, f"{name} reserves no NVIDIA GPU"
    assert service["image"].startswith("vllm/vllm-openai:")
    assert not service["image"].endswith(":latest"), "pin the vLLM image"
    command = _command(service)
    assert "--enable-lora" in command
    assert "--served-model-name" in command
    assert _env(service)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_compose_engines_default_to_distinct_gpus() -> None:
    # Docker gives `count: 1` the first GPU to every container: both engines would share it.
    services = _compose()["services"]
    ids = []
    for name in ("vllm-online", "vllm-batch"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        ids.append(tuple(_compose_default(str(i)) for i in device.get("device_ids", [])))
    assert all(ids) and ids[0] != ids[1], ids


def test_compose_app_services_are_production_like() -> None:
    services = _compose()["services"]
    for name in ("migrate", "web", "worker", "beat", "drains"):
        service = services[name]
        env = _env(service)
        assert env["INFERPLANE_ENV"] == "production", name
        assert env["SECRET_KEY"].startswith("${SECRET_KEY:?"), (
            f"{name}: SECRET_KEY must be required"
        )
        assert env["DATABASE_URL"].startswith("postgres://"), name
        assert env["REDIS_URL"].startswith("redis://"), name
        assert service["image"] == services["web"]["image"], f"{name} runs another image"
    assert "scripts/web.sh" in _command(services["web"])
    assert "celery -A controlplane worker" in _command(services["worker"])
    assert "celery -A controlplane beat" in _command(services["beat"])
    assert "manage.py run_drains" in _command(services["drains"])
    assert "manage.py migrate" in _command(services["migrate"])


def test_compose_start_order() -> None:
    services = _compose()["services"]
    assert services["postgres"]["image"].startswith("postgres:17")
    for name in ("postgres", "redis", "web"):
        assert "test" in services[name]["healthcheck"], f"{name} has no healthcheck"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    web_deps = services["web"]["depends_on"]
    assert web_deps["migrate"]["condition"] == "service_completed_successfully"
    assert web_deps["redis"]["condition"] == "service_healthy"
    for name in ("worker", "beat", "drains"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name


# --- Dockerfile ------------------------------------------------------------------------------


def test_every_celery_queue_has_a_worker_everywhere() -> None:
    """A task routed to a queue no worker reads waits forever: each queue of the routes has
    a worker under make run (Procfile), in docker-compose.yml and in Kubernetes."""
    from django.conf import settings

    queues = {"celery"} | {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}

    def read(command: list[str]) -> set[str]:
        if "worker" not in command:
            return set()
        if "-Q" not in command:
            return {"celery"}  # Celery's default queue
        return set(command[command.index("-Q") + 1].split(","))

    procfile = set()
    for line in (ROOT / "Procfile").read_text().splitlines():
        procfile |= read(line.partition(":")[2].split())
    compose = set()
    for service in _compose()["services"].values():
        command = service.get("command")
        compose |= read(command) if isinstance(command, list) else set()
    k8s = set()
    for doc in _base_docs():
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                k8s |= read(container.get("command") or [])
    assert queues <= procfile, queues - procfile
    assert queues <= compose, queues - compose
    assert queues <= k8s, queues - k8s


def test_no_worker_announces_itself_every_two_seconds() -> None:
    """Celery's event heartbeat and gossip cost Redis a PUBLISH per worker every 2 s, idle
    (docs/scaling.md, "What an idle platform costs"); nothing here reads them."""
    commands = [
        line.partition(":")[2].split() for line in (ROOT / "Procfile").read_text().splitlines()
    ]
    commands += [
        s["command"] for s in _compose()["services"].values() if isinstance(s.get("command"), list)
    ]
    for doc in _base_docs():
        if doc["kind"] == "Deployment":
            commands += [
                c.get("command") or [] for c in doc["spec"]["template"]["spec"]["containers"]
            ]
    workers = [c for c in commands if "celery" in c and "worker" in c]
    assert len(workers) == 9  # three workers, three ways to deploy them
    for command in workers:
        assert "--without-heartbeat" in command and "--without-gossip" in command, command


def test_dockerfile_is_multi_stage_non_root_and_collects_static() -> None:
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))
    froms = [
        re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
        for image in re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    ]
    assert len(froms) >= 2, "expected a multi-stage build"
    assert all(image == "python:3.12-slim" for image in froms), froms
    users = re.findall(r"^USER (\S+)", text, flags=re.MULTILINE)
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in {"root", "0"}
    assert "pip install" in text
    assert "collectstatic --noinput" in text
    cmd = re.findall(r"^CMD (.+)$", text, flags=re.MULTILINE)
    assert cmd and "scripts/web.sh" in cmd[-1]
    assert "COPY scripts/web.sh" in text  # the script the CMD runs is in the image


def test_the_image_holds_every_package_of_the_product() -> None:
    """A package left out of the image imports fine here and fails only in production."""
    text = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = re.search(r"^include = \[(.*)\]$", pyproject, flags=re.MULTILINE)
    assert found, "pyproject.toml lists the packages it installs"
    packages = [p.strip().strip('"').rstrip("*") for p in found.group(1).split(",")]
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench", "devkit"}
    assert set(packages) == on_disk, "pyproject.toml installs exactly the product's packages"
    stages = text.split("\nFROM ")[1:]
    for package in packages:
        for stage in stages:
            assert f"COPY {package} ./{package}" in stage, f"{package} is missing from a stage"


def test_dockerignore_keeps_local_state_out() -> None:
    entries = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "var"} <= entries


# --- platform/ -------------------------------------------------------------------------------


def test_platform_is_not_a_python_package() -> None:
    # A package named "platform" would shadow the standard library module.
    assert not (PLATFORM / "__init__.py").exists()
    python_files = [p for p in PLATFORM.rglob("*") if p.suffix in {".py", ".pyc"}]
    assert python_files == []


def test_platform_has_manifests() -> None:
    names = {p.relative_to(PLATFORM).parts[:2] for p in _manifest_files()}
    assert {("k8s", "base"), ("k8s", "overlays"), ("monitoring", "k8s")} <= names
    assert (PRODUCTION / "kustomization.yaml").is_file()


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(PLATFORM)))
def test_every_document_has_identity(path: Path) -> None:
    docs = _load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), path
        assert doc.get("apiVersion"), f"{path}: document without apiVersion"
        assert doc.get("kind"), f"{path}: document without kind"
        assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without name"


@pytest.mark.parametrize(
    "kustomization", _kustomizations(), ids=lambda p: str(p.parent.relative_to(PLATFORM))
)
def test_kustomization_references_exist(kustomization: Path) -> None:
    here = kustomization.parent
    k = _load_all(kustomization)[0]
    assert k["kind"] in {"Kustomization", "Component"}
    referenced: list[str] = []
    referenced += k.get("resources", [])
    referenced += k.get("components", [])
    referenced += k.get("configurations", [])
    referenced += [p["path"] for p in k.get("patches", []) if "path" in p]
    for generator in k.get("configMapGenerator", []):
        referenced += generator.get("envs", []) + generator.get("files", [])
    assert referenced, f"{kustomization} references nothing"
    for ref in referenced:
        target = here / ref.split("=", 1)[-1]
        assert target.exists(), f"{kustomization}: {ref} does not exist"
    # Secrets are not committed: each env file needs a committed template and a git-ignore.
    for generator in k.get("secretGenerator", []):
        for env in generator.get("envs", []):
            assert (here / f"{env}.example").is_file(), f"{kustomization}: no {env}.example"
            ignored = (here / ".gitignore").read_text().split()
            assert env in ignored, f"{kustomization}: {env} is not git-ignored"


def test_every_container_has_resource_limits() -> None:
    checked = 0
    for path in _manifest_files():
        for doc in _load_all(path):
            if doc["kind"] not in WORKLOAD_KINDS or path.parent.name == "patches":
                continue
            for container in _containers(_pod_spec(doc)):
                where = f"{path.name}: {doc['metadata']['name']}/{container['name']}"
                limits = container.get("resources", {}).get("limits", {})
                assert {"cpu", "memory"} <= set(limits), f"{where} lacks cpu/memory limits"
                assert container.get("resources", {}).get("requests"), f"{where} lacks requests"
                checked += 1
    assert checked >= 6


def test_app_pods_run_as_non_root() -> None:
    app_workloads = 0
    for doc in _base_docs():
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        pod = _pod_spec(doc)
        for container in _containers(pod):
            if not _is_app_image(container["image"]):
                continue
            non_root = container.get("securityContext", {}).get(
                "runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot")
            )
            assert non_root is True, f"{doc['metadata']['name']}/{container['name']}"
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
        app_workloads += 1
    assert app_workloads >= 4


def test_batch_pool_runs_on_spot_online_on_demand() -> None:
    docs = _base_docs()
    batch, online = _pod_spec(_engine(docs, "batch")), _pod_spec(_engine(docs, "online"))

    assert batch["nodeSelector"]["inferplane.io/capacity"] == "spot"
    batch_taints = {t["key"] for t in batch.get("tolerations", [])}
    assert batch_taints >= SPOT_TAINT_KEYS, f"missing: {SPOT_TAINT_KEYS - batch_taints}"

    assert online["nodeSelector"]["inferplane.io/capacity"] == "on-demand"
    online_taints = {t["key"] for t in online.get("tolerations", [])}
    assert not online_taints & SPOT_TAINT_KEYS, "the dedicated pool must not go to spot nodes"

    for pod in (batch, online):
        assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"


def test_overlay_keeps_the_pools_apart() -> None:
    for patch in (PRODUCTION / "patches").glob("gpu-nodes-*.yaml"):
        (doc,) = _load_all(patch)
        selector = doc["spec"]["template"]["spec"]["nodeSelector"]
        if doc["metadata"]["name"] == "vllm-online":
            assert selector.get("inferplane.io/capacity") == "on-demand"
        else:
            assert selector.get("inferplane.io/capacity", "spot") == "spot"


@pytest.mark.parametrize("pool", ["online", "batch"])
def test_engines_are_vllm_with_a_gpu_and_runtime_lora(pool: str) -> None:
    pod = _pod_spec(_engine(_base_docs(), pool))
    (engine,) = pod["containers"]
    assert engine["image"].startswith("vllm/vllm-openai:")
    assert not engine["image"].endswith(":latest")
    args = " ".join(engine.get("command", []) + engine.get("args", []))
    for flag in (
        "--model",
        "--served-model-name",
        "--max-model-len",
        "--enable-lora",
        "--max-lora-rank",
        "--max-loras",
    ):
        assert flag in args, f"vllm-{pool} lacks {flag}"
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert str(engine["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = engine["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget >= 600, "loading weights takes minutes: give the startup probe time"
    assert "terminationGracePeriodSeconds" in pod


@pytest.mark.parametrize("pool", ["online", "batch"])
def test_engines_are_discovered_through_a_headless_service(pool: str) -> None:
    # The control plane routes to each replica itself: no load-balancing VIP in between. The
    # pool's DNS discovery resolves the headless Service: every ready pod is a replica.
    docs = _base_docs()
    engine = _engine(docs, pool)
    service = _find(docs, "Service", f"vllm-{pool}")
    assert service["spec"].get("clusterIP") == "None"
    # A terminating pod must leave the name (that is what drains it), so only ready pods.
    assert not service["spec"].get("publishNotReadyAddresses", False)
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert labels["inferplane.io/pool"] == pool
    # Replaced at once when a (spot) node is lost, new pods registered by discovery.
    assert engine["kind"] == "Deployment"
    (port,) = service["spec"]["ports"]
    (container,) = _pod_spec(engine)["containers"]
    assert port["port"] == 8000 and "--port=8000" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DRAIN_SERVICE"]["value"] == service["metadata"]["name"]


def _env_seconds(container: Doc, name: str) -> int:
    (item,) = [e for e in container["env"] if e["name"] == name]
    return int(item["value"])


@pytest.mark.parametrize("pool", ["online", "batch"])
def test_engines_drain_before_they_stop(pool: str) -> None:
    docs = _base_docs()
    pod = _pod_spec(_engine(docs, pool))
    (container,) = pod["containers"]
    timeouts = [a for a in container["args"] if a.startswith("--shutdown-timeout=")]
    assert len(timeouts) == 1, "vLLM must let running requests finish on SIGTERM"
    shutdown = int(timeouts[0].split("=", 1)[1])
    assert shutdown > 0  # 0 aborts them

    # The preStop hook is the drain script, mounted from its ConfigMap.
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    script = command[-1]
    mount = next(m for m in container["volumeMounts"] if script.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    kustomization = _load_all(K8S / "base" / "kustomization.yaml")[0]
    generator = next(
        g for g in kustomization["configMapGenerator"] if g["name"] == volume["configMap"]["name"]
    )
    assert any(Path(f).name == Path(script).name for f in generator["files"])
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    # Waiting one probe round: the control plane must have marked the replica draining.
    config = (K8S / "base" / "config" / "app.env").read_text()
    interval = re.search(r"^INFERPLANE_PROBE_INTERVAL_SECONDS=(\d+)$", config, flags=re.M)
    assert interval, "app.env must set the probe interval the engines' drain waits for"
    assert _env_seconds(container, "DRAIN_PROBE_SECONDS") > int(interval.group(1))

    bound = sum(
        _env_seconds(container, name)
        for name in ("DRAIN_DNS_SECONDS", "DRAIN_PROBE_SECONDS", "DRAIN_IDLE_SECONDS")
    )
    assert pod["terminationGracePeriodSeconds"] >= bound + shutdown, (
        f"vllm-{pool}: grace {pod['terminationGracePeriodSeconds']}s < preStop {bound}s "
        f"+ shutdown {shutdown}s"
    )
    if pool == "batch":  # inside the usual 30 s spot preemption notice
        assert pod["terminationGracePeriodSeconds"] <= 30


def _secret_ref(container: Doc, name: str) -> Doc | None:
    for item in container.get("env", []):
        if item["name"] == name:
            ref: Doc = item["valueFrom"]["secretKeyRef"]
            return ref
    return None


def test_engines_require_the_api_key_the_gateway_sends() -> None:
    docs = _base_docs()
    expected = {"name": "inferplane-secrets", "key": "INFERPLANE_ENGINE_API_KEY"}
    for pool in ("online", "batch"):
        (engine,) = _pod_spec(_engine(docs, pool))["containers"]
        ref = _secret_ref(engine, "VLLM_API_KEY")
        assert ref is not None and ref.items() >= expected.items(), pool
        assert not ref.get("optional", False), "an engine without its key is open to anyone"
    for name, container_name in (("inferplane-web", "web"), ("inferplane-worker", "worker")):
        pod = _pod_spec(_find(docs, "Deployment", name))
        container = next(c for c in pod["containers"] if c["name"] == container_name)
        ref = _secret_ref(container, "INFERPLANE_ENGINE_API_KEY")
        assert ref is not None and ref.items() >= expected.items(), name
    example = (PRODUCTION / "secrets.env.example").read_text()
    assert re.search(r"^INFERPLANE_ENGINE_API_KEY=", example, flags=re.M)


def test_prometheus_sends_the_metrics_token_the_web_requires() -> None:
    """GET /metrics answers only INFERPLANE_METRICS_TOKEN's bearer: the web pods read it from
    the Secret the web PodMonitor sends it from; in Compose the web service requires it and
    Prometheus reads the same value as a secret file."""
    docs = _base_docs()
    expected = {"name": "inferplane-secrets", "key": "INFERPLANE_METRICS_TOKEN"}
    pod = _pod_spec(_find(docs, "Deployment", "inferplane-web"))
    web = next(c for c in pod["containers"] if c["name"] == "web")
    ref = _secret_ref(web, "INFERPLANE_METRICS_TOKEN")
    assert ref is not None and ref.items() >= expected.items() and not ref.get("optional")
    monitors = list(yaml.safe_load_all((MONITORING / "k8s" / "podmonitor.yaml").read_text()))
    (endpoint,) = next(m for m in monitors if m["metadata"]["name"] == "inferplane-web")["spec"][
        "podMetricsEndpoints"
    ]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": expected}
    example = (PRODUCTION / "secrets.env.example").read_text()
    assert re.search(r"^INFERPLANE_METRICS_TOKEN=", example, flags=re.M)
    compose = _compose()
    assert "INFERPLANE_METRICS_TOKEN:?" in str(compose["services"]["web"]["environment"])
    assert compose["secrets"]["metrics_token"] == {"environment": "INFERPLANE_METRICS_TOKEN"}
    prometheus = compose["services"]["prometheus"]
    assert any("metrics_token" in str(secret) for secret in prometheus["secrets"])
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "inferplane-web"]
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/run/secrets/metrics_token",
    }


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def test_only_web_and_worker_pods_reach_the_engines() -> None:
    docs = _base_docs()
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert "Ingress" in spec["policyTypes"]
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in WORKLOAD_KINDS
    }
    engines = {name for name in pods if name.startswith("vllm-")}
    assert engines == {"vllm-online", "vllm-batch"}
    selected = {name for name, labels in pods.items() if _selects(spec["podSelector"], labels)}
    assert selected == engines
    (rule,) = spec["ingress"]
    allowed = {
        name
        for name, labels in pods.items()
        for peer in rule["from"]
        if set(peer) == {"podSelector"} and _selects(peer["podSelector"], labels)
    }
    assert allowed == {"inferplane-web", "inferplane-worker", "inferplane-worker-batch"}
    assert [p["port"] for p in rule["ports"]] == [8000]


def _metrics_server(answers: list[float]) -> tuple[Any, list[str]]:
    """A stand-in for an engine's /metrics: vllm:num_requests_running is each answer in
    turn (then the last one), waiting always 0."""
    import http.server
    import threading

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            running = answers[min(len(seen), len(answers)) - 1]
            body = (
                "# HELP vllm:num_requests_running Requests running.\n"
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
                'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def _drain(**env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    import os
    import time

    started = time.monotonic()
    result = subprocess.run(
        ["sh", str(K8S / "base" / "config" / "engine-drain.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": os.environ["PATH"], "DRAIN_PROBE_SECONDS": "0", **env},
    )
    return result, time.monotonic() - started


def test_the_drain_hook_waits_while_in_dns_then_until_the_engine_is_idle() -> None:
    server, seen = _metrics_server([2.0, 1.0, 1.0, 0.0])
    try:
        result, took = _drain(
            POD_IP="127.0.0.1",  # still published: localhost resolves to it
            DRAIN_SERVICE="localhost",
            DRAIN_DNS_SECONDS="2",
            DRAIN_IDLE_SECONDS="30",
            DRAIN_ENGINE_PORT=str(server.server_address[1]),
        )
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert "still in DNS" in result.stdout
    assert "requests running or waiting: 0.0" in result.stdout
    assert len(seen) == 4 and set(seen) == {"/metrics"}
    assert 2 + 3 <= took < 20  # the DNS bound, then three busy answers a second apart


def test_the_drain_hook_is_bounded() -> None:
    server, _ = _metrics_server([1.0])  # never idle
    try:
        result, took = _drain(
            POD_IP="192.0.2.1",  # not (or no longer) an address of the name
            DRAIN_SERVICE="localhost",
            DRAIN_DNS_SECONDS="30",
            DRAIN_IDLE_SECONDS="2",
            DRAIN_ENGINE_PORT=str(server.server_address[1]),
        )
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    assert "192.0.2.1 out of localhost" in result.stdout
    assert "requests running or waiting: 1.0" in result.stdout
    assert took < 10


def test_the_drains_run_everywhere() -> None:
    """Nothing else moves usage records into the ledger: a deployment without the drains
    would serve requests and bill none of them."""
    procfile = (ROOT / "Procfile").read_text()
    assert re.search(r"^drains: python manage.py run_drains$", procfile, flags=re.M)
    drains = _find(_base_docs(), "Deployment", "inferplane-drains")
    (container,) = drains["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "manage.py", "run_drains"]
    assert drains["spec"]["replicas"] >= 2  # a pod's restart never pauses the ledger


def test_beat_is_a_singleton() -> None:
    docs = _base_docs()
    beat = _find(docs, "Deployment", "inferplane-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"
    for path in _manifest_files():
        for doc in _load_all(path):
            target = doc.get("spec", {}).get("scaleTargetRef", {}).get("name")
            assert target != "inferplane-beat", f"{path}: beat must never be autoscaled"


def test_web_is_autoscaled_protected_and_probed_past_the_https_redirect() -> None:
    docs = _base_docs()
    web = _find(docs, "Deployment", "inferplane-web")
    hpa = _find(docs, "HorizontalPodAutoscaler", "inferplane-web")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "inferplane-web",
    }
    assert any(m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    pdb = _find(docs, "PodDisruptionBudget", "inferplane-web")
    pod_labels = web["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = next(c for c in _pod_spec(web)["containers"] if c["name"] == "web")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        headers = {h["name"].lower(): h["value"] for h in get.get("httpHeaders", [])}
        assert get["path"] == "/healthz", probe
        assert headers.get("x-forwarded-proto") == "https", probe
    config = (K8S / "base" / "config" / "app.env").read_text()
    hosts = re.search(r"^ALLOWED_HOSTS=(.*)$", config, flags=re.MULTILINE)
    assert hosts, "ALLOWED_HOSTS is not configured"
    probe_host = headers.get("host", "localhost")
    assert probe_host in hosts.group(1).split(","), "the probes' Host must be allowed"


def test_services_select_existing_pods() -> None:
    docs = _base_docs()
    pod_labels = [
        d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in WORKLOAD_KINDS
    ]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), (
            f"Service {service['metadata']['name']} selects no pods"
        )


def test_migrations_run_as_a_job() -> None:
    job = _find(_base_docs(), "Job", "inferplane-migrate")
    (container,) = _pod_spec(job)["containers"]
    assert container["command"][-2:] == ["migrate", "--noinput"]
    assert _pod_spec(job)["restartPolicy"] in {"Never", "OnFailure"}


def test_worker_scales_on_the_celery_queue() -> None:
    docs = _load_all(K8S / "components" / "keda-worker" / "scaledobject.yaml")
    scaled = _find(docs, "ScaledObject", "inferplane-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "inferplane-worker"
    _find(_base_docs(), "Deployment", "inferplane-worker")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis"
    assert trigger["metadata"]["listName"] == "celery"
    assert int(trigger["metadata"]["listLength"]) > 0
    assert scaled["spec"]["minReplicaCount"] >= 1


def test_spot_engines_scale_to_zero_on_the_batch_lines_to_run() -> None:
    docs = _load_all(K8S / "components" / "keda-batch" / "scaledobject.yaml")
    engines = _find(docs, "ScaledObject", "vllm-batch")
    assert engines["spec"]["scaleTargetRef"]["name"] == "vllm-batch"
    assert engines["spec"]["minReplicaCount"] == 0
    (trigger,) = engines["spec"]["triggers"]
    assert trigger["type"] == "postgresql"
    query = trigger["metadata"]["query"]
    # The query names our tables and states: it must keep up with the models.
    from batches.models import Batch, Line

    assert Line._meta.db_table in query and Batch._meta.db_table in query
    for state in (Line.State.PENDING, Line.State.RUNNING):
        assert f"'{state}'" in query
    workers = _find(docs, "ScaledObject", "inferplane-worker-batch")
    (trigger,) = workers["spec"]["triggers"]
    assert trigger["metadata"]["listName"] == "batch"
    assert workers["spec"]["minReplicaCount"] >= 1  # the sweeper runs on that queue


def test_prometheus_alerts_on_queued_requests() -> None:
    (rule,) = _load_all(MONITORING / "k8s" / "prometheusrule.yaml")
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    waiting = [r for r in rules if "vllm:num_requests_waiting" in r["expr"]]
    assert waiting and waiting[0]["for"] == "5m"
    assert any("up" in r["expr"] or "replicas_ready" in r["expr"] for r in rules)


# --- kustomize build ---------------------------------------------------------------------------


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _build_production(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    command = _kustomize_command()
    assert command, "kubectl (machines of this kind carry it) or kustomize is needed to build"
    copy = tmp_path / "platform"
    shutil.copytree(PLATFORM, copy)
    overlay = copy / "k8s" / "overlays" / "production"
    shutil.copy(overlay / "secrets.env.example", overlay / "secrets.env")
    result = subprocess.run(
        [*command, str(overlay)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result


def test_production_overlay_builds(tmp_path: Path) -> None:
    result = _build_production(tmp_path)
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]

    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Job", "Service", "ConfigMap", "Secret", "NetworkPolicy"} <= kinds
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "inferplane", doc["metadata"]["name"]

    # Every reference to the generated Secret follows its hashed name, KEDA's included.
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"].startswith("inferplane-secrets-")
    refs = re.findall(r"name: (inferplane-secrets\S*)", result.stdout)
    assert refs and set(refs) == {secret["metadata"]["name"]}

    # The overlay's image replaces the placeholder everywhere.
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            for container in _containers(_pod_spec(doc)):
                assert container["image"] != APP_IMAGE, doc["metadata"]["name"]

    # The engines' preStop script follows its generated ConfigMap's hashed name.
    (drain,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("inferplane-engine-drain")
    ]
    assert "engine-drain.sh" in drain["data"]
    for pool in ("online", "batch"):
        volumes = _pod_spec(_find(docs, "Deployment", f"vllm-{pool}"))["volumes"]
        names = {v["configMap"]["name"] for v in volumes if "configMap" in v}
        assert names == {drain["metadata"]["name"]}, pool
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"} >= {"vllm-engines"}

    # KEDA owns the workers' and the engines' replica counts, the HPA the web's.
    worker = _find(docs, "Deployment", "inferplane-worker")
    assert "replicas" not in worker["spec"]
    for name in ("inferplane-worker-batch", "vllm-batch", "vllm-online"):
        assert "replicas" not in _find(docs, "Deployment", name)["spec"], name
    assert "replicas" not in _find(docs, "Deployment", "inferplane-web")["spec"]


# --- schemas -----------------------------------------------------------------------------------

# The Kubernetes release whose schemas the built objects must meet (kubernetes-validate ships
# them); the README asks for 1.29 or later, and every field used here is in 1.29's API too.
KUBERNETES_VERSION = "1.33.0"
CRD_SCHEMAS = Path(__file__).parent / "schemas"


def _strict(schema: Any) -> Any:
    """A CRD's schema that refuses unknown fields, as ``kubectl apply --validate=strict``
    does (the API server would silently drop them: a typo'd field is a setting lost)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_validator(doc: Doc) -> jsonschema.protocols.Validator | None:
    group, _, version = doc["apiVersion"].rpartition("/")
    path = CRD_SCHEMAS / f"{group}_{doc['kind'].lower()}_{version}.json"
    if not path.exists():
        return None
    schema = _strict(json.loads(path.read_text()))
    # metadata is the API server's (ObjectMeta), not the CRD's to describe.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def test_every_built_object_meets_its_schema(tmp_path: Path) -> None:
    """The production overlay, every component included, against the Kubernetes API's
    schemas and the CRDs' (KEDA, Prometheus Operator: tests/schemas/), unknown fields refused."""
    docs = [d for d in yaml.safe_load_all(_build_production(tmp_path).stdout) if d]
    kinds = set()
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        kinds.add(doc["kind"])
        if "." in doc["apiVersion"].split("/")[0] and not doc["apiVersion"].startswith(
            ("apps/", "batch/", "policy/", "autoscaling/", "networking.k8s.io/")
        ):
            validator = _crd_validator(doc)
            assert validator is not None, (
                f"{where}: no schema for {doc['apiVersion']} in tests/schemas"
            )
            errors = [
                f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(doc)
            ]
            assert not errors, f"{where}: {errors}"
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {exc.message} at {'/'.join(map(str, exc.path))}")
    assert {"ScaledObject", "TriggerAuthentication", "PodMonitor", "PrometheusRule"} <= kinds
    assert {"Deployment", "HorizontalPodAutoscaler", "NetworkPolicy", "Job"} <= kinds


def test_the_schemas_refuse_a_misspelt_field() -> None:
    (scaled,) = [
        d
        for d in _load_all(K8S / "components" / "keda-online" / "scaledobject.yaml")
        if d["kind"] == "ScaledObject"
    ]
    validator = _crd_validator(scaled)
    assert validator is not None and validator.is_valid(scaled)
    scaled["spec"]["minReplicas"] = scaled["spec"].pop("minReplicaCount")
    assert not validator.is_valid(scaled)
    web = _find(_base_docs(), "Deployment", "inferplane-web")
    web["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(web, KUBERNETES_VERSION, strict=True)
