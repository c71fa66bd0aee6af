"""Who pulled an adapter from this node lately: a seeder tells each swarm puller how many others there are.

Why a puller needs to know is ``pace``'s docstring (a lone pull beside idle members, against a rollout's start). This
node counts the pullers that asked for a digest in the last ``LATELY_S`` seconds, told apart by the port they serve on
(every swarm request carries it: ``fetch_metadata.holder``), and says how many others there were in its pick
(``fetch_metadata.picked``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

#: a puller that asked within this many seconds still counts: a rollout's pullers ask the seeder every few requests
LATELY_S = 2.0
#: digests remembered, the most recently asked for kept
DIGESTS_KEPT = 64
#: pullers remembered per digest, the most recent kept (a count past it says "many" all the same)
PULLERS_KEPT = 256
#: stands for every request that named no puller (an older node, or one not serving): one more other for the named
UNNAMED = ("", 0)


class RecentPullers:
    """Per digest, the pullers seen in the last LATELY_S seconds; bounded in digests and pullers. One thread (the loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: OrderedDict[str, OrderedDict[Hashable, float]] = OrderedDict()

    def others(self, digest: str, puller: Hashable | None) -> int | None:
        """Record a request of ``puller`` (None: unnamed) for ``digest``; how many other pullers asked lately (None to an
        unnamed one: it could not tell itself from the others)."""
        now = self._clock()
        seen = self._seen.pop(digest, None) or OrderedDict()
        self._seen[digest] = seen  # most recently asked for last
        while len(self._seen) > DIGESTS_KEPT:
            self._seen.popitem(last=False)
        while seen and next(iter(seen.values())) < now - LATELY_S:  # oldest first: stop at the first recent one
            seen.popitem(last=False)
        key = UNNAMED if puller is None else puller
        seen.pop(key, None)
        others = len(seen)
        seen[key] = now
        while len(seen) > PULLERS_KEPT:
            seen.popitem(last=False)
        return None if puller is None else others
