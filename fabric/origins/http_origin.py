"""``https://host/prefix`` and ``http://``: an adapter is ``<prefix>/<id>/adapter_config.json`` and
``<prefix>/<id>/adapter_model.safetensors`` on any web server (nginx, a bucket's website, an artifact store).

Through urllib3 (a maintained client the vLLM and Hub stacks already bring): TLS verified against the system's
CAs (``SSL_CERT_FILE`` honoured), ``Retry`` with exponential backoff on connection errors, 429 and 5xx
(``Retry-After`` respected), at most ``MAX_REDIRECTS`` redirects, the Authorization header dropped on a
redirect to another host. Revalidation is conditional: ``If-None-Match`` with each file's ETag (or
``If-Modified-Since`` with its Last-Modified); two 304s mean nothing changed and nothing is read. A pin
(``ID@ETAG``) is sent as ``If-Match``: a server that no longer has that version answers 412, refused by name.
Credentials in the URI (``https://user:password@host/``) go in a header, never into a label, log or error.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import urllib3
from urllib3.util import make_headers

from adapter_fabric.errors import AdapterNotFound, OriginUnavailable
from adapter_fabric.origins.base import ADAPTER_FILES, DEFAULT_TIMEOUT_S, DEFAULT_TRIES, MAX_REDIRECTS, FetchLimits, Revision
from adapter_fabric.origins.bounded import copy_to_file
from adapter_fabric.origins.deadline import DeadlineRetry, DeadlineTimeout

#: answers worth another try (after a backoff): the server is busy or failing for now
RETRY_STATUSES = (429, 500, 502, 503, 504)
#: the most seconds a connect, or one read, may take (the fetch's own deadline bounds the whole)
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 30.0


def retry_policy(tries: int) -> DeadlineRetry:
    """urllib3's Retry: ``tries`` attempts in all, backoff 0.2 s doubling, bounded redirects (no hand-written loop);
    each request holds it to its fetch's deadline."""
    return DeadlineRetry(
        total=tries - 1 + MAX_REDIRECTS, connect=tries - 1, read=tries - 1, status=tries - 1, other=0, redirect=MAX_REDIRECTS,
        backoff_factor=0.2, backoff_max=5.0, status_forcelist=RETRY_STATUSES, allowed_methods=frozenset({"GET", "HEAD"}),
        raise_on_redirect=True, raise_on_status=False, respect_retry_after_header=True,
    )  # fmt: skip


def strip_credentials(url: str) -> str:
    """``url`` without its user and password (the label shown everywhere)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def revision_of(etag: str, last_modified: str) -> str:
    """What an HTTP file's version is called: its ETag without quotes (weak or strong), else its Last-Modified."""
    if etag:
        return etag.removeprefix("W/").strip('"')
    return last_modified


class HttpOrigin:
    """Adapters under one http(s) URL prefix."""

    kind = "http"

    def __init__(self, url: str, *, trusted: bool = False, timeout: float = DEFAULT_TIMEOUT_S, tries: int = DEFAULT_TRIES, headers: dict[str, str] | None = None,
                 label: str = "") -> None:  # fmt: skip
        parts = urlsplit(url)
        self.base = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path.rstrip("/"), "", ""))
        self.label = label or strip_credentials(url)
        self.trusted = trusted
        self.timeout = timeout
        self.headers = dict(headers or {})
        if parts.username is not None:
            self.headers.update(make_headers(basic_auth=f"{parts.username}:{parts.password or ''}"))
        self.pool = urllib3.PoolManager(
            retries=retry_policy(tries),  # each request's timeouts: DeadlineTimeout, from its fetch's deadline
            cert_reqs="CERT_REQUIRED",
        )  # fmt: skip

    def _get(self, url: str, name: str, into: Path, limits: FetchLimits, what: str, condition: str = "", match: str = "") -> str | None:
        return get_file(self.pool, url, self.headers, name, into, limits, what, condition, match)

    def url_of(self, adapter_id: str, name: str) -> str:
        return f"{self.base}/{quote(adapter_id)}/{name}"

    def fetch(self, adapter_id: str, pin: str, known: Revision | None, into: Path, limits: FetchLimits) -> Revision | None:
        what = f"origin {self.label}: {adapter_id}"
        urls = {name: self.url_of(adapter_id, name) for name in ADAPTER_FILES}
        validators: dict[str, str | None]
        if known is not None and not pin and known.validators:
            # Revalidation: a conditional GET per file; any 200 brings its bytes already.
            got = {name: self._get(urls[name], name, into, limits, what, condition=known.validator(name)) for name in ADAPTER_FILES}
            if all(v is None for v in got.values()):
                return None
            validators = {name: v for name, v in got.items() if v is not None}
            for name in ADAPTER_FILES:
                if name not in validators:
                    validators[name] = self._get(urls[name], name, into, limits, what)  # unchanged, but needed beside the changed one
        else:
            validators = {name: self._get(urls[name], name, into, limits, what, match=pin if name != ADAPTER_FILES[0] else "") for name in ADAPTER_FILES}
        weights = validators[ADAPTER_FILES[1]]
        return Revision(self.label, revision_of(*weights.split("\n", 1)) if weights else "", tuple((n, v or "") for n, v in validators.items()))


def get_file(pool: urllib3.PoolManager, url: str, base_headers: dict[str, str], name: str, into: Path, limits: FetchLimits, what: str,
             condition: str = "", match: str = "") -> str | None:
    """GET ``url`` into ``into/name``; its validator ("ETag\\nLast-Modified"), or None on a 304 to ``condition``."""
    headers = dict(base_headers)
    if condition:
        etag, _, modified = condition.partition("\n")
        headers.update({"If-None-Match": etag} if etag else {"If-Modified-Since": modified} if modified else {})
    if match:
        headers["If-Match"] = f'"{match}"' if not match.startswith(('"', "W/")) else match
    retries = pool.connection_pool_kw["retries"].new(deadline=limits.deadline)  # the pool's retry_policy, held to this fetch
    try:
        reply = pool.request("GET", url, headers=headers, preload_content=False, retries=retries,
                             timeout=DeadlineTimeout(limits.deadline, connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S))  # fmt: skip
    except urllib3.exceptions.HTTPError as exc:
        reason = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
        raise limits.unavailable(what, f"{what}: {name} could not be fetched: {_reason(reason)}") from None
    try:
        status = reply.status
        if status == 304 and condition:
            return None
        if status in (404, 410):
            raise AdapterNotFound(f"{what}: the origin has no {name} (HTTP {status})")
        if status == 412 and match:
            raise AdapterNotFound(f"{what}: the origin no longer has revision {match[:80]!r} of {name} (HTTP 412)")
        if status in (401, 403):
            raise OriginUnavailable(f"{what}: the origin refused access to {name} (HTTP {status}); check the credentials it is given")
        if status != 200:
            raise OriginUnavailable(f"{what}: the origin answered HTTP {status} for {name}")
        declared = reply.headers.get("Content-Length")
        if declared is not None and declared.isdigit():
            limits.check_size(name, int(declared), what)
        try:
            copy_to_file(reply.read1, reply.shutdown, into / name, name, limits, what)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise limits.unavailable(what, f"{what}: {name} was cut short: {_reason(exc)}") from None
        return f"{reply.headers.get('ETag', '')}\n{reply.headers.get('Last-Modified', '')}"
    finally:
        reply.release_conn()


def _reason(exc: object) -> str:
    """A bounded one-line reason (urllib3's name the host and path, never the credentials: those travel in a header)."""
    text = " ".join(str(exc).split())
    return text[:300]
