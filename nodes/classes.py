"""The ComfyUI node classes (V1 schema): inputs, outputs, and a call into the plain-Python modules next to
them (inputs, loading, checks, status; the parallel MODEL in comfy_model). Nothing else.

ComfyUI modules (`folder_paths`, `comfy.*`) are imported inside the methods, so this module imports
outside ComfyUI too (the tests read INPUT_TYPES with stand-ins for those modules).
"""

from __future__ import annotations

from typing import Any

from . import checks, inputs, loading
from .inputs import CATEGORY, HANDLE_TYPE, LayoutRequest, ParallelHandle
from .registry import REGISTRY, shows_errors
from .status import status_text

SEED_MAX = 0xFFFFFFFFFFFFFFFF  # ComfyUI's KSampler seed range

_HANDLE_TOOLTIP = "The worker group and checkpoint from a ROCm Parallel Loader."


def _interrupted() -> None:
    """Raises ComfyUI's InterruptProcessingException when the user pressed Cancel (checked between the
    tensors of a load, so a Cancel during a long load stops it there on every rank)."""
    import comfy.model_management as mm

    mm.throw_exception_if_processing_interrupted()


def _sampler_lists() -> tuple[list[str], list[str]]:
    """ComfyUI's own sampler and scheduler lists, all of them (the sampling is ComfyUI's)."""
    import comfy.samplers

    return list(comfy.samplers.KSampler.SAMPLERS), list(comfy.samplers.KSampler.SCHEDULERS)


