"""Record what a REAL ComfyUI samples with small random FLUX models (the references of test_sampling.py).

Run with a ComfyUI checkout that lives outside this repository (torchvision/torchaudio may be stubs: the
FLUX path never calls them), once per ComfyUI version the pack is checked against:

    COMFYUI_PATH=/path/to/ComfyUI python tests/tools/make_comfy_references.py [--out FILE.safetensors]

Each version writes its own file (`reference_file`): tests/data/comfy_references.safetensors for ComfyUI
0.3.75 (the oldest the pack claims; the CPU suite's references) and comfy_references-<version>.safetensors for
any other. Their outputs differ where ComfyUI changed: since 0.7.0 its ancestral samplers draw their noise from
seed + 1 on the CPU (comfy/k_diffusion/sampling.py default_noise_sampler, upstream 1e4e342f), and since 0.14
its q/k RMSNorm and RoPE round differently (torch's RMSNorm, comfy_kitchen's rope). Cases a version cannot
run (`ref_method` options its Edit Model Reference Method node lacks, e.g. 0.33's index_timestep_zero on
0.3.75) are left out of that version's file.

For each case it builds the model with `build_flux(tiny_flux_config(...), seed=...)`, converts the weights to
the BFL layout ComfyUI loads (`diffusers_to_bfl`), loads them with ComfyUI's own
`comfy.sd.load_diffusion_model_state_dict`, and samples with ComfyUI's own nodes (`common_ksampler` with
euler / simple / cfg 1.0, `ModelSamplingFlux`, `SamplerCustom`) in float32 on the CPU. Inputs, settings and
ComfyUI's output latents go into one safetensors file; the settings, model configs and the ComfyUI commit
are JSON in its metadata. The tests rebuild identical weights from the recorded config and seed.

ComfyUI's model detection infers depths, input channels, pooled width and guidance from the checkpoint's
keys but hard-codes the widths of the released model (hidden 3072, 24 heads, T5 4096, RoPE axes 16/56/56),
so this script wraps `detect_unet_config` to replace exactly those widths by the tiny model's; everything
else (model class dev vs schnell, sampling settings, latent format) is ComfyUI's own choice.

FLUX.2 (ComfyUI >= 0.3.75; stored under the metadata keys `flux2_models` / `flux2_cases`, so the FLUX.1
readers never see them): small random Flux2Transformer2DModels written in the BFL / ComfyUI single-file
layout (`diffusers_to_bfl`), loaded by ComfyUI's own loader, which detects FLUX.2 from
`double_stream_modulation_img.lin.weight` (comfy/model_detection.py) and builds `model_base.Flux2`
(supported_models.Flux2, latent_formats.Flux2: 128 channels at 1/16). Detection hard-codes [dev]'s 48
heads and RoPE axes 32/32/32/32 (hidden width and text width it reads from img_in / txt_in), so those two
are replaced by the tiny model's. Each case is the graph of ComfyUI's FLUX.2 template
(image_flux2_text_to_image): RandomNoise + EmptyFlux2LatentImage + Flux2Scheduler + FluxGuidance +
BasicGuider + KSamplerSelect + SamplerCustomAdvanced, with the prompt's features random (CLIPTextEncode
with a FLUX.2 text encoder gives [B, T, text_dim] and pooled_output None; model_base.Flux2.extra_conds
pads the text to 512 tokens), and optionally ReferenceLatent (FLUX.2's reference images, placed by the
"index" method FLUX.2's unet_config defaults to).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DATA = Path(__file__).resolve().parents[1] / "data"
# The version whose references the CPU suite reads (tests/test_sampling.py): the oldest the pack claims.
BASE_VERSION = "0.3.75"


def reference_file(version: str) -> Path:
    """Where the references made by ComfyUI `version` live."""
    if version == BASE_VERSION:
        return DATA / "comfy_references.safetensors"
    return DATA / f"comfy_references-{version}.safetensors"


# Small but structurally complete models: 2 double + 2 single blocks, 4 heads x 16.
MODELS: dict[str, dict[str, Any]] = {
    "dev": {"config": {"heads": 4, "head_dim": 16, "text_dim": 32, "pooled_dim": 24}, "seed": 1234},
    "schnell": {
        "config": {"heads": 4, "head_dim": 16, "text_dim": 32, "pooled_dim": 24, "guidance": False},
        "seed": 4321,
    },
    # FLUX.1 Fill's shape: 96 channels per latent pixel in (latent, masked image, mask), 16 out. ComfyUI
    # detects it from img_in as FluxInpaint (comfy/model_detection.py, comfy/supported_models.py).
    "fill": {
        "config": {"heads": 4, "head_dim": 16, "text_dim": 32, "pooled_dim": 24, "in_channels": 384,
                   "out_channels": 64},
        "seed": 2468,
    },
}  # fmt: skip
TEXT_TOKENS = 8

# FLUX.2: [dev]'s structure (shared modulation, SwiGLU x3, no biases, 4 RoPE axes, patch 1, 128 latent
# channels) with small widths (backend/flux2/model.py tiny_flux2_config); "flux2_klein" has no guidance
# embedder, like FLUX.2 [klein].
# The "_itz" models draw their weights 2x wider (init_scale 0.1, build_flux2's default 0.05): the timestep
# then moves the modulation enough that index_timestep_zero differs from index by ~1, far above rounding.
FLUX2_MODELS: dict[str, dict[str, Any]] = {
    "flux2": {"config": {"heads": 4, "head_dim": 16, "text_dim": 32, "in_channels": 128}, "seed": 5678},
    "flux2_klein": {
        "config": {"heads": 4, "head_dim": 16, "text_dim": 24, "in_channels": 128, "guidance": False},
        "seed": 8765,
    },
    "flux2_itz": {
        "config": {"heads": 4, "head_dim": 16, "text_dim": 32, "in_channels": 128}, "seed": 5679,
        "init_scale": 0.1,
    },
    "flux2_klein_itz": {
        "config": {"heads": 4, "head_dim": 16, "text_dim": 24, "in_channels": 128, "guidance": False},
        "seed": 8766, "init_scale": 0.1,
    },
}  # fmt: skip
# Sizes in pixels (the latent is 1/16: EmptyFlux2LatentImage); refs: ReferenceLatent's latents, in pixels.
FLUX2_CASES: dict[str, dict[str, Any]] = {
    "flux2_4steps": {"variant": "flux2", "width": 96, "height": 64, "steps": 4, "seed": 44, "guidance": 4.0},
    "flux2_klein_3steps": {"variant": "flux2_klein", "width": 64, "height": 80, "steps": 3, "seed": 45},
    # The first model calls of a run with two reference latents (ComfyUI's own Flux2 output for each).
    "flux2_ref_calls": {
        "variant": "flux2", "width": 80, "height": 48, "steps": 2, "seed": 46, "guidance": 4.0,
        "record_calls": 2, "refs": [[48, 64], [32, 48]],
    },
    # A whole run with one reference latent (the live /prompt test's reference).
    "flux2_ref_2steps": {
        "variant": "flux2", "width": 64, "height": 48, "steps": 2, "seed": 47, "guidance": 4.0,
        "refs": [[48, 64]],
    },
    # index_timestep_zero (ComfyUI >= 0.17's Edit Model Reference Method): [klein] at batch 2 (CFG: the
    # negative prompt batched with the positive, both with the references), [dev] at batch 1 (ComfyUI's own
    # [dev] runs it at batch 1 only); two odd-sized references each, every model call recorded.
    "flux2_klein_itz_calls": {
        "variant": "flux2_klein_itz", "width": 80, "height": 48, "steps": 2, "seed": 48, "cfg": 2.5,
        "negative": True, "record_calls": 2, "refs": [[48, 32], [32, 48]], "ref_method": "index_timestep_zero",
    },
    "flux2_itz_calls": {
        "variant": "flux2_itz", "width": 64, "height": 80, "steps": 2, "seed": 49, "guidance": 4.0,
        "record_calls": 2, "refs": [[48, 64], [16, 48]], "ref_method": "index_timestep_zero",
    },
}  # fmt: skip


def import_comfy(path: str) -> dict[str, Any]:
    """Import ComfyUI from a checkout (CPU, argument parsing as `main.py --cpu` would do)."""
    sys.path.insert(0, path)
    argv, sys.argv = sys.argv, [sys.argv[0], "--cpu"]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.model_detection
        import comfy.samplers
        import comfy.sd
        import comfy_extras.nodes_custom_sampler as custom
        import comfy_extras.nodes_edit_model as edit
        import comfy_extras.nodes_flux as flux_nodes
        import comfy_extras.nodes_model_advanced as advanced
        import node_helpers

        import nodes
    finally:
        sys.argv = argv
    return {
        "sd": comfy.sd,
        "detection": comfy.model_detection,
        "samplers": comfy.samplers,
        "nodes": nodes,
        "custom": custom,
        "advanced": advanced,
        "edit": edit,
        "flux_nodes": flux_nodes,
        "node_helpers": node_helpers,
    }


def comfy_commit(path: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def comfy_version(path: str) -> str:
    text = (Path(path) / "comfyui_version.py").read_text()
    return text.split("__version__ =")[-1].strip().strip("\"'")


def _load_detected_as(
    comfy: dict[str, Any], bfl: dict[str, torch.Tensor], image_model: str, widths: dict[str, Any]
):
    """ComfyUI's own loader on a BFL state dict, its detection told the tiny `widths` it cannot read from
    the header (comfy/model_detection.py hard-codes the full models' heads and RoPE axes); it must detect
    the file as `image_model` ("flux" or "flux2")."""
    detection = comfy["detection"]
    original = detection.detect_unet_config

    def detect_tiny(state_dict, key_prefix, metadata=None):
        config = original(state_dict, key_prefix, metadata=metadata)
        if config is None or config.get("image_model") != image_model:
            raise RuntimeError(f"ComfyUI did not detect the test checkpoint as {image_model}: {config}")
        return {**config, **widths}

    detection.detect_unet_config = detect_tiny
    try:
        model = comfy["sd"].load_diffusion_model_state_dict(dict(bfl), model_options={"dtype": torch.float32})
    finally:
        detection.detect_unet_config = original
    if model is None:
        raise RuntimeError("ComfyUI could not load the test checkpoint")
    return model


def load_in_comfy(comfy: dict[str, Any], diffusers_config: dict[str, Any], bfl: dict[str, torch.Tensor]):
    """Load a FLUX.1 BFL state dict with ComfyUI's loader, telling its detection the tiny widths."""
    heads = diffusers_config["num_attention_heads"]
    widths = {
        "hidden_size": heads * diffusers_config["attention_head_dim"],
        "num_heads": heads,
        "context_in_dim": diffusers_config["joint_attention_dim"],
        "axes_dim": list(diffusers_config["axes_dims_rope"]),
    }
    return _load_detected_as(comfy, bfl, "flux", widths)


def load_flux2_in_comfy(
    comfy: dict[str, Any], diffusers_config: dict[str, Any], bfl: dict[str, torch.Tensor]
):
    """Load a FLUX.2 BFL state dict with ComfyUI's loader, telling its detection the tiny heads and RoPE
    axes (it hard-codes [dev]'s 48 heads and (32, 32, 32, 32))."""
    widths = {
        "num_heads": diffusers_config["num_attention_heads"],
        "axes_dim": list(diffusers_config["axes_dims_rope"]),
    }
    model = _load_detected_as(comfy, bfl, "flux2", widths)
    if type(model.model).__name__ != "Flux2":
        raise RuntimeError(f"ComfyUI did not load the test checkpoint as its Flux2: {model}")
    return model


def flux2_model(variant: str) -> torch.nn.Module:
    """The diffusers Flux2Transformer2DModel of a FLUX.2 variant (random weights from its seed)."""
    from rocm_parallel.backend.flux2.model import build_flux2
    from rocm_parallel.testing.models import tiny_flux2_config

    spec = FLUX2_MODELS[variant]
    return build_flux2(
        tiny_flux2_config(**spec["config"]), seed=spec["seed"], init_scale=spec.get("init_scale", 0.05)
    )


def flux2_inputs(name: str, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The prompt's text features (as a FLUX.2 CLIPTextEncode gives them: [1, T, text_dim]) and the reference
    latents ([1, 128, h/16, w/16], as VAEEncode with the FLUX.2 VAE gives them)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    text_dim = FLUX2_MODELS[case["variant"]]["config"]["text_dim"]
    tensors = {"cond": torch.randn(1, TEXT_TOKENS, text_dim, generator=g)}
    for j, (h_px, w_px) in enumerate(case.get("refs", ())):
        tensors[f"ref{j}"] = torch.randn(1, 128, h_px // 16, w_px // 16, generator=g) * 0.8 + 0.1
    if case.get("negative"):  # drawn last: the cases without one keep their inputs
        tensors["neg_cond"] = torch.randn(1, TEXT_TOKENS, text_dim, generator=g)
    return tensors


def flux2_conditioning(
    comfy, case: dict[str, Any], tensors: dict[str, torch.Tensor], key: str = "cond"
) -> list:
    """CLIPTextEncode's CONDITIONING for FLUX.2 (features, pooled_output None: the Mistral encoder has no
    pooled vector), then FluxGuidance and ReferenceLatent as the template wires them, and the Edit Model
    Reference Method (FluxKontextMultiReferenceLatentMethod) when the case sets one."""
    flux_nodes = comfy["flux_nodes"]
    conditioning: list = [[tensors[key], {"pooled_output": None}]]
    if "guidance" in case:
        conditioning = flux_nodes.FluxGuidance.execute(conditioning, case["guidance"])[0]
    for j in range(len(case.get("refs", ()))):
        conditioning = comfy["edit"].ReferenceLatent.execute(conditioning, {"samples": tensors[f"ref{j}"]})[0]
    if "ref_method" in case:
        method = flux_nodes.FluxKontextMultiReferenceLatentMethod
        conditioning = method.execute(conditioning, case["ref_method"])[0]
    return conditioning


def ref_methods(comfy) -> list[str]:
    """The reference placements this ComfyUI's Edit Model Reference Method node offers."""
    schema = comfy["flux_nodes"].FluxKontextMultiReferenceLatentMethod.define_schema()
    (combo,) = [i for i in schema.inputs if getattr(i, "id", None) == "reference_latents_method"]
    return list(combo.options)


def runs(comfy, case: dict[str, Any]) -> bool:
    """Whether this ComfyUI can run the case (its ref_method is one its node offers)."""
    return "ref_method" not in case or case["ref_method"] in ref_methods(comfy)


def run_flux2_case(comfy, models, name: str, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """ComfyUI's FLUX.2 template graph (comfy_extras/nodes_flux.py EmptyFlux2LatentImage, Flux2Scheduler;
    nodes_custom_sampler.py RandomNoise, BasicGuider, KSamplerSelect, SamplerCustomAdvanced) on `models`'
    model for the case's variant."""
    model = models[case["variant"]]
    tensors = flux2_inputs(name, case)
    conditioning = flux2_conditioning(comfy, case, tensors)
    flux_nodes, custom = comfy["flux_nodes"], comfy["custom"]
    latent = flux_nodes.EmptyFlux2LatentImage.execute(case["width"], case["height"], 1)[0]
    sigmas = flux_nodes.Flux2Scheduler.execute(case["steps"], case["width"], case["height"])[0]
    calls: dict[str, torch.Tensor] = {}
    if "record_calls" in case:
        model = model.clone()
        record_calls(model, case["record_calls"], calls, ids="refs" in case)
    if case.get("negative"):  # CFGGuider: ComfyUI batches the negative prompt with the positive
        negative = flux2_conditioning(comfy, case, tensors, "neg_cond")
        guider = custom.CFGGuider().get_guider(model, conditioning, negative, case["cfg"])[0]
    else:
        guider = custom.BasicGuider().get_guider(model, conditioning)[0]
    out = custom.SamplerCustomAdvanced().sample(
        custom.RandomNoise().get_noise(case["seed"])[0],
        guider,
        custom.KSamplerSelect().get_sampler(case.get("sampler", "euler"))[0],
        sigmas,
        latent,
    )[0]
    tensors["sigmas"] = torch.as_tensor(sigmas, dtype=torch.float32)
    tensors["output"] = out["samples"].to(torch.float32).contiguous()
    if "record_calls" in case:
        return {f"{name}.{k}": v for k, v in calls.items()}
    return {f"{name}.{k}": v for k, v in tensors.items()}


def cond_for(variant: str, batch: int, seed: int, guidance: float | None) -> tuple[list, dict[str, Any]]:
    """A CONDITIONING like CLIPTextEncode (+ FluxGuidance) makes, with random embeddings."""
    config = MODELS[variant]["config"]
    g = torch.Generator().manual_seed(seed)
    cond = torch.randn(batch, TEXT_TOKENS, config["text_dim"], generator=g)
    pooled = torch.randn(batch, config["pooled_dim"], generator=g)
    extras: dict[str, Any] = {"pooled_output": pooled}
    if guidance is not None:
        extras["guidance"] = guidance
    return [[cond, extras]], {"cond": cond, "pooled": pooled}


# name -> settings. latent: "zeros" (EmptySD3LatentImage), "zeros4" (4-channel EmptyLatentImage) or "random"
# (an encoded image); sizes in pixels.
CASES: dict[str, dict[str, Any]] = {
    "dev_4steps": {"variant": "dev", "width": 64, "height": 64, "steps": 4, "seed": 42, "guidance": 3.5},
    "schnell_4steps": {"variant": "schnell", "width": 64, "height": 64, "steps": 4, "seed": 7},
    "img2img_denoise06": {
        "variant": "dev", "width": 64, "height": 64, "steps": 5, "seed": 3, "denoise": 0.6,
        "latent": "random", "guidance": 2.5,
    },
    "inpaint_mask": {
        "variant": "dev", "width": 64, "height": 48, "steps": 4, "seed": 11, "denoise": 0.8,
        "latent": "random", "mask": True,  # no guidance key: ComfyUI's default 3.5
    },
    "batch2": {
        "variant": "dev", "width": 48, "height": 32, "steps": 3, "seed": 5, "batch": 2, "guidance": 4.0,
    },
    "batch2_index": {
        "variant": "dev", "width": 48, "height": 32, "steps": 3, "seed": 5, "batch": 2, "guidance": 4.0,
        "latent": "random", "batch_index": [3, 1],
    },
    "nonsquare": {"variant": "dev", "width": 96, "height": 48, "steps": 3, "seed": 9, "guidance": 3.5},
    "empty_sd_latent": {
        "variant": "schnell", "width": 32, "height": 48, "steps": 2, "seed": 13, "latent": "zeros4",
    },
    "model_sampling_flux": {
        "variant": "dev", "width": 80, "height": 64, "steps": 4, "seed": 21, "guidance": 3.5,
        "shift": {"max_shift": 1.15, "base_shift": 0.5},
    },
    "custom_sigmas": {
        "variant": "dev", "width": 64, "height": 64, "seed": 17, "guidance": 3.5, "latent": "random",
        "sigmas": [0.9, 0.7, 0.45, 0.2, 0.05],  # ends above 0: exercises inverse_noise_scaling
    },
    # ComfyUI's own samplers, schedulers, CFG and guiders (issue 12): the pack drives the sharded model
    # through the same code, one model call at a time.
    "dpmpp_2m_beta": {
        "variant": "dev", "width": 64, "height": 64, "steps": 5, "seed": 31, "guidance": 3.5,
        "sampler": "dpmpp_2m", "scheduler": "beta",
    },
    "euler_ancestral_normal": {
        "variant": "dev", "width": 64, "height": 48, "steps": 4, "seed": 32, "guidance": 3.5,
        "sampler": "euler_ancestral", "scheduler": "normal",
    },
    "heun_sgm_uniform": {
        "variant": "schnell", "width": 48, "height": 48, "steps": 3, "seed": 33,
        "sampler": "heun", "scheduler": "sgm_uniform",
    },
    "cfg_negative": {
        "variant": "dev", "width": 64, "height": 64, "steps": 4, "seed": 34, "guidance": 3.5,
        "sampler": "euler", "scheduler": "simple", "cfg": 2.5, "negative": True,
    },
    "custom_advanced_cfg_guider": {
        "variant": "dev", "width": 48, "height": 64, "steps": 4, "seed": 35, "guidance": 3.5,
        "sampler": "dpmpp_2m", "scheduler": "simple", "cfg": 2.0, "negative": True, "guider": "cfg",
    },
    "odd_size": {  # an odd-sized photo, img2img: latent 25x17, padded inside the model
        "variant": "dev", "width": 200, "height": 136, "steps": 4, "seed": 36, "guidance": 3.5,
        "denoise": 0.75, "latent": "random",
    },
    "lora_bfl": {
        "variant": "dev", "width": 64, "height": 64, "steps": 4, "seed": 37, "guidance": 3.5,
        "lora": {"format": "bfl", "strength": 0.8, "rank": 4, "seed": 77},
    },
    "lora_kohya": {
        "variant": "dev", "width": 64, "height": 64, "steps": 4, "seed": 37, "guidance": 3.5,
        "sampler": "dpmpp_2m", "scheduler": "beta",
        "lora": {"format": "kohya", "strength": 0.8, "rank": 4, "seed": 77},
    },
    # Not a sampling result: the first diffusion-model calls of a CFG run on an odd-sized latent, with
    # ComfyUI's own Flux.forward output for each (the CI tier checks the pack's forward against them).
    "model_calls": {
        "variant": "dev", "width": 72, "height": 56, "steps": 2, "seed": 38, "guidance": 3.5,
        "cfg": 2.0, "negative": True, "record_calls": 3,
    },
    # Kontext (issue 13): ReferenceLatent on both prompts (a CFG batch of reference latents), two odd-sized
    # references placed by each of ComfyUI's ref_latents_method values; the recorded calls carry
    # `ref{j}` (after process_in, as the model receives them) and ComfyUI's own Flux.forward output.
    "kontext_calls": {
        "variant": "dev", "width": 72, "height": 56, "steps": 2, "seed": 39, "guidance": 2.5,
        "cfg": 2.0, "negative": True, "record_calls": 2, "refs": [[40, 56], [24, 24]],
    },
    "kontext_index_calls": {
        "variant": "dev", "width": 56, "height": 40, "steps": 1, "seed": 40, "guidance": 2.5,
        "record_calls": 1, "refs": [[40, 56], [24, 40]], "ref_method": "index",
    },
    "kontext_uxo_calls": {
        "variant": "dev", "width": 56, "height": 40, "steps": 1, "seed": 41, "guidance": 2.5,
        "record_calls": 1, "refs": [[40, 56], [24, 40]], "ref_method": "uxo/uno",
    },
    # A whole Kontext run (ComfyUI's KSampler, euler / simple) with one reference latent: the output the
    # live /prompt test compares the pack's Kontext path against (tests/comfy/test_integration.py).
    "kontext_2steps": {
        "variant": "dev", "width": 56, "height": 40, "steps": 2, "seed": 43, "guidance": 2.5,
        "refs": [[40, 56]],
    },
    # Fill: InpaintModelConditioning's conditioning values (the encoded image and the pixel mask) set
    # directly, without a VAE; ComfyUI's Flux.concat_cond appends them to x (96 channels).
    "fill_calls": {
        "variant": "fill", "width": 72, "height": 56, "steps": 2, "seed": 42, "guidance": 30.0,
        "cfg": 2.0, "negative": True, "record_calls": 2, "fill": True,
    },
}  # fmt: skip


def case_inputs(name: str, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # stable when cases are added
    batch, h, w = case.get("batch", 1), case["height"] // 8, case["width"] // 8
    kind = case.get("latent", "zeros")
    if kind == "random":
        latent = torch.randn(batch, 16, h, w, generator=g) * 0.8 + 0.1
    else:
        latent = torch.zeros(batch, 4 if kind == "zeros4" else 16, h, w)
    tensors = {"latent": latent}
    if "refs" in case:
        for j, (h_px, w_px) in enumerate(case["refs"]):
            tensors[f"ref{j}"] = torch.randn(1, 16, h_px // 8, w_px // 8, generator=g) * 0.8 + 0.1
    if case.get("fill"):
        tensors["concat_latent"] = torch.randn(1, 16, h, w, generator=g) * 0.8 + 0.1
        # InpaintModelConditioning's mask: [B, 1, H, W] in pixels, 1 where the image is to be filled
        tensors["concat_mask"] = (torch.rand(1, 1, case["height"], case["width"], generator=g) > 0.5).float()
    if case.get("mask"):
        # A soft pixel-space mask (SetLatentNoiseMask stores [1, H, W]); ComfyUI resizes it to the latent.
        ramp = torch.linspace(0.0, 1.0, case["width"])
        tensors["mask"] = (ramp[None, None, :] * torch.ones(1, case["height"], 1)).clamp(0.2, 0.9)
    return tensors


def with_lora(comfy, model, spec: dict[str, Any], folder: Path):
    """ComfyUI's own LoraLoaderModelOnly with a random LoRA file (testing.helpers.write_random_lora)."""
    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    name = f"lora-{spec['format']}-{spec['seed']}.safetensors"
    config = tiny_flux_config(**MODELS["dev"]["config"])
    write_random_lora(folder / name, config, spec["format"], rank=spec["rank"], seed=spec["seed"])
    return comfy["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, name, spec["strength"])[0]


def with_extras(comfy, conditioning: list, case: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list:
    """Kontext: ComfyUI's ReferenceLatent per reference (+ FluxKontextMultiReferenceLatentMethod); Fill:
    the values InpaintModelConditioning sets (nodes.py), without its VAE."""
    for j in range(len(case.get("refs", ()))):
        conditioning = comfy["edit"].ReferenceLatent.execute(conditioning, {"samples": tensors[f"ref{j}"]})[0]
    if "ref_method" in case:
        method = comfy["flux_nodes"].FluxKontextMultiReferenceLatentMethod
        conditioning = method.execute(conditioning, case["ref_method"])[0]
    if case.get("fill"):
        values = {"concat_latent_image": tensors["concat_latent"], "concat_mask": tensors["concat_mask"]}
        conditioning = comfy["node_helpers"].conditioning_set_values(conditioning, values)
    return conditioning


def record_calls(model, limit: int, store: dict[str, torch.Tensor], ids: bool = False) -> None:
    """Keep the first `limit` calls of ComfyUI's Flux.forward on this model: inputs and output; with `ids`,
    also the image position ids Flux._forward handed to forward_orig (Kontext's reference placement)."""
    flux = model.model.diffusion_model
    original = flux.forward
    count = [0]
    seen: list[torch.Tensor] = []
    if ids and hasattr(flux, "forward_orig"):  # the pack's proxy has none: its ids are made in the workers
        forward_orig = flux.forward_orig

        def recorded_orig(img, img_ids, *args, **kwargs):
            seen.append(img_ids)
            return forward_orig(img, img_ids, *args, **kwargs)

        flux.forward_orig = recorded_orig

    def recorded(x, timestep, context, y=None, guidance=None, ref_latents=None, **kwargs):
        out = original(x, timestep, context, y=y, guidance=guidance, ref_latents=ref_latents, **kwargs)
        i = count[0]
        if i < limit:
            refs = {f"ref{j}": r for j, r in enumerate(ref_latents or ())}
            if seen:
                refs["img_ids"] = seen[-1]
            for key, value in {"x": x, "timestep": timestep, "context": context, "y": y,
                               "guidance": guidance, "output": out, **refs}.items():  # fmt: skip
                if value is not None:  # FLUX.2 has no pooled y; [klein] and schnell no guidance
                    store[f"{i}.{key}"] = value.detach().to(torch.float32).clone()
        count[0] += 1
        return out

    flux.forward = recorded


def run_case(comfy, models, name: str, case: dict[str, Any], folder: Path) -> dict[str, torch.Tensor]:
    variant = case["variant"]
    if variant in FLUX2_MODELS:
        return run_flux2_case(comfy, models, name, case)
    model = models[variant]
    tensors = case_inputs(name, case)
    positive, cond_tensors = cond_for(variant, 1, 500 + len(name), case.get("guidance"))
    tensors.update(cond_tensors)
    negative = positive  # cfg 1: ComfyUI never runs the negative
    if case.get("negative"):
        negative, neg = cond_for(variant, 1, 900 + len(name), case.get("guidance"))
        tensors.update(neg_cond=neg["cond"], neg_pooled=neg["pooled"])
    if "refs" in case or case.get("fill"):
        positive, negative = (with_extras(comfy, c, case, tensors) for c in (positive, negative))
    latent = {"samples": tensors["latent"].clone()}
    if "mask" in tensors:
        latent["noise_mask"] = tensors["mask"].clone()
    if "batch_index" in case:
        latent["batch_index"] = list(case["batch_index"])
    if "shift" in case:
        s = case["shift"]
        model = (
            comfy["advanced"]
            .ModelSamplingFlux()
            .patch(model, s["max_shift"], s["base_shift"], case["width"], case["height"])[0]
        )
    if "lora" in case:
        model = with_lora(comfy, model, case["lora"], folder)
    calls: dict[str, torch.Tensor] = {}
    if "record_calls" in case:
        model = model.clone()
        record_calls(model, case["record_calls"], calls, ids="refs" in case)
    cfg, sampler_name = case.get("cfg", 1.0), case.get("sampler", "euler")
    custom = comfy["custom"]
    if "sigmas" in case:
        sampler = comfy["samplers"].sampler_object(sampler_name)
        sigmas = torch.tensor(case["sigmas"], dtype=torch.float32)
        out = custom.SamplerCustom().sample(
            model, True, case["seed"], cfg, positive, negative, sampler, sigmas, latent
        )[0]
    elif case.get("guider") == "cfg":
        noise = custom.RandomNoise().get_noise(case["seed"])[0]
        guider = custom.CFGGuider().get_guider(model, positive, negative, cfg)[0]
        sampler = custom.KSamplerSelect().get_sampler(sampler_name)[0]
        sigmas = custom.BasicScheduler().get_sigmas(
            model, case["scheduler"], case["steps"], case.get("denoise", 1.0)
        )[0]
        out = custom.SamplerCustomAdvanced().sample(noise, guider, sampler, sigmas, latent)[0]
    else:
        out = comfy["nodes"].common_ksampler(
            model, case["seed"], case["steps"], cfg, sampler_name, case.get("scheduler", "simple"), positive,
            negative, latent, denoise=case.get("denoise", 1.0),
        )[0]  # fmt: skip
    tensors["output"] = out["samples"].to(torch.float32).contiguous()
    if "record_calls" in case:
        return {f"{name}.{k}": v for k, v in calls.items()}
    return {f"{name}.{k}": v for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default: this version's file (reference_file)")
    args = parser.parse_args()
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout")
    torch.set_num_threads(1)
    comfy = import_comfy(path)
    out = args.out or reference_file(comfy_version(path))

    from rocm_parallel.backend.checkpoint import diffusers_to_bfl
    from rocm_parallel.backend.flux.model import build_flux
    from rocm_parallel.testing.models import tiny_flux_config

    models = {}
    for variant, spec in MODELS.items():
        config = tiny_flux_config(**spec["config"])
        flux = build_flux(config, seed=spec["seed"])
        models[variant] = load_in_comfy(comfy, config, diffusers_to_bfl(flux.state_dict()))

    from rocm_parallel.backend.checkpoint import diffusers_to_bfl

    for variant in FLUX2_MODELS:
        flux2 = flux2_model(variant)
        models[variant] = load_flux2_in_comfy(comfy, dict(flux2.config), diffusers_to_bfl(flux2.state_dict()))

    import folder_paths

    loras = Path(tempfile.mkdtemp(prefix="rp-loras-"))
    folder_paths.add_model_folder_path("loras", str(loras))
    tensors: dict[str, torch.Tensor] = {}
    flux2_cases = {n: c for n, c in FLUX2_CASES.items() if runs(comfy, c)}
    for name in sorted(set(FLUX2_CASES) - set(flux2_cases)):
        print(
            f"{name}: left out, ComfyUI {comfy_version(path)} offers no {FLUX2_CASES[name]['ref_method']!r}"
        )
    for name, case in {**CASES, **flux2_cases}.items():
        with torch.no_grad():
            got = run_case(comfy, models, name, case, loras)
        tensors.update({k: v.contiguous() for k, v in got.items()})
        print(f"{name}: {len(got)} tensors")

    commit = comfy_commit(path)
    metadata = {
        "comfyui_commit": commit,
        "comfyui_version": comfy_version(path),
        "torch": torch.__version__,
        "models": json.dumps(MODELS),
        "cases": json.dumps(CASES),
        "flux2_models": json.dumps(FLUX2_MODELS),
        "flux2_cases": json.dumps(flux2_cases),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    print(f"wrote {out} ({out.stat().st_size} bytes) from ComfyUI {metadata['comfyui_version']} {commit}")


if __name__ == "__main__":
    main()
