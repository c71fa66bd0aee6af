"""``hf://`` (any repo) or ``hf://ORG`` (that organisation's repos only): the Hugging Face Hub.

An adapter id is a model repo id, ``org/name``; its files are the repo's root ``adapter_config.json`` and
``adapter_model.safetensors`` (what PEFT's ``push_to_hub`` writes). Through ``huggingface_hub``: its
endpoint (``HF_ENDPOINT``), its token (``HF_TOKEN`` or the token file ``hf auth login`` writes), its
request headers, its retries with backoff (``http_backoff``), its error types and its ``ModelInfo``.

Revision: the repo's commit. Revalidation asks the revision's commit (one small API call) and reads no
file when it is the one held. ``org/name@REV`` pins a commit, branch or tag: it is resolved to its commit
once, and a pinned id never moves. The files' sizes come from the Hub's listing and are checked against
the node's limits before a byte is fetched; the bytes come through the same bounded reader as an HTTP
origin's (the Hub answers with a redirect to its CDN: bounded, and the token is not sent on to another host).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import urllib3

from adapter_fabric.errors import AdapterNotFound, InvalidArgument, OriginUnavailable
from adapter_fabric.origins.base import ADAPTER_FILES, DEFAULT_TIMEOUT_S, DEFAULT_TRIES, FetchLimits, Revision
from adapter_fabric.origins.http_origin import get_file, retry_policy


class HubOrigin:
    """Model repos on the Hugging Face Hub (or a Hub-compatible endpoint), as adapters."""

    kind = "hf"

    def __init__(self, uri: str, *, trusted: bool = False, timeout: float = DEFAULT_TIMEOUT_S, tries: int = DEFAULT_TRIES, label: str = "") -> None:
        org = uri[len("hf://") :].strip("/")
        if "/" in org:
            raise InvalidArgument(f"origin {uri[:200]!r}: hf:// takes at most an organisation (hf://ORG), not a repo")
        self.org = org
        self.label = label or uri
        self.trusted = trusted
        self.timeout = timeout
        self.tries = tries
        self.pool = urllib3.PoolManager(retries=retry_policy(tries), cert_reqs="CERT_REQUIRED")

    def repo_of(self, adapter_id: str) -> str | None:
        """The repo id an adapter id names here, or None (not ``org/name``, or another organisation's)."""
        parts = adapter_id.split("/")
        if len(parts) != 2 or (self.org and parts[0] != self.org):
            return None
        return adapter_id

    def fetch(self, adapter_id: str, pin: str, known: Revision | None, into: Path, limits: FetchLimits) -> Revision | None:
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers

        what = f"origin {self.label}: {adapter_id}"
        repo = self.repo_of(adapter_id)
        if repo is None:
            raise AdapterNotFound(f"{what}: not a repo id {'of ' + self.org if self.org else '(org/name)'}")
        endpoint = constants.ENDPOINT.rstrip("/")  # HF_ENDPOINT, read by huggingface_hub when it is imported
        headers = build_hf_headers(library_name="adapter-fabric")  # HF_TOKEN (or the saved token) as its Authorization
        commit, sizes = self._revision(endpoint, repo, pin or "main", headers, limits, what)
        if known is not None and not pin and known.revision == commit:
            return None
        for name in ADAPTER_FILES:
            if name not in sizes:
                raise AdapterNotFound(f"{what}: repo {repo} has no {name} at commit {commit[:12]}")
            limits.check_size(name, sizes[name], what)
        for name in ADAPTER_FILES:
            # The Hub's resolve route, as hf_hub_url writes it (built here: its template is fixed when the library loads)
            url = f"{endpoint}/{repo}/resolve/{quote(commit, safe='')}/{quote(name)}"
            get_file(self.pool, url, headers, name, into, limits, what)
        return Revision(self.label, commit, tuple((name, commit) for name in ADAPTER_FILES))

    def _revision(self, endpoint: str, repo: str, revision: str, headers: dict, limits: FetchLimits, what: str) -> tuple[str, dict[str, int]]:
        """The commit ``revision`` names in ``repo``, and the size of each file at its root."""
        from huggingface_hub import ModelInfo
        from huggingface_hub import errors as hub_errors
        from huggingface_hub.utils import hf_raise_for_status, http_backoff

        url = f"{endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
        try:
            # http_backoff retries a timed-out attempt with the same timeout: each of the tries gets its share of
            # what is left, so all of them end by the fetch's deadline (plus their short backoffs)
            reply = http_backoff(
                "GET", url, headers=headers, params={"blobs": True}, timeout=limits.left(what) / self.tries,
                max_retries=self.tries - 1, base_wait_time=0.2, max_wait_time=5.0,
            )  # fmt: skip
            hf_raise_for_status(reply)
            info = ModelInfo(**reply.json())
        except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError) as exc:
            kind = "revision" if isinstance(exc, hub_errors.RevisionNotFoundError) else "repo"
            raise AdapterNotFound(f"{what}: the Hub has no {kind} {repo}@{revision[:80]}" if kind == "revision" else f"{what}: the Hub has no repo {repo}") from None
        except hub_errors.HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", "?")
            if status in (401, 403):
                raise OriginUnavailable(f"{what}: the Hub refused access (HTTP {status}); check HF_TOKEN") from None
            raise OriginUnavailable(f"{what}: the Hub answered HTTP {status}") from None
        except Exception as exc:  # noqa: BLE001 (the Hub client's HTTP library raises its own connection errors)
            raise limits.unavailable(what, f"{what}: the Hub did not answer: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
        if not info.sha:
            raise OriginUnavailable(f"{what}: the Hub answered no commit for {repo}@{revision[:80]}")
        sizes = {s.rfilename: int(s.size) for s in info.siblings or () if s.size is not None}
        return info.sha, sizes