def _sampler_inputs() -> dict[str, Any]:
    samplers, schedulers = _sampler_lists()
    return {
        "parallel_flux": (HANDLE_TYPE, {"tooltip": _HANDLE_TOOLTIP}),
        "positive": (
            "CONDITIONING",
            {
                "tooltip": "The prompt: CLIPTextEncode with the model's text encoder (and FluxGuidance for a "
                "guidance-distilled model)."
            },
        ),
        "latent_image": (
            "LATENT",
            {
                "tooltip": "The latent to denoise, any size ComfyUI accepts: EmptySD3LatentImage for "
                "text-to-image, or an encoded image."
            },
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
        "cfg": (
            "FLOAT",
            {
                "default": 1.0,
                "min": 0.0,
                "max": 100.0,
                "step": 0.1,
                "round": 0.01,
                "tooltip": "Classifier-free guidance scale, as in KSampler. Guidance-distilled models: keep 1.0 "
                "and set FluxGuidance instead; above 1.0 a negative prompt is needed (positive and negative "
                "then run as one batch on the workers).",
            },
        ),
        "sampler_name": (samplers, {"tooltip": "ComfyUI's sampling algorithm (every KSampler sampler)."}),
        "scheduler": (
            schedulers,
            {"tooltip": "ComfyUI's noise schedule (every KSampler scheduler); ignored with sigmas."},
        ),
        "denoise": (
            "FLOAT",
            {
                "default": 1.0,
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "How much of the latent is replaced: 1.0 for text-to-image, less for image-to-image "
                "(ignored with sigmas).",
            },
        ),
    }


_OPTIONAL_INPUTS = {
    "negative": (
        "CONDITIONING",
        {"tooltip": "Optional negative prompt; needed when cfg is not 1.0, ignored by ComfyUI at cfg 1.0."},
    ),
    "sigmas": (
        "SIGMAS",
        {
            "tooltip": "Optional custom schedule (BasicScheduler, BetaSamplingScheduler, ...): sampled like "
            "SamplerCustom, replacing steps, scheduler and denoise."
        },
    ),
}


_BATCH_TOOLTIP = (
    "Groups of devices that each take part of every model call's batch: cond and uncond at cfg > 1 (with "
    "a negative prompt), or several images. 1 = none; a call with fewer entries leaves groups idle."
)


def _degree(tooltip: str) -> tuple[str, dict[str, Any]]:
    """An optional degree widget (1 = that dimension unused)."""
    return ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": tooltip})


class RocmParallelLoader:
    DESCRIPTION = (
        "Starts one worker process per device and loads a diffusion model on them (the families the pack "
        "supports: docs/models.md). The workers and the model stay resident between queue runs; running again "
        "with the same devices reuses them, and a second loader on the same devices keeps its model resident too."
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
                    inputs.diffusion_model_files(folder_paths),
                    {"tooltip": inputs.checkpoint_tooltip()},
                ),
                "devices": (
                    "STRING",
                    {
                        "default": inputs.DEVICES_ALL,
                        "tooltip": "'all' visible GPUs, a list of GPU indices such as '0,1,2,3', or CPU "
                        "workers for testing such as 'cpu x2'.",
                    },
                ),
                "dtype": (
                    list(inputs.DTYPES),
                    {
                        "default": "default",
                        "tooltip": "Compute dtype on the workers; default is bfloat16 on GPUs, float32 on "
                        "CPU. Weights in another dtype are upcast to it layer by layer (see weight_dtype).",
                    },
                ),
                "preload": (
                    list(inputs.PRELOAD_LAYOUTS),
                    {
                        "default": "none",
                        "tooltip": "Load the weights now in this layout (tp = tensor parallel, context = ring "
                        "attention, auto = the planner's choice for these GPUs and a 1024x1024 image, "
                        "explained on the node), or 'none' to load them when a sampler first runs.",
                    },
                ),
                "weight_dtype": (
                    list(inputs.WEIGHT_DTYPES),
                    {
                        "default": "default",
                        "tooltip": "How the weights stay on the GPUs, as in ComfyUI's Load Diffusion Model: "
                        "default keeps an fp8 checkpoint in fp8 (half the memory of bf16, same image) and "
                        "other files in the compute dtype; fp8_e4m3fn / fp8_e5m2 convert the weights to "
                        "that fp8 format while loading. fp8 weights are upcast layer by layer.",
                    },
                ),
            },
            # The node's id names its model among the group's resident ones (two loaders, two models).
            "hidden": {"unique_id": "UNIQUE_ID"},
            # Optional and last: workflows saved before it load unchanged, with the default.
            "optional": {
                "compile": (
                    list(inputs.COMPILE_CHOICES),
                    {
                        "default": "off",
                        "tooltip": "inductor: torch.compile the repeated transformer blocks on every worker. "
                        "The first run (and the first run at each new image size) spends extra time "
                        "compiling; off runs eager. Off by default until measured faster on GPUs.",
                    },
                ),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, devices: str) -> bool | str:
        # Runs when the prompt is queued: a bad device list is reported before anything executes.
        from ..backend.config import ConfigError
        from ..backend.runtime.client import validate_devices

        try:
            validate_devices(inputs.parse_devices(devices))
        except ConfigError as exc:
            return str(exc)
        return True

    @shows_errors
    def load(
        self,
        checkpoint: str,
        devices: str,
        dtype: str,
        preload: str,
        weight_dtype: str = "default",
        compile: str = "off",
        unique_id: str | None = None,
    ) -> tuple[ParallelHandle]:
        import folder_paths

        from ..backend.runtime.client import validate_devices

        handle = ParallelHandle(
            checkpoint=folder_paths.get_full_path_or_raise("diffusion_models", checkpoint),
            name=checkpoint,
            devices=validate_devices(inputs.parse_devices(devices)),
            dtype=inputs.compute_dtype(dtype),
            weight_dtype=inputs.weight_dtype(weight_dtype),
            compile=inputs.compile_choice(compile),
            slot=inputs.loader_slot(unique_id),
        )
        if preload != "none":
            from . import comfy_model  # imports torch: only once a node runs

            comfy_model.free_comfy_models(handle.devices)
        loading.load(REGISTRY, handle, preload, interrupted=_interrupted)
        return (handle,)


class _ParallelSampler:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent, for VAEDecode.",)
    FUNCTION = "sample"

    def _run(
        self,
        request: LayoutRequest,
        parallel_flux: ParallelHandle,
        positive: Any,
        latent_image: dict[str, Any],
        seed: int,
        steps: int,
        cfg: float,
        sampler_name: str,
        scheduler: str,
        denoise: float,
        negative: Any = None,
        sigmas: Any = None,
    ) -> tuple[dict[str, Any]]:
        # Before any worker starts, any weight loads or ComfyUI's models are moved.
        info = checks.check_sampler_inputs(
            REGISTRY, parallel_flux, request, positive, negative, latent_image, cfg=cfg, sigmas=sigmas
        )
        from . import comfy_model

        model = comfy_model.parallel_model(parallel_flux, request, REGISTRY, info)
        # At cfg 1.0 ComfyUI never evaluates the negative (checked above that cfg is 1.0 when it is absent).
        negative = negative if negative is not None else []
        if sigmas is None:
            out = comfy_model.ksampler(
                model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise
            )
        else:
            out = comfy_model.sample_custom(
                model, seed, cfg, sampler_name, sigmas, positive, negative, latent_image
            )
        return (out,)


