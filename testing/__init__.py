"""Helpers shared by the tests (tests/) and the benchmarks (benchmarks/): see testing/helpers.py.

Not part of the installed package: pyproject lists neither this folder nor benchmarks/, and
tests/test_wheel.py checks the built wheel holds none of them.
"""
