"""Adapter ids and digests: the documented alphabet and rules, and messages that name the id and the rule."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapter_fabric.errors import InvalidAdapterId, InvalidArgument
from adapter_fabric.store.ids import MAX_ID_LENGTH, validate_adapter_id, validate_digest

ALPHABET = "abcXYZ019._-/"


@pytest.mark.parametrize("value", ["a", "team-a/support-v3", "A.b_c-9", "x" * MAX_ID_LENGTH, "..a", "a/.b/c..", "a/b/c/d"])
def test_valid_ids_are_returned_unchanged(value: str) -> None:
    assert validate_adapter_id(value) == value


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("", "empty"),
        ("x" * (MAX_ID_LENGTH + 1), "129 characters"),
        ("a b", "' '"),
        ("a\0b", "'\\x00'"),
        ("caf\u00e9", "'\u00e9'"),
        ("a%2Fb", "'%'"),
        ("/a", "starts or ends with '/'"),
        ("a/", "starts or ends with '/'"),
        ("a//b", "empty, '.' or '..' segment"),
        (".", "empty, '.' or '..' segment"),
        ("..", "empty, '.' or '..' segment"),
        ("a/../b", "empty, '.' or '..' segment"),
        ("a/./b", "empty, '.' or '..' segment"),
        ("a\n", "'\\n'"),
    ],
)
def test_invalid_ids_name_the_id_and_the_rule(value: str, rule: str) -> None:
    with pytest.raises(InvalidAdapterId) as caught:
        validate_adapter_id(value)
    message = str(caught.value)
    assert rule in message
    assert repr(value)[:40] in message


@pytest.mark.parametrize("value", [None, 12, b"abc", ["a"]])
def test_non_strings_are_refused_by_type(value: object) -> None:
    with pytest.raises(InvalidAdapterId, match=type(value).__name__):
        validate_adapter_id(value)


def test_a_huge_id_is_shown_truncated() -> None:
    with pytest.raises(InvalidAdapterId) as caught:
        validate_adapter_id("y" * 1_000_000)
    assert len(str(caught.value)) < 300
    assert "1000000 characters" in str(caught.value)


def _obeys_rules(value: str) -> bool:
    return (
        1 <= len(value) <= MAX_ID_LENGTH
        and re.fullmatch(r"[A-Za-z0-9._\-/]+(@[A-Za-z0-9._\-]+)?", value) is not None
        and all(seg not in ("", ".", "..") for seg in value.split("@")[0].split("/"))
        and not value.split("@")[0].endswith("/")
    )


@given(st.text(alphabet=ALPHABET + " %@\0\u00e9", max_size=140))
def test_validation_agrees_with_the_documented_rules(value: str) -> None:
    if _obeys_rules(value):
        assert validate_adapter_id(value) == value
    else:
        with pytest.raises(InvalidAdapterId):
            validate_adapter_id(value)


def test_digests_are_64_lowercase_hex() -> None:
    good = "0123456789abcdef" * 4
    assert validate_digest(good) == good
    for bad in (good.upper(), good[:-1], good + "0", "g" * 64, None, 5):
        with pytest.raises(InvalidArgument, match="64 lowercase hex"):
            validate_digest(bad)
    with pytest.raises(InvalidArgument, match="file sha256"):
        validate_digest("zz", "file sha256")


def test_a_pinned_revision_follows_one_at_in_the_last_segment() -> None:
    from adapter_fabric.store.ids import split_pin

    assert validate_adapter_id("team-a/support@3f2a9c") == "team-a/support@3f2a9c"
    assert split_pin("team-a/support@3f2a9c") == ("team-a/support", "3f2a9c")
    assert split_pin("team-a/support") == ("team-a/support", "")
    for bad in ("@rev", "team-a/@rev", "team-a@x/support", "a@b@c", "team-a/support@", "x/..@r"):
        with pytest.raises(InvalidAdapterId, match="'@'|segment"):
            validate_adapter_id(bad)
