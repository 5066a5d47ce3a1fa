"""The one module that touches ComfyUI's model internals: the ROCm Parallel Model as a ComfyUI MODEL.

A real `comfy.model_patcher.ModelPatcher` around a real `comfy.model_base` model (Flux, Flux2, QwenImage,
...), built from the `comfy.supported_models` config ComfyUI's own loader would pick for the checkpoint
(the model family decides it from the header: `ModelFamily.comfy_model`, backend/family.py), so
model_sampling, the latent format, guidance nodes, ModelSampling* nodes, ReferenceLatent and concatenated
inputs (`c_concat`) behave exactly as with ComfyUI's loader, with `disable_unet_model_creation` so no
weights exist here. Checked against the ComfyUI versions in
`TESTED_COMFYUI` (the comfy tier, tests/comfy); a family whose class is newer than the oldest claimed ComfyUI
fails naming what this ComfyUI lacks. Its `diffusion_model` is `ParallelDiffusionModel`, a small proxy whose
forward is one `ParallelModel.forward` on the workers, with the inputs the family's `CallSpec` declares. ComfyUI's samplers, schedulers, CFG, guiders and sigma nodes run
unchanged around it.

Imported lazily, only inside ComfyUI. Every ComfyUI internal it needs is named in `_REQUIRED`; a missing
one fails with a RuntimeError naming the ComfyUI version and what is missing.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from . import checks, comfy_beside
from .inputs import LayoutRequest, ParallelHandle
from .loading import needs_gpu_memory
from .registry import REGISTRY, Registry
from .runner import ModelRunner, call_batch_of, step_of

if TYPE_CHECKING:
    from ..backend.checkpoint import CheckpointInfo

# The ComfyUI versions the parallel MODEL is checked against (the comfy tier, tests/comfy, with each version's
# own references tests/data/comfy_references*.safetensors): the oldest the pack claims (pyproject.toml
# requires-comfyui) and the newest.
TESTED_COMFYUI = ("0.3.75", "0.33.0")

# (module, attribute path) this module relies on; checked once, before the first MODEL is built. The
# config class of the checkpoint's family (supported_models.Flux2 for FLUX.2) is checked when it is picked.
_REQUIRED = (
    ("comfy.model_base", "Flux"),
    ("comfy.model_base", "ModelType.FLOW"),
    ("comfy.model_patcher", "ModelPatcher.add_patches"),
    ("comfy.model_patcher", "ModelPatcher.add_wrapper_with_key"),
    ("comfy.supported_models", "Flux"),
    ("comfy.supported_models", "FluxSchnell"),
    ("comfy.supported_models", "FluxInpaint"),
    ("comfy.patcher_extension", "WrappersMP.OUTER_SAMPLE"),
    ("comfy.patcher_extension", "WrappersMP.DIFFUSION_MODEL"),
    ("comfy.patcher_extension", "WrapperExecutor.new_class_executor"),
    ("comfy.patcher_extension", "get_all_wrappers"),
    ("comfy.model_management", "throw_exception_if_processing_interrupted"),
    ("comfy.sample", "fix_empty_latent_channels"),
    ("comfy.samplers", "sampler_object"),
    ("nodes", "common_ksampler"),
    ("comfy_extras.nodes_custom_sampler", "SamplerCustom"),
)
WRAPPER_KEY = "rocm_parallel"


def comfyui_version() -> str:
    try:
        return importlib.import_module("comfyui_version").__version__
    except Exception:  # any failure means "unknown"
        return "unknown"


def missing_internals(required: tuple[tuple[str, str], ...] = _REQUIRED) -> list[str]:
    """The `module.attribute` names of `required` this ComfyUI lacks."""
    missing = []
    for module_name, path in required:
        try:
            obj: Any = importlib.import_module(module_name)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{path}")
    return missing


def require_internals(required: tuple[tuple[str, str], ...] = _REQUIRED) -> None:
    missing = missing_internals(required)
    if missing:
        raise RuntimeError(
            f"ROCm Parallel Model: ComfyUI {comfyui_version()} lacks {', '.join(missing)}, which the parallel "
            f"MODEL needs (checked against ComfyUI {' and '.join(TESTED_COMFYUI)}). Update ComfyUI, or use the TP / Ring "
            "Attention Sampler's pack version made for this ComfyUI"
        )


class ParallelDiffusionModel(torch.nn.Module):
    """ComfyUI's diffusion model of the checkpoint's family, as far as ComfyUI sees it; each call runs on the
    workers.

    No parameters: ComfyUI's memory management finds nothing to move. `dtype` is the workers' compute
    dtype, so ComfyUI casts the inputs as it would for its own model of that dtype. The inputs a call may
    carry are the family's (`ModelFamily.call_spec`, by ComfyUI's names): anything else ComfyUI passes with
    a value is refused by name, never ignored.
    """

    def __init__(
        self,
        runner: ModelRunner,
        dtype: torch.dtype,
        patch_size: Any = 2,
        default_ref_method: str = "",
        weights: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__()
        self.runner, self.dtype = runner, dtype
        # The weight shapes ComfyUI's model class reads from its diffusion model (the family's
        # `ComfyModel.weights`, e.g. Wan's patch_embedding for concat_cond): empty meta tensors at those paths,
        # plain attributes, so ComfyUI finds no parameter to move or patch.
        for path, shape in (weights or {}).items():
            *parents, leaf = path.split(".")
            holder: Any = self
            for name in parents:
                if name not in vars(holder):
                    setattr(holder, name, types.SimpleNamespace())
                holder = getattr(holder, name)
            setattr(holder, leaf, torch.empty(shape, device="meta"))
        # Read by ComfyUI's model classes (FLUX's extra_conds upscales attention masks by it): the family's
        # unet_config value as ComfyUI's own model has it (an int for FLUX, Wan's (1, 2, 2) tuple).
        self.patch_size = patch_size
        # comfy/ldm/flux/model.py Flux._forward: `kwargs.get("ref_latents_method",
        # self.params.default_ref_method)`; FLUX.2's unet_config says "index", FLUX.1's default "offset".
        # (ComfyUI 0.33's FluxKVCache object-patches this attribute when the model has no `params`; its
        # attention patches are refused with checks.KV_CACHE_MESSAGE.) Every method is checked against the
        # family's `references` before a rank runs (backend/diffusion/checks.py).
        self.default_ref_method = default_ref_method

    def __getattr__(self, name: str) -> Any:
        # A missing attribute names the proxy as its `obj`, so forward() can tell a diffusion_model wrapper
        # that reached for the transformer's blocks (they are in the workers) from any other failure.
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' has no attribute '{name}': the transformer's layers live in "
                "the ROCm Parallel workers",
                name=name,
                obj=self,
            ) from None

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        *args: Any,
        control: Any = None,
        transformer_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """ComfyUI's diffusion model forward: the diffusion_model wrappers (EasyCache's, which skips or
        reuses whole calls) run around the call to the workers, seeing the same inputs and outputs as around
        ComfyUI's own model; one that reaches into the model (`executor.class_obj`) for its layers is
        refused."""
        import comfy.patcher_extension as extension

        options = transformer_options if transformer_options is not None else {}
        wrappers = extension.get_all_wrappers(extension.WrappersMP.DIFFUSION_MODEL, options)
        executor = extension.WrapperExecutor.new_class_executor(self._forward, self, wrappers)
        try:
            return executor.execute(
                x, timestep, *args, control=control, transformer_options=options, **kwargs
            )
        except AttributeError as err:
            if wrappers and getattr(err, "obj", None) is self:
                names = checks.diffusion_model_wrappers(options)
                raise RuntimeError(checks.patches_message("diffusion_model wrappers", names)) from err
            raise

    def _forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        *args: Any,
        control: Any = None,
        transformer_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One model call on the workers, after the wrappers: the family's inputs by ComfyUI's names
        (positional ones in the family's order, as ComfyUI's own model takes them)."""
        options = transformer_options or {}
        spec = self.runner.info.model_family.call_spec
        given = dict(zip(spec.positional, args, strict=False))
        given.update(kwargs)
        refused = checks.unsupported_forward_inputs(control, options, given, spec.names)
        if refused is not None:
            raise RuntimeError(refused)
        if "ref_latents_method" in spec.names and given.get("ref_latents_method") is None:
            given["ref_latents_method"] = self.default_ref_method
        out = self.runner.forward(x, timestep, given, step_of(options))
        return out.to(x.device)


