"""Import-only stand-ins for torchvision and torchaudio, for the real-ComfyUI tier on a CPU-only torch.

ComfyUI imports torchvision and torchaudio at start-up (comfy/sd.py, several comfy_extras nodes), and the
package registries' builds of them for a CPU torch 2.13 are CUDA builds that fail to import
(`operator torchvision::nms does not exist`). The tier never calls them, so a meta-path finder answers every
`torchvision.*` / `torchaudio.*` import with a module whose attributes are classes that exist and raise when
instantiated. Their class attributes are such classes too: transformers reads
`torchvision.transforms.InterpolationMode.NEAREST_EXACT` at import. Test-tier helper only (never shipped);
scripts/comfy_tier.sh puts this folder first on PYTHONPATH.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

STANDING_IN_FOR = ("torchvision", "torchaudio")
VERSION = "0.0.0+standin"


def _refuse(name: str) -> Any:
    def __init__(self: object, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(
            f"{name} is an import-only stand-in in the comfy tier's environment (no CPU build)"
        )

    return __init__


class _StandInClass(type):
    """A stand-in class; its own attributes (an enum member, a constant) are stand-in classes as well."""

    def __getattr__(cls, attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return stand_in_class(f"{cls.__module__}.{cls.__name__}", attr)


def stand_in_class(module: str, name: str) -> type:
    return _StandInClass(name, (), {"__init__": _refuse(f"{module}.{name}"), "__module__": module})


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        cls = stand_in_class(self.__name__, attr)
        setattr(self, attr, cls)
        return cls


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every module under STANDING_IN_FOR and makes it a (package-shaped) `_StandInModule`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in STANDING_IN_FOR:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        if spec.name in STANDING_IN_FOR:
            module.__version__ = VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())
