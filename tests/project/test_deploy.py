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
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and 'pip install ".[k8s]"' in text and 'ENTRYPOINT ["fabric-node"]' in text
    for source in re.findall(r"^COPY (\S+)", text, flags=re.M):
        assert (ROOT / source).exists(), source
    statefulset_port = {p["name"]: p["containerPort"] for p in _kind("StatefulSet")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert f"EXPOSE {statefulset_port['grpc']} {statefulset_port['metrics']}" in text


# ------------------------------------------------------------ an engine with its node: deploy/vllm-sidecar.yaml

PLUGIN_SOURCE = ROOT / "fabric" / "integrations" / "vllm_resolver.py"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _mounted(container: dict, path: Path) -> tuple[str, Path]:
    """(volume name, path inside that volume) of a path a container sees."""
    for mount in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        if path.is_relative_to(mount["mountPath"]):
            return mount["name"], path.relative_to(mount["mountPath"])
    raise AssertionError(f"{container['name']}: {path} is on no volume")


def _deployment(name: str) -> dict:
    (found,) = [doc for doc in _docs() if doc["kind"] == "Deployment" and doc["metadata"]["name"] == name]
    return found


def _engine_pod(name: str = "vllm-engine") -> tuple[dict, dict, dict]:
    """(pod template, its node sidecar, its engine container) of the Deployment ``name``."""
    pod = _deployment(name)["spec"]["template"]
    (node,) = pod["spec"]["initContainers"]
    (vllm,) = pod["spec"]["containers"]
    return pod, node, vllm


@pytest.mark.parametrize("name", ["vllm-engine", "sglang-engine"])
def test_the_engine_pod_runs_a_store_only_node_as_a_sidecar_that_starts_first(name: str) -> None:
    pod, node, _ = _engine_pod(name)
    settings = parse_settings(node.get("args", []), _env(node))  # the node would accept this configuration
    assert node["restartPolicy"] == "Always", "a native sidecar: started before vLLM, kept running beside it"
    assert node["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}  # vLLM waits for recovery and export
    assert node["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert node["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert settings.store_only and settings.export_dir is not None
    # export entries are hard links into the store: both on one volume
    assert _mounted(node, settings.export_dir)[0] == _mounted(node, settings.store)[0]
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert int(settings.metrics_listen.rsplit(":", 1)[1]) == ports["metrics"] == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.drain_timeout


@pytest.mark.parametrize("name", ["vllm-engine", "sglang-engine"])
def test_the_engine_pods_nodes_are_peers_of_the_statefulsets(name: str) -> None:
    service, statefulset, deployment = _kind("Service"), _kind("StatefulSet"), _deployment(name)
    pod, node, _ = _engine_pod(name)
    settings = parse_settings(node.get("args", []), _env(node))
    dns_name, dns_port = settings.peers_dns.rsplit(":", 1)
    assert dns_name == service["metadata"]["name"]
    assert int(dns_port) == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    for template in (pod, statefulset["spec"]["template"]):
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    # the two controllers never select each other's pods
    assert not deployment["spec"]["selector"]["matchLabels"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    assert not statefulset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert settings.peer_tls_name == service["metadata"]["name"]


def test_the_vllm_container_loads_the_plugin_configured_for_its_sidecar() -> None:
    pod, node, vllm = _engine_pod()
    settings = parse_settings(node.get("args", []), _env(node))
    env = _env(vllm)
    pyproject = (ROOT / "pyproject.toml").read_text()
    plugin = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\n(\w+) = ', pyproject).group(1)
    assert env["VLLM_PLUGINS"] == plugin and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    read = set(re.findall(r"FABRIC_[A-Z_]+", PLUGIN_SOURCE.read_text()))
    assert {name for name in env if name.startswith("FABRIC_")} <= read | {"FABRIC_TLS_CERT", "FABRIC_TLS_KEY", "FABRIC_TLS_CA"}
    host, port = env["FABRIC_NODE"].rsplit(":", 1)
    assert host in ("localhost", "127.0.0.1") and int(port) == int(settings.listen.rsplit(":", 1)[1])
    # the plugin's export dir is the node's, on the same volume, read-only for vLLM
    assert _mounted(vllm, Path(env["FABRIC_EXPORT_DIR"])) == _mounted(node, settings.export_dir)
    assert next(m for m in vllm["volumeMounts"] if m["name"] == _mounted(node, settings.export_dir)[0])["readOnly"]
    for key in ("FABRIC_TLS_CERT", "FABRIC_TLS_KEY", "FABRIC_TLS_CA", "FABRIC_AUTH_TOKEN_FILE"):
        assert _mounted(vllm, Path(env[key])) == _mounted(node, Path(_env(node)[key])), key  # the node's own credentials
    http = {p["name"]: p["containerPort"] for p in vllm["ports"]}["http"]
    assert f"--port={http}" in vllm["args"] and "--enable-lora" in vllm["args"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert vllm["image"] in (ROOT / "deploy" / "vllm.Dockerfile").read_text()


def test_the_sglang_pods_node_drives_its_sglang_over_localhost_from_the_shared_export_dir() -> None:
    pod, node, sglang = _engine_pod("sglang-engine")
    settings = parse_settings(node.get("args", []), _env(node))  # the node would accept this configuration (it needs --export-dir)
    http = {p["name"]: p["containerPort"] for p in sglang["ports"]}["http"]
    assert settings.sglang_url == f"http://localhost:{http}" and f"--port={http}" in sglang["args"] and "--enable-lora" in sglang["args"]
    assert 1 <= settings.sglang_sync_interval <= 60
    # SGLang reads the export directory at the node's path, on the same volume, read-only
    assert _mounted(sglang, settings.export_dir) == _mounted(node, settings.export_dir)
    assert next(m for m in sglang["volumeMounts"] if m["name"] == _mounted(node, settings.export_dir)[0])["readOnly"]
    assert _env(sglang)["HF_HUB_OFFLINE"] == "1"  # a lora_path that is not a directory is never fetched from a hub
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sglang[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.drain_timeout


def test_the_vllm_image_installs_the_wheel_from_the_clone_holding_torch() -> None:
    text = (ROOT / "deploy" / "vllm.Dockerfile").read_text()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), source
    copied = {s for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M) for s in line.split()}
    assert {"pyproject.toml", "setup.py", "fabric", "node"} <= copied
    assert "pip wheel --no-cache-dir --no-deps" in text and "--constraint /tmp/hold-torch.txt" in text


def test_the_readmes_kubernetes_names_are_the_manifests() -> None:
    readme = (ROOT / "README.md").read_text()
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in _docs()}
    service_ports = {p["port"] for p in _kind("Service")["spec"]["ports"]}
    for host, port in re.findall(r"(?:--peers-dns[ =]|FABRIC_PEERS_DNS=)([\w.-]+):(\d+)", readme):
        assert ("Service", host.split(".")[0]) in names and int(port) in service_ports, host
    kinds = {"statefulset/": "StatefulSet", "pod/": "StatefulSet", "deployment/": "Deployment", "secret generic ": "Secret"}
    for word, name in re.findall(r"\b(statefulset/|pod/|deployment/|secret generic )([a-z0-9-]+)", readme):
        name = re.sub(r"-\d+$", "", name) if word == "pod/" else name  # pod/fabric-0: the StatefulSet's first pod
        assert (kinds[word], name) in names, (kinds[word], name)
    for path in re.findall(r"deploy/[\w.-]+", readme):
        assert (ROOT / path).is_file(), path
    assert ("Deployment", "vllm-engine") in names and "deploy/vllm-sidecar.yaml" in readme
    assert ("Deployment", "sglang-engine") in names and "deploy/sglang-sidecar.yaml" in readme


# ------------------------------------------------------------ the README's rules for engines, held by the manifests

#: the model the README's examples serve, and so what an adapter for it names in base_model_name_or_path
README_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("name", ["vllm-engine", "sglang-engine"])
def test_an_evicting_node_beside_an_engine_holds_what_the_engine_registered(name: str) -> None:
    """README (What the engines hold): a node that may evict beside vLLM reads its engine's /v1/models
    (--engine-url), or drives its SGLang (--sglang-url), so it never removes a directory the engine still names."""
    _, node, engine = _engine_pod(name)
    settings = parse_settings(node.get("args", []), _env(node))
    assert settings.max_store_bytes > 0 and settings.when_full == "evict"  # a cache: it evicts
    http = {p["name"]: p["containerPort"] for p in engine["ports"]}["http"]
    engine_urls = {*settings.engine_url, *([settings.sglang_url] if settings.sglang_url else [])}
    assert f"http://localhost:{http}" in engine_urls, (name, engine_urls)


def test_the_vllm_plugin_resolves_adapters_made_for_the_model_it_serves() -> None:
    """README (vLLM): vLLM hands the plugin its model path (/models/base here), so the plugin must be told the name
    adapters give that model (FABRIC_BASE_MODEL), by the same rule the node and the plugin use."""
    from adapter_fabric.format.base_model import base_model_matches

    _, _, vllm = _engine_pod()
    env = _env(vllm)
    model_path = vllm["args"][0]
    aliases = [n.strip() for n in env.get("FABRIC_BASE_MODEL", "").split(",") if n.strip()]
    assert base_model_matches(README_MODEL, [model_path, *aliases])
    assert not base_model_matches("mistralai/Mistral-7B-v0.1", [model_path, *aliases])  # the rule still refuses another model
    assert "FABRIC_BASE_MODEL" in PLUGIN_SOURCE.read_text()


def test_sizes_are_written_as_kubernetes_quantities_the_node_reads_alike() -> None:
    """FABRIC_*_BYTES as 18Gi (not "19327352832"), which the node reads as Kubernetes does: Gi = 2^30."""
    from adapter_fabric.units import parse_size

    found = 0
    for doc in _docs():
        for container in _containers(doc):
            for variable, value in _env(container).items():
                if variable.endswith(("_BYTES", "_RATE")) and variable.startswith("FABRIC_"):
                    quantity = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", str(value))
                    assert quantity, (variable, value)
                    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
                    assert parse_size(str(value)) == int(quantity[1]) * units[quantity[2]]
                    found += 1
    assert found >= 3


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def test_the_node_may_watch_its_services_endpoint_slices_and_nothing_more() -> None:
    service, statefulset = _kind("Service"), _kind("StatefulSet")
    account, role, binding = _kind("ServiceAccount"), _kind("Role"), _kind("RoleBinding")
    pod = statefulset["spec"]["template"]["spec"]
    node = pod["containers"][0]
    settings = parse_settings(node.get("args", []), _env(node))
    assert settings.peers_k8s.split(":")[0] == service["metadata"]["name"] and settings.homes == 3
    assert settings.peers_k8s.split(":")[1] in {p["name"] for p in service["spec"]["ports"]}
    assert pod["serviceAccountName"] == account["metadata"]["name"] == binding["subjects"][0]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


def test_every_node_runs_the_policy_with_a_peer_token_that_is_not_its_admin_token() -> None:
    """Issue 28: the manifests serve nothing without a principal, and the token a node sends its peers grants read and pull."""
    from adapter_fabric.access.policy import parse_policy

    secret, config_map = _kind("Secret"), _kind("ConfigMap")
    policy = parse_policy(config_map["data"]["policy.toml"])
    [peers] = [p for p in policy.principals if p.name == "peers"]
    assert not peers.may_anywhere("admin") and {v for g in peers.grants for v in g.verbs} == {"read", "pull"}
    pods = [_kind("StatefulSet")["spec"]["template"]] + [_engine_pod(name)[0] for name in ("vllm-engine", "sglang-engine")]
    for pod in pods:
        node = (pod["spec"].get("initContainers") or pod["spec"]["containers"])[0]
        settings = parse_settings(node.get("args", []), _env(node))
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        policy_volume, policy_file = _mounted(node, settings.policy)
        assert volumes[policy_volume]["configMap"]["name"] == config_map["metadata"]["name"] and policy_file.as_posix() in config_map["data"]
        for path in (settings.auth_token_file, settings.peer_token_file):
            name, key = _mounted(node, path)
            assert volumes[name]["secret"]["secretName"] == secret["metadata"]["name"] and key.as_posix() in secret["stringData"]
        assert settings.peer_token_file.name != settings.auth_token_file.name
    assert secret["stringData"]["peer-token"] != secret["stringData"]["token"]
