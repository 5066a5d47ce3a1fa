"""The ComfyUI node classes (V1 schema): inputs, outputs, and a call into `logic`. Nothing else.

ComfyUI modules (`folder_paths`, `comfy.*`) are imported inside the methods, so this module imports
outside ComfyUI too (the tests read INPUT_TYPES with stand-ins for those modules).
"""

from __future__ import annotations

from typing import Any

from . import logic
from .logic import CATEGORY, HANDLE_TYPE, REGISTRY

SEED_MAX = 0xFFFFFFFFFFFFFFFF  # ComfyUI's KSampler seed range

_HANDLE_TOOLTIP = "The worker group and checkpoint from a ROCm Parallel Loader."


def _free_comfy_models(devices: tuple[str, ...]) -> None:
    """Give the GPUs to the workers: ComfyUI's own resident models would otherwise hold their memory."""
    import comfy.model_management as mm

    if logic.needs_gpu_memory(devices):
        mm.unload_all_models()
        mm.soft_empty_cache()


def _interrupted() -> None:
    """Raises ComfyUI's InterruptProcessingException when the user pressed Cancel (checked between the
    tensors of a load, so a Cancel during a long load stops it there on every rank)."""
    import comfy.model_management as mm

    mm.throw_exception_if_processing_interrupted()


def _progress_bar(total: int):
    """ComfyUI's progress bar; its hook raises on a pending interrupt, which cancels the job on all ranks."""
    import comfy.utils

    bar = comfy.utils.ProgressBar(total)
    return lambda step, steps: bar.update_absolute(step, steps)


def _sampler_inputs() -> dict[str, Any]:
    return {
        "parallel_flux": (HANDLE_TYPE, {"tooltip": _HANDLE_TOOLTIP}),
        "positive": (
            "CONDITIONING",
            {
                "tooltip": "One FLUX prompt: CLIPTextEncode (with a FLUX DualCLIPLoader), then FluxGuidance for dev."
            },
        ),
        "latent_image": (
            "LATENT",
            {"tooltip": "The latent to denoise: EmptySD3LatentImage for text-to-image, or an encoded image."},
        ),
        "seed": (
            "INT",
            {
                "default": 0,
                "min": 0,
                "max": SEED_MAX,
                "control_after_generate": True,
                "tooltip": "The noise seed; the same seed gives the same image as ComfyUI's KSampler.",
            },
        ),
        "steps": (
            "INT",
            {"default": 20, "min": 1, "max": 10000, "tooltip": "Denoising steps (ignored with sigmas)."},
        ),
        "sampler_name": (
            list(logic.SAMPLERS),
            {"tooltip": "The sampling algorithm; the parallel samplers implement euler."},
        ),
        "scheduler": (
            list(logic.SCHEDULERS),
            {"tooltip": "The noise schedule; the parallel samplers implement simple."},
        ),
        "denoise": (
            "FLOAT",
            {
                "default": 1.0,
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "How much of the latent is replaced: 1.0 for text-to-image, less for image-to-image.",
            },
        ),
    }


_SIGMAS_INPUT = {
    "sigmas": (
        "SIGMAS",
        {"tooltip": "Optional custom schedule (e.g. BasicScheduler); replaces steps, scheduler and denoise."},
    )
}


