"""The ``ModelAdapters`` interface: the seven operations a node calls on its model.

``ModelAdapters`` itself is the neutral implementation for a model without
adapter support: read calls answer with their neutral value (id 0 = base
model, slot -1 = no ref taken) and mutating calls raise ``AdaptersUnsupported``
naming the operation. ``MultiLoraModel`` (``fabric.multi_lora``) overrides all
seven.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fabric.errors import AdaptersUnsupported


class ModelAdapters:
    """Adapter operations of a served model; these defaults mean "no adapter support"."""

    def _unsupported(self, operation: str) -> AdaptersUnsupported:
        return AdaptersUnsupported(
            f"{operation}: the model {type(self).__name__} has no adapter support; "
            "serve it behind MultiLoraModel to load LoRA adapters"
        )

    def set_active_lora(self, name: str) -> None:
        raise self._unsupported(f"set_active_lora({name!r})")

    def adapter_id_for(self, slot: int) -> int:
        return 0

    def acquire_adapter_slot(self, slot: int) -> int:
        return -1

    def release_adapter_slot(self, resolved: int) -> None:
        return None

    def swap_lora_from_disk(self, adapter_dir: str | Path, name: str, slot: int) -> None:
        raise self._unsupported(f"swap_lora_from_disk({str(adapter_dir)!r}, {name!r}, slot={slot})")

    def promote_lora_from_peer(self, peer_addr: str, adapter_id: str, name: str, peft: Any) -> tuple[int, str | None]:
        raise self._unsupported(f"promote_lora_from_peer({peer_addr!r}, {adapter_id!r}, {name!r})")

    def promote_lora_from_disk(self, adapter_dir: str | Path, name: str) -> tuple[int, str | None]:
        raise self._unsupported(f"promote_lora_from_disk({str(adapter_dir)!r}, {name!r})")
