"""Install names: the folders fabric/ and node/ install as adapter_fabric and adapter_fabric.node.

``fabric`` is also the import name of the Fabric SSH library and ``node`` a name other software uses, so
an engine's environment (vLLM, SGLang) gets one top-level package, ``adapter_fabric``, that collides with
nothing. pyproject.toml cannot prefix the packages it finds, so the list is computed here from the folders
(a package added under fabric/ or node/ is installed without editing this file).
"""

from setuptools import find_packages, setup

#: import package -> folder (the project's layout keeps the folder names)
FOLDERS = {"adapter_fabric": "fabric", "adapter_fabric.node": "node"}


def _packages() -> list[str]:
    found = []
    for package, folder in FOLDERS.items():
        found += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages(), package_dir=FOLDERS)
