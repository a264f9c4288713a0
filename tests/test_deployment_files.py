"""Static checks of the deployment files: docker-compose.yml, Dockerfile, platform/k8s.

No Docker, cluster or database is needed. Where kubectl (or kustomize) is installed, the
production overlay is also built with kustomize and its output checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PLATFORM = ROOT / "platform"
K8S = PLATFORM / "k8s"
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
    return sorted(p for p in K8S.rglob("*") if p.suffix in {".yaml", ".yml"} and p.is_file())


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
        "beat",
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
    for name in ("migrate", "web", "worker", "beat"):
        service = services[name]
        env = _env(service)
        assert env["INFERPLANE_ENV"] == "production", name
        assert env["SECRET_KEY"].startswith("${SECRET_KEY:?"), (
            f"{name}: SECRET_KEY must be required"
        )
        assert env["DATABASE_URL"].startswith("postgres://"), name
        assert env["REDIS_URL"].startswith("redis://"), name
        assert service["image"] == services["web"]["image"], f"{name} runs another image"
    assert "uvicorn controlplane.asgi:application" in _command(services["web"])
    assert "celery -A controlplane worker" in _command(services["worker"])
    assert "celery -A controlplane beat" in _command(services["beat"])
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
    for name in ("worker", "beat"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name


# --- Dockerfile ------------------------------------------------------------------------------


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
    assert cmd and "uvicorn" in cmd[-1]


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
    names = {p.relative_to(K8S).parts[0] for p in _manifest_files()}
    assert {"base", "overlays", "monitoring"} <= names
    assert (PRODUCTION / "kustomization.yaml").is_file()


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_document_has_identity(path: Path) -> None:
    docs = _load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), path
        assert doc.get("apiVersion"), f"{path}: document without apiVersion"
        assert doc.get("kind"), f"{path}: document without kind"
        assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without name"


@pytest.mark.parametrize(
    "kustomization", _kustomizations(), ids=lambda p: str(p.parent.relative_to(K8S))
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


def test_engines_have_per_replica_dns() -> None:
    # The control plane routes to each replica itself: no load-balancing VIP in between.
    docs = _base_docs()
    for pool in ("online", "batch"):
        engine = _engine(docs, pool)
        service = _find(docs, "Service", f"vllm-{pool}")
        assert service["spec"].get("clusterIP") == "None"
        assert engine["kind"] == "StatefulSet"
        assert engine["spec"]["serviceName"] == f"vllm-{pool}"


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


def test_prometheus_alerts_on_queued_requests() -> None:
    (rule,) = _load_all(K8S / "monitoring" / "prometheusrule.yaml")
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


def test_production_overlay_builds(tmp_path: Path) -> None:
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
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]

    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Job", "Service", "ConfigMap", "Secret"} <= kinds
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

    # KEDA owns the worker's replica count, the HPA the web's.
    worker = _find(docs, "Deployment", "inferplane-worker")
    assert "replicas" not in worker["spec"]
    assert "replicas" not in _find(docs, "Deployment", "inferplane-web")["spec"]
