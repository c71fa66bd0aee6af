"""The access policy enforced by a real node (--policy): principals x RPCs x ids, peers, listings, reloads, the audit trail.

One policy node (tiny model, two slots) serves the whole module; a store-only
peer node pulls from it as the ``node-2`` principal. The tests run in file
order: the matrix and the reads first, the policy reloads last.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import FabricError, InvalidArgument, PermissionDenied, Unauthenticated
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc import security
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.transport.data_channel import DataChannelFailed, DataChannels
from adapter_fabric.transport.fetch_metadata import announce_data_port
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.certs import TestCA

pytestmark = pytest.mark.slow

TOKENS = {"cluster": "cluster-token-9f2c", "team-a": "team-a-token-51e0", "team-b": "team-b-token-77d1", "node-2": "node-2-token-0b4a",
          "engine": "engine-token-c3a8"}
#: each principal's grants, as the policy file below writes them: verb -> prefixes
GRANTS = {
    "team-a": {"read": ["team-a/", "shared/"], "pull": ["team-a/"], "publish": ["team-a/"], "unstage": ["team-a/"], "operate": ["team-a/"]},
    "team-b": {"read": ["team-b/"], "pull": ["team-b/"], "publish": ["team-b/"]},
    "node-2": {"read": ["*"], "pull": ["*"]},
    "engine": {"read": ["team-a/"], "pull": ["team-a/"]},
}


def policy_text(grants: dict[str, dict[str, list[str]]] = GRANTS) -> str:
    blocks = []
    for name, verbs in grants.items():
        lines = ", ".join(f'{{ verbs = ["{verb}"], prefixes = [{", ".join(repr(p).replace(chr(39), chr(34)) for p in prefixes)}] }}' for verb, prefixes in verbs.items())
        blocks.append(f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{token_sha256(TOKENS[name])}"\ngrants = [{lines}]\n')
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model()
    return {team: make_peft_adapter(root / team, base_model=base, r=4, seed=i) for i, team in enumerate(("team-a", "team-b", "shared"))}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("access")
    found = {"policy": root / "policy.toml", "cluster": root / "cluster.token", "peer": root / "node-2.token"}
    found["policy"].write_text(policy_text())
    found["cluster"].write_text(TOKENS["cluster"])
    found["peer"].write_text(TOKENS["node-2"])
    return found


@pytest.fixture(scope="module")
def node(tmp_path_factory, files, adapters):
    root = tmp_path_factory.mktemp("node")
    with LocalNode(root / "store", token_file=files["cluster"], extra_args=["--policy", str(files["policy"])]) as n:
        with n.client() as cluster:  # the cluster token: every verb on every id
            cluster.stage(adapters["team-a"], "team-a/x")
            cluster.stage(adapters["team-b"], "team-b/x")
            cluster.stage(adapters["shared"], "shared/base")
        yield n


def client(node: LocalNode, who: str) -> NodeClient:
    return NodeClient(node.address, token=TOKENS[who])


def allowed(who: str, verb: str, adapter_id: str) -> bool:
    return any(p == "*" or adapter_id.lower().startswith(p) for p in GRANTS[who].get(verb, []))


def fetch(node: LocalNode, who: str, adapter_id: str = "", digest: str = "") -> None:
    stub = fabric_pb2_grpc.FabricStub(security.channel(node.address, token=TOKENS[who]))
    try:
        for _ in stub.Fetch(fabric_pb2.FetchRequest(adapter_id=adapter_id, digest=digest), timeout=30):
            pass
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise PermissionDenied(exc.details()) from None
        raise FabricError(exc.details()) from None


def digest_of(node: LocalNode, adapter_id: str) -> str:
    with node.client() as cluster:
        return cluster.manifest(adapter_id).digest


#: each RPC: the verb it needs, and a call of it on an id ("absent" ids never staged; refusing or not is the same)
CALLS = {
    "Stage": ("publish", lambda c, n, a, i, w: c.stage(a[i.split("/")[0]] if i.split("/")[0] in a else a["team-a"], i)),
    "Unstage": ("unstage", lambda c, n, a, i, w: c.unstage(i + "-absent")),
    "Keep": ("operate", lambda c, n, a, i, w: c.keep(i)),
    "Promote": ("operate", lambda c, n, a, i, w: c.promote(i)),
    "Pin": ("operate", lambda c, n, a, i, w: c.pin(i, False)),
    "SetActive": ("operate", lambda c, n, a, i, w: c.set_active(i)),
    "GetManifest": ("read", lambda c, n, a, i, w: c.manifest(i)),
    "Locate": ("read", lambda c, n, a, i, w: c.locate(i)),
    "Generate": ("read", lambda c, n, a, i, w: c.generate([3, 14, 15], i, max_new_tokens=1)),
    "Fetch": ("pull", lambda c, n, a, i, w: fetch(n, w, adapter_id=i)),
    "Fetch by digest": ("pull", lambda c, n, a, i, w: fetch(n, w, digest=digest_of(n, i))),
}


@pytest.mark.parametrize("who", sorted(GRANTS))
@pytest.mark.parametrize("rpc", sorted(CALLS))
@pytest.mark.parametrize("adapter_id", ["team-a/x", "team-b/x"])
def test_each_principal_may_do_what_the_policy_grants_and_nothing_else(node, adapters, who, rpc, adapter_id):
    verb, call = CALLS[rpc]
    with client(node, who) as c:
        try:
            call(c, node, adapters, adapter_id, who)
            refused = None
        except PermissionDenied as exc:
            refused = str(exc)
        except FabricError:
            refused = None  # allowed through the gate; the call failed for its own reason (not resident, already gone)
    if allowed(who, verb, adapter_id):
        assert refused is None, f"{who} was refused {rpc} on {adapter_id}: {refused}"
    else:
        assert refused is not None, f"{who} was let through {rpc} on {adapter_id}"
        assert repr(verb) in refused and ("'team-" in refused or "digest" in refused), refused


def test_a_refusal_reads_the_same_for_an_id_that_exists_and_one_that_does_not(node):
    with client(node, "team-b") as c:
        answers = []
        for adapter_id in ("team-a/x", "team-a/never-staged"):
            with pytest.raises(PermissionDenied) as refused:
                c.manifest(adapter_id)
            answers.append(str(refused.value))
    assert answers[0] == answers[1] == "principal 'team-b' lacks 'read' on 'team-a/'"
    real, fake = digest_of(node, "team-a/x"), "ab" * 32
    messages = []
    for digest in (real, fake):
        with pytest.raises(PermissionDenied) as refused:
            fetch(node, "team-b", digest=digest)
        messages.append(str(refused.value).replace(digest, "<digest>"))
    assert messages[0] == messages[1]


@pytest.mark.parametrize(
    ("trick", "refusal"),
    [
        ("team-b/../team-a/x", InvalidArgument),
        ("team-b/%2F../team-a/x", InvalidArgument),
        ("team-b%2Fteam-a/x", InvalidArgument),
        ("Team-A/x", PermissionDenied),
        ("TEAM-A/x", PermissionDenied),
        ("te\u0430m-a/x", InvalidArgument),  # a Cyrillic 'a'
        ("team\u2010a/x", InvalidArgument),  # a Unicode hyphen
        ("team-b./x", PermissionDenied),
        ("team-b../team-a/x", PermissionDenied),
    ],
)
def test_id_tricks_cannot_cross_a_prefix(node, adapters, trick, refusal):
    with client(node, "team-b") as c:
        with pytest.raises(refusal):
            c.manifest(trick)
        with pytest.raises(refusal):
            c.stage(adapters["team-b"], trick)


def test_case_variants_of_a_granted_prefix_stay_inside_it(node):
    with client(node, "team-a") as c:
        try:
            c.manifest("TEAM-A/x")
        except PermissionDenied:
            pytest.fail("team-a was refused its own prefix in capitals")
        except FabricError:
            pass  # not staged under that spelling


def test_no_principal_is_unauthenticated_even_for_peer_reads(node):
    with NodeClient(node.address) as anonymous:
        with pytest.raises(Unauthenticated):
            anonymous.manifest("team-a/x")
        assert anonymous.health() == "SERVING"  # health stays open
    with NodeClient(node.address, token="not-anyones-token") as stranger:
        with pytest.raises(Unauthenticated):
            stranger.locate("team-a/x")


def test_listings_show_only_what_the_caller_may_read(node):
    with client(node, "team-a") as c:
        assert sorted(a.adapter_id for a in c.list().staged) == ["shared/base", "team-a/x"]
        pages = list(c.list_pages(page_size=1))
        assert [a.adapter_id for p in pages for a in p.staged] == ["shared/base", "team-a/x"]
        assert all(len(p.staged) == 1 for p in pages)
        assert c.store_status().adapters == 2
    with client(node, "team-b") as c:
        assert [a.adapter_id for a in c.list().staged] == ["team-b/x"]
        listing = c.list()
        assert all(not s.name or s.name.startswith("team-b/") for s in listing.slots)
        assert c.store_status().adapters == 1
    with node.client() as cluster:
        assert len(cluster.list().staged) == 3


def test_whoami_names_the_principal_and_its_grants(node):
    with client(node, "engine") as c:
        who = c.whoami()
    assert who.principal == "engine" and who.policy
    assert sorted((tuple(g.verbs), tuple(g.prefixes)) for g in who.grants) == [(("pull",), ("team-a/",)), (("read",), ("team-a/",))]
    with node.client() as cluster:
        assert cluster.whoami().principal == "cluster-token"
    out = subprocess.run(
        [sys.executable, "-m", "adapter_fabric.cli", "whoami", node.address, "--auth-token-file", str(node.token_file)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("principal cluster-token") and "admin on *" in out.stdout


def test_a_peer_principal_pulls_but_cannot_publish(node, files, adapters, tmp_path):
    # node-2 runs with its own token; node 1's policy grants that token read and pull on every id
    with LocalNode(tmp_path / "peer", model="none", token_file=files["peer"], peers=[node.address]) as peer:
        with peer.client() as c:
            pulled = c.pull("team-a/x", peer=node.address)
            assert pulled.digest == digest_of(node, "team-a/x") and pulled.bytes_transferred > 0
    with client(node, "node-2") as as_peer:
        with pytest.raises(PermissionDenied, match="lacks 'publish' on 'team-a/'"):
            as_peer.stage(adapters["team-a"], "team-a/from-a-peer")
        with pytest.raises(PermissionDenied, match="lacks 'unstage'"):
            as_peer.unstage("team-a/x")


def data_fetch(node: LocalNode, token: str, digest: str) -> int:
    """Bytes one data channel stream of ``digest`` carries, asked for with ``token`` in its hello."""
    port = int(re.search(r"data channel on port (\d+)", node.banner).group(1))
    channels = DataChannels(token=token)
    channels.learn(node.address, announce_data_port(port))
    call = channels.open(node.address, fabric_pb2.FetchRequest(digest=digest), None, 1 << 20)
    try:
        return sum(len(view) for _, view in call)
    except DataChannelFailed as exc:
        raise exc.error from None


def test_the_data_channel_hello_gets_the_same_pull_check(node):
    digest = digest_of(node, "team-a/x")
    assert data_fetch(node, TOKENS["engine"], digest) > 0
    with pytest.raises(PermissionDenied, match="lacks 'pull'"):
        data_fetch(node, TOKENS["team-b"], digest)
    with pytest.raises(Unauthenticated):
        data_fetch(node, "not-a-principal-token", digest)


def test_a_client_certificate_is_a_principal_by_its_san(tmp_path, adapters):
    ca = TestCA(tmp_path / "ca")
    ops, stranger = ca.issue("ops", hosts=("ops.fabric.internal",)), ca.issue("stranger", hosts=("stranger.fabric.internal",))
    policy = tmp_path / "policy.toml"
    policy.write_text('[[principal]]\nname = "ops"\nsan = "ops.fabric.internal"\ngrants = [{ verbs = ["read", "publish"], prefixes = ["team-a/"] }]\n')
    with LocalNode(tmp_path / "store", model="none", tls=ca.issue("node"), extra_args=["--policy", str(policy)]) as mtls:
        with NodeClient(mtls.address, tls=ops) as c:
            assert c.whoami().principal == "ops"
            c.stage(adapters["team-a"], "team-a/by-ops")
            with pytest.raises(PermissionDenied, match="lacks 'publish' on 'team-b/'"):
                c.stage(adapters["team-b"], "team-b/by-ops")
            assert [a.adapter_id for a in c.list().staged] == ["team-a/by-ops"]
        with NodeClient(mtls.address, tls=stranger) as c:  # signed by the CA, but no principal of the policy
            with pytest.raises(Unauthenticated):
                c.whoami()


# ---------------------------------------------------------------- reloads (they change the node's policy: last)


def audit_lines(node: LocalNode) -> list[str]:
    return [line for line in node.log_path.read_text(errors="replace").splitlines() if "fabric.audit" in line]


def wait_for_reload(node: LocalNode, before: int, timeout: float = 30.0) -> str:
    """The next policy-reload audit line (the node writes one per reload, whatever its outcome)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reloads = [line for line in audit_lines(node) if "action=policy-reload" in line]
        if len(reloads) > before:
            return reloads[before]
        time.sleep(0.1)
    raise AssertionError("the node logged no policy reload")


