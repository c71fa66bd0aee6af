#!/usr/bin/env bash
# Create or reuse ./.venv with the project installed. Sourced by scripts/demo and scripts/test.
# A second run only checks a stamp, so it costs well under a second.
#
# torch: on a machine with an NVIDIA GPU, the default (CUDA) build. Without one, a CPU build, never the
# multi-GB CUDA build by accident: first a CPU wheel this machine's pip already offers (a local wheel
# or mirror), else PyTorch's CPU index (FABRIC_TORCH_INDEX, default https://download.pytorch.org/whl/cpu).
# Each candidate is resolved with `pip install --dry-run --report` and taken only if the wheel it picks
# is a CPU build (+cpu in its version, or a non-Linux wheel, which PyTorch builds for CPU only).
# FABRIC_TORCH_PICK_ONLY=1 prints the choice and exits without creating anything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FABRIC_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
torch_spec="torch>=2.2,<3"
cpu_index="${FABRIC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

# The wheel a pip run would pick: "cpu VERSION", "other VERSION" (a CUDA build), or nothing (unreachable).
resolve_torch() {  # resolve_torch PYTHON SPEC [PIP ARGS...]
    local py="$1" spec="$2" report
    shift 2
    report="$(mktemp)"
    "$py" -m pip install --quiet --disable-pip-version-check --dry-run --ignore-installed --no-deps \
        --timeout 15 --retries 1 --report "$report" "$@" "$spec" >/dev/null 2>&1 || { rm -f "$report"; return 1; }
    "$py" - "$report" <<'PY'
import json, platform, sys
for item in json.load(open(sys.argv[1]))["install"]:
    if item["metadata"]["name"].lower() == "torch":
        version, url = item["metadata"]["version"], item["download_info"]["url"]
        # Linux wheels without +cpu (PyPI's) are the CUDA build, with GBs of nvidia-* dependencies.
        print("cpu" if "+cpu" in version or platform.system() != "Linux" else "other", version, url)
PY
    rm -f "$report"
}

# Requirement specs worth a dry run: each +cpu version in range that pip lists (on Linux), or the range itself.
cpu_candidates() {  # cpu_candidates PYTHON
    "$1" - <<'PY'
import platform, re, subprocess, sys
if platform.system() != "Linux":
    print("torch>=2.2,<3")  # PyTorch builds its non-Linux wheels for CPU only
    sys.exit()
listing = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch", "--timeout", "15", "--retries", "1"], capture_output=True, text=True).stdout
found = re.search(r"Available versions: (.*)", listing)
for version in (found.group(1).split(", ") if found else []):
    major, minor = (int(x) for x in version.split(".")[:2])
    if "+cpu" in version and (2, 2) <= (major, minor) < (3, 0):
        print(f"torch=={version}")
PY
}

# pick_cpu_torch PYTHON: print "VERSION<TAB>SOURCE" of a CPU build of torch, or say what to do and fail.
pick_cpu_torch() {
    local py="$1" spec kind version url
    # 1. CPU builds this machine's pip (its config, mirrors, local wheels) offers, newest first: pip would
    #    otherwise prefer a newer CUDA build of the same range. Each is confirmed by a dry run.
    for spec in $(cpu_candidates "$py" | head -n 3); do
        read -r kind version url < <(resolve_torch "$py" "$spec" || true) || continue
        if [ "$kind" = cpu ]; then
            printf '%s\tdefault\n' "$version"
            return 0
        fi
    done
    # 2. PyTorch's CPU index alone (no local config, mirrors or extra indexes mixed in).
    read -r kind version url < <(cpu_index_pip resolve_torch "$py" "$torch_spec" --index-url "$cpu_index" || true) || true
    if [ "${kind:-}" = cpu ]; then
        printf '%s\t%s\n' "$version" "$cpu_index"
        return 0
    fi
    echo "bootstrap: no CPU build of torch: this machine's pip offers none, and $cpu_index" >&2
    echo "bootstrap: cannot be reached (or has no CPU build). Either set FABRIC_TORCH_INDEX to a reachable" >&2
    echo "bootstrap: mirror of PyTorch's CPU index, or install a CPU torch (>=2.2,<3) into $venv yourself" >&2
    echo "bootstrap: (python3 -m venv $venv && $venv/bin/pip install torch --index-url URL), then run this again." >&2
    return 1
}