class RocmParallelTPSampler(_ParallelSampler):
    DESCRIPTION = (
        "ComfyUI's KSampler (every sampler and scheduler, cfg with an optional negative, denoise, optional "
        "SIGMAS like SamplerCustom) with the model's weights split over every device of the loader (tensor "
        "parallelism): the way to fit a model that is too big for one GPU. Optional degrees compose with it: "
        "batch_degree 2 on 4 GPUs runs cond and uncond on two TP pairs ('batch 2 x tp 2' on the panel)."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        optional = {
            **_OPTIONAL_INPUTS,
            "batch_degree": _degree(_BATCH_TOOLTIP + " TP takes the devices the degrees leave."),
            "ring_degree": _degree(
                "Devices passing keys/values around a ring within each TP group (context parallelism "
                "composed with TP: 'tp 2 x ring 2'); 1 = none."
            ),
            "ulysses_degree": _degree(
                "Devices splitting the attention heads TP leaves them (all-to-all; composed with TP: 'tp 2 x "
                "ulysses 2'); 1 = none. It must divide the heads / tp."
            ),
        }
        return {"required": _sampler_inputs(), "optional": optional}

    @shows_errors
    def sample(
        self,
        parallel_flux: ParallelHandle,
        positive: Any,
        latent_image: dict[str, Any],
        seed: int,
        steps: int,
        cfg: float,
        sampler_name: str,
        scheduler: str,
        denoise: float,
        negative: Any = None,
        sigmas: Any = None,
        batch_degree: int = 1,
        ring_degree: int = 1,
        ulysses_degree: int = 1,
    ) -> tuple[dict[str, Any]]:
        layout = inputs.tp_layout(len(parallel_flux.devices), batch_degree, ring_degree, ulysses_degree)
        request = LayoutRequest(layout)
        return self._run(
            request, parallel_flux, positive, latent_image, seed, steps, cfg, sampler_name, scheduler, denoise,
            negative, sigmas,
        )  # fmt: skip


class RocmParallelRingSampler(_ParallelSampler):
    DESCRIPTION = (
        "ComfyUI's KSampler (every sampler and scheduler, cfg with an optional negative, denoise, optional "
        "SIGMAS like SamplerCustom) with the image tokens split over the devices (context parallelism: ring "
        "attention x Ulysses). Every device holds the whole model; this speeds up large images. Optional "
        "degrees compose with it: tp_degree shares each copy of the weights ('tp 2 x ring 2'), "
        "batch_degree splits cond and uncond over groups ('batch 2 x ring 2')."
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
                "auto: the planner picks the split for this image and the measured link (keeping "
                "batch_degree and tp_degree), and says why.",
            },
        )
        required["ulysses_degree"] = (
            "INT",
            {
                **degree,
                "tooltip": "Devices splitting the attention heads (all-to-all); 0 = fill the rest. "
                "batch x tp x ring x ulysses must equal the device count.",
            },
        )
        optional = {
            **_OPTIONAL_INPUTS,
            "batch_degree": _degree(_BATCH_TOOLTIP + " Ring x Ulysses take the devices the degrees leave."),
            "tp_degree": _degree(
                "Devices sharing each copy of the weights by tensor parallelism (composed with context "
                "parallelism: 'tp 2 x ring 2'; fits a model too big for one GPU); 1 = none."
            ),
        }
        return {"required": required, "optional": optional}

    @shows_errors
    def sample(
        self,
        parallel_flux: ParallelHandle,
        positive: Any,
        latent_image: dict[str, Any],
        seed: int,
        steps: int,
        cfg: float,
        sampler_name: str,
        scheduler: str,
        denoise: float,
        ring_degree: int,
        ulysses_degree: int,
        negative: Any = None,
        sigmas: Any = None,
        batch_degree: int = 1,
        tp_degree: int = 1,
    ) -> tuple[dict[str, Any]]:
        devices = len(parallel_flux.devices)
        layout = inputs.context_layout(ring_degree, ulysses_degree, devices, batch_degree, tp_degree)
        request = LayoutRequest(layout, context_only=True, batch=batch_degree, tp=tp_degree)
        return self._run(
            request, parallel_flux, positive, latent_image, seed, steps, cfg, sampler_name, scheduler, denoise,
            negative, sigmas,
        )  # fmt: skip


