"""Package layout: kernels/, datasets/ and eval/ sit at the top of the repository but install inside the
`imggen` namespace (imggen.kernels, imggen.datasets, imggen.eval), so nothing installs a top-level
`datasets` or `eval`. Every subpackage under those four roots is found here, so a new folder with an
__init__.py ships in the wheel without editing a list (everything else is in pyproject.toml)."""
from setuptools import find_packages, setup

ROOTS = {"imggen": "imggen", "imggen.kernels": "kernels", "imggen.datasets": "datasets", "imggen.eval": "eval"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages(), package_dir=ROOTS)
