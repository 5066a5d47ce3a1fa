"""The import check's record of this ComfyUI version (tests/data/comfy_api-<version>.json, which CI checks
the pack's uses against) is what this real ComfyUI has: every recorded name described again here, live."""

from __future__ import annotations

import sys

import pytest
from comfy_server import COMFYUI_PATH, COMFYUI_VERSION, TESTS_DIR

pytestmark = pytest.mark.comfy


def test_the_record_of_this_version_is_what_this_comfyui_has():
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    from comfy_uses import records, scan
    from dump_comfy_api import describe, import_comfyui

    assert import_comfyui(COMFYUI_PATH) == COMFYUI_VERSION
    record = records().get(COMFYUI_VERSION)
    assert record is not None, (
        f"no tests/data/comfy_api-{COMFYUI_VERSION}.json: run tests/tools/dump_comfy_api.py"
    )
    assert {u.name for u in scan()} <= set(record["names"])
    live = {name: describe(name) for name in record["names"]}
    assert live == record["names"]
