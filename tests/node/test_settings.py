"""The node's flags (``adapter_fabric.node.settings``): one table is the one place each default is written."""

from __future__ import annotations

import dataclasses

import pytest

from adapter_fabric.node.settings import FLAGS, NodeSettings, parse_settings


def test_every_flag_has_a_field_and_no_field_has_a_default_of_its_own() -> None:
    fields = {f.name: f for f in dataclasses.fields(NodeSettings)}
    flags = {flag.lstrip("-").replace("-", "_") for flag, *_ in FLAGS}
    assert flags == set(fields), f"flags without a field: {flags - set(fields)}; fields without a flag: {set(fields) - flags}"
    with_defaults = [name for name, f in fields.items() if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert not with_defaults, f"write these defaults in the flag table only: {with_defaults}"


def test_with_nothing_set_every_setting_is_its_flags_default() -> None:
    settings = parse_settings([], environ={})
    for flag, _, default, _, _ in FLAGS:
        assert getattr(settings, flag.lstrip("-").replace("-", "_")) == default, flag


def test_placement_is_on_by_default_with_three_homes() -> None:
    """Issue 32: --homes defaults to 3; 0 (the mesh) is an operator's explicit choice."""
    assert parse_settings([], environ={}).homes == 3
    assert parse_settings(["--homes", "0"], environ={}).homes == 0 and parse_settings([], environ={"FABRIC_HOMES": "0"}).homes == 0
    assert parse_settings(["--peers-k8s", "fabric-peers:grpc"], environ={}).peers_k8s == "fabric-peers:grpc"


def test_peers_from_endpoint_slices_without_placement_stop_the_node_by_name(capsys) -> None:
    """Issue 32: --peers-k8s feeds the fleet's members, which exist only with placement; with --homes 0 (the mesh) it
    would be ignored."""
    for args, environ in ((["--peers-k8s", "fabric-peers:grpc", "--homes", "0"], {}), ([], {"FABRIC_PEERS_K8S": "fabric-peers:grpc", "FABRIC_HOMES": "0"})):
        with pytest.raises(SystemExit) as stopped:
            parse_settings(args, environ=environ)
        assert stopped.value.code == 2 and "--peers-k8s needs --homes" in capsys.readouterr().err
    assert parse_settings([], environ={"FABRIC_PEERS_K8S": "fabric-peers:grpc", "FABRIC_HOMES": "3"}).homes == 3


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--homes", "65"], "from 0 (no placement) to 64"),
        (["--homes", "-1"], "from 0 (no placement) to 64"),
        (["--peers-k8s", "no-port"], "is not [NAMESPACE/]SERVICE:PORT"),
        (["--non-member-peers", "sometimes"], "expected one of refuse, anonymous"),
        (["--peer-token-file", "a\0b"], "expected a file path"),
        (["--origin-concurrency", "65"], "from 1 to 64"),
        (["--origin-concurrency", "0"], "from 1 to 64"),
        (["--base-model", ",".join(f"m{i}" for i in range(17))], "at most 16 names, got 17"),
        (["--base-model", "m" * 513], "at most 512 characters"),
        (["--origin", "ftp://x"], "is not one of s3://"),
        (["--upload-slots", "0"], "from 1 to 1024"),
        (["--upload-slots", "1025"], "from 1 to 1024"),
        (["--upload-slots", "9" * 400], "from 1 to 1024"),
    ],
)
def test_the_flags_this_step_added_refuse_values_past_their_bounds_by_name(args, refusal, capsys) -> None:
    """Every flag issues 28, 31, 32, 33 and 34 (``--upload-slots``) added has a bound; a value past it stops the node at
    start, naming the flag."""
    with pytest.raises(SystemExit) as stopped:
        parse_settings(args, environ={})
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument {args[0]}" in err and refusal in err, err
