"""The node's flags (``adapter_fabric.node.settings``): one table is the one place each default is written."""

from __future__ import annotations

import dataclasses

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
