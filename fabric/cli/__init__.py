"""The ``fabric`` command line (``python -m fabric.cli`` runs it too)."""

from fabric.cli.main import main

__all__ = ["main"]