# Run a pip command against the CPU index alone: no config files, mirrors or local wheels.
cpu_index_pip() {
    (
        unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
        export PIP_CONFIG_FILE=/dev/null
        "$@"
    )
}

# vLLM's own code for tests/integrations/test_vllm.py: the pinned package without its dependencies (they
# include a CUDA torch) plus the pure-Python ones its plugin loader, resolver registry and OpenAI serving
# layer import (and uvicorn, which serves that layer in tests/support/vllm_engine.py), with torch held at the installed build. Soft: when it cannot be installed (no registry),
# say why; the suite still runs and those tests skip, naming the reason.
VLLM_TESTED="vllm==0.34.0"
VLLM_IMPORTS=(packaging msgspec pyzmq urllib3 aiohttp requests pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo
              llguidance "xgrammar==0.2.8" cbor2 fastapi uvicorn)
# pip's notes that are not problems: a configured find-links location this machine lacks (one per package it
# looks up), and vLLM's own pins, left unmet on purpose (below). Every pip call's stderr goes through this.
drop_pip_noise() {
    grep -v -e "is ignored: it is neither" -e "^vllm .* requires " -e "dependency resolver does not currently take into account" || true
}
install_vllm_for_tests() {
    local torch_now hold
    torch_now="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
    hold="$(mktemp)"
    echo "torch==$torch_now" > "$hold"
    echo "bootstrap: installing $VLLM_TESTED without its dependencies, for the vLLM tests" >&2
    # pip reports vLLM's own pins (a CUDA torch and more) as unmet: left so on purpose, so that noise is dropped.
    if ! "${pip[@]}" --no-deps "$VLLM_TESTED" 2> >(drop_pip_noise >&2) \
       || ! PIP_CONSTRAINT="$hold" "${pip[@]}" "${VLLM_IMPORTS[@]}" 2> >(drop_pip_noise >&2); then
        echo "bootstrap: could not install $VLLM_TESTED and its imports (see above): the vLLM tests will skip" >&2
    fi
    rm -f "$hold"
}

if [ "${FABRIC_TORCH_PICK_ONLY:-}" = 1 ]; then
    pick_cpu_torch "$python"
    exit $?
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "bootstrap: creating $venv" >&2
    "$python" -m venv "$venv"
fi

stamp="$venv/.fabric-installed"
want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            echo "bootstrap: GPU found, installing the default (CUDA) torch build" >&2
            "${pip[@]}" "$torch_spec" 2> >(drop_pip_noise >&2)
        else
            picked="$(pick_cpu_torch "$venv/bin/python")"
            version="${picked%%$'\t'*}" source="${picked#*$'\t'}"
            echo "bootstrap: no GPU, installing the CPU build torch $version ($source)" >&2
            if [ "$source" = default ]; then
                "${pip[@]}" "torch==$version" 2> >(drop_pip_noise >&2)
            else
                cpu_index_pip "${pip[@]}" --index-url "$source" "torch==$version" 2> >(drop_pip_noise >&2)
            fi
        fi
    fi
    echo "bootstrap: installing adapter-fabric and its test tools" >&2
    "${pip[@]}" -e "$root[test]" 2> >(drop_pip_noise >&2)
    install_vllm_for_tests
    echo "$want" > "$stamp"
fi
# nginx serves the HTTP origin tests (tests/support/origin_servers.py). Soft, like vLLM: as root with apt-get it is
# installed when missing (a fresh CI machine); otherwise those tests skip, naming the reason.
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing nginx-light for the HTTP origin tests" >&2
    if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light) >/dev/null 2>&1; then
        echo "bootstrap: could not install nginx-light: the HTTP origin tests will skip" >&2
    fi
fi
export PATH="$venv/bin:$PATH"
