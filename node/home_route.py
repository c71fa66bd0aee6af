"""A miss through the fleet (docs/ARCHITECTURE.md, "Homes"): the holders an id's homes name, else its first live home
fetches it from the origin and this node pulls it from there, so a fleet downloads each origin object once.

``HomeRoute`` is what ``node.origin_fetch.OriginFetches`` asks before its own origins, on a node with placement:

1. ``Homes.find``: the id's homes in rank order, the holders they name (a fan-out only when a home could not be asked,
   or the node has no origin to fall back on); a pull from the best of them.
2. None holds it and the node has origins: the id's first live home (the same member on every node: rendezvous order,
   less the members marked down) is asked to bring it (a stage-only Promote naming no peer: it resolves the miss
   itself, and concurrent asks join its one origin fetch), then this node pulls from it. A first home that does not
   answer is marked down and the next live home is asked.
3. This node is the first live home, or no home could bring it: None, and the caller fetches from its origins (then
   publishes to the other homes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from adapter_fabric.access.policy import Principal
from adapter_fabric.errors import AdapterNotFound, FabricError, PeerUnavailable, Untrusted
from adapter_fabric.node.homes import Homes
from adapter_fabric.node.signed import SignedAdapters
from adapter_fabric.store.manifest import Manifest
from adapter_fabric.transport.placement import first_live
from adapter_fabric.transport.pull import PullStats

log = logging.getLogger("fabric.node")


class HomeRoute:
    """See the module docstring. ``io`` runs a blocking call on an I/O thread (``NodeContext.io``)."""

    def __init__(self, homes: Homes, signed: SignedAdapters, io: Callable, has_origins: bool) -> None:
        """``has_origins``: the node has --origin (then a miss no home names goes to the first live home, and a digest a
        home says came from an origin is origin-backed here too: never a last copy)."""
        self.has_origins = has_origins
        self.homes = homes
        self.signed = signed
        self.io = io

    async def __call__(
        self, adapter_id: str, admit: Callable[[Manifest], None] | None, who: Principal, authority: dict
    ) -> tuple[Manifest, PullStats] | None:
        """``who`` and ``authority`` (``node.authority.pull_authority``): the caller this miss is resolved for; every call to a
        member (the lookups, the first home's fetch, the pull) names it, so each gives only what that caller may pull."""
        homes = self.homes
        channels = self.signed.puller.channels.for_caller(authority.get("behalf", ""))
        found = await self.io(homes.find, adapter_id, channels, not self.has_origins)
        if found.sources:
            try:
                return await self._pull(found.sources, adapter_id, admit, found.complete, found.origin, who, authority)
            except (AdapterNotFound, PeerUnavailable, Untrusted) as exc:
                if not self.has_origins:
                    raise
                log.info("%s: the holders its homes named did not give it (%s); asking its first home", adapter_id, str(exc)[:200])
        if not self.has_origins:
            named = ", ".join(homes.homes_of(adapter_id)) or "none: this node knows no members"
            raise AdapterNotFound(
                f"adapter {adapter_id!r} is not staged here, and neither its homes ({named}) nor {found.fanned_out} other members "
                f"asked hold it" + (f" ({len(found.unreachable)} did not answer)" if found.unreachable else "") + "; the node has no --origin"
            )
        for _ in range(homes.k):
            first = first_live(homes.homes_of(adapter_id), homes.view.down())
            if first is None or first == homes.view.me:
                return None  # this node is the first live home: it fetches from its origins
            try:
                await self.io(homes.fetch_at, first, adapter_id, channels)
            except FabricError as exc:
                log.warning("first home %s did not bring %s from its origin (%s)", first, adapter_id, str(exc)[:200])
                if not homes.view.is_down(first):
                    return None  # it answered with a refusal: this node tries its origins itself
                continue  # marked down: the next live home is the first now
            return await self._pull([first], adapter_id, admit, {first}, f"an origin, through its first home {first}", who, authority)
        return None

    async def _pull(
        self, sources: list[str], adapter_id: str, admit: Callable[[Manifest], None] | None, complete: set[str], origin: str,
        who: Principal, authority: dict,
    ) -> tuple[Manifest, PullStats]:
        """``origin``: where the digest came from, when a home said so (or the first home just fetched it): marked backed."""
        manifest, stats = await self.io(self.signed.pull, sources, adapter_id, admit, None, who, complete=complete, **authority)
        if origin and self.has_origins:
            self.homes.mark_backed(manifest.digest, origin)
        if stats.referred:
            self.homes.announce(adapter_id, manifest.digest)
        return manifest, stats
