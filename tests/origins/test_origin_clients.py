"""Each origin client against a real server: nginx (HTTP, ETags, a rate-limited drip), moto's S3 server, a Hub
endpoint read through huggingface_hub, and a directory. Conditional revalidation, pins, bounds and named refusals."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from adapter_fabric.errors import AdapterNotFound, InvalidArgument, LimitExceeded, OriginTooSlow, OriginUnavailable
from adapter_fabric.origins.base import FetchLimits, Revision
from adapter_fabric.origins.records import RevisionRecord, RevisionRecords
from adapter_fabric.origins.uri import open_origin, parse_origin
from tests.support import origin_servers as servers

FILES = ("adapter_config.json", "adapter_model.safetensors")
LIMITS = 64 << 20


def _same(into: Path, source: Path) -> bool:
    return all((into / n).read_bytes() == (source / n).read_bytes() for n in FILES)


def _put(root: Path, adapter_id: str, source: Path) -> None:
    dest = root / adapter_id
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(source / name, dest / name)


@pytest.fixture()
def into(tmp_path: Path) -> Path:
    path = tmp_path / "into"
    path.mkdir()
    return path


# ---------------------------------------------------------------- HTTP (nginx)


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("www")
    with servers.nginx(root, tmp_path_factory.mktemp("nginx")) as url:
        yield url, root


def test_http_fetches_then_revalidates_with_a_304_and_sees_a_change(web, store_adapters, into: Path, tmp_path: Path) -> None:
    url, root = web
    _put(root, "team-a/support", store_adapters["a"])
    origin = open_origin(parse_origin(url))
    revision = origin.fetch("team-a/support", "", None, into, FetchLimits(LIMITS))
    assert _same(into, store_adapters["a"]) and revision.revision and revision.origin == url
    again = tmp_path / "again"
    again.mkdir()
    assert origin.fetch("team-a/support", "", revision, again, FetchLimits(LIMITS)) is None
    assert not list(again.iterdir())  # a 304: nothing read, nothing written
    os.utime(root / "team-a/support" / FILES[1], ns=(1, 10**18))  # nginx's ETag is mtime-size: a retrain changes it
    _put(root, "team-a/support", store_adapters["b"])
    changed = origin.fetch("team-a/support", "", revision, again, FetchLimits(LIMITS))
    assert changed is not None and changed.revision != revision.revision and _same(again, store_adapters["b"])
    pinned = tmp_path / "pinned"
    pinned.mkdir()
    with pytest.raises(AdapterNotFound, match="no longer has revision"):
        origin.fetch("team-a/support", revision.revision, None, pinned, FetchLimits(LIMITS))  # If-Match: 412
    assert origin.fetch("team-a/support", changed.revision, None, pinned, FetchLimits(LIMITS)).revision == changed.revision


def test_http_refusals_are_named(web, store_adapters, into: Path) -> None:
    url, root = web
    _put(root, "team-a/big", store_adapters["a"])
    origin = open_origin(parse_origin(url))
    with pytest.raises(AdapterNotFound, match="has no adapter_config.json"):
        origin.fetch("team-a/absent", "", None, into, FetchLimits(LIMITS))
    with pytest.raises(LimitExceeded, match="more than this node accepts"):
        origin.fetch("team-a/big", "", None, into, FetchLimits(1000))
    assert not (into / FILES[1]).exists()  # refused from Content-Length, before a byte was written
    with pytest.raises(OriginTooSlow, match="slow or stalled"):
        open_origin(parse_origin(f"{url}/slow#timeout=1s")).fetch("team-a/big", "", None, into, FetchLimits(LIMITS, timeout=1.0))
    with pytest.raises(OriginUnavailable, match="redirect"):
        open_origin(parse_origin(f"{url}/moved")).fetch("x", "", None, into, FetchLimits(LIMITS))


def test_http_origin_down_is_unavailable_by_name(into: Path) -> None:
    from adapter_fabric.harness.cluster import free_port

    url = f"http://user:hunter2@127.0.0.1:{free_port()}/adapters"
    origin = open_origin(parse_origin(url))
    assert "hunter2" not in origin.label
    with pytest.raises(OriginUnavailable, match="could not be fetched") as caught:
        origin.fetch("team-a/x", "", None, into, FetchLimits(LIMITS))
    assert "hunter2" not in str(caught.value) and "127.0.0.1" in str(caught.value)


# ---------------------------------------------------------------- S3 (moto's server)


@pytest.fixture(scope="module")
def s3():
    with servers.moto_s3() as endpoint:
        yield endpoint, servers.s3_client(endpoint)


@pytest.fixture()
def aws_env(s3, monkeypatch: pytest.MonkeyPatch):
    for key, value in servers.S3_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3[0])  # the standard variable, read by the client the origin builds
    return s3[1]


def test_s3_fetches_revalidates_and_pins_a_version(aws_env, store_adapters, into: Path, tmp_path: Path) -> None:
    client = aws_env
    client.create_bucket(Bucket="adapters")
    client.put_bucket_versioning(Bucket="adapters", VersioningConfiguration={"Status": "Enabled"})
    servers.put_adapter_s3(client, "adapters", "cust/team-a/support", store_adapters["a"])
    origin = open_origin(parse_origin("s3://adapters/cust"))
    first = origin.fetch("team-a/support", "", None, into, FetchLimits(LIMITS))
    assert _same(into, store_adapters["a"]) and first.revision  # the weights' VersionId
    again = tmp_path / "again"
    again.mkdir()
    assert origin.fetch("team-a/support", "", first, again, FetchLimits(LIMITS)) is None
    servers.put_adapter_s3(client, "adapters", "cust/team-a/support", store_adapters["b"])
    second = origin.fetch("team-a/support", "", first, again, FetchLimits(LIMITS))
    assert second.revision != first.revision and _same(again, store_adapters["b"])
    pinned = tmp_path / "pinned"
    pinned.mkdir()
    origin.fetch("team-a/support", first.revision, None, pinned, FetchLimits(LIMITS))
    assert (pinned / FILES[1]).read_bytes() == (store_adapters["a"] / FILES[1]).read_bytes()  # the old version's bytes


def test_s3_refusals_are_named(aws_env, store_adapters, into: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aws_env.create_bucket(Bucket="small")
    servers.put_adapter_s3(aws_env, "small", "x/y", store_adapters["a"])
    with pytest.raises(AdapterNotFound, match="no object"):
        open_origin(parse_origin("s3://small")).fetch("x/absent", "", None, into, FetchLimits(LIMITS))
    with pytest.raises(LimitExceeded):
        open_origin(parse_origin("s3://small")).fetch("x/y", "", None, into, FetchLimits(1000))
    with pytest.raises(OriginUnavailable, match="does not exist"):
        open_origin(parse_origin("s3://no-such-bucket")).fetch("x/y", "", None, into, FetchLimits(LIMITS))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-shown")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(OriginUnavailable, match="did not answer") as caught:
        open_origin(parse_origin("s3://small#timeout=5s"), tries=1).fetch("x/y", "", None, into, FetchLimits(LIMITS))
    assert "s3cr3t" not in str(caught.value)


# ---------------------------------------------------------------- the Hub (huggingface_hub against a local endpoint)


@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants

    with servers.hub_endpoint(tmp_path / "hub", token="hf_secret") as (url, repos):
        # HF_ENDPOINT is read when huggingface_hub is imported (node processes get the variable); here it is imported already
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        yield repos


def test_hub_fetches_a_repo_at_its_commit_and_revalidates_by_commit(hub, store_adapters, into: Path, tmp_path: Path) -> None:
    first_sha = hub.publish("team-a/support", store_adapters["a"])
    origin = open_origin(parse_origin("hf://"))
    first = origin.fetch("team-a/support", "", None, into, FetchLimits(LIMITS))
    assert first.revision == first_sha and _same(into, store_adapters["a"])
    served = len(hub.fetches)
    assert origin.fetch("team-a/support", "", first, tmp_path, FetchLimits(LIMITS)) is None and len(hub.fetches) == served
    second_sha = hub.publish("team-a/support", store_adapters["b"])
    again = tmp_path / "again"
    again.mkdir()
    assert origin.fetch("team-a/support", "", first, again, FetchLimits(LIMITS)).revision == second_sha
    pinned = tmp_path / "pinned"
    pinned.mkdir()
    assert origin.fetch("team-a/support", first_sha, None, pinned, FetchLimits(LIMITS)).revision == first_sha
    assert _same(pinned, store_adapters["a"])


def test_hub_refusals_are_named(hub, store_adapters, into: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.publish("team-a/support", store_adapters["a"])
    with pytest.raises(AdapterNotFound, match="no repo"):
        open_origin(parse_origin("hf://")).fetch("team-a/absent", "", None, into, FetchLimits(LIMITS))
    with pytest.raises(AdapterNotFound, match="not a repo id"):
        open_origin(parse_origin("hf://other-org")).fetch("team-a/support", "", None, into, FetchLimits(LIMITS))
    with pytest.raises(LimitExceeded):
        open_origin(parse_origin("hf://")).fetch("team-a/support", "", None, into, FetchLimits(1000))
    assert not (into / FILES[1]).exists()  # the Hub's listed size refused it before the download
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises((OriginUnavailable, AdapterNotFound)) as caught:
        open_origin(parse_origin("hf://")).fetch("team-a/support", "", None, into, FetchLimits(LIMITS))
    assert "hf_wrong" not in str(caught.value)


# ---------------------------------------------------------------- a directory, URIs, records


def test_directory_origin_revalidates_by_stamps(tmp_path: Path, store_adapters, into: Path) -> None:
    _put(tmp_path / "src", "team-a/support", store_adapters["a"])
    origin = open_origin(parse_origin(f"file://{tmp_path / 'src'}"))
    first = origin.fetch("team-a/support", "", None, into, FetchLimits(LIMITS))
    assert _same(into, store_adapters["a"]) and origin.fetch("team-a/support", "", first, into, FetchLimits(LIMITS)) is None
    (tmp_path / "src/team-a/support" / FILES[1]).unlink()
    _put(tmp_path / "src", "team-a/support", store_adapters["b"])
    assert origin.fetch("team-a/support", "", first, into, FetchLimits(LIMITS)).revision != first.revision


@pytest.mark.parametrize(
    "text, message",
    [("ftp://x/y", "is not one of"), ("s3://B/x", "bucket name"), ("https://h/x#fast", "unknown option"), ("https://h/x#timeout=0", "timeout"),
     ("https:///x", "names no host"), ("file://relative", "absolute")],
)  # fmt: skip
def test_bad_origin_uris_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        open_origin(parse_origin(text))


def test_options_after_the_hash() -> None:
    spec = parse_origin("https://u:pw@host/a#trusted,timeout=2m")
    assert spec.trusted and spec.timeout == 120 and spec.uri == "https://u:pw@host/a"
    assert open_origin(spec).label == "https://host/a"


def test_records_round_trip(tmp_path: Path) -> None:
    records = RevisionRecords(tmp_path / "origins")
    record = RevisionRecord("d" * 64, Revision("s3://b/p", "v1", (("adapter_model.safetensors", '"e"'),)), 12.5, pinned=True)
    records.put("team-a/x", record)
    assert records.get("team-a/x") == record and records.get("team-a/y") is None
    records.remove("team-a/x")
    assert records.get("team-a/x") is None
