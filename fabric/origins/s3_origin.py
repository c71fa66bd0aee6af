"""``s3://bucket/prefix``: an adapter is ``<prefix>/<id>/adapter_config.json`` and ``<prefix>/<id>/adapter_model.safetensors``.

Through boto3, chosen over obstore and s3fs: it reads every standard AWS setting the way the AWS CLI does
(``AWS_ENDPOINT_URL`` and ``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE`` and the shared config and credentials
files, SSO, web identity in Kubernetes, instance metadata), which obstore does not (no profiles without a
boto3 credential provider) and s3fs reaches only through aiobotocore; and an adapter is two objects of a
few MB to a few hundred MB, read in one stream each, where obstore's parallel range reads would not help
(docs/BENCHMARKS.md has the miss-to-ready time). It is synchronous, as the node's origin fetches are (they
run on I/O threads). Retries are botocore's own ("standard" mode: backoff with jitter on throttling, 5xx
and connection errors); any S3-compatible server works (MinIO, Ceph, R2, moto).

Revision: the weights' VersionId on a versioned bucket, else its ETag. Revalidation is a conditional
HEAD per object (``If-None-Match``: 304 means unchanged, no bytes read). A pin (``ID@REVISION``) is a
VersionId, or an ETag sent as ``If-Match`` (412: the bucket no longer has it, refused by name).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from adapter_fabric.errors import AdapterNotFound, InvalidArgument, OriginUnavailable
from adapter_fabric.origins.base import ADAPTER_FILES, DEFAULT_TIMEOUT_S, DEFAULT_TRIES, FetchLimits, Revision
from adapter_fabric.origins.bounded import copy_to_file

#: an S3 ETag: 32 hex characters, "-N" after for a multipart upload (anything else a pin names is a VersionId)
_ETAG = re.compile(r"[0-9a-f]{32}(-[0-9]+)?")
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 30.0
_MISSING = {"NoSuchKey", "404", "NotFound"}
_NOT_MODIFIED = {"304", "NotModified"}
_PRECONDITION = {"412", "PreconditionFailed"}


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (bucket, "a/b")."""
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise InvalidArgument(f"origin {uri[:200]!r}: {bucket[:80]!r} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
    return bucket, prefix.strip("/")


class S3Origin:
    """Adapters under one S3 bucket and prefix, on AWS or any S3-compatible endpoint."""

    kind = "s3"

    def __init__(self, uri: str, *, trusted: bool = False, timeout: float = DEFAULT_TIMEOUT_S, tries: int = DEFAULT_TRIES, label: str = "") -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise InvalidArgument(f"origin {uri[:200]!r} needs boto3: pip install 'adapter-fabric[s3]'") from None
        self.bucket, self.prefix = split_s3(uri)
        self.label = label or uri
        self.trusted = trusted
        self.timeout = timeout
        # botocore gives each attempt these waits: the tries share the fetch's timeout, so its retries of a silent
        # endpoint end near the deadline, and none starts after it (_refuse_past_deadline)
        share = timeout / tries
        config = Config(
            connect_timeout=min(CONNECT_TIMEOUT_S, share), read_timeout=min(READ_TIMEOUT_S, share),
            retries={"mode": "standard", "total_max_attempts": tries}, user_agent_extra="adapter-fabric",
        )  # fmt: skip
        # The session reads the environment and the shared files (profile, region, endpoint, credentials).
        self.client = boto3.session.Session().client("s3", config=config)
        self._fetching = threading.local()  # the (limits, what) of the fetch this thread runs
        self.client.meta.events.register("before-send.s3", self._refuse_past_deadline)

    def _refuse_past_deadline(self, **_: object) -> None:
        """Before each attempt botocore sends: none once the fetch's deadline has passed."""
        fetching = getattr(self._fetching, "current", None)
        if fetching is not None and fetching[0].expired():
            raise fetching[0].too_slow(fetching[1])

    def key_of(self, adapter_id: str, name: str) -> str:
        return f"{self.prefix}/{adapter_id}/{name}" if self.prefix else f"{adapter_id}/{name}"

    def fetch(self, adapter_id: str, pin: str, known: Revision | None, into: Path, limits: FetchLimits) -> Revision | None:
        what = f"origin {self.label}: {adapter_id}"
        self._fetching.current = (limits, what)
        try:
            return self._fetch(adapter_id, pin, known, into, limits, what)
        finally:
            self._fetching.current = None

    def _fetch(self, adapter_id: str, pin: str, known: Revision | None, into: Path, limits: FetchLimits, what: str) -> Revision | None:
        if known is not None and not pin and known.validators:
            if not any(self._changed(self.key_of(adapter_id, n), known.validator(n), what, limits) for n in ADAPTER_FILES):
                return None
        validators: dict[str, str] = {}
        version = ""
        for name in ADAPTER_FILES:
            args = {}
            if pin and name != ADAPTER_FILES[0]:
                args = {"IfMatch": f'"{pin}"'} if _ETAG.fullmatch(pin) else {"VersionId": pin}
            etag, version = self._get(self.key_of(adapter_id, name), name, into, limits, what, args)
            validators[name] = etag
        weights_etag = validators[ADAPTER_FILES[1]].strip('"')
        return Revision(self.label, version if version and version != "null" else weights_etag, tuple(validators.items()))

    def _changed(self, key: str, etag: str, what: str, limits: FetchLimits) -> bool:
        """Whether ``key``'s ETag is other than ``etag`` (a conditional HEAD; 304 = the same)."""
        if not etag:
            return True
        try:
            self.client.head_object(Bucket=self.bucket, Key=key, IfNoneMatch=etag)
        except Exception as exc:  # noqa: BLE001 (botocore's ClientError and connection errors, sorted by _failure)
            if _code(exc) in _NOT_MODIFIED:
                return False
            raise self._failure(exc, key, what, limits) from None
        return True

    def _get(self, key: str, name: str, into: Path, limits: FetchLimits, what: str, args: dict) -> tuple[str, str]:
        """GetObject ``key`` into ``into/name``: (its ETag, its VersionId or "")."""
        try:
            limits.left(what)
            reply = self.client.get_object(Bucket=self.bucket, Key=key, **args)
        except Exception as exc:  # noqa: BLE001
            raise self._failure(exc, key, what, limits, pinned="VersionId" in args or "IfMatch" in args) from None
        body = reply["Body"]
        try:
            limits.check_size(name, int(reply.get("ContentLength") or 0), what)
            # The urllib3 response under botocore's StreamingBody: read1 returns what has arrived (a drip is seen at
            # the deadline, not after a whole block) and shutdown interrupts a blocked read from the watchdog.
            raw = getattr(body, "_raw_stream", None)
            read = getattr(raw, "read1", body.read)
            close = getattr(raw, "shutdown", body.close)
            try:
                copy_to_file(read, close, into / name, name, limits, what)
            except OSError as exc:
                raise limits.unavailable(what, f"{what}: {name} was cut short: {' '.join(str(exc).split())[:200]}") from None
        finally:
            body.close()
        return str(reply.get("ETag", "")), str(reply.get("VersionId") or "")

    def _failure(self, exc: Exception, key: str, what: str, limits: FetchLimits, pinned: bool = False) -> Exception:
        if limits.expired():  # botocore's own timeout, or our refusal of an attempt past the deadline
            return limits.too_slow(what)
        code = _code(exc)
        if code in _MISSING:
            return AdapterNotFound(f"{what}: the origin has no object {key[:200]!r}")
        if code == "NoSuchVersion" or (pinned and code in _PRECONDITION | {"InvalidArgument"}):
            return AdapterNotFound(f"{what}: the origin no longer has the pinned revision of {key[:200]!r} ({code})")
        if code == "NoSuchBucket":
            return OriginUnavailable(f"{what}: bucket {self.bucket!r} does not exist at the endpoint")
        if code in {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}:
            return OriginUnavailable(f"{what}: the origin refused access ({code}); check the AWS credentials the node is given")
        name = type(exc).__name__
        if name == "NoCredentialsError":
            return OriginUnavailable(f"{what}: no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the shared files)")
        text = " ".join(str(exc).split())[:200]
        return OriginUnavailable(f"{what}: the origin did not answer ({name}: {text})" if not code else f"{what}: the origin answered {code}")


def _code(exc: Exception) -> str:
    """botocore's error code of a ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""
