"""Errors a caller can act on.

Every failure the library raises on purpose is a ``FabricError`` subclass. The
node maps each class to one gRPC status code, in one place
(``node/status.py``); nothing else in the library knows about gRPC.

Messages name the problem (the key, the tensor, the module, the numbers) and,
where there is one, what a person can do about it.
"""

from __future__ import annotations


class FabricError(Exception):
    """Base class of every error this project raises on purpose."""

    #: True when the same call may succeed later without any change.
    retryable: bool = False


# --- bad input: the caller must change what it sent ------------------------


class InvalidArgument(FabricError):
    """A request argument is malformed (an id, a name, an offset)."""


class InvalidAdapterId(InvalidArgument):
    """An adapter id outside the documented alphabet or length."""


class InvalidAdapter(InvalidArgument):
    """An adapter's files are malformed or unsupported."""


class InvalidConfig(InvalidAdapter):
    """``adapter_config.json`` is malformed or asks for an unsupported setting."""


class InvalidHeader(InvalidAdapter):
    """A safetensors header breaks a rule of the format."""


class InvalidTensors(InvalidAdapter):
    """The tensors are well-formed but are not a PEFT LoRA adapter that matches its config."""


class ConfigMismatch(InvalidArgument):
    """The caller's PEFT fields disagree with the staged adapter's config."""


class LimitExceeded(InvalidArgument):
    """A request passes a size limit this node is configured with (adapter bytes, header bytes): send less or raise the limit."""


class FieldTooLarge(InvalidArgument):
    """A request field is longer than its bound (``adapter_fabric.rpc.bounds``): the refusal names the field and the limit, never the value."""


class BadSignature(InvalidArgument):
    """A signature that does not verify under the public key it names, over the digest it is sent with (or names no key)."""


# --- the adapter does not fit this node -------------------------------------


class IncompatibleAdapter(FabricError):
    """A valid adapter that this node's model or pool cannot hold (module, shape, rank)."""


class IncompatibleFormat(FabricError):
    """A peer, client or store speaks another version of the wire or store format (another digest scheme)."""


class AdaptersUnsupported(FabricError):
    """The model behind this node has no adapter support."""


# --- state ------------------------------------------------------------------


class AdapterNotFound(FabricError):
    """No adapter by that id (or name) is staged or resident here."""


class SlotBusy(FabricError):
    """The slot holds a reference from a running sequence and cannot be overwritten."""


class PoolFull(FabricError):
    """Every slot is busy or pinned; retry once a sequence ends."""

    retryable = True


class Busy(FabricError):
    """Someone else is doing this very thing right now (another stream sends the same upload); retry once it ends."""

    retryable = True


class StoreMissing(FabricError):
    """The store's directory, or one of its parts, is gone from under the running node (deleted by hand, an unmounted volume)."""


#: ``QuotaExceeded.bound``: the bounds a puller tells apart (``ErrorDetail.bound`` on the wire). Only the data channel's
#: own bound sends a refused stream over gRPC: the others refuse gRPC Fetch the same way.
PEER_STREAMS_BOUND = "peer-streams"  # --max-streams-per-peer: gRPC Fetch and the data channel count together
FIRST_COPIES_BOUND = "first-copies"  # a seed sends a swarm caller to the nodes its first copies went to
DATA_CONNECTIONS_BOUND = "data-connections"  # the data channel's connections, which gRPC Fetch is not under
NAMED_BOUNDS = frozenset({PEER_STREAMS_BOUND, FIRST_COPIES_BOUND, DATA_CONNECTIONS_BOUND})


class QuotaExceeded(FabricError):
    """Accepting this would pass a configured limit (store bytes, adapter size, streams).

    ``bound``: which of ``NAMED_BOUNDS`` refused it; "" for any other, and when an older node did not say.
    """

    retryable = True

    def __init__(self, message: str = "", bound: str = "") -> None:
        super().__init__(message)
        self.bound = bound


class StoreFull(QuotaExceeded):
    """The store's byte limit refuses a writer now, before anything was written: an evicting node makes room and the writer opens again.

    ``needed``: the bytes the writer asked for; ``what``: the writer, in words ("uploading 'team-a/x'").
    """

    def __init__(self, message: str, needed: int = 0, what: str = "") -> None:
        super().__init__(message)
        self.needed = needed
        self.what = what


class PinLimitReached(QuotaExceeded):
    """Pinning another adapter would pin every slot: only an operator's unpin frees one, so retrying alone never helps."""

    retryable = False


class TooManySigners(QuotaExceeded):
    """A digest already carries signatures by as many signers as a store keeps (``adapter_fabric.trust.signing.MAX_SIGNERS``)."""

    retryable = False


# --- bytes and peers --------------------------------------------------------


class IntegrityError(FabricError):
    """Bytes do not match their digest (a chunk, a file, or a manifest)."""


class PeerUnavailable(FabricError):
    """No reachable peer could serve the request."""

    retryable = True


class DeadlineExceeded(PeerUnavailable):
    """The caller's deadline passed before the node answered, or before the work was done (a partial result is never
    returned as if it were whole). The node may go on with the work; a later call, or a longer timeout, may succeed.

    A kind of ``PeerUnavailable`` (the node did not answer in time): code that caught a client's deadline as
    ``PeerUnavailable``, as it had to before this type was raised for it, still does.
    """


class ClientClosed(FabricError):
    """A call on a ``NodeClient`` after ``close()`` (or after its ``with`` block ended): make a new client."""


# --- origins (adapter_fabric.origins) ---------------------------------------


class OriginUnavailable(PeerUnavailable):
    """An origin (S3, the Hub, an HTTP server, a directory) did not answer, or answered an error, after its retries."""


class OriginTooSlow(DeadlineExceeded):
    """An origin sent an adapter slower than its timeout allows (a slow drip): nothing of it was staged."""


# --- who is calling ---------------------------------------------------------


class Untrusted(FabricError):
    """An adapter not signed by a signer this node trusts (unsigned, another key, or changed since it was signed)."""


class Unauthenticated(FabricError):
    """The call carried no valid bearer token while the node requires one."""


class PermissionDenied(FabricError):
    """The caller is known but its principal lacks the verb on the id's prefix (the message never says whether the id exists)."""


class NotAMember(PermissionDenied):
    """A caller named a peer address that is not a member of the node's cluster: the node sends its credentials only to members."""


class InvalidPolicy(InvalidArgument):
    """An access policy file that is not valid TOML or breaks one of its rules (the message names which)."""
