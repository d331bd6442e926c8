"""deploy/: the Kubernetes examples and the compose file are consistent with the reaper they run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from harvester import __version__
from harvester.daemon.loading import load
from harvester.daemon.settings import ReaperSettings
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"

# A container of the log source needs, besides logTransactionMemory, the reaper's own memory (the
# reaper and its producer process, measured: docs/reaper.md "Memory and spill files") and slack.
OWN_MEMORY = 150 << 20
SLACK = 1.25


def memory_quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity (``512Mi``, ``2Gi``) or a compose size (``512m``)."""
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text)).groups()  # type: ignore[union-attr]
    scale = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(number) * scale[unit]


def fits(limit: int, budget: int) -> bool:
    """Whether a memory limit holds a log source's budget, the reaper's own memory and the slack."""
    return limit >= (budget + OWN_MEMORY) * SLACK


def sets_budget(text: str) -> bool:
    """Whether a reaper.yaml sets logTransactionMemory (either spelling)."""
    return re.search(r"^\s*(logTransactionMemory|log_transaction_memory):", text, re.MULTILINE) is not None


def with_log_source(text: str) -> str:
    """A manifest's reaper.yaml running the log source: as it is, or with its one commented-out
    ``source: log`` line switched on (the variant the manifest offers)."""
    if re.search(r"^\s*source: log\b", text, re.MULTILINE):
        return text
    switched, count = re.subn(r"^(\s*)# (source: log)$", r"\1\2", text, flags=re.MULTILINE)
    assert count == 1, "neither runs the log source nor offers it in one line"
    return switched


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


def header(path: Path) -> str:
    """The manifest's leading comment, where the commands that deploy it are written."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines)


def created_secret(path: Path) -> tuple[str, set[str]]:
    """The name and keys of the Secret that the manifest's header tells to create."""
    (command,) = re.findall(r"kubectl create secret generic .*", header(path))
    words = shlex.split(command)
    return words[4], {w.removeprefix("--from-file=").split("=")[0] for w in words if w.startswith("--from-file=")}


