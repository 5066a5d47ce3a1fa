"""The wheel's packages, found by setuptools itself (metadata and options: pyproject.toml).

The repository root *is* the package `rocm_parallel` (ComfyUI loads it from custom_nodes/<any folder>, and
`pip install -e .` exposes the same tree), which pyproject's `packages.find` cannot say: it names packages
after their folders, with no parent package. So the root and every package setuptools finds under backend/
and nodes/ (a new family's folder, a new room) ship without a list to extend; benchmarks/, testing/ and
tests/ run from a checkout and stay out of the wheel (tests/test_wheel.py checks both).
"""

from setuptools import find_packages, setup

SHIPPED = ("backend", "backend.*", "nodes", "nodes.*")

setup(packages=["rocm_parallel", *(f"rocm_parallel.{p}" for p in find_packages(include=SHIPPED))])
