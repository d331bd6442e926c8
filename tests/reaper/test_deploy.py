"""deploy/: the Kubernetes examples and the compose file are consistent with the reaper they run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from harvester.daemon.settings import ReaperSettings, load
from tests.support import ROOT

pytestmark = pytest.mark.unit

K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"


def documents(path: Path) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(path.read_text()) if d}


def validate(text: str, tmp_path: Path, files: dict[str, str], env: dict[str, str]) -> ReaperSettings:
    """Load an embedded reaper.yaml the way the container would, with its secret files placed under tmp_path."""
    for mounted, content in files.items():
        local = tmp_path / mounted.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(content)
        text = text.replace(f"${{file:{mounted}}}", f"${{file:{local}}}")
    for ref in re.findall(r"\$\{file:([^}]*)\}", text):
        assert ref.startswith(str(tmp_path)), f"{ref} is not mounted from the Secret"
    path = tmp_path / "reaper.yaml"
    path.write_text(text)
    return load(path, environ=env)


def reaper_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "reaper")


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == port))


@pytest.mark.parametrize(
    ("manifest", "name", "replicas"), [("sidecar.yaml", "orders", 2), ("standalone.yaml", "outbox-reaper", 3)]
)
def test_kubernetes_manifests(tmp_path: Path, manifest: str, name: str, replicas: int) -> None:
    docs = documents(K8S / manifest)
    deployment = docs[f"Deployment/{name}"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == replicas
    container = reaper_container(deployment)
    if manifest == "sidecar.yaml":
        assert [c["name"] for c in pod["containers"]] == ["app", "reaper"]

    # The config comes from a ConfigMap mounted where the args point.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    config_map = docs[f"ConfigMap/{volumes[config_volume]['configMap']['name']}"]
    assert container["args"] == ["run", "-f", f"{mounts[config_volume]}/reaper.yaml"]

    # Secrets come from a Secret: files in the secret volume, and env vars from secretKeyRef.
    secret_volume = next(n for n, v in volumes.items() if "secret" in v)
    secret = docs[f"Secret/{volumes[secret_volume]['secret']['secretName']}"]
    files = {f"{mounts[secret_volume]}/{key}": value for key, value in secret["stringData"].items()}
    env = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == secret["metadata"]["name"]
            env[var["name"]] = secret["stringData"][ref["key"]]
        elif var["name"].startswith("REAPER_"):
            env[var["name"]] = "pod-name"
    settings = validate(config_map["data"]["reaper.yaml"], tmp_path, files, env)
    assert settings.harvest.name == "pod-name"  # every log line names the pod
    assert "change-me" in settings.harvest.data_source  # the password really came from the Secret

    # Probes: /healthz for liveness, bounded in time, on the configured http port. /readyz (which
    # needs Kafka) gates a standalone reaper's readiness only: a sidecar's would take its application
    # out of service in a Kafka outage, which the outbox exists to absorb.
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["timeoutSeconds"] <= 5
    probes = ["livenessProbe"]
    if manifest == "sidecar.yaml":
        assert "readinessProbe" not in container
    else:
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        probes.append("readinessProbe")
    for probe in probes:
        assert port_number(container, container[probe]["httpGet"]["port"]) == settings.http.port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.http.port)

    # The graceful stop fits in the grace period, and the container runs unprivileged.
    assert settings.shutdown.timeout.total_seconds() < pod["terminationGracePeriodSeconds"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_compose_file(tmp_path: Path) -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "kafka", "reaper-migrate", "reaper"} <= services.keys()
    for name in ("reaper-migrate", "reaper"):
        assert services[name]["build"]["context"] == "../.."
        assert (COMPOSE / services[name]["build"]["context"] / services[name]["build"]["dockerfile"]).is_file()
    assert services["reaper-migrate"]["command"] == ["migrate"]
    assert services["reaper"]["command"] == ["run"]
    assert services["reaper"]["deploy"]["replicas"] >= 2
    assert services["reaper"]["depends_on"]["reaper-migrate"]["condition"] == "service_completed_successfully"

    # The mounted reaper.yaml, read with the compose secret, reaches the compose services.
    mount = next(v for v in services["reaper"]["volumes"] if v.endswith(":/etc/reaper/reaper.yaml:ro"))
    secret_file = (COMPOSE / compose["secrets"]["pg_password"]["file"]).read_text()
    text = (COMPOSE / mount.split(":")[0]).read_text()
    settings = validate(text, tmp_path, {"/run/secrets/pg_password": secret_file}, {})
    assert "host=postgres" in settings.harvest.data_source
    assert settings.harvest.data_source.endswith("password=compose-only-password")  # newline stripped
    assert settings.harvest.base_kafka_config["bootstrap.servers"] == "kafka:9092"
    listeners = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert re.search(r"//kafka:9092\b", listeners)
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/pg_password"
