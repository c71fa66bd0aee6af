#!/usr/bin/env bash
# Create or reuse ./.venv with the project installed. Sourced by scripts/demo and scripts/test.
# A second run only checks a stamp, so it costs well under a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FABRIC_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "bootstrap: creating $venv" >&2
    "$python" -m venv "$venv"
fi

stamp="$venv/.fabric-installed"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            echo "bootstrap: GPU found, installing the default (CUDA) torch build" >&2
            "${pip[@]}" "torch>=2.2,<3"
        else
            # No GPU: the CPU build (a local wheel on these machines) instead of a multi-GB CUDA build.
            echo "bootstrap: no GPU, installing the CPU build of torch" >&2
            "${pip[@]}" "torch==2.13.0" 2>/dev/null \
                || "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "torch>=2.2,<3"
        fi
    fi
    echo "bootstrap: installing adapter-fabric and its test tools" >&2
    "${pip[@]}" -e "$root[test]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
