"""Package discovery for the wheel; the project's metadata is in pyproject.toml.

Every package under the source folders is found, never listed by hand: ``flowrl/`` installs as
``flowrl``, and the top-level ``pipelines/``, ``rewards/`` and ``recipes/`` install as
``flowrl.pipelines``, ``flowrl.rewards`` and ``flowrl.recipes`` (no top-level ``pipelines`` or
``rewards`` package is installed). Folders without an ``__init__.py`` that hold data (prompt sets,
recipes) are namespace packages, so their files ship as package data.
"""
from setuptools import find_namespace_packages, setup

# installed package -> source folder
SOURCE_ROOTS = {"flowrl": "flowrl", "flowrl.pipelines": "pipelines", "flowrl.rewards": "rewards",
                "flowrl.recipes": "recipes"}


def discover() -> list[str]:
    found = []
    for package, folder in SOURCE_ROOTS.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]
    return sorted(set(found))


setup(packages=discover(), package_dir={p: f for p, f in SOURCE_ROOTS.items() if p != f})