def _parallel_patcher_class() -> type:
    import comfy.model_patcher

    class ParallelModelPatcher(comfy.model_patcher.ModelPatcher):
        """A ModelPatcher whose weights live in the workers: weight patches are refused, never ignored.
        (`clone()` builds `self.__class__`, so every clone keeps this.)"""

        def add_patches(self, patches: Any, strength_patch: float = 1.0, strength_model: float = 1.0) -> Any:
            raise RuntimeError(checks.LORA_ON_MODEL_MESSAGE)

        def deepclone_multigpu(self, new_load_device: Any = None, models_cache: Any = None) -> Any:
            raise RuntimeError(comfy_beside.CFG_SPLIT_MESSAGE)  # ComfyUI >= 0.33's MultiGPU nodes

    return ParallelModelPatcher


_PATCHER_CLASS: type | None = None


def _outer_sample(runner: ModelRunner):
    """The OUTER_SAMPLE wrapper: the model is made resident (planned for this latent and the batch of
    its model calls) before ComfyUI's sampling starts, and the panel shows the run and how it ended (a
    Cancel as such)."""

    def wrapper(
        executor: Any, noise: torch.Tensor, latent_image: Any, sampler: Any, sigmas: Any, *args, **kw
    ):
        # The guider (comfy/samplers.py CFGGuider.sample builds this executor around its outer_sample)
        # holds the run's conds: ReferenceLatent's latents there ride along in every model call, and its
        # cfg and the conds' text shapes say whether cond and uncond share a call.
        guider = getattr(executor, "class_obj", None)
        conds = getattr(guider, "conds", None)
        references = checks.reference_shapes(conds)
        calls = _call_batch(guider, int(noise.shape[0]), runner.info.model_family.text.tokens)
        with runner.sampling(tuple(noise.shape), max(int(sigmas.shape[-1]) - 1, 0), references, calls):
            comfy_beside.show_dynamic_vram(runner.registry)
            return executor(noise, latent_image, sampler, sigmas, *args, **kw)

    return wrapper