def reload_count(node: LocalNode) -> int:
    return sum("action=policy-reload" in line for line in audit_lines(node))


def test_sighup_applies_a_new_policy_without_a_restart(node, files):
    with client(node, "team-b") as c:
        with pytest.raises(PermissionDenied):
            c.manifest("team-a/x")
    wider = {**GRANTS, "team-b": {**GRANTS["team-b"], "read": ["team-b/", "team-a/"]}}
    before = reload_count(node)
    files["policy"].write_text(policy_text(wider))
    os.kill(node.pid, signal.SIGHUP)
    assert "outcome=ok" in wait_for_reload(node, before)
    with client(node, "team-b") as c:
        assert c.manifest("team-a/x").adapter_id == "team-a/x"
    pid = node.pid
    assert node.process.poll() is None and node.pid == pid


def test_a_changed_file_is_picked_up_without_a_signal(node, files):
    before = reload_count(node)
    files["policy"].write_text(policy_text() + "\n# narrowed again\n")
    assert "outcome=ok" in wait_for_reload(node, before)
    with client(node, "team-b") as c:
        with pytest.raises(PermissionDenied):
            c.manifest("team-a/x")


def test_a_broken_file_on_reload_keeps_the_previous_policy_and_says_why_in_one_line(node, files):
    before = reload_count(node)
    files["policy"].write_text(policy_text().replace('"read"', '"raed"', 1))
    os.kill(node.pid, signal.SIGHUP)
    line = wait_for_reload(node, before)
    assert "outcome=refused" in line and "kept the previous policy" in line and "unknown verb 'raed'" in line
    with client(node, "team-a") as c:
        assert c.manifest("team-a/x").adapter_id == "team-a/x"  # the previous policy still holds
    with client(node, "team-b") as c:
        with pytest.raises(PermissionDenied):
            c.manifest("team-a/x")
    before = reload_count(node)
    files["policy"].write_text(policy_text())
    os.kill(node.pid, signal.SIGHUP)
    assert "outcome=ok" in wait_for_reload(node, before)


