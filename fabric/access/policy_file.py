"""A policy file on disk (``--policy``): read strictly at start, reloaded on SIGHUP or when it changes.

A reload that fails (unreadable, not TOML, a rule broken) keeps the policy in
force and says why in one audit line; only a whole, valid file replaces it.
Each reload is counted by outcome (``fabric_policy_reloads_total``).
"""

from __future__ import annotations

from pathlib import Path

from adapter_fabric.access.policy import Policy, parse_policy
from adapter_fabric.errors import InvalidPolicy
from adapter_fabric.observability.audit import audit
from adapter_fabric.observability.metrics import POLICY_RELOADS
from adapter_fabric.store.stamps import FileStamp, file_stamp

#: the largest policy file read (a thousand principals with a hundred grants fit well within)
MAX_POLICY_BYTES = 4 << 20


def read_policy(path: Path) -> Policy:
    """The policy in ``path``; ``InvalidPolicy`` naming the file and its first problem, in one line."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise InvalidPolicy(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_POLICY_BYTES:
        raise InvalidPolicy(f"{path} is over {MAX_POLICY_BYTES} bytes; a policy file is a few kilobytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidPolicy(f"{path} is not UTF-8 text") from None
    try:
        return parse_policy(text)
    except InvalidPolicy as exc:
        raise InvalidPolicy(f"{path}: {exc}") from None


def _stamp(path: Path) -> FileStamp | None:
    """What changes when the file is rewritten or replaced (an editor's rename, a ConfigMap's symlink swap)."""
    try:
        return file_stamp(path)
    except OSError:
        return None


class PolicyFile:
    """The policy in force and the file it came from."""

    def __init__(self, path: Path) -> None:
        """Read ``path`` now: ``InvalidPolicy`` (one line) when it is broken, so a node refuses to start on it."""
        self.path = Path(path)
        self._stamp = _stamp(self.path)
        self.policy = read_policy(self.path)
        #: counts the policies put in force: a running stream re-checks its admission when it moved (``node.gate.StillAdmitted``)
        self.generation = 0

    def reload(self, why: str) -> bool:
        """Read the file again; on any problem keep the policy in force. Whether the new one took effect."""
        self._stamp = _stamp(self.path)
        try:
            policy = read_policy(self.path)
        except InvalidPolicy as exc:
            POLICY_RELOADS.labels("refused").inc()
            audit("policy-reload", "node", "refused", detail=f"{why}: kept the previous policy: {exc}")
            return False
        self.policy = policy
        self.generation += 1
        POLICY_RELOADS.labels("ok").inc()
        audit("policy-reload", "node", "ok", detail=f"{why}: {len(policy.principals)} principals")
        return True

    def reload_if_changed(self) -> bool | None:
        """Reload when the file changed since the last read; None when it did not."""
        if _stamp(self.path) == self._stamp:
            return None
        return self.reload("the file changed")
