"""Validation of adapter ids and digests, the two names the wire and the store use.

An adapter id is a caller-chosen reference such as ``team-a/support-v3``. The
store keeps one file per id, so the rules below exist to make every valid id a
safe, unambiguous name on disk and on the wire.
"""

from __future__ import annotations

import re

from adapter_fabric.errors import InvalidAdapterId, InvalidArgument

MAX_ID_LENGTH = 128
_ID_CHARS = re.compile(r"[A-Za-z0-9._\-/@]+")
#: ``ID@REVISION``: a revision pinned at an origin (adapter_fabric.origins), in the last segment, after one "@"
_PIN = re.compile(r"[A-Za-z0-9._\-]+")
MAX_NAME_LENGTH = 128
_NAME_CHARS = re.compile(r"[A-Za-z0-9._\-/:@+]+")
#: names a slot may not take: "base" is how a Generate asks for the base model
RESERVED_NAMES = frozenset({"base"})
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _show(value: object, limit: int = 60) -> str:
    """``repr`` cut short, so a megabyte of junk does not become a megabyte of message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value) if isinstance(value, (str, bytes)) else '?'} chars)"


def validate_adapter_id(value: object) -> str:
    """Return ``value`` if it is a valid adapter id, else raise ``InvalidAdapterId``.

    Rules:

    - a ``str`` of 1 to 128 characters;
    - only characters from ``[A-Za-z0-9._-/]`` (ASCII letters, digits, dot,
      underscore, hyphen and slash; no NUL, whitespace or other characters);
    - no leading or trailing ``/``;
    - ``/`` separates segments, and no segment is empty, ``.`` or ``..``;
    - at most one ``@``, in the last segment, with a name before it and a revision after it
      (``team-a/support@3f2a9c``: that revision of ``team-a/support`` at its origin, which never moves).
    """
    if not isinstance(value, str):
        raise InvalidAdapterId(f"adapter id {_show(value)} must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidAdapterId("adapter id '' is empty: an id has 1 to 128 characters")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidAdapterId(f"adapter id {_show(value)} has {len(value)} characters: at most {MAX_ID_LENGTH} are allowed")
    if _ID_CHARS.fullmatch(value) is None:
        bad = next(c for c in value if _ID_CHARS.fullmatch(c) is None)
        raise InvalidAdapterId(f"adapter id {_show(value)} holds {bad!r}: only [A-Za-z0-9._-/] are allowed (and one '@' before a revision)")
    if value.startswith("/") or value.endswith("/"):
        raise InvalidAdapterId(f"adapter id {_show(value)} starts or ends with '/'")
    for segment in value.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidAdapterId(f"adapter id {_show(value)} has an empty, '.' or '..' segment between '/'")
    if "@" in value:
        name, _, revision = value.rpartition("@")
        if "@" in name or "/" in revision or not name or name.endswith("/") or _PIN.fullmatch(revision) is None or name.rsplit("/", 1)[-1] in (".", ".."):
            raise InvalidAdapterId(f"adapter id {_show(value)}: '@' comes once, in the last segment, between a name and a revision (ID@REVISION)")
    return value


def split_pin(adapter_id: str) -> tuple[str, str]:
    """``team-a/x@rev`` -> ("team-a/x", "rev"); an id without a pin -> (id, "")."""
    name, at, revision = adapter_id.rpartition("@")
    return (name, revision) if at else (adapter_id, "")


def validate_name(value: object) -> str:
    """Return ``value`` if it may name a resident adapter (a slot), else raise ``InvalidArgument``.

    Rules: a ``str`` of 1 to 128 characters from ``[A-Za-z0-9._-/:@+]`` (every
    adapter id is a valid name; no NUL, whitespace, control or other
    characters), and not a reserved name (``base`` means the base model).
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"adapter name {_show(value)} must be a string, not {type(value).__name__}")
    if not value or len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"adapter name {_show(value)} has {len(value)} characters: a name has 1 to {MAX_NAME_LENGTH}")
    if _NAME_CHARS.fullmatch(value) is None:
        bad = next(c for c in value if _NAME_CHARS.fullmatch(c) is None)
        raise InvalidArgument(f"adapter name {_show(value)} holds {bad!r}: only [A-Za-z0-9._-/:@+] are allowed")
    if value in RESERVED_NAMES:
        raise InvalidArgument(f"adapter name {value!r} is reserved (a Generate with adapter={value!r} runs the base model); choose another")
    return value


def validate_digest(value: object, what: str = "digest") -> str:
    """Return ``value`` if it is a digest's hex form (64 lowercase hex characters: a BLAKE3 root), else raise ``InvalidArgument``."""
    if not isinstance(value, str) or _DIGEST.fullmatch(value) is None:
        raise InvalidArgument(f"{what} {_show(value)} is not a digest: expected 64 lowercase hex characters")
    return value
