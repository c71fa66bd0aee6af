"""The access policy alone: strict parsing with one line naming the problem, verbs on prefixes, id tricks."""

from __future__ import annotations

import pytest

from adapter_fabric.access.policy import CLUSTER, VERBS, canonical_id, parse_policy, token_sha256
from adapter_fabric.errors import InvalidAdapterId, InvalidPolicy, PermissionDenied

TOKEN_A, TOKEN_B = "token-of-team-a", "token-of-team-b"
POLICY = f"""
[[principal]]
name = "team-a"
token_sha256 = "{token_sha256(TOKEN_A)}"
grants = [{{ verbs = ["read", "pull", "publish", "unstage"], prefixes = ["team-a/"] }},
          {{ verbs = ["read"], prefixes = ["shared/base/"] }}]

[[principal]]
name = "team-b"
token_sha256 = "{token_sha256(TOKEN_B)}"
grants = [{{ verbs = ["read", "pull", "publish"], prefixes = ["team-b/"] }}]

[[principal]]
name = "node-2"
san = "node-2.fabric.internal"
grants = [{{ verbs = ["read", "pull"], prefixes = ["*"] }}]
"""


@pytest.fixture
def policy():
    return parse_policy(POLICY)


def test_a_token_finds_its_principal_and_an_unknown_token_none(policy):
    assert policy.by_token(TOKEN_A).name == "team-a"
    assert policy.by_token(TOKEN_B).name == "team-b"
    assert policy.by_token("guess") is None
    assert policy.by_san(["other.example", "NODE-2.fabric.internal"]).name == "node-2"
    assert policy.by_san(["node-3.fabric.internal"]) is None


def test_the_policy_holds_hashes_never_tokens(policy):
    assert TOKEN_A not in repr(policy)
    assert TOKEN_B not in repr(policy)


@pytest.mark.parametrize(
    ("who", "verb", "adapter_id", "allowed"),
    [
        ("team-a", "publish", "team-a/support-v3", True),
        ("team-a", "publish", "team-b/support-v3", False),
        ("team-a", "read", "shared/base/x", True),
        ("team-a", "publish", "shared/base/x", False),
        ("team-a", "operate", "team-a/x", False),
        ("team-b", "unstage", "team-b/x", False),
        ("node-2", "pull", "team-a/x", True),
        ("node-2", "pull", "team-b/deep/x", True),
        ("node-2", "publish", "team-a/x", False),
        ("node-2", "unstage", "team-b/x", False),
    ],
)
def test_verbs_on_prefixes(policy, who, verb, adapter_id, allowed):
    principal = next(p for p in policy.principals if p.name == who)
    assert principal.allows(verb, adapter_id) is allowed


@pytest.mark.parametrize(
    "trick",
    [
        "team-a/../team-b/x",  # a dot-dot segment
        "team-a/%2F../team-b/x",  # percent-encoding
        "team-a%2Fteam-b/x",
        "team\u2010a/x",  # a Unicode hyphen that looks like '-'
        "te\u0430m-a/x",  # a Cyrillic 'a'
        "team-a/./x",
        "/team-a/x",
        "team-a//x",
        "team-a/x\x00",
    ],
)
def test_id_tricks_never_match_a_prefix(policy, trick):
    team_a = policy.by_token(TOKEN_A)
    assert not team_a.allows("read", trick)
    with pytest.raises(InvalidAdapterId):
        canonical_id(trick)


def test_trailing_dots_and_longer_segments_do_not_cross_a_prefix(policy):
    team_a = policy.by_token(TOKEN_A)
    for near in ("team-a./x", "team-a../x", "team-ab/x", "team-a", "team/a/x"):
        assert not team_a.allows("read", near), near


def test_case_is_one_name_both_ways(policy):
    team_a, team_b = policy.by_token(TOKEN_A), policy.by_token(TOKEN_B)
    assert team_a.allows("publish", "TEAM-A/x")
    assert not team_b.allows("publish", "Team-A/x")  # team-b cannot squat a case variant of team-a's names


def test_a_refusal_names_verb_and_prefix_and_does_not_depend_on_existence(policy):
    team_b = policy.by_token(TOKEN_B)
    with pytest.raises(PermissionDenied) as one:
        team_b.check("pull", "team-a/exists")
    with pytest.raises(PermissionDenied) as other:
        team_b.check("pull", "team-a/never-staged")
    assert str(one.value) == str(other.value) == "principal 'team-b' lacks 'pull' on 'team-a/'"


