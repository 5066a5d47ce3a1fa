"""Stand-ins for the few ComfyUI modules the nodes import lazily (folder_paths, comfy.utils,
comfy.model_management, comfy.samplers' lists), so the node classes run in CI without ComfyUI. They record
what the nodes did. The parallel MODEL itself (nodes/comfy_model.py) needs a real ComfyUI: tests/comfy.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest


class InterruptProcessingException(Exception):
    """Same name and role as comfy.model_management's: raised by the progress hook on Cancel."""


# Stand-in lists (a real ComfyUI has more): the nodes must offer exactly what comfy.samplers lists.
SAMPLERS = ["euler", "euler_ancestral", "heun", "dpmpp_2m", "fake_sampler"]
SCHEDULERS = ["simple", "normal", "sgm_uniform", "beta", "fake_scheduler"]


class FakeComfy:
    def __init__(self, models: Path, loras: Path | None = None) -> None:
        self.models = models
        self.loras = loras if loras is not None else models.parent / "loras"
        self.vaes = models.parent / "vae"
        self.calls: list[str] = []  # model_management calls, in order
        self.progress: list[tuple[int, int]] = []  # every update_absolute(value, total)
        self.interrupt_at: int | None = None  # raise from the progress bar once this step is reported
        self.interrupt_at_check: int | None = None  # raise from the n-th interrupt check (1-based)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fake = self
        folder_paths = types.ModuleType("folder_paths")

        folders = {
            "diffusion_models": fake.models,
            "loras": fake.loras,
            "vae": fake.vaes,
            "text_encoders": fake.models.parent / "te",
        }

        def get_filename_list(kind: str) -> list[str]:
            # ComfyUI lists its supported_pt_extensions only: a .gguf file is not among them
            folder = folders[kind]
            return (
                sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".gguf")
                if folder.is_dir()
                else []
            )

        def get_folder_paths(kind: str) -> list[str]:
            return [str(folders[kind])]

        def recursive_search(
            directory: str, excluded_dir_names: list[str] | None = None
        ) -> tuple[list, dict]:
            root = Path(directory)
            return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()], {}

        def filter_files_extensions(files: list[str], extensions: set[str]) -> list[str]:
            return sorted(f for f in files if Path(f).suffix.lower() in extensions)

        def get_full_path_or_raise(kind: str, name: str) -> str:
            path = folders[kind] / name
            if not path.is_file():
                raise FileNotFoundError(f"Model in folder '{kind}' with filename '{name}' not found.")
            return str(path)

        folder_paths.get_filename_list = get_filename_list
        folder_paths.get_folder_paths = get_folder_paths
        folder_paths.recursive_search = recursive_search
        folder_paths.filter_files_extensions = filter_files_extensions
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
        samplers = types.ModuleType("comfy.samplers")
        samplers.KSampler = type("KSampler", (), {"SAMPLERS": SAMPLERS, "SCHEDULERS": SCHEDULERS})
        comfy = types.ModuleType("comfy")
        comfy.__path__ = []
        comfy.utils, comfy.model_management, comfy.samplers = utils, mm, samplers
        for name, module in {
            "folder_paths": folder_paths,
            "comfy": comfy,
            "comfy.utils": utils,
            "comfy.model_management": mm,
            "comfy.samplers": samplers,
        }.items():
            monkeypatch.setitem(sys.modules, name, module)
