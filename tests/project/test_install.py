"""The wheel built from the clone, installed into a separate virtual environment as an engine image would.

An engine's image (vLLM, SGLang) already holds torch, grpc and the rest; adapter-fabric goes in beside them
without replacing any. Here the "engine environment" is a fresh venv whose base packages are this test run's
(a path entry to its site-packages, so nothing is downloaded): the wheel is installed there with
``--no-index`` and a constraint holding torch at the version present, so pip may add nothing and replace
nothing. Then, from outside the clone: ``import adapter_fabric`` comes from that venv, the vLLM plugin's
entry point resolves to it, the two commands run, and no top-level ``fabric`` or ``node`` exists
(``fabric`` is also the Fabric SSH library's import name; ``node`` a name other software uses).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow

#: what the wheel needs from the clone (a fresh clone has exactly these; the copy keeps builds out of the clone)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "fabric", "node")
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "fabric_lora_resolver"
PIP_TIMEOUT_S = 300


def _pip(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps`` over a copy of the clone's sources, with this environment's setuptools (offline)."""
    source = tmp_path_factory.mktemp("clone")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    out = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(source))
    (built,) = out.glob("adapter_fabric-*.whl")
    return built


@pytest.fixture(scope="module")
def engine_env(wheel: Path, tmp_path_factory) -> Path:
    """A fresh venv over this run's packages (the engine's), the wheel installed into it; its python."""
    home = tmp_path_factory.mktemp("engine")
    venv.create(home / "venv", with_pip=False, symlinks=True)
    python = home / "venv" / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    base = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # A plain path entry: the clone's editable-install hook (a .pth in that site-packages) is not run from it.
    (site / "zz_engine_base.pth").write_text("".join(f"{path}\n" for path in base))
    hold = home / "hold-torch.txt"
    hold.write_text(f"torch=={version('torch')}\n")
    done = _pip("--python", str(python), "install", "--no-index", "--constraint", str(hold), str(wheel))
    installed = [line for line in done.stdout.splitlines() if line.startswith("Successfully installed")]
    assert installed == [f"Successfully installed adapter-fabric-{version('adapter-fabric')}"], done.stdout[-2000:]
    return python


def _run(python: Path, code: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points).decode()
    top = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top == {"adapter_fabric"}, top
    assert "adapter_fabric/node/main.py" in names and "adapter_fabric/v1/fabric_pb2.py" in names
    assert "adapter_fabric/node/__init__.py" in names and not any(n.startswith(("fabric/", "node/")) for n in names)
    assert f"{PLUGIN_NAME} = adapter_fabric.integrations.vllm_resolver:register" in declared
    assert "fabric = adapter_fabric.cli:main" in declared and "fabric-node = adapter_fabric.node.main:main" in declared


def test_the_engine_environment_imports_the_wheel_not_the_clone(engine_env: Path, tmp_path: Path) -> None:
    code = f"""
import importlib.metadata as md, importlib.util, json
import adapter_fabric
(plugin,) = [e for e in md.entry_points(group={PLUGIN_GROUP!r}) if e.name == {PLUGIN_NAME!r}]
register = plugin.load()
print(json.dumps({{
    "package": adapter_fabric.__file__,
    "version": adapter_fabric.__version__,
    "plugin": register.__module__ + ":" + register.__name__,
    "plugin_file": importlib.util.find_spec(register.__module__).origin,
    "dist": str(md.distribution("adapter-fabric").locate_file("")),
    "fabric": importlib.util.find_spec("fabric") is not None,
    "node": importlib.util.find_spec("node") is not None,
    "torch": md.version("torch"),
}}))
"""
    found = _run(engine_env, code, cwd=tmp_path)
    venv_dir = str(engine_env.parent.parent)
    assert found["package"].startswith(venv_dir) and not found["package"].startswith(str(ROOT)), found
    assert found["plugin"] == "adapter_fabric.integrations.vllm_resolver:register" and found["plugin_file"].startswith(venv_dir)
    assert found["dist"].startswith(venv_dir) and found["version"] == version("adapter-fabric")
    assert not found["fabric"] and not found["node"], "a top-level fabric or node module is importable"
    assert found["torch"] == version("torch"), "installing the wheel replaced the engine's torch"


def test_the_commands_run_from_the_engine_environment(engine_env: Path, tmp_path: Path) -> None:
    bin_dir = engine_env.parent
    for command in ("fabric", "fabric-node"):
        done = subprocess.run([bin_dir / command, "--version"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 0 and version("adapter-fabric") in done.stdout + done.stderr, (command, done.stderr[-2000:])