def _call_batch(guider: Any, latent_batch: int, padded_to: int) -> int:
    """The batch of the run's model calls (runner.call_batch_of) from the guider's cfg and its conds'
    text contexts (`cross_attn` [B, tokens, dim] of each cond kind's entry)."""
    cfg = float(getattr(guider, "cfg", 1.0))
    conds = getattr(guider, "conds", None) or {}
    lengths = {}
    for kind, entries in conds.items():
        context = entries[0].get("cross_attn") if entries else None
        lengths[kind] = int(context.shape[1]) if context is not None else None
    return call_batch_of(latent_batch, cfg, lengths, padded_to)


def _no_local_memory(input_shape: Any, cond_shapes: Any = None) -> int:
    """The parallel MODEL's `memory_required`: nothing on ComfyUI's device, the weights and activations
    live in the workers. ComfyUI batches cond and uncond into one model call only when this estimate x
    1.5 fits its free memory (comfy/samplers.py `_calc_cond_batch`, 0.3.75 and 0.33.0) and would
    otherwise halve the batch on a busy machine: two calls per step, and a batch degree that idles. It
    also feeds `load_models_gpu(memory_required=...)`, which then evicts nothing for us
    (`free_comfy_models` gives the GPUs to the workers)."""
    return 0


def parallel_model(
    handle: ParallelHandle,
    request: LayoutRequest,
    registry: Registry | None = None,
    info: CheckpointInfo | None = None,
) -> Any:
    """The ComfyUI MODEL for `handle` in `request`'s layout (nothing loads until ComfyUI samples); `info`:
    the checkpoint's header as the node's run read it (read here when not given)."""
    global _PATCHER_CLASS
    require_internals()
    import comfy.model_base
    import comfy.model_management as mm
    import comfy.patcher_extension
    import comfy.supported_models

    registry = registry if registry is not None else REGISTRY
    runner = ModelRunner(
        registry,
        handle,
        request,
        info,
        interrupted=mm.throw_exception_if_processing_interrupted,
        make_room=lambda: free_comfy_models(handle.devices, registry),
    )
    family = runner.info.model_family
    wanted = runner.comfy_model()  # the supported_models class ComfyUI's loader picks, with its unet_config
    # A family's class newer than the oldest claimed ComfyUI fails here naming what this ComfyUI lacks.
    require_internals((("comfy.supported_models", wanted.config_class),))
    config_class = getattr(comfy.supported_models, wanted.config_class)
    unet_config = {**wanted.unet_config, "disable_unet_model_creation": True}
    dtype = runner.compute_dtype()
    model_config = config_class(unet_config)
    model_config.set_inference_dtype(dtype, None)
    cpu = torch.device("cpu")  # the weights live in the workers: nothing for ComfyUI to move
    model = model_config.get_model({}, device=cpu)
    model.memory_required = _no_local_memory  # cond and uncond in one call whenever cfg != 1 (see there)
    model.diffusion_model = ParallelDiffusionModel(
        runner,
        dtype,
        patch_size=unet_config.get("patch_size", 2),
        default_ref_method=str(unet_config.get("default_ref_method", family.ref_method)),
        weights=wanted.weights,
    )
    if _PATCHER_CLASS is None:
        _PATCHER_CLASS = _parallel_patcher_class()
    patcher = _PATCHER_CLASS(model, load_device=cpu, offload_device=cpu)
    patcher.add_wrapper_with_key(
        comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample(runner)
    )
    return patcher