def documented_images(verb: str) -> set[str]:
    """Every image that a `docker build -t` (verb "build -t") or `docker push` in the README, docs/, the
    Dockerfile or a manifest names, with the $REGISTRY the reader chooses written as the manifests'
    REGISTRY placeholder."""
    texts = [ROOT / "README.md", ROOT / "Dockerfile", *(ROOT / "docs").glob("*.md"), *K8S.glob("*.yaml")]
    return {
        image.strip("\"'").replace("$REGISTRY", "REGISTRY")
        for path in texts
        for image in re.findall(rf"docker {verb} (\S+)", path.read_text())
    }


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

    # Secrets come from the Secret the header's `kubectl create secret` makes: files in the secret
    # volume, and env vars from secretKeyRef, each naming a key that command creates.
    secret_name, keys = created_secret(K8S / manifest)
    secret_volume = next(n for n, v in volumes.items() if "secret" in v)
    assert volumes[secret_volume]["secret"]["secretName"] == secret_name
    items = volumes[secret_volume]["secret"].get("items") or [{"key": k, "path": k} for k in keys]
    assert {item["key"] for item in items} <= keys
    files = {f"{mounts[secret_volume]}/{item['path']}": f"from-secret-{item['key']}" for item in items}
    env = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == secret_name
            assert ref["key"] in keys
            env[var["name"]] = f"from-secret-{ref['key']}"
        elif var["name"].startswith("REAPER_"):
            env[var["name"]] = "pod-name"
    settings = validate(config_map["data"]["reaper.yaml"], tmp_path, files, env)
    assert settings.harvest.name == "pod-name"  # every log line names the pod
    assert "password=from-secret-pg-password" in settings.harvest.data_source  # it really came from the Secret
    # TLS to both ends, verified against a CA bundle mounted read-only from the ConfigMap the header creates.
    assert "sslmode=verify-full" in settings.harvest.data_source
    (rootcert,) = re.findall(r"sslrootcert=(\S+)", settings.harvest.data_source)
    assert settings.harvest.base_kafka_config["security.protocol"] == "SASL_SSL"
    (ca_map,) = re.findall(r"kubectl create configmap (\S+) --from-file=ca.crt=", header(K8S / manifest))
    ca_volume = next(n for n, v in volumes.items() if v.get("configMap", {}).get("name") == ca_map)
    ca_mount = next(m for m in container["volumeMounts"] if m["name"] == ca_volume)
    assert ca_mount["readOnly"] is True
    for path in (rootcert, settings.harvest.base_kafka_config["ssl.ca.location"]):
        assert path == f"{ca_mount['mountPath']}/ca.crt", path

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

    # The log source, as the manifest runs it or offers it: its spill directory is a writable emptyDir
    # on the node's disk (the root filesystem is read-only), and the memory limit holds its budget.
    log = validate(with_log_source(config_map["data"]["reaper.yaml"]), tmp_path, files, env).harvest
    assert log.source == "log"
    assert log.log_spill_directory is not None, "the default, /tmp, is on the read-only root filesystem"
    spill = next(m for m in container["volumeMounts"] if m["mountPath"] == log.log_spill_directory)
    assert not spill.get("readOnly")
    assert volumes[spill["name"]]["emptyDir"].get("medium") != "Memory"  # a tmpfs would count as memory
    assert memory_quantity(volumes[spill["name"]]["emptyDir"]["sizeLimit"]) >= 1 << 30
    limit = memory_quantity(container["resources"]["limits"]["memory"])
    assert memory_quantity(container["resources"]["requests"]["memory"]) <= limit
    assert fits(limit, int(log.log_transaction_memory)), (limit, log.log_transaction_memory)
    assert sets_budget(config_map["data"]["reaper.yaml"]), "set explicitly: the default, 1GiB, fits no limit here"

    # The graceful stop fits in the grace period, and the container runs unprivileged.
    assert settings.shutdown.timeout.total_seconds() < pod["terminationGracePeriodSeconds"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def pod_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_sidecar_readiness_does_not_depend_on_kafka() -> None:
    """No container of the application's pod, native sidecar included, gates readiness or startup on /readyz,
    which fails while Kafka is down: the application needs only PostgreSQL to write its outbox."""
    deployment = documents(K8S / "sidecar.yaml")["Deployment/orders"]
    for container in pod_containers(deployment):
        for probe in ("readinessProbe", "startupProbe"):
            assert container.get(probe, {}).get("httpGet", {}).get("path") != "/readyz", (container["name"], probe)
    assert "readinessProbe" not in reaper_container(deployment)


def test_every_image_is_one_the_documented_build_produces() -> None:
    builds = documented_images("build -t")
    assert builds == {f"REGISTRY/outbox-harvester/reaper:{__version__}"}, "one image, tagged with the version"
    for path in sorted(K8S.glob("*.yaml")):
        for key, doc in documents(path).items():
            if doc["kind"] != "Deployment":
                continue
            for container in pod_containers(doc):
                if key == "Deployment/orders" and container["name"] == "app":
                    continue  # the reader's own application
                assert container["image"] in builds, f"{path.name}: nothing documented builds {container['image']}"
    assert documented_images("push") == builds, "what is built is what is pushed"


def test_no_secret_is_applied_with_the_workload() -> None:
    """Applying a manifest never resets real credentials: it carries no Secret and no literal password;
    the Secret it references is created once, by the command in its header."""
    for path in sorted(K8S.glob("*.yaml")):
        docs = documents(path)
        assert not [k for k in docs if k.startswith("Secret/")], f"{path.name} applies a Secret"
        body = path.read_text().split("\napiVersion:", 1)[1]  # past the header's commands
        assert not re.search(r"password=(?!\$\{)", body), f"{path.name}: literal password"
        assert not re.search(r"password:\s*(?![\s$])", body), f"{path.name}: literal password"
        name, keys = created_secret(path)
        assert keys, f"{path.name}: the header creates the Secret from files"
        referenced = {ref for doc in docs.values() if doc["kind"] == "Deployment" for ref in secret_references(doc)}
        assert referenced == {name}
    # The docs show the same command as the manifest they deploy.
    headers = "\n".join(header(path) for path in K8S.glob("*.yaml"))
    docs_text = "\n".join(doc.read_text() for doc in (ROOT / "docs").glob("*.md"))
    commands = re.findall(r"kubectl create secret .*", docs_text)
    assert commands
    assert all(c in headers for c in commands)


def secret_references(deployment: dict[str, Any]) -> set[str]:
    pod = deployment["spec"]["template"]["spec"]
    names = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for container in pod_containers(deployment):
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                names.add(ref["name"])
        names.update(e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e)
    return names


def test_standalone_disruption_budget_and_service_account() -> None:
    docs = documents(K8S / "standalone.yaml")
    # In an outage every replica is NotReady: the budget must still let a node drain evict them.
    assert docs["PodDisruptionBudget/outbox-reaper"]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    pod = docs["Deployment/outbox-reaper"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # the reaper never calls the Kubernetes API


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

    # The log source: PostgreSQL of a version the suite tests, with wal_level=logical; the reapers'
    # memory limit holds their budget; spill files go to the image's /tmp, writable here.
    postgres = services["postgres"]
    assert re.fullmatch(r"postgres:(15|18)(\.\d+)*(-\w+)?", postgres["image"])
    assert "wal_level=logical" in postgres["command"]
    harvest = settings.harvest
    assert harvest.source == "log"
    assert sets_budget(text), "set explicitly: the default, 1GiB, fits no limit here"
    assert fits(memory_quantity(services["reaper"]["mem_limit"]), int(harvest.log_transaction_memory))
    assert harvest.log_spill_directory is None and not services["reaper"].get("read_only")
