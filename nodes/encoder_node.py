"""The ROCm Parallel Text Encoder Loader node: ComfyUI's CLIP with its big text encoder sharded on the
resident worker group (nodes/comfy_clip.py builds it; backend/encoders/ runs it)."""

from __future__ import annotations

from typing import Any

from ..backend.resident.parking import DEFAULT_POLICY, PARK_POLICIES, check_policy
from . import inputs
from .inputs import CATEGORY
from .registry import REGISTRY, shows_errors

NONE = "none"  # no second file (every encoder but FLUX.1's T5-XXL, which takes CLIP-L beside it)


def encoder_slot(unique_id: str | None) -> str:
    """The group's slot for this loader's encoder: its node id, so two loaders keep two encoders resident."""
    from ..backend.encoders.messages import ENCODER_SLOT

    return f"{ENCODER_SLOT} {unique_id}" if unique_id not in (None, "") else ENCODER_SLOT


class RocmParallelTextEncoderLoader:
    DESCRIPTION = (
        "Loads a text encoder as a standard ComfyUI CLIP whose transformer runs tensor-parallel on the ROCm "
        "Parallel workers (attention heads, MLP and token embeddings split; each GPU reads only its slices). "
        "Use it where CLIPLoader / DualCLIPLoader would go, with the same files and type; ComfyUI's own text "
        "nodes (CLIPTextEncode, CLIPTextEncodeFlux, ...) work on it unchanged. A second file the pack does not "
        "shard (the CLIP-L beside T5-XXL) stays in ComfyUI's process."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CLIP",)
    RETURN_NAMES = ("clip",)
    OUTPUT_TOOLTIPS = ("ComfyUI's CLIP for these files; each encode runs once on every worker.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        import folder_paths

        from ..backend.encoders.kind import clip_types

        files = folder_paths.get_filename_list("text_encoders")
        return {
            "required": {
                "clip_name1": (
                    files,
                    {"tooltip": "The text encoder the workers shard (T5-XXL, Mistral 3, ...)."},
                ),
                "clip_name2": (
                    [NONE, *files],
                    {
                        "default": NONE,
                        "tooltip": "The second file of a dual encoder (CLIP-L beside T5-XXL), or none.",
                    },
                ),
                "type": (
                    clip_types(),
                    {"tooltip": "ComfyUI's CLIPLoader type: the graph the encoder is for."},
                ),
                "devices": (
                    "STRING",
                    {
                        "default": inputs.DEVICES_ALL,
                        "tooltip": "The worker group's devices: the same as the ROCm Parallel Loader's, so the "
                        "encoder and the diffusion model share the workers.",
                    },
                ),
            },
            "optional": {
                "placement": (
                    list(PARK_POLICIES),
                    {
                        "default": DEFAULT_POLICY,
                        "tooltip": "Where the encoder's shard waits between prompts. auto: on the GPUs, moved to "
                        "host memory only when sampling or a VAE decode needs the room (and back for the next "
                        "prompt); resident: always on the GPUs; host: in host memory except while encoding.",
                    },
                ),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @shows_errors
    def load(
        self,
        clip_name1: str,
        clip_name2: str,
        type: str,
        devices: str,
        placement: str = DEFAULT_POLICY,
        unique_id: str | None = None,
    ) -> tuple[Any]:
        import folder_paths

        from ..backend.runtime.client import validate_devices
        from .comfy_clip import build_clip

        names = [clip_name1] + ([clip_name2] if clip_name2 != NONE else [])
        paths = [folder_paths.get_full_path_or_raise("text_encoders", name) for name in names]
        group = REGISTRY.group_for(validate_devices(inputs.parse_devices(devices)))
        check_policy(placement)
        REGISTRY.watch_residency(group)
        return (build_clip(group, paths, type, slot=encoder_slot(unique_id), placement=placement),)


__all__ = ["RocmParallelTextEncoderLoader", "encoder_slot"]
