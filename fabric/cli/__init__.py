"""The ``fabric`` command line (``python -m adapter_fabric.cli`` runs it too)."""

from adapter_fabric.cli.main import main

__all__ = ["main"]
