"""A PEFT adapter directory as ``save_pretrained`` writes it: its config and weights files, or a refusal saying what was given."""

from __future__ import annotations

from pathlib import Path

from adapter_fabric.errors import InvalidAdapter
from adapter_fabric.format.config import CONFIG_FILE
from adapter_fabric.store.digests import WEIGHTS_FILE


def adapter_files(adapter_dir: str | Path) -> tuple[Path, Path]:
    """The config and weights files of a PEFT adapter directory; ``InvalidAdapter`` saying what was given instead."""
    adapter_dir = Path(adapter_dir)
    layout = f"a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}"
    if adapter_dir.is_file():
        raise InvalidAdapter(f"{adapter_dir} is a file, not a directory: give the directory that holds it ({adapter_dir.parent}); {layout}")
    if not adapter_dir.is_dir():
        raise InvalidAdapter(f"{adapter_dir} does not exist: give an adapter directory ({layout}; fabric make-adapter writes one)")
    missing = [adapter_dir / name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (adapter_dir / name).is_file()]
    if missing:
        raise InvalidAdapter(f"{' and '.join(map(str, missing))} does not exist: {layout}, as PEFT's save_pretrained writes them")
    return adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