class RocmParallelModel:
    DESCRIPTION = (
        "A standard ComfyUI MODEL whose diffusion transformer runs on the ROCm Parallel workers: connect it to "
        "ComfyUI's KSampler, KSamplerAdvanced, SamplerCustom, or CFGGuider/BasicGuider + "
        "SamplerCustomAdvanced, with the model's own nodes as usual (its latent node, ModelSampling*, "
        "guidance and scheduler nodes, ReferenceLatent). Its layout composes every degree "
        "('batch 2 x tp 2', 'tp 2 x ulysses 2'); at cfg > 1 it makes ComfyUI send cond and uncond as one "
        "batch, which a batch degree splits over groups of GPUs. For LoRAs use the ROCm Parallel LoRA node "
        "before this one."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("A MODEL for ComfyUI's samplers; each model call is one forward on every worker.",)
    FUNCTION = "model"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        degree = {"default": 0, "min": 0, "max": 64}
        return {
            "required": {
                "parallel_flux": (HANDLE_TYPE, {"tooltip": _HANDLE_TOOLTIP}),
                "layout": (
                    "STRING",
                    {
                        "default": "tp",
                        "tooltip": "tp = weights split over the devices (fits big models); context = image "
                        "tokens split (ring x Ulysses below; every device holds the model); auto = the "
                        "planner's choice for each latent's size and batch, among every composition; or "
                        "degrees whose product is the device count, e.g. 'batch 2 x tp 2' (cond and uncond "
                        "on two TP pairs at cfg > 1), 'tp 2 x ulysses 2', 'tp2xring2'.",
                    },
                ),
                "ring_degree": (
                    "INT",
                    {
                        **degree,
                        "tooltip": "context only: ring degree; 0 = fill the rest, both 0 = auto split.",
                    },
                ),
                "ulysses_degree": (
                    "INT",
                    {**degree, "tooltip": "context only: Ulysses degree; ring x ulysses = the device count."},
                ),
            }
        }

    @shows_errors
    def model(
        self, parallel_flux: ParallelHandle, layout: str, ring_degree: int, ulysses_degree: int
    ) -> tuple[Any]:
        from . import comfy_model

        request = inputs.model_layout(layout, ring_degree, ulysses_degree, len(parallel_flux.devices))
        info = loading.read_checkpoint(parallel_flux)  # once: the MODEL carries it to every load
        if request.layout is not None:  # a layout the checkpoint cannot take fails here, not mid-sampling
            options = loading.load_options(parallel_flux, request.layout)
            REGISTRY.group_for(parallel_flux.devices).check_load(info, options)
        return (comfy_model.parallel_model(parallel_flux, request, REGISTRY, info),)


class RocmParallelLoRA:
    DESCRIPTION = (
        "Adds a LoRA from models/loras to the ROCm Parallel model (applied on the workers; chain several). "
        "ComfyUI's LoraLoaderModelOnly cannot patch the parallel MODEL: use this node instead."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = (HANDLE_TYPE,)
    RETURN_NAMES = ("parallel_flux",)
    OUTPUT_TOOLTIPS = (
        "The same model with this LoRA, for a sampler, the ROCm Parallel Model or another LoRA.",
    )
    FUNCTION = "add_lora"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        import folder_paths

        return {
            "required": {
                "parallel_flux": (HANDLE_TYPE, {"tooltip": _HANDLE_TOOLTIP}),
                "lora_name": (
                    folder_paths.get_filename_list("loras"),
                    {
                        "tooltip": "A LoRA for the loader's model from models/loras (BFL, kohya, diffusers/PEFT or LyCORIS keys)."
                    },
                ),
                "strength_model": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": -100.0,
                        "max": 100.0,
                        "step": 0.01,
                        "tooltip": "How strongly the LoRA changes the model, as in LoraLoaderModelOnly; 0 = off.",
                    },
                ),
            }
        }

    @shows_errors
    def add_lora(
        self, parallel_flux: ParallelHandle, lora_name: str, strength_model: float
    ) -> tuple[ParallelHandle]:
        import folder_paths

        path = folder_paths.get_full_path_or_raise("loras", lora_name)
        return (loading.add_lora(parallel_flux, path, strength_model),)


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
                    list(inputs.STATUS_ACTIONS),
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

    @shows_errors
    def status(self, action: str, parallel_flux: ParallelHandle | None = None) -> dict[str, Any]:
        devices = parallel_flux.devices if parallel_flux is not None else None
        text = status_text(REGISTRY, action, devices)
        return {"ui": {"text": [text]}, "result": (text,)}