def free_comfy_models(devices: tuple[str, ...], registry: Registry | None = None) -> None:
    """Give the GPUs to the workers: ComfyUI's own resident models would otherwise hold their memory (those
    on any worker GPU too, e.g. after Select CLIP / VAE Device; the panel names them)."""
    import comfy.model_management as mm

    if needs_gpu_memory(devices):
        comfy_beside.free_worker_gpus(registry if registry is not None else REGISTRY, devices)
        mm.unload_all_models()
        mm.soft_empty_cache()


def ksampler(
    model: Any,
    seed: int,
    steps: int,
    cfg: float,
    sampler_name: str,
    scheduler: str,
    positive: Any,
    negative: Any,
    latent: dict[str, Any],
    denoise: float,
) -> dict[str, Any]:
    """ComfyUI's KSampler itself (`nodes.common_ksampler`) on the parallel MODEL."""
    import nodes as comfy_nodes  # ComfyUI's top-level nodes module (the pack's own is imported relatively)

    return comfy_nodes.common_ksampler(
        model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise=denoise
    )[0]


def sample_custom(
    model: Any,
    seed: int,
    cfg: float,
    sampler_name: str,
    sigmas: torch.Tensor,
    positive: Any,
    negative: Any,
    latent: dict[str, Any],
) -> dict[str, Any]:
    """ComfyUI's SamplerCustom itself (add_noise on, KSamplerSelect's sampler) on the parallel MODEL."""
    import comfy.samplers
    from comfy_extras.nodes_custom_sampler import SamplerCustom

    sampler = comfy.samplers.sampler_object(sampler_name)
    return SamplerCustom().sample(model, True, seed, cfg, positive, negative, sampler, sigmas, latent)[0]
