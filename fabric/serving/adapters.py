"""The ``ModelAdapters`` interface: the seven operations a node calls on its model.

``ModelAdapters`` itself is the neutral implementation for a model without
adapter support: read calls answer with their neutral value (id 0 = base
model, slot -1 = no ref taken) and mutating calls raise ``AdaptersUnsupported``
naming the operation. ``MultiLoraModel`` (``adapter_fabric.serving.multi_lora``) overrides all
seven.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapter_fabric.errors import AdaptersUnsupported


class ModelAdapters:
    """Adapter operations of a served model; these defaults mean "no adapter support"."""

    def _unsupported(self, operation: str) -> AdaptersUnsupported:
        return AdaptersUnsupported(
            f"{operation}: the model {type(self).__name__} has no adapter support; "
            "serve it behind MultiLoraModel to load LoRA adapters"
        )

    def set_active_lora(self, name: str) -> None:
        """Make the resident adapter ``name`` the active one (the one slot ``-1`` means)."""
        raise self._unsupported(f"set_active_lora({name!r})")

    def adapter_id_for(self, slot: int) -> int:
        """The u64 prefix-cache id of a slot: ``-1`` = the active adapter, ``0`` = the base model."""
        return 0

    def acquire_adapter_slot(self, slot: int) -> int:
        """Take a ref on the slot a sequence will use (at prefill); resolves ``-1``; returns the resolved slot, or ``-1`` if no ref was taken."""
        return -1

    def release_adapter_slot(self, resolved: int) -> None:
        """Drop a ref taken by ``acquire_adapter_slot``."""
        return None

    def swap_lora_from_disk(self, adapter_dir: str | Path, name: str, slot: int) -> None:
        """Load a PEFT adapter directory into the given slot (refused while the slot is busy)."""
        raise self._unsupported(f"swap_lora_from_disk({str(adapter_dir)!r}, {name!r}, slot={slot})")

    def promote_lora_from_peer(self, peer_addr: str, adapter_id: str, name: str, peft: Any) -> tuple[int, str | None]:
        """Pull ``adapter_id`` from a peer, check it against ``peft``, load it into the victim slot and make it active; returns ``(slot, evicted name or None)``."""
        raise self._unsupported(f"promote_lora_from_peer({peer_addr!r}, {adapter_id!r}, {name!r})")

    def promote_lora_from_disk(self, adapter_dir: str | Path, name: str) -> tuple[int, str | None]:
        """The same as ``promote_lora_from_peer``, from a local PEFT directory."""
        raise self._unsupported(f"promote_lora_from_disk({str(adapter_dir)!r}, {name!r})")
