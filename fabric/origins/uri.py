"""``--origin URI``: which origin kind a URI names, and the options after its ``#``.

    s3://bucket/prefix            S3 or any S3-compatible endpoint (adapter_fabric.origins.s3_origin)
    hf://  or  hf://ORG           the Hugging Face Hub (adapter_fabric.origins.hub_origin)
    https://host/prefix, http://  a web server (adapter_fabric.origins.http_origin)
    file:///path                  a directory (adapter_fabric.origins.directory_origin)

Options, comma-separated after ``#`` (never sent to the origin): ``trusted`` (the operator vouches for this
origin's content: a node with --trusted-signers accepts it unsigned) and ``timeout=DURATION`` (one fetch's
bound, overriding --origin-timeout). ``https://host/adapters#trusted,timeout=2m``.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.origins.base import DEFAULT_TIMEOUT_S, DEFAULT_TRIES, Origin
from adapter_fabric.units import parse_duration

SCHEMES = ("s3://", "hf://", "https://", "http://", "file://")
MAX_URI_CHARS = 2048
#: origins one node tries at most (each miss may ask them all, in order)
MAX_ORIGINS = 16


@dataclass(frozen=True)
class OriginSpec:
    """A parsed --origin value: the URI (without options) and its options."""

    uri: str
    trusted: bool = False
    timeout: float | None = None

    @property
    def kind(self) -> str:
        return self.uri.split(":", 1)[0].replace("https", "http")


def parse_origin(text: str) -> OriginSpec:
    """``text`` checked (a known scheme, bounded, known options); ``InvalidArgument`` naming the problem."""
    if len(text) > MAX_URI_CHARS:
        raise InvalidArgument(f"origin URI is {len(text)} characters long; at most {MAX_URI_CHARS}")
    uri, _, options = text.strip().partition("#")
    if not uri.startswith(SCHEMES):
        raise InvalidArgument(f"origin {_shown(uri)} is not one of {', '.join(s + '...' for s in SCHEMES)}")
    if any(c.isspace() or ord(c) < 32 for c in uri):
        raise InvalidArgument(f"origin {_shown(uri)} holds whitespace or control characters")
    trusted, timeout = False, None
    for option in filter(None, (o.strip() for o in options.split(","))):
        key, _, value = option.partition("=")
        if key == "trusted" and not value:
            trusted = True
        elif key == "timeout" and value:
            try:
                timeout = parse_duration(value, allow_zero=False)
            except ValueError as exc:
                raise InvalidArgument(f"origin {_shown(uri)}: timeout={value[:40]!r}: {exc}") from None
        else:
            raise InvalidArgument(f"origin {_shown(uri)}: unknown option {option[:40]!r} after '#' (trusted, timeout=DURATION)")
    if uri.startswith(("http://", "https://")) and not uri.split("://", 1)[1].split("/", 1)[0]:
        raise InvalidArgument(f"origin {_shown(uri)} names no host")
    return OriginSpec(uri, trusted, timeout)


def origin_list(text: str) -> tuple[str, ...]:
    """Space-separated origin URIs (a URI's options may hold commas), each checked, at most MAX_ORIGINS; ValueError naming the problem."""
    uris = tuple(text.split())
    for uri in uris:
        try:
            parse_origin(uri)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
    if len(uris) > MAX_ORIGINS:
        raise ValueError(f"at most {MAX_ORIGINS} origins, got {len(uris)}")
    return uris


def _shown(uri: str) -> str:
    """A URI as an error shows it: bounded, and without a password."""
    from adapter_fabric.origins.http_origin import strip_credentials

    return repr(strip_credentials(uri)[:200] if uri.startswith(("http://", "https://")) else uri[:200])


def open_origin(spec: OriginSpec, default_timeout: float = DEFAULT_TIMEOUT_S, tries: int = DEFAULT_TRIES) -> Origin:
    """The origin client ``spec`` names (its library imported now: a missing one is refused at start, by name)."""
    timeout = spec.timeout or default_timeout
    if spec.uri.startswith("s3://"):
        from adapter_fabric.origins.s3_origin import S3Origin

        return S3Origin(spec.uri, trusted=spec.trusted, timeout=timeout, tries=tries)
    if spec.uri.startswith("hf://"):
        from adapter_fabric.origins.hub_origin import HubOrigin

        return HubOrigin(spec.uri, trusted=spec.trusted, timeout=timeout, tries=tries)
    if spec.uri.startswith("file://"):
        from adapter_fabric.origins.directory_origin import DirectoryOrigin

        return DirectoryOrigin(spec.uri, trusted=spec.trusted, timeout=timeout)
    from adapter_fabric.origins.http_origin import HttpOrigin

    return HttpOrigin(spec.uri, trusted=spec.trusted, timeout=timeout, tries=tries)
