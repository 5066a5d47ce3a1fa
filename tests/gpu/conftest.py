"""GPU tier: opt-in with RP_GPU_TESTS=1 on a machine with CUDA or ROCm GPUs; skipped cleanly otherwise."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    if os.environ.get("RP_GPU_TESTS") != "1":
        reason = "GPU tier is opt-in: set RP_GPU_TESTS=1"
    elif not torch.cuda.is_available():
        reason = "no CUDA/ROCm GPU visible"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
