"""Stand-ins for the few ComfyUI modules the nodes import lazily (folder_paths, comfy.utils,
comfy.model_management), so the node classes run in CI without ComfyUI. They record what the nodes did.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest


class InterruptProcessingException(Exception):
    """Same name and role as comfy.model_management's: raised by the progress hook on Cancel."""


class FakeComfy:
    def __init__(self, models: Path) -> None:
        self.models = models
        self.calls: list[str] = []  # model_management calls, in order
        self.progress: list[tuple[int, int]] = []  # every update_absolute(value, total)
        self.interrupt_at: int | None = None  # raise from the progress bar once this step is reported
        self.interrupt_at_check: int | None = None  # raise from the n-th interrupt check (1-based)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self
        folder_paths = types.ModuleType("folder_paths")

        def get_filename_list(kind: str) -> list[str]:
            assert kind == "diffusion_models"
            return sorted(p.name for p in fake.models.iterdir())

        def get_full_path_or_raise(kind: str, name: str) -> str:
            path = fake.models / name
            if kind != "diffusion_models" or not path.is_file():
                raise FileNotFoundError(f"Model in folder '{kind}' with filename '{name}' not found.")
            return str(path)

        folder_paths.get_filename_list = get_filename_list
        folder_paths.get_full_path_or_raise = get_full_path_or_raise

        mm = types.ModuleType("comfy.model_management")
        mm.InterruptProcessingException = InterruptProcessingException
        mm.unload_all_models = lambda: fake.calls.append("unload_all_models")
        mm.soft_empty_cache = lambda force=False: fake.calls.append("soft_empty_cache")

        def throw_exception_if_processing_interrupted() -> None:
            fake.calls.append("check_interrupt")
            if (
                fake.interrupt_at_check is not None
                and fake.calls.count("check_interrupt") >= fake.interrupt_at_check
            ):
                raise InterruptProcessingException()

        mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted

        class ProgressBar:
            def __init__(self, total: int, node_id: str | None = None) -> None:
                self.total = total

            def update_absolute(self, value: int, total: int | None = None, preview: object = None) -> None:
                self.total = total if total is not None else self.total
                fake.progress.append((value, self.total))
                if fake.interrupt_at is not None and value >= fake.interrupt_at:
                    raise InterruptProcessingException()

        utils = types.ModuleType("comfy.utils")
        utils.ProgressBar = ProgressBar
        comfy = types.ModuleType("comfy")
        comfy.__path__ = []
        comfy.utils, comfy.model_management = utils, mm
        for name, module in {
            "folder_paths": folder_paths,
            "comfy": comfy,
            "comfy.utils": utils,
            "comfy.model_management": mm,
        }.items():
            monkeypatch.setitem(sys.modules, name, module)
