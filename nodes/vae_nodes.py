"""The ROCm Parallel VAE Decode and Encode node classes (V1 schema): widgets, and a call into nodes/vae.py.

ComfyUI modules are imported inside the methods, so this module imports outside ComfyUI too.
"""

from __future__ import annotations

from typing import Any

from . import vae
from .inputs import CATEGORY, HANDLE_TYPE, ParallelHandle
from .registry import REGISTRY, shows_errors

_VAE_TOOLTIP = (
    "A VAE from models/vae/ as ComfyUI's Load VAE reads it: the one the loaded model's family decodes with "
    "(docs/nodes.md lists them). Every worker reads it and keeps it resident beside the model."
)
_HANDLE_TOOLTIP = "The worker group from a ROCm Parallel Loader: the VAE runs on its devices."


def _vae_files() -> list[str]:
    import folder_paths

    return folder_paths.get_filename_list("vae")


def _vae_path(vae_name: str) -> str:
    import folder_paths

    return folder_paths.get_full_path_or_raise("vae", vae_name)


class RocmParallelVAEDecode:
    DESCRIPTION = (
        "ComfyUI's VAE Decode split over the loader's devices: the latent in horizontal bands, one per device, "
        "the rows each convolution reads past a band exchanged with its neighbours, GroupNorm over the whole "
        "image and the mid-block attention over every token, so the image equals the untiled decode (no tile "
        "seams) while each GPU holds only its band's activations."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded image, as VAE Decode gives it.",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "parallel_flux": (HANDLE_TYPE, {"tooltip": _HANDLE_TOOLTIP}),
                "samples": ("LATENT", {"tooltip": "The latent to decode (from a sampler)."}),
                "vae_name": (_vae_files(), {"tooltip": _VAE_TOOLTIP}),
            }
        }

    @shows_errors
    def decode(self, parallel_flux: ParallelHandle, samples: dict[str, Any], vae_name: str) -> tuple[Any]:
        return (vae.decode(REGISTRY, parallel_flux, _vae_path(vae_name), samples),)


class RocmParallelVAEEncode:
    DESCRIPTION = (
        "ComfyUI's VAE Encode split over the loader's devices in horizontal bands (for img2img and edit "
        "references), equal to the untiled encode."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The encoded latent, as VAE Encode gives it.",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "parallel_flux": (HANDLE_TYPE, {"tooltip": _HANDLE_TOOLTIP}),
                "pixels": ("IMAGE", {"tooltip": "The image to encode."}),
                "vae_name": (_vae_files(), {"tooltip": _VAE_TOOLTIP}),
            }
        }

    @shows_errors
    def encode(self, parallel_flux: ParallelHandle, pixels: Any, vae_name: str) -> tuple[dict[str, Any]]:
        return (vae.encode(REGISTRY, parallel_flux, _vae_path(vae_name), pixels),)
