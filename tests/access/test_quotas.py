"""Issue 21's per-tenant quotas as the policy file states them: parsed strictly, bounded, one line naming the problem."""

from __future__ import annotations

import pytest

from adapter_fabric.access.policy import MAX_ADAPTERS_LIMIT, MAX_QUOTAS, TenantQuota, parse_policy, token_sha256
from adapter_fabric.errors import InvalidPolicy

PRINCIPAL = f"""
[[principal]]
name = "ops"
token_sha256 = "{token_sha256('ops-token')}"
grants = [{{ verbs = ["admin"], prefixes = ["*"] }}]
"""


def quotas(text: str) -> tuple[TenantQuota, ...]:
    return parse_policy(PRINCIPAL + text).quotas


def test_quotas_parse_with_sizes_through_the_units_parser() -> None:
    parsed = quotas(
        """
[[quota]]
prefix = "team-a/"
max_bytes = "10GiB"
max_adapters = 500

[[quota]]
prefix = "Team-B/Sub/"
max_bytes = 4096

[[quota]]
prefix = "team-c/"
max_adapters = 1
"""
    )
    assert parsed == (
        TenantQuota("team-a/", 10 << 30, 500),
        TenantQuota("team-b/sub/", 4096, None),  # case-blind, like the policy's prefixes
        TenantQuota("team-c/", None, 1),
    )


def test_a_policy_without_quotas_has_none() -> None:
    assert parse_policy(PRINCIPAL).quotas == ()


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('[[quota]]\nprefix = "team-a/"\n', "needs max_bytes, max_adapters or both"),
        ('[[quota]]\nprefix = "team-a"\nmax_adapters = 1\n', "must be '*' or end with '/'"),
        ('[[quota]]\nprefix = "*"\nmax_adapters = 1\n', "--max-store-bytes"),
        ('[[quota]]\nprefix = "../x/"\nmax_adapters = 1\n', "is not an id's leading segments"),
        ('[[quota]]\nmax_adapters = 1\n', "must be '*' or end with '/'"),
        ('[[quota]]\nprefix = "team-a/"\nmax_bytes = "10 potatoes"\n', "max_bytes '10 potatoes': expected a size"),
        ('[[quota]]\nprefix = "team-a/"\nmax_bytes = "0"\n', "expected a size more than 0"),
        ('[[quota]]\nprefix = "team-a/"\nmax_bytes = "2PiB"\n', "at most 1 PiB"),
        ('[[quota]]\nprefix = "team-a/"\nmax_bytes = -5\n', "expected a size"),
        ('[[quota]]\nprefix = "team-a/"\nmax_bytes = true\n', "max_bytes must be a size"),
        ('[[quota]]\nprefix = "team-a/"\nmax_adapters = 0\n', f"from 1 to {MAX_ADAPTERS_LIMIT}"),
        ('[[quota]]\nprefix = "team-a/"\nmax_adapters = "500"\n', "max_adapters must be an integer"),
        (f'[[quota]]\nprefix = "team-a/"\nmax_adapters = {MAX_ADAPTERS_LIMIT + 1}\n', f"from 1 to {MAX_ADAPTERS_LIMIT}"),
        ('[[quota]]\nprefix = "team-a/"\nmax_adapters = 1\nmax_files = 3\n', "unknown key 'max_files'"),
        ('[[quota]]\nprefix = "team-a/"\nmax_adapters = 1\n[[quota]]\nprefix = "TEAM-A/"\nmax_adapters = 2\n', "repeats another quota's prefix"),
    ],
)
def test_a_broken_quota_is_refused_in_one_line_naming_the_problem(text: str, names: str) -> None:
    with pytest.raises(InvalidPolicy) as caught:
        quotas(text)
    message = str(caught.value)
    assert names in message and "\n" not in message, message


def test_quota_must_be_tables() -> None:
    with pytest.raises(InvalidPolicy, match=r"\[\[quota\]\] tables"):
        parse_policy('quota = "team-a/ 10GiB"\n' + PRINCIPAL)


def test_the_number_of_quotas_is_bounded() -> None:
    many = "".join(f'[[quota]]\nprefix = "t{i}/"\nmax_adapters = 1\n' for i in range(MAX_QUOTAS + 1))
    with pytest.raises(InvalidPolicy, match=f"0 to {MAX_QUOTAS}"):
        quotas(many)
    assert len(quotas("".join(f'[[quota]]\nprefix = "t{i}/"\nmax_adapters = 1\n' for i in range(3)))) == 3
