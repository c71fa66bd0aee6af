"""What a listing, a status census and an eviction read of a manifest, read without building the manifest.

A ``Manifest`` checks every claim when it is built (the tensor index, the LoRA
pairs, the content id: ~0.2-0.5 ms for a small adapter), as a promote or a
serve must. A listing of 100,000 ids cannot pay that per id (measured: a first
full listing took ~50 s that way). A ``Summary`` holds what those scans read:
the adapter's size, its blob roots, its content id and its PEFT fields. Read
from a manifest's JSON (``SummaryReader.read``) it is checked lightly: the
format, the digest against the file name and against the file roots, the
config file's entry against the config bytes, and the config itself; the
tensor index and the content id are checked when the adapter is used
(``Catalog.get`` builds the whole manifest), as they always were.

Adapters share configs (one per rank, alpha and targets): a config's check and
its PEFT fields are kept by its root (bounded), so a listing parses each
distinct config once.
"""

from __future__ import annotations

import base64
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from adapter_fabric.errors import IntegrityError, InvalidAdapter
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.format.peft_fields import peft_fields_of
from adapter_fabric.store.digests import CONFIG_FILE, FILE_NAMES, FileEntry, adapter_digest, hash_bytes
from adapter_fabric.store.manifest import Manifest

#: the on-disk manifest format a summary is read from (``Manifest.to_json``)
MANIFEST_FORMAT = 2
#: distinct configs whose check and PEFT fields are kept (a few hundred bytes each)
MAX_CONFIGS = 4096


@dataclass(frozen=True, slots=True)
class Summary:
    """An adapter digest as scans of the whole store see it (~0.3 KB: no tensor index, no chunk list)."""

    total_size: int
    roots: tuple[str, ...]
    content_id: int
    peft: bytes  # fabric.v1.PeftFields, serialized: shared by every adapter of the same config


@dataclass(frozen=True, slots=True)
class _Config:
    text: str  # as the manifest JSON holds it (base64)
    size: int
    root: str
    peft: bytes


class SummaryReader:
    """Summaries from manifests and from manifest JSON; each distinct config checked once (safe from I/O threads)."""

    def __init__(self, capacity: int = MAX_CONFIGS) -> None:
        self.capacity = capacity
        self._configs: OrderedDict[str, _Config] = OrderedDict()
        self._lock = threading.Lock()

    def of_manifest(self, manifest: Manifest) -> Summary:
        """The summary of a manifest already built (every claim checked)."""
        entry, text = manifest.files[0], base64.b64encode(manifest.config_json).decode("ascii")
        config = self._known(entry.root, text, entry.size)
        if config is None:
            config = self._keep(_Config(text, entry.size, entry.root, peft_fields_of(manifest.config).SerializeToString()))
        return Summary(manifest.total_size, (config.root, manifest.weights.root), manifest.content_id, config.peft)

    def read(self, digest: str, data: bytes) -> Summary:
        """The summary of ``digest`` from its manifest file's bytes; ``InvalidAdapter``/``IntegrityError`` when they are damaged."""
        try:
            raw = json.loads(data)
            if raw.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {raw.get('format')!r} is not {MANIFEST_FORMAT}")
            files = raw["files"]
            if [f["name"] for f in files] != list(FILE_NAMES):
                raise ValueError(f"files must be exactly {list(FILE_NAMES)}")
            (config_root, config_size), (weights_root, weights_size) = ((f["root"], f["size"]) for f in files)
            content_id, text = raw["content_id"], raw["config_json"]
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (config_size, weights_size, content_id)):
                raise ValueError("a size or the content id is not a whole number")
            if not isinstance(text, str):
                raise ValueError("config_json is not text")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidAdapter(f"manifest JSON is malformed: {str(exc)[:200]}") from None
        if raw.get("digest") != digest or adapter_digest(config_root, weights_root) != digest:
            raise IntegrityError(f"the manifest of {digest} names files whose digest is another")
        config = self._known(config_root, text, config_size) or self._check_config(files[0], text)
        return Summary(config_size + weights_size, (config.root, weights_root), content_id, config.peft)

    def _check_config(self, entry: dict, text: str) -> _Config:
        """A config not seen yet: its bytes against its file entry, then parsed (``InvalidAdapter`` names what is wrong)."""
        try:
            config_json = base64.b64decode(text, validate=True)
            claimed = FileEntry.from_dict(entry)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidAdapter(f"manifest JSON is malformed: {str(exc)[:200]}") from None
        if hash_bytes(CONFIG_FILE, config_json, claimed.chunk_size) != claimed:
            raise IntegrityError(f"its {CONFIG_FILE} entry (root {claimed.root}) does not match its config bytes")
        peft = peft_fields_of(PeftAdapterConfig.from_json_bytes(config_json)).SerializeToString()
        return self._keep(_Config(text, claimed.size, claimed.root, peft))

    def _known(self, root: str, text: str, size: int) -> _Config | None:
        with self._lock:
            config = self._configs.get(root)
            if config is None or config.size != size or config.text != text:
                return None
            self._configs.move_to_end(root)
            return config

    def _keep(self, config: _Config) -> _Config:
        with self._lock:
            self._configs[config.root] = config
            self._configs.move_to_end(config.root)
            while len(self._configs) > self.capacity:
                self._configs.popitem(last=False)
        return config
