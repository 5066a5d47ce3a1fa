"""The comfy tier's one ComfyUI server per session (skipped cleanly without COMFYUI_PATH)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from comfy_server import COMFYUI_PATH, Comfy, running_comfy


@pytest.fixture(scope="session")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Comfy]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    with running_comfy(tmp_path_factory.mktemp("comfy-base")) as server:
        yield server