class RocmParallelLoader:
    DESCRIPTION = (
        "Starts one worker process per device and loads a FLUX.1 diffusion model on them. The workers "
        "stay resident between queue runs; running again with the same devices reuses them."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = (HANDLE_TYPE,)
    RETURN_NAMES = ("parallel_flux",)
    OUTPUT_TOOLTIPS = ("The resident worker group and checkpoint, for a TP or Ring Attention Sampler.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        import folder_paths

        return {
            "required": {
                "checkpoint": (
                    folder_paths.get_filename_list("diffusion_models"),
                    {"tooltip": "A FLUX.1 dev or schnell transformer from models/diffusion_models."},
                ),
                "devices": (
                    "STRING",
                    {
                        "default": logic.DEVICES_ALL,
                        "tooltip": "'all' visible GPUs, a list of GPU indices such as '0,1,2,3', or CPU "
                        "workers for testing such as 'cpu x2'.",
                    },
                ),
                "dtype": (
                    list(logic.DTYPES),
                    {
                        "default": "default",
                        "tooltip": "Weight and compute dtype on the workers; default is bfloat16 on GPUs, "
                        "float32 on CPU. fp8 checkpoints are upcast to it.",
                    },
                ),
                "preload": (
                    list(logic.PRELOAD_LAYOUTS),
                    {
                        "default": "none",
                        "tooltip": "Load the weights now in this layout (tp = tensor parallel, context = ring "
                        "attention, auto = the planner's choice for these GPUs and a 1024x1024 image, "
                        "explained on the node), or 'none' to load them when a sampler first runs.",
                    },
                ),
            }
        }

    @classmethod
    def VALIDATE_INPUTS(cls, devices: str) -> bool | str:
        # Runs when the prompt is queued: a bad device list is reported before anything executes.
        from ..backend.client import validate_devices
        from ..backend.config import ConfigError

        try:
            validate_devices(logic.parse_devices(devices))
        except ConfigError as exc:
            return str(exc)
        return True

    def load(self, checkpoint: str, devices: str, dtype: str, preload: str) -> tuple[logic.ParallelHandle]:
        import folder_paths

        from ..backend.client import validate_devices

        handle = logic.ParallelHandle(
            checkpoint=folder_paths.get_full_path_or_raise("diffusion_models", checkpoint),
            name=checkpoint,
            devices=validate_devices(logic.parse_devices(devices)),
            dtype=logic.compute_dtype(dtype),
        )
        if preload != "none":
            _free_comfy_models(handle.devices)
        logic.load(REGISTRY, handle, preload, interrupted=_interrupted)
        return (handle,)


class _ParallelSampler:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent, for VAEDecode.",)
    FUNCTION = "sample"

    def _run(
        self,
        layout: Any,
        parallel_flux: logic.ParallelHandle,
        positive: Any,
        latent_image: dict[str, Any],
        seed: int,
        steps: int,
        denoise: float,
        sigmas: Any = None,
    ) -> tuple[dict[str, Any]]:
        import comfy.model_management as mm

        mm.throw_exception_if_processing_interrupted()
        total = steps if sigmas is None else max(len(sigmas) - 1, 0)
        out = logic.sample(
            REGISTRY,
            parallel_flux,
            layout,
            positive,
            latent_image,
            seed=seed,
            steps=steps,
            denoise=denoise,
            sigmas=sigmas,
            progress=_progress_bar(total),
            interrupted=_interrupted,
            make_room=lambda: _free_comfy_models(parallel_flux.devices),
        )
        return (out,)


class RocmParallelTPSampler(_ParallelSampler):
    DESCRIPTION = (
        "Samples FLUX like KSampler (euler, simple, cfg 1) with the weights split over every device of the "
        "loader (tensor parallelism): the way to fit a model that is too big for one GPU."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": _sampler_inputs(), "optional": dict(_SIGMAS_INPUT)}

    def sample(
        self,
        parallel_flux: logic.ParallelHandle,
        positive: Any,
        latent_image: dict[str, Any],
        seed: int,
        steps: int,
        sampler_name: str,
        scheduler: str,
        denoise: float,
        sigmas: Any = None,
    ) -> tuple[dict[str, Any]]:
        layout = logic.tp_layout(len(parallel_flux.devices))
        return self._run(layout, parallel_flux, positive, latent_image, seed, steps, denoise, sigmas)


class RocmParallelRingSampler(_ParallelSampler):
    DESCRIPTION = (
        "Samples FLUX like KSampler (euler, simple, cfg 1) with the image tokens split over the devices "
        "(context parallelism: ring attention x Ulysses). Every device holds the whole model; this speeds "
        "up large images."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        degree = {"default": 0, "min": 0, "max": 64}
        required = _sampler_inputs()
        required["ring_degree"] = (
            "INT",
            {
                **degree,
                "tooltip": "Devices passing keys/values around a ring; 0 = fill the rest. Both degrees 0 = "
                "auto: the planner picks the split for this image and the measured link, and says why.",
            },
        )
        required["ulysses_degree"] = (
            "INT",
            {
                **degree,
                "tooltip": "Devices splitting the attention heads (all-to-all); 0 = auto. "
                "ring x ulysses must equal the device count.",
            },
        )
        return {"required": required, "optional": dict(_SIGMAS_INPUT)}

    def sample(
        self,
        parallel_flux: logic.ParallelHandle,
        positive: Any,
        latent_image: dict[str, Any],
        seed: int,
        steps: int,
        sampler_name: str,
        scheduler: str,
        denoise: float,
        ring_degree: int,
        ulysses_degree: int,
        sigmas: Any = None,
    ) -> tuple[dict[str, Any]]:
        layout = logic.context_layout(ring_degree, ulysses_degree, len(parallel_flux.devices))
        return self._run(layout, parallel_flux, positive, latent_image, seed, steps, denoise, sigmas)


class RocmParallelStatus:
    DESCRIPTION = (
        "Reports the worker group (devices, layout, per-device memory); 'unload' frees the model on the "
        "devices but keeps the workers, 'close' stops the workers, 'doctor' checks torch, the GPUs, the "
        "flags and the group's collectives and says what to fix (python -m rocm_parallel doctor)."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("status",)
    OUTPUT_TOOLTIPS = ("The status as text.",)
    OUTPUT_NODE = True
    FUNCTION = "status"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "action": (
                    list(logic.STATUS_ACTIONS),
                    {
                        "default": "report",
                        "tooltip": "report; unload the model (workers stay); close the workers; doctor: check the "
                        "machine and the group's collectives, with advice.",
                    },
                )
            },
            "optional": {
                "parallel_flux": (
                    HANDLE_TYPE,
                    {"tooltip": _HANDLE_TOOLTIP + " Connect it to run after the loader."},
                ),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **kwargs: Any) -> float:
        return float("nan")  # never cached: the group's state changes between runs

    def status(self, action: str, parallel_flux: logic.ParallelHandle | None = None) -> dict[str, Any]:
        devices = parallel_flux.devices if parallel_flux is not None else None
        text = logic.status_text(REGISTRY, action, devices)
        return {"ui": {"text": [text]}, "result": (text,)}
