"""Issue 29, item 7: SIGHUP to a node without --policy, and a storm of SIGHUPs to one with a 1,000-principal policy.

Real node processes; each reload writes one ``policy-reload`` audit line (``adapter_fabric.access.policy_file``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.errors import Unauthenticated
from adapter_fabric.harness.cluster import LocalNode
from tests.node.test_hostile_weak_spots import log_lines
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: a ListAdapters answers within this while the storm lasts (a bound on hanging: it takes milliseconds)
LIST_BOUND_S = 30.0


def big_policy(principals: int, last: str = "p-last", last_token: str = "token-last") -> str:
    """``principals`` principals with three grants each (~390 bytes a principal), and one more named ``last`` holding ``last_token``."""
    grant = '{{ verbs = ["{verb}"], prefixes = ["team-{i}/", "shared-{i}/"] }}'
    blocks = [
        f'[[principal]]\nname = "p-{i}"\ntoken_sha256 = "{token_sha256(f"token-{i}")}"\n'
        f'grants = [{", ".join(grant.format(verb=v, i=i) for v in ("read", "pull", "publish"))}]\n'
        for i in range(principals)
    ]
    blocks.append(f'[[principal]]\nname = "{last}"\ntoken_sha256 = "{token_sha256(last_token)}"\ngrants = [{{ verbs = ["read"], prefixes = ["x/"] }}]\n')
    return "\n".join(blocks)


def refused(node: LocalNode, token: str) -> bool:
    """Whether ``token`` names no principal of the policy in force."""
    with node.client(token=token) as client:
        try:
            client.list()
        except Unauthenticated:
            return True
    return False


def reloads(node: LocalNode) -> list[str]:
    return log_lines(node, "action=policy-reload")


def test_sighup_without_a_policy_is_logged_once_and_ignored(tmp_path) -> None:
    node = LocalNode(tmp_path / "n", model="none").start()
    try:
        for _ in range(3):
            node.process.send_signal(signal.SIGHUP)  # was: the node ended at once, undrained, nothing logged
        wait_for(lambda: log_lines(node, "SIGHUP ignored"), "the SIGHUP to be logged")
        with node.client() as client:
            assert client.health() == "SERVING"
        assert len(log_lines(node, "SIGHUP ignored")) == 1
    finally:
        assert node.stop() == 0


def test_a_storm_of_sighups_is_parsed_a_few_times_off_the_event_loop_and_the_latest_file_wins(tmp_path) -> None:
    policy, token = tmp_path / "policy.toml", tmp_path / "cluster.token"
    policy.write_text(big_policy(999))
    token.write_text("cluster-token-0d1e")
    node = LocalNode(tmp_path / "n", model="none", token_file=token, extra_args=["--policy", str(policy)]).start()
    try:
        listed: list[object] = []

        def list_during_the_storm() -> None:
            with node.client() as client:
                listed.append(client.list(timeout=LIST_BOUND_S))  # was: DEADLINE_EXCEEDED, the loop parsing for ~30 s

        lister = threading.Thread(target=list_during_the_storm)
        for number in range(1000):
            if number == 500:
                lister.start()
            if number == 900:
                policy.write_text(big_policy(999, last="p-newest", last_token="token-last-but-new"))  # mid-storm: this file must win
            os.kill(node.pid, signal.SIGHUP)
            time.sleep(0.002)  # paced, so each is delivered (the kernel merges a signal sent while one is pending)
        lister.join(LIST_BOUND_S + 10)
        assert listed, "ListAdapters did not answer during the storm"
        wait_for(lambda: refused(node, "token-last"), "the newest file in force (p-last gone)")  # the latest file wins
        settled = len(reloads(node))
        # one parse at a time, whatever the storm: about its length over a parse's (~2 s / ~50 ms); was one per signal
        assert settled <= 300, f"{settled} parses for 1,000 signals"
        assert not refused(node, "token-last-but-new")
    finally:
        node.stop()
