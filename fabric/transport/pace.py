"""How a pull from several peers asks: at a swarm's pace, or at a lone pull's, reached by a ramp.

A Promote naming a peer on a node that knows members pulls from several peers, at a swarm's pace: one short request
outstanding per peer, first chunks at random, so a rollout's first copies spread. When the named peer is the only
holder and nobody else pulls the adapter, that pace costs a round trip and a request's set-up per run of 1-3 chunks
(an 84 MB pull beside six empty members took 127 ms; naming the peer alone, 82 ms). The puller cannot tell the two
cases apart (a poll at a rollout's start finds nothing either); the seeder can, and says so in its pick
(``recent_pullers``). A pull told that nobody else pulls from a peer holding it whole goes at a lone pull's pace: two
streams (``swarm.ONE_SOURCE_WINDOW``), chunks in file order, and runs doubled at each such answer up to one source's
(``swarm.run_length``). The ramp is the guard: a rollout's first puller may hear "nobody" before the others ask, and
then takes one run of two chunks, not 32 MiB. An answer naming other pullers returns the pull to the swarm's pace.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter_fabric.transport import swarm

#: answers in a row that said nobody else pulls, counted at most (the run stops doubling long before)
MAX_ALONE = 32


@dataclass
class Pace:
    """Requests outstanding per peer (``window``) and chunks per request (``max_run``), a swarm's or a lone pull's."""

    swarm_window: int
    swarm_run: int
    lone_window: int
    lone_run: int
    alone: int = 0  # answers in a row that said nobody else pulls (0: the swarm's pace)

    @property
    def window(self) -> int:
        return self.lone_window if self.alone else self.swarm_window

    @property
    def max_run(self) -> int:
        return max(self.swarm_run, min(self.lone_run, 1 << self.alone)) if self.alone else self.swarm_run

    def heard(self, plan: swarm.SwarmPlan, others: int | None) -> None:
        """A peer's pick said ``others`` pull the adapter from it lately (None: it did not say, and the pace stays).
        Going lone puts ``plan``'s chunks in file order (long runs stay whole); going back spreads them again."""
        if others is None:
            return
        was_alone = bool(self.alone)
        self.alone = 0 if others else min(self.alone + 1, MAX_ALONE)
        if was_alone != bool(self.alone):
            swarm.order_chunks(plan, in_file_order=bool(self.alone))


def pace_for(chunk_size: int, chunk_count: int, peers: int, window: int | None, several: bool) -> Pace:
    """The pace of a pull from ``peers`` peers; ``window``: the operator's, for both paces; ``several``: the first peer
    takes several streams of ours at once (it refused none lately)."""
    swarm_window = swarm.window_for(peers, window, several=several)
    lone_window = swarm.window_for(1, window, several=several)
    return Pace(
        swarm_window, swarm.run_length(chunk_size, chunk_count, peers, swarm_window),
        lone_window, swarm.run_length(chunk_size, chunk_count, 1, lone_window),
    )  # fmt: skip
