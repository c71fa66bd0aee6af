"""The content-addressed adapter store: ids, manifests and digests, committed blobs, partial downloads, uploads.

``AdapterStore`` is the entry point; ``PartialDownload`` and ``Upload`` are what it opens.
"""

from adapter_fabric.store.adapter_store import AdapterStore
from adapter_fabric.store.partial import PartialDownload
from adapter_fabric.store.upload import Upload

__all__ = ["AdapterStore", "PartialDownload", "Upload"]
