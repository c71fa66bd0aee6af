#!/usr/bin/env python3
"""Stage a PEFT adapter directory on a node: the same as ``fabric stage NODE DIR --id ID``.

    scripts/stage_adapter.py 127.0.0.1:50051 path/to/adapter --id team-a/support-v3 [--json]

Uploads adapter_config.json and adapter_model.safetensors with a progress bar;
an interrupted upload resumes where it stopped when the command is run again.
"""

from __future__ import annotations

import sys

from adapter_fabric.cli.main import main

if __name__ == "__main__":
    main(["stage", *sys.argv[1:]])
