"""Helpers the tests share, imported as ``tests.support.*`` (``tests`` is a package: no ``sys.path`` edits).

- ``store``: real PEFT adapters made once, store snapshots, StageBegin messages, byte flips;
- ``certs``: a throwaway certificate authority;
- ``hostile_corpus``: broken adapters, one defect each (tests/node/test_hostile.py);
- ``stage_worker``: a separate process working on a store (run as a script, ``STAGE_WORKER``);
- ``peers/``: hostile relay peers, each a separate gRPC server process (run as scripts, ``PEERS``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
PEERS = Path(__file__).resolve().parent / "peers"
STAGE_WORKER = Path(__file__).resolve().parent / "stage_worker.py"
