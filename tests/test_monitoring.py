"""platform/monitoring: the gateway's alert rules pass their promtool tests, every rule and
dashboard query parses, and what Compose and Kubernetes load is the same. (That the queries
name only metrics a real scrape holds is tested against a live stack and engine:
tests/inference/test_metrics.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "platform" / "monitoring"
DASHBOARDS = MONITORING / "grafana" / "dashboards"
# Grafana's variables, as a panel's query would see them (all pools, all tenants).
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$pool": ".*",
    "$tenant": ".*",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is needed (Debian's prometheus package: make installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, check=False)


def dashboard_queries() -> dict[str, list[str]]:
    """Every query of every dashboard (panels' targets and variables'), by dashboard file."""
    found: dict[str, list[str]] = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        queries = [
            target["expr"] for panel in board["panels"] for target in panel.get("targets", [])
        ]
        queries += [
            variable["definition"]
            for variable in board["templating"]["list"]
            if variable["type"] == "query"
        ]
        found[path.name] = queries
    return found


def as_promql(query: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        query = query.replace(name, value)
    # label_values(metric, label): Grafana's, not PromQL; its metric is what must exist.
    return re.sub(r"^label_values\((.+), \w+\)$", r"\1", query)


def metric_names(query: str) -> set[str]:
    return set(re.findall(r"\b(?:inferplane_|vllm:)[a-zA-Z0-9_:]+", query))


def _operator_groups(name: str) -> list[dict[str, Any]]:
    rule = yaml.safe_load((MONITORING / "k8s" / name).read_text())
    assert rule["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def test_the_gateway_alerts_fire_and_stay_silent_as_their_tests_say() -> None:
    result = promtool("test", "rules", str(MONITORING / "rules" / "gateway.test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    rules = yaml.safe_load((MONITORING / "rules" / "gateway.yaml").read_text())
    alerts = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    tests = yaml.safe_load((MONITORING / "rules" / "gateway.test.yaml").read_text())["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    assert firing == alerts, f"never fire: {sorted(alerts - firing)}"
    assert silent == alerts, f"never shown silent: {sorted(alerts - silent)}"


def test_every_rule_parses(tmp_path: Path) -> None:
    for name in ("prometheusrule.yaml", "prometheusrule-gateway.yaml"):
        plain = tmp_path / name
        plain.write_text(yaml.safe_dump({"groups": _operator_groups(name)}))
        result = promtool("check", "rules", str(plain))
        assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_and_compose_load_the_same_gateway_alerts() -> None:
    plain = yaml.safe_load((MONITORING / "rules" / "gateway.yaml").read_text())["groups"]
    assert _operator_groups("prometheusrule-gateway.yaml") == plain, (
        "copy rules/gateway.yaml's groups into k8s/prometheusrule-gateway.yaml's spec"
    )


def test_compose_prometheus_config_is_valid(tmp_path: Path) -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    # Compose mounts rules/ at /etc/prometheus/rules: check it with the files where they are.
    config["rule_files"] = [str(MONITORING / "rules" / Path(f).name) for f in config["rule_files"]]
    # ... and its secret (promtool checks that the token's file exists).
    token = tmp_path / "metrics_token"
    token.write_text("a-token\n")
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"inferplane-web", "inferplane-vllm"} <= jobs


@pytest.mark.parametrize("board", sorted(p.name for p in DASHBOARDS.glob("*.json")))
def test_every_dashboard_query_parses(board: str, tmp_path: Path) -> None:
    queries = dashboard_queries()[board]
    assert queries, f"{board} has no queries"
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": as_promql(q)}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_are_provisioned_for_compose_and_kubernetes() -> None:
    boards = {p.name for p in DASHBOARDS.glob("*.json")}
    assert boards == {"gateway.json", "engines.json", "batch.json", "moderation.json"}
    for name in boards:
        board = json.loads((DASHBOARDS / name).read_text())
        assert board["uid"].startswith("inferplane-")
        # One data source variable: the boards work under any Prometheus name.
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", (name, panel["title"])
    component = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    (generator,) = component["configMapGenerator"]
    assert {Path(f).name for f in generator["files"]} == boards
    assert generator["options"]["labels"] == {"grafana_dashboard": "1"}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mounts = " ".join(compose["grafana"]["volumes"])
    assert "./platform/monitoring/grafana/dashboards:" in mounts
    provider = yaml.safe_load(
        (MONITORING / "grafana/provisioning/dashboards/inferplane.yaml").read_text()
    )
    path = provider["providers"][0]["options"]["path"]
    assert f"grafana/dashboards:{path}:ro" in mounts
    assert (
        "./platform/monitoring/rules:/etc/prometheus/rules:ro" in compose["prometheus"]["volumes"]
    )
