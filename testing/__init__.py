"""Helpers shared by the tests (tests/) and the benchmarks (benchmarks/): helpers.py (configs, timing, tables),
models.py (tiny configs, random inputs), writers.py (fp8 "mixed" checkpoints, LoRAs), fake.py (the fake
process group), meta.py (the meta-device tracer).

Not part of the installed package: pyproject lists neither this folder nor benchmarks/, and
tests/test_wheel.py checks the built wheel holds none of them.
"""
