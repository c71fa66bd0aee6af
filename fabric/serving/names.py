"""Names the node shares with the serving code, without torch: a store-only node (``--model none``) imports
these and never loads torch (its start-up would otherwise spend most of its time importing it)."""

from __future__ import annotations

#: the linear modules a slot pool adapts unless told otherwise (--target-modules)
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: ``acquire``/``adapter_id_for`` argument meaning "the active adapter".
ACTIVE = -1