def test_the_cluster_token_may_do_everything():
    for verb in VERBS:
        assert CLUSTER.allows(verb, "any/team/x")
        assert CLUSTER.may_anywhere(verb)
    assert CLUSTER.describe() == ["admin on *"]


def test_may_anywhere_for_calls_without_an_id(policy):
    node = policy.by_san(["node-2.fabric.internal"])
    assert node.may_anywhere("read") and not node.may_anywhere("publish")


def _one(principal: str) -> str:
    return f"[[principal]]\n{principal}\n"


GRANT = 'grants = [{ verbs = ["read"], prefixes = ["team-a/"] }]'
SHA = token_sha256("x")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[[principal]\n", "not valid TOML"),
        ("", "needs 1 to"),
        ("admins = 1\n" + _one(f'name = "a"\nsan = "a"\n{GRANT}'), "unknown top-level key 'admins'"),
        (_one(f'name = "a"\nsan = "a"\ntoken = "plain"\n{GRANT}'), "unknown key 'token'"),
        (_one(f'san = "a"\n{GRANT}'), "needs a name"),
        (_one(f'name = "a b"\nsan = "a"\n{GRANT}'), "needs a name"),
        (_one(f'name = "a"\n{GRANT}'), "exactly one of token_sha256"),
        (_one(f'name = "a"\nsan = "a"\ntoken_sha256 = "{SHA}"\n{GRANT}'), "exactly one of token_sha256"),
        (_one(f'name = "a"\ntoken_sha256 = "my-secret-token"\n{GRANT}'), "64 lowercase hex"),
        (_one('name = "a"\nsan = "a"\n'), "'grants' must be a list"),
        (_one('name = "a"\nsan = "a"\ngrants = [{ verbs = ["pubish"], prefixes = ["team-a/"] }]'), "unknown verb 'pubish'"),
        (_one('name = "a"\nsan = "a"\ngrants = [{ verbs = ["read"], prefixes = ["team-a"] }]'), "must be '*' or end with '/'"),
        (_one('name = "a"\nsan = "a"\ngrants = [{ verbs = ["read"], prefixes = ["team-a/../"] }]'), "not an id's leading segments"),
        (_one('name = "a"\nsan = "a"\ngrants = [{ verbs = ["read"] }]'), "exactly the keys verbs and prefixes"),
        (_one(f'name = "a"\nsan = "a"\n{GRANT}') + _one(f'name = "a"\nsan = "b"\n{GRANT}'), "repeats another principal's name"),
        (_one(f'name = "a"\ntoken_sha256 = "{SHA}"\n{GRANT}') + _one(f'name = "b"\ntoken_sha256 = "{SHA}"\n{GRANT}'), "'b': repeats another principal's token_sha256"),
    ],
)
def test_a_broken_policy_is_refused_in_one_line_naming_the_problem(text, names):
    with pytest.raises(InvalidPolicy) as caught:
        parse_policy(text)
    message = str(caught.value)
    assert names in message
    assert "\n" not in message
    assert SHA not in message  # a token's hash is never echoed


def test_a_compiled_matcher_answers_as_allows_over_valid_ids(policy):
    """``matcher`` (what a scoped caller's listing and StoreStatus filter every id with) is ``allows`` compiled: the same
    answer for each principal, verb and valid id, a node calling on behalf of another (the intersection) included."""
    from adapter_fabric.access.policy import CLUSTER, on_behalf

    ids = [
        "team-a/x", "TEAM-A/x", "Team-A/deep/er", "team-a./x", "team-ab/x", "team-a", "team/a/x", "team-b/y", "Team-B/y",
        "shared/base/m", "Shared/Base/M", "shared/other", "shared/base", "other/z", "x@v1", "team-a/x@rev-2",
    ]  # fmt: skip
    team_a, team_b, node = policy.by_token(TOKEN_A), policy.by_token(TOKEN_B), policy.by_san(["node-2.fabric.internal"])
    principals = [team_a, team_b, node, CLUSTER, on_behalf(node, team_a), on_behalf(team_b, team_a), on_behalf(team_a, node)]
    for who in principals:
        for verb in VERBS:
            matches = who.matcher(verb)
            assert [i for i in ids if matches(i)] == [i for i in ids if who.allows(verb, i)], (who.name, verb)
    assert [i for i in ids if team_a.matcher("read")(i)] == ["team-a/x", "TEAM-A/x", "Team-A/deep/er", "shared/base/m", "Shared/Base/M", "team-a/x@rev-2"]
