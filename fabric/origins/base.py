"""What every origin kind shares: the revision it answers, the limits a fetch runs under, and the protocol.

An origin answers one question per adapter id: "what is ``<id>`` now?" A fetch
is conditional on what the node already holds (``known``): the origin answers
``None`` when that is still current (an HTTP 304, the same S3 ETag or version,
the same Hub commit, the same file stamps), else it writes the adapter's two
files into a fresh directory and says which revision they are. The node then
stages that directory like any other (``adapter_fabric.store.staging``): every
check a Stage makes, made once, in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from adapter_fabric.errors import LimitExceeded, OriginTooSlow, OriginUnavailable
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE

#: the files of an adapter at an origin, in the order they are fetched (the config first: it is small and refused early)
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
#: the largest adapter_config.json fetched (a PEFT config is a few KiB)
MAX_CONFIG_BYTES = 1 << 20
#: how long one fetch of one adapter (both files, retries included) may take by default
DEFAULT_TIMEOUT_S = 60.0
#: tries of one request when an origin answers 429/5xx or the connection fails (the first included)
DEFAULT_TRIES = 3
#: most redirects followed for one file (the Hub answers a download with one to its CDN)
MAX_REDIRECTS = 5


@dataclass(frozen=True)
class Revision:
    """Which content an origin had for an id: its name at the origin and what a conditional request sends.

    ``revision``: what ``ID@REVISION`` pins and listings show: the Hub's commit, the weights' S3 VersionId or
    ETag, the weights' HTTP ETag (or Last-Modified), a directory's file stamps.
    ``validators``: file name -> opaque validator (an ETag, a version, a stamp) each file had, for revalidation.
    """

    origin: str
    revision: str
    validators: tuple[tuple[str, str], ...] = ()

    def validator(self, name: str) -> str:
        return dict(self.validators).get(name, "")

    def to_dict(self) -> dict:
        return {"origin": self.origin, "revision": self.revision, "validators": [list(v) for v in self.validators]}

    @classmethod
    def from_dict(cls, data: dict) -> Revision:
        return cls(str(data["origin"]), str(data["revision"]), tuple((str(a), str(b)) for a, b in data.get("validators", ())))


@dataclass
class FetchLimits:
    """The bounds of one fetch: bytes per file (checked before a byte is written, where the origin declares a size,
    and while bytes arrive), and one deadline for the whole fetch (a slow drip ends at it, by name)."""

    max_adapter_bytes: int
    timeout: float = DEFAULT_TIMEOUT_S
    started: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def left(self, what: str) -> float:
        """Seconds left before the deadline; ``OriginTooSlow`` naming ``what`` once none are."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self.too_slow(what)
        return remaining

    def expired(self) -> bool:
        """Whether the deadline has passed: a client's own timeout or failure then is this deadline, by name."""
        return time.monotonic() >= self.deadline

    def unavailable(self, what: str, message: str) -> OriginUnavailable | OriginTooSlow:
        """A client's failure: ``OriginUnavailable(message)``, or ``OriginTooSlow`` once the deadline has passed."""
        return self.too_slow(what) if self.expired() else OriginUnavailable(message)

    def too_slow(self, what: str) -> OriginTooSlow:
        return OriginTooSlow(f"{what}: not done within the origin's timeout of {self.timeout:g}s (a slow or stalled origin); nothing was staged")

    def cap(self, name: str) -> int:
        """The most bytes file ``name`` may have."""
        return MAX_CONFIG_BYTES if name == CONFIG_FILE else self.max_adapter_bytes

    def check_size(self, name: str, size: int, what: str) -> None:
        """Refuse a declared ``size`` past the file's cap before any of its bytes are written."""
        if size > self.cap(name):
            raise LimitExceeded(f"{what}: {name} is {size} bytes, more than this node accepts ({self.cap(name)}); nothing was staged")


class Origin(Protocol):
    """One place adapters live (``adapter_fabric.origins.uri.open_origin`` builds one from its URI)."""

    #: the URI as shown in listings, logs and metrics: never a credential
    label: str
    #: s3, hf, http or file (a metrics label)
    kind: str
    #: the operator vouches for its content: a node with --trusted-signers accepts it unsigned
    trusted: bool
    #: seconds one fetch from it may take
    timeout: float

    def fetch(self, adapter_id: str, pin: str, known: Revision | None, into: Path, limits: FetchLimits) -> Revision | None:
        """``into``/adapter_config.json and ``into``/adapter_model.safetensors as the origin has them for ``adapter_id``
        (at revision ``pin`` when not ""), and which revision they are; None, writing nothing, when ``known`` is still
        what the origin has. ``AdapterNotFound`` when the origin has no such adapter, ``OriginUnavailable`` when it does
        not answer, ``LimitExceeded`` or ``OriginTooSlow`` past ``limits``. Blocking."""
        ...
