"""The torch versions the pack runs on, checked when the pack is imported, without importing torch.

`pyproject.toml` asks pip for `torch>=2.9`, a lower bound only: a user's ROCm or CUDA torch of 2.9 or newer
is never replaced. But ComfyUI-Manager and the Comfy Registry install `requirements.txt`, which names no
torch on purpose (it must not replace ComfyUI's), and a checkout in custom_nodes/ is never installed at
all: there an older torch would fail deep inside a worker with an AttributeError. So `import rocm_parallel`
(ComfyUI loading the pack, the command line, the Python API) refuses a torch below the range first, in
one message with the range and the install commands. The version comes from the installed distribution's
metadata (`importlib.metadata`), so the check costs no torch import: loading the pack stays cheap.

The range is what CI tests (.ci/run): the lowest supported release, the GPU machines'
2.11, the README's CPU wheel and the newest release; tests/test_packaging.py keeps the three places
(this module, pyproject.toml, .ci/run) in step.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

LOWEST = (2, 9)  # = pyproject.toml's `torch>=2.9` (tests/test_packaging.py)
# the releases CI tests (.ci/run: the whole suite on 2.13, the tests marked torch_api on the others)
TESTED = ("2.9.1", "2.11.0", "2.13.0", "2.15.0")
INSTALL = (
    "install torch first, then this pack: ROCm (Linux): pip install torch --index-url "
    "https://download.pytorch.org/whl/rocmX.Y (X.Y from pytorch.org's install selector, e.g. rocm6.4); "
    "NVIDIA: pip install torch; CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu"
)


class TorchVersionError(ImportError):
    """The installed torch is missing or older than the pack supports."""


def installed_torch() -> str | None:
    """The installed torch's version ('2.9.1+rocm7.1'): the imported module's when torch is imported (in
    ComfyUI it is), else read from its metadata; None when there is none."""
    imported = sys.modules.get("torch")
    if imported is not None and isinstance(getattr(imported, "__version__", None), str):
        return str(imported.__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: '2.9.1+rocm7.1' -> (2, 9), '2.10.0a0+git' -> (2, 10)."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if not found:
        raise TorchVersionError(f"torch reports the version {version!r}, which is not a release number")
    return int(found[1]), int(found[2])


def supported() -> str:
    return f"torch >= {LOWEST[0]}.{LOWEST[1]} (CI tests {', '.join(TESTED)})"


def check_torch(version: str | None = None) -> None:
    """Raise TorchVersionError naming the installed version, the supported range and the install commands
    when torch is missing or older than LOWEST (`version`: the installed one by default)."""
    version = installed_torch() if version is None else version
    if version is None:
        raise TorchVersionError(f"ROCm Parallel needs {supported()}, and this Python has no torch: {INSTALL}")
    if release(version) < LOWEST:
        raise TorchVersionError(
            f"ROCm Parallel needs {supported()}; this Python has torch {version}. Upgrade torch, keeping "
            f"your build (ROCm, CUDA or CPU): {INSTALL}"
        )
