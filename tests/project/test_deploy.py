"""deploy/ and the Dockerfile, checked offline: Kubernetes schemas (shipped inside kubernetes-validate), and that
the manifests agree with the node's own flags, ports, probes and volumes."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support import ROOT
from adapter_fabric.node.settings import parse_settings

DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests target; the newest schemas too
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def _docs() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kind(kind: str) -> dict:
    found = [doc for doc in _docs() if doc["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_the_validator_rejects_a_broken_manifest() -> None:
    broken = _kind("StatefulSet")
    broken = {**broken, "spec": {**broken["spec"], "replicas": "three"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_statefulset_agrees_with_the_node_flags_service_probes_and_volumes() -> None:
    service, statefulset, secret = _kind("Service"), _kind("StatefulSet"), _kind("Secret")
    pod = statefulset["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = parse_settings(container.get("args", []), env)  # the node would accept this configuration

    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    dns_name, dns_port = settings.peers_dns.rsplit(":", 1)
    assert dns_name == service["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(dns_port) == ports["grpc"] == int(settings.listen.rsplit(":", 1)[1])
    assert settings.listen.startswith("0.0.0.0:") and int(settings.metrics_listen.rsplit(":", 1)[1]) == ports["metrics"]

    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.drain_timeout

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert settings.store.is_relative_to(mounts[claim["metadata"]["name"]])
    claimed = int(re.fullmatch(r"(\d+)Gi", claim["spec"]["resources"]["requests"]["storage"]).group(1)) << 30
    assert 0 < settings.max_store_bytes < claimed

    secret_volume = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    assert secret_volume["secret"]["secretName"] == secret["metadata"]["name"]
    for path in (settings.tls_cert, settings.tls_key, settings.tls_ca, settings.auth_token_file):
        assert path is not None and path.parent.as_posix() == mounts[secret_volume["name"]] and path.name in secret["stringData"]


def test_the_dockerfile_installs_through_the_project_and_copies_what_exists() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "pip install ." in text and 'ENTRYPOINT ["fabric-node"]' in text
    for source in re.findall(r"^COPY (\S+)", text, flags=re.M):
        assert (ROOT / source).exists(), source
    statefulset_port = {p["name"]: p["containerPort"] for p in _kind("StatefulSet")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert f"EXPOSE {statefulset_port['grpc']} {statefulset_port['metrics']}" in text
