from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DigestScheme(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIGEST_SCHEME_UNSPECIFIED: _ClassVar[DigestScheme]
    DIGEST_SCHEME_SHA256: _ClassVar[DigestScheme]
    DIGEST_SCHEME_BLAKE3_CHUNKS: _ClassVar[DigestScheme]
DIGEST_SCHEME_UNSPECIFIED: DigestScheme
DIGEST_SCHEME_SHA256: DigestScheme
DIGEST_SCHEME_BLAKE3_CHUNKS: DigestScheme

class PeftFields(_message.Message):
    __slots__ = ("r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern", "target_modules_pattern")
    class RankPatternEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AlphaPatternEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    R_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    RANK_PATTERN_FIELD_NUMBER: _ClassVar[int]
    ALPHA_PATTERN_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_PATTERN_FIELD_NUMBER: _ClassVar[int]
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    rank_pattern: _containers.ScalarMap[str, int]
    alpha_pattern: _containers.ScalarMap[str, float]
    target_modules_pattern: str
    def __init__(self, r: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., rank_pattern: _Optional[_Mapping[str, int]] = ..., alpha_pattern: _Optional[_Mapping[str, float]] = ..., target_modules_pattern: _Optional[str] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("name", "size", "chunk_size", "root", "chunk_digests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    chunk_size: int
    root: str
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., chunk_size: _Optional[int] = ..., root: _Optional[str] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "begin", "end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    begin: int
    end: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class SignerSignature(_message.Message):
    __slots__ = ("public_key", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("adapter_id", "digest", "content_id", "files", "config_json", "peft", "tensors", "header_size", "signature", "signatures", "digest_scheme", "file_sha256", "origin", "revision")
    class FileSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PEFT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    HEADER_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SCHEME_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    content_id: int
    files: _containers.RepeatedCompositeFieldContainer[FileEntry]
    config_json: bytes
    peft: PeftFields
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    header_size: int
    signature: bytes
    signatures: _containers.RepeatedCompositeFieldContainer[SignerSignature]
    digest_scheme: DigestScheme
    file_sha256: _containers.ScalarMap[str, str]
    origin: str
    revision: str
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., content_id: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., config_json: _Optional[bytes] = ..., peft: _Optional[_Union[PeftFields, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., header_size: _Optional[int] = ..., signature: _Optional[bytes] = ..., signatures: _Optional[_Iterable[_Union[SignerSignature, _Mapping]]] = ..., digest_scheme: _Optional[_Union[DigestScheme, str]] = ..., file_sha256: _Optional[_Mapping[str, str]] = ..., origin: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class StageBegin(_message.Message):
    __slots__ = ("adapter_id", "config_json", "safetensors_size", "offset", "safetensors_blake3", "weights_root", "digest_scheme", "signature", "signer_public_key")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ROOT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SCHEME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    config_json: bytes
    safetensors_size: int
    offset: int
    safetensors_blake3: str
    weights_root: str
    digest_scheme: DigestScheme
    signature: bytes
    signer_public_key: bytes
    def __init__(self, adapter_id: _Optional[str] = ..., config_json: _Optional[bytes] = ..., safetensors_size: _Optional[int] = ..., offset: _Optional[int] = ..., safetensors_blake3: _Optional[str] = ..., weights_root: _Optional[str] = ..., digest_scheme: _Optional[_Union[DigestScheme, str]] = ..., signature: _Optional[bytes] = ..., signer_public_key: _Optional[bytes] = ...) -> None: ...

class StageData(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("begin", "data")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    begin: StageBegin
    data: StageData
    def __init__(self, begin: _Optional[_Union[StageBegin, _Mapping]] = ..., data: _Optional[_Union[StageData, _Mapping]] = ...) -> None: ...

class StageResponse(_message.Message):
    __slots__ = ("adapter_id", "digest", "content_id", "bytes_received", "already_staged")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STAGED_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    content_id: int
    bytes_received: int
    already_staged: bool
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., content_id: _Optional[int] = ..., bytes_received: _Optional[int] = ..., already_staged: _Optional[bool] = ...) -> None: ...

class StageManyRequest(_message.Message):
    __slots__ = ("begin", "data", "digest")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    begin: StageBegin
    data: bytes
    digest: str
    def __init__(self, begin: _Optional[_Union[StageBegin, _Mapping]] = ..., data: _Optional[bytes] = ..., digest: _Optional[str] = ...) -> None: ...

class StageManyResult(_message.Message):
    __slots__ = ("adapter_id", "staged", "error")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    staged: StageResponse
    error: ErrorDetail
    def __init__(self, adapter_id: _Optional[str] = ..., staged: _Optional[_Union[StageResponse, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class UploadOffsetRequest(_message.Message):
    __slots__ = ("adapter_id", "safetensors_blake3")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    safetensors_blake3: str
    def __init__(self, adapter_id: _Optional[str] = ..., safetensors_blake3: _Optional[str] = ...) -> None: ...

class UploadOffsetResponse(_message.Message):
    __slots__ = ("offset", "chunk_size", "digest_scheme")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SCHEME_FIELD_NUMBER: _ClassVar[int]
    offset: int
    chunk_size: int
    digest_scheme: DigestScheme
    def __init__(self, offset: _Optional[int] = ..., chunk_size: _Optional[int] = ..., digest_scheme: _Optional[_Union[DigestScheme, str]] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("adapter_id", "digest_scheme", "with_sha256")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SCHEME_FIELD_NUMBER: _ClassVar[int]
    WITH_SHA256_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest_scheme: DigestScheme
    with_sha256: bool
    def __init__(self, adapter_id: _Optional[str] = ..., digest_scheme: _Optional[_Union[DigestScheme, str]] = ..., with_sha256: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("adapter_id", "digest", "file", "offset", "length", "accept_bitmap")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_BITMAP_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    file: str
    offset: int
    length: int
    accept_bitmap: bytes
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., accept_bitmap: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AvailabilityRequest(_message.Message):
    __slots__ = ("digest", "file")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    file: str
    def __init__(self, digest: _Optional[str] = ..., file: _Optional[str] = ...) -> None: ...

class AvailabilityResponse(_message.Message):
    __slots__ = ("complete", "chunk_count", "verified_bitmap", "durable", "streams")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BITMAP_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    chunk_count: int
    verified_bitmap: bytes
    durable: bool
    streams: int
    def __init__(self, complete: _Optional[bool] = ..., chunk_count: _Optional[int] = ..., verified_bitmap: _Optional[bytes] = ..., durable: _Optional[bool] = ..., streams: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("adapter_id", "digest", "at_home")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    AT_HOME_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    at_home: bool
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., at_home: _Optional[bool] = ...) -> None: ...

class PeerHolding(_message.Message):
    __slots__ = ("address", "complete", "verified_chunks", "streams")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    address: str
    complete: bool
    verified_chunks: int
    streams: int
    def __init__(self, address: _Optional[str] = ..., complete: _Optional[bool] = ..., verified_chunks: _Optional[int] = ..., streams: _Optional[int] = ...) -> None: ...

class AnnounceRequest(_message.Message):
    __slots__ = ("adapter_id", "digest", "complete", "dropped", "address")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    complete: bool
    dropped: bool
    address: str
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., complete: _Optional[bool] = ..., dropped: _Optional[bool] = ..., address: _Optional[str] = ...) -> None: ...

class AnnounceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("digest", "peers", "origin")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    digest: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerHolding]
    origin: str
    def __init__(self, digest: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerHolding, _Mapping]]] = ..., origin: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class StagedAdapter(_message.Message):
    __slots__ = ("adapter_id", "digest", "content_id", "size", "peft", "damaged", "engines", "origin", "revision", "checked_at")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PEFT_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CHECKED_AT_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    content_id: int
    size: int
    peft: PeftFields
    damaged: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    origin: str
    revision: str
    checked_at: float
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., content_id: _Optional[int] = ..., size: _Optional[int] = ..., peft: _Optional[_Union[PeftFields, _Mapping]] = ..., damaged: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., origin: _Optional[str] = ..., revision: _Optional[str] = ..., checked_at: _Optional[float] = ...) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("slot", "name", "content_id", "ref_count", "pinned", "active", "last_used", "rank", "digest")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    content_id: int
    ref_count: int
    pinned: bool
    active: bool
    last_used: int
    rank: int
    digest: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., content_id: _Optional[int] = ..., ref_count: _Optional[int] = ..., pinned: _Optional[bool] = ..., active: _Optional[bool] = ..., last_used: _Optional[int] = ..., rank: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("staged", "slots", "max_rank", "device", "next_page_token")
    STAGED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    staged: _containers.RepeatedCompositeFieldContainer[StagedAdapter]
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    max_rank: int
    device: str
    next_page_token: str
    def __init__(self, staged: _Optional[_Iterable[_Union[StagedAdapter, _Mapping]]] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ..., max_rank: _Optional[int] = ..., device: _Optional[str] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("peer", "adapter_id", "name", "peft", "pin", "stage_only", "named_peer_only", "base_model", "export_version")
    PEER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PEFT_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    STAGE_ONLY_FIELD_NUMBER: _ClassVar[int]
    NAMED_PEER_ONLY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPORT_VERSION_FIELD_NUMBER: _ClassVar[int]
    peer: str
    adapter_id: str
    name: str
    peft: PeftFields
    pin: bool
    stage_only: bool
    named_peer_only: bool
    base_model: str
    export_version: bool
    def __init__(self, peer: _Optional[str] = ..., adapter_id: _Optional[str] = ..., name: _Optional[str] = ..., peft: _Optional[_Union[PeftFields, _Mapping]] = ..., pin: _Optional[bool] = ..., stage_only: _Optional[bool] = ..., named_peer_only: _Optional[bool] = ..., base_model: _Optional[str] = ..., export_version: _Optional[bool] = ...) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("slot", "evicted_name", "content_id", "digest", "bytes_transferred", "source_peer", "pull_seconds", "joined", "origin", "revision", "export_name")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PEER_FIELD_NUMBER: _ClassVar[int]
    PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    EXPORT_NAME_FIELD_NUMBER: _ClassVar[int]
    slot: int
    evicted_name: str
    content_id: int
    digest: str
    bytes_transferred: int
    source_peer: str
    pull_seconds: float
    joined: bool
    origin: str
    revision: str
    export_name: str
    def __init__(self, slot: _Optional[int] = ..., evicted_name: _Optional[str] = ..., content_id: _Optional[int] = ..., digest: _Optional[str] = ..., bytes_transferred: _Optional[int] = ..., source_peer: _Optional[str] = ..., pull_seconds: _Optional[float] = ..., joined: _Optional[bool] = ..., origin: _Optional[str] = ..., revision: _Optional[str] = ..., export_name: _Optional[str] = ...) -> None: ...

class SetActiveRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SetActiveResponse(_message.Message):
    __slots__ = ("slot", "content_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    content_id: int
    def __init__(self, slot: _Optional[int] = ..., content_id: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("name", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class UnstageRequest(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    def __init__(self, adapter_id: _Optional[str] = ...) -> None: ...

class UnstageResponse(_message.Message):
    __slots__ = ("bytes_removed",)
    BYTES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    bytes_removed: bool
    def __init__(self, bytes_removed: _Optional[bool] = ...) -> None: ...

class KeepRequest(_message.Message):
    __slots__ = ("adapter_id", "unkeep")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    UNKEEP_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    unkeep: bool
    def __init__(self, adapter_id: _Optional[str] = ..., unkeep: _Optional[bool] = ...) -> None: ...

class KeepResponse(_message.Message):
    __slots__ = ("kept",)
    KEPT_FIELD_NUMBER: _ClassVar[int]
    kept: bool
    def __init__(self, kept: _Optional[bool] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AccessGrant(_message.Message):
    __slots__ = ("verbs", "prefixes")
    VERBS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    verbs: _containers.RepeatedScalarFieldContainer[str]
    prefixes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, verbs: _Optional[_Iterable[str]] = ..., prefixes: _Optional[_Iterable[str]] = ...) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("principal", "grants", "policy")
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    principal: str
    grants: _containers.RepeatedCompositeFieldContainer[AccessGrant]
    policy: bool
    def __init__(self, principal: _Optional[str] = ..., grants: _Optional[_Iterable[_Union[AccessGrant, _Mapping]]] = ..., policy: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("adapter", "use_base", "input_ids", "max_new_tokens", "return_logits")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    USE_BASE_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    use_base: bool
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    return_logits: bool
    def __init__(self, adapter: _Optional[str] = ..., use_base: _Optional[bool] = ..., input_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., return_logits: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output_ids", "last_logits", "slot", "content_id")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    last_logits: _containers.RepeatedScalarFieldContainer[float]
    slot: int
    content_id: int
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., last_logits: _Optional[_Iterable[float]] = ..., slot: _Optional[int] = ..., content_id: _Optional[int] = ...) -> None: ...

class StoreStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreLeftover(_message.Message):
    __slots__ = ("adapter_id", "digest", "bytes", "age_seconds", "in_use")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    bytes: int
    age_seconds: float
    in_use: bool
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ..., in_use: _Optional[bool] = ...) -> None: ...

class DamagedEntry(_message.Message):
    __slots__ = ("adapter_id", "digest", "reason")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    digest: str
    reason: str
    def __init__(self, adapter_id: _Optional[str] = ..., digest: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StoreStatusResponse(_message.Message):
    __slots__ = ("used_bytes", "quota_bytes", "adapters", "uploads", "partials", "expire_after_seconds", "damaged", "evictions", "kept", "evicts", "tenants", "uploads_total", "partials_total", "damaged_total", "origins", "recent_evictions")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    EVICTS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ORIGINS_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    quota_bytes: int
    adapters: int
    uploads: _containers.RepeatedCompositeFieldContainer[StoreLeftover]
    partials: _containers.RepeatedCompositeFieldContainer[StoreLeftover]
    expire_after_seconds: float
    damaged: _containers.RepeatedCompositeFieldContainer[DamagedEntry]
    evictions: int
    kept: int
    evicts: bool
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    uploads_total: int
    partials_total: int
    damaged_total: int
    origins: _containers.RepeatedCompositeFieldContainer[OriginState]
    recent_evictions: _containers.RepeatedCompositeFieldContainer[Eviction]
    def __init__(self, used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., adapters: _Optional[int] = ..., uploads: _Optional[_Iterable[_Union[StoreLeftover, _Mapping]]] = ..., partials: _Optional[_Iterable[_Union[StoreLeftover, _Mapping]]] = ..., expire_after_seconds: _Optional[float] = ..., damaged: _Optional[_Iterable[_Union[DamagedEntry, _Mapping]]] = ..., evictions: _Optional[int] = ..., kept: _Optional[int] = ..., evicts: _Optional[bool] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., uploads_total: _Optional[int] = ..., partials_total: _Optional[int] = ..., damaged_total: _Optional[int] = ..., origins: _Optional[_Iterable[_Union[OriginState, _Mapping]]] = ..., recent_evictions: _Optional[_Iterable[_Union[Eviction, _Mapping]]] = ...) -> None: ...

class OriginState(_message.Message):
    __slots__ = ("origin", "answering", "error", "since")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    ANSWERING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    origin: str
    answering: bool
    error: str
    since: float
    def __init__(self, origin: _Optional[str] = ..., answering: _Optional[bool] = ..., error: _Optional[str] = ..., since: _Optional[float] = ...) -> None: ...

class Eviction(_message.Message):
    __slots__ = ("adapter_ids", "digest", "bytes", "age_seconds", "reason")
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    digest: str
    bytes: int
    age_seconds: float
    reason: str
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ..., digest: _Optional[str] = ..., bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("prefix", "max_bytes", "max_adapters", "bytes", "adapters")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    max_bytes: int
    max_adapters: int
    bytes: int
    adapters: int
    def __init__(self, prefix: _Optional[str] = ..., max_bytes: _Optional[int] = ..., max_adapters: _Optional[int] = ..., bytes: _Optional[int] = ..., adapters: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("kind", "message", "retryable", "bound")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    retryable: bool
    bound: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., bound: _Optional[str] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("token", "fetch", "holder_port", "holder_bitmap", "on_behalf_of", "keep_open")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_PORT_FIELD_NUMBER: _ClassVar[int]
    HOLDER_BITMAP_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    KEEP_OPEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    fetch: FetchRequest
    holder_port: int
    holder_bitmap: bytes
    on_behalf_of: str
    keep_open: bool
    def __init__(self, token: _Optional[str] = ..., fetch: _Optional[_Union[FetchRequest, _Mapping]] = ..., holder_port: _Optional[int] = ..., holder_bitmap: _Optional[bytes] = ..., on_behalf_of: _Optional[str] = ..., keep_open: _Optional[bool] = ...) -> None: ...