def test_every_change_and_refusal_is_audited_and_no_token_is_logged(node):
    lines = audit_lines(node)
    text = "\n".join(lines)
    for action in ("action=stage", "action=unstage", "action=keep", "action=promote", "action=unpin", "action=set-active", "action=policy-reload"):
        assert action in text, action
    assert any("outcome=refused" in line and "principal=team-b" in line for line in lines)
    assert any("action=stage" in line and "principal=cluster-token" in line and "adapter=team-a/x" in line and "digest=" in line for line in lines)
    everything = node.log_path.read_text(errors="replace")
    for token in TOKENS.values():
        assert token not in everything
    assert all(len(line) < 2000 for line in lines)


def test_a_broken_policy_file_stops_the_node_at_start_with_one_line(tmp_path):
    broken = tmp_path / "policy.toml"
    broken.write_text('[[principal]]\nname = "x"\ntoken_sha256 = "my-plain-token"\ngrants = [{ verbs = ["read"], prefixes = ["a/"] }]\n')
    out = subprocess.run(
        [sys.executable, "-m", "adapter_fabric.node.main", "--policy", str(broken), "--store", str(tmp_path / "store"), "--model", "none", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("fabric-node: --policy ") and "64 lowercase hex" in lines[0] and str(broken) in lines[0]
    assert not (tmp_path / "store").exists()  # refused before the store was touched
