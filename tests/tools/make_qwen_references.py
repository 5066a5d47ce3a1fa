"""Record what a REAL ComfyUI samples with small random Qwen-Image models (the Qwen-Image references).

Run with a ComfyUI checkout outside this repository, once per ComfyUI version the pack is checked against:

    COMFYUI_PATH=/path/to/ComfyUI python tests/tools/make_qwen_references.py          # -> tests/data/qwen_references_0.33.0.safetensors

Each model is built with the family's own builder (`build_qwen_image(tiny_qwen_image_config(...), seed=...)`),
written as the single file users have (`save_checkpoint`: Comfy-Org's layout, diffusers' key names under
`model.diffusion_model.`) and loaded with ComfyUI's own `comfy.sd.load_diffusion_model_state_dict`, which
detects QwenImage from `txt_norm.weight` (comfy/model_detection.py) and builds `model_base.QwenImage`
(supported_models.QwenImage: latent format Wan21, ModelSamplingFlux shift 1.15). Its detection reads only
in_channels and the block count and hard-codes the released widths (24 heads x 128, text 3584, RoPE
16/56/56), so this script wraps `detect_unet_config` to add exactly those widths of the tiny model; Edit-2511's
`default_ref_method` ComfyUI 0.33 reads from the file's `__index_timestep_zero__` marker itself.

Each case is a graph of ComfyUI's Qwen-Image templates (comfyui-workflow-templates image_qwen_image,
image_qwen_image_edit[_2509|_2511]) run with ComfyUI's own nodes in float32 on the CPU: EmptySD3LatentImage,
ModelSamplingAuraFlow, LoraLoaderModelOnly (a random LoRA, testing/writers.py), CFGNorm (the edit
templates), ReferenceLatent (what TextEncodeQwenImageEdit[Plus] sets: the VL text encoder itself cannot run
here, so the prompt's features are random), FluxKontextMultiReferenceLatentMethod, KSampler. A prompt's text
`attention_mask` (what CLIPTextEncode sets when a prompt has padding) is set on the conditioning as the text
encoder would: ComfyUI 0.33 hands it to the model, 0.3.75 does not (model_base.QwenImage.extra_conds), so the
two versions' references differ there, and each version's are its own. Inputs, settings and ComfyUI's output
latents go into one safetensors file; settings, model configs and the ComfyUI version are in its metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_comfy_references import comfy_commit, comfy_version, import_comfy

DATA = Path(__file__).resolve().parents[1] / "data"
TEXT_DIM = 32

# Small but structurally complete: 2 dual-stream blocks, 4 heads x 16, RoPE (4, 6, 6), 16 latent channels.
MODELS: dict[str, dict[str, Any]] = {
    "qwen": {"config": {"heads": 4, "head_dim": 16, "blocks": 2, "text_dim": TEXT_DIM}, "seed": 1357},
    # Edit-2511: ComfyUI 0.33 reads its default placement from the file (index_timestep_zero)
    "qwen_2511": {
        "config": {"heads": 4, "head_dim": 16, "blocks": 2, "text_dim": TEXT_DIM, "zero_cond_t": True},
        "seed": 2468,
    },
}
# Sizes in pixels (latents are 1/8: odd latent sizes pad inside the model); text: tokens of each prompt;
# mask: padded tokens at the end of a prompt (the text encoder's attention_mask); refs: reference images
# in pixels; lora: a random LoRA (testing/writers.py) in a key format ComfyUI maps for QwenImage.
CASES: dict[str, dict[str, Any]] = {
    # image_qwen_image: ModelSamplingAuraFlow 3.1, KSampler euler/simple, cfg 2.5 with a negative prompt
    "qwen_t2i": {
        "model": "qwen", "width": 72, "height": 56, "steps": 3, "seed": 51, "shift": 3.1, "cfg": 2.5,
        "text": 9, "negative_text": 5, "mask": 3,
        "lora": {"format": "bare", "strength": 0.8, "rank": 4, "seed": 71},
    },
    # the headless `ParallelModel.sample` references: the template's schedule, cfg 1, no LoRA; text-to-image
    # and an encoded image at denoise 0.6 (the latent format's per-channel process_in and process_out)
    "qwen_t2i_cfg1": {"model": "qwen", "width": 88, "height": 40, "steps": 4, "seed": 52, "shift": 3.1, "text": 7},
    "qwen_img2img_cfg1": {
        "model": "qwen", "width": 56, "height": 72, "steps": 4, "seed": 56, "shift": 3.1, "text": 6,
        "latent": "random", "denoise": 0.6,
    },
    # a prompt with three padded tokens and its text mask, which `ParallelModel.sample` passes on as ComfyUI 0.33
    # does (0.3.75 drops the mask in model_base.QwenImage.extra_conds: recorded on the newer ComfyUI only)
    "qwen_t2i_mask_cfg1": {
        "model": "qwen", "width": 72, "height": 56, "steps": 3, "seed": 57, "shift": 3.1, "text": 9, "mask": 3,
        "newer": True,
    },
    # image_qwen_image_edit: the encoded image as the start latent and as the reference of both prompts,
    # ModelSamplingAuraFlow 3.0 + CFGNorm, a reference wider than the image (the text's RoPE start)
    "qwen_edit": {
        "model": "qwen", "width": 56, "height": 40, "steps": 3, "seed": 53, "shift": 3.0, "cfg": 2.5,
        "text": 11, "negative_text": 11, "cfg_norm": True, "refs": [[40, 88]], "latent": "ref0",
        "lora": {"format": "kohya", "strength": 1.0, "rank": 4, "seed": 72},
    },
    # image_qwen_image_edit_2509: two reference images placed by "offset" (the node's choice), another
    # sampler
    "qwen_edit_2509_offset": {
        "model": "qwen", "width": 56, "height": 56, "steps": 3, "seed": 54, "shift": 3.0, "cfg": 2.0,
        "text": 8, "negative_text": 6, "mask": 2, "cfg_norm": True, "refs": [[40, 72], [24, 40]],
        "ref_method": "offset", "sampler": "dpmpp_2m", "scheduler": "beta",
        "lora": {"format": "peft", "strength": 0.7, "rank": 4, "seed": 73},
    },
    # image_qwen_image_edit_2511 (0.33 only): the file's default placement, index_timestep_zero
    "qwen_edit_2511": {
        "model": "qwen_2511", "width": 56, "height": 40, "steps": 3, "seed": 55, "shift": 3.1, "cfg": 2.5,
        "text": 10, "negative_text": 10, "cfg_norm": True, "refs": [[40, 56]], "latent": "ref0", "newer": True,
        "lora": {"format": "bfl", "strength": 0.9, "rank": 4, "seed": 74},
    },
}  # fmt: skip
LORA_RELATIVE = 0.5  # the LoRA's delta against weights ~ 1/sqrt(fan_in): moves outputs well above 1e-4


def references_path(version: str) -> Path:
    return DATA / f"qwen_references_{version}.safetensors"


def supported(case: dict[str, Any], version: str) -> bool:
    """Whether ComfyUI `version` has what the case needs (index_timestep_zero came after 0.3.75)."""
    return not case.get("newer") or not version.startswith("0.3.")


def qwen_config(name: str) -> dict[str, Any]:
    from rocm_parallel.testing.models import tiny_qwen_image_config

    return tiny_qwen_image_config(**MODELS[name]["config"])


def qwen_model(name: str) -> torch.nn.Module:
    """The diffusers model of a test model (random weights from its seed, ComfyUI's RoPE)."""
    from rocm_parallel.backend.qwen_image.model import build_qwen_image

    return build_qwen_image(qwen_config(name), seed=MODELS[name]["seed"])


def write_model(name: str, folder: Path) -> str:
    """The test model as Comfy-Org's single file (keys under `model.diffusion_model.`)."""
    from rocm_parallel.backend.checkpoint import save_checkpoint

    return save_checkpoint(qwen_model(name), folder / f"tiny-{name}.safetensors", prefix=True)


def load_in_comfy(comfy: dict[str, Any], path: str, config: dict[str, Any]):
    """ComfyUI's own loader on the file, its detection told the tiny widths it hard-codes."""
    from comfy.utils import load_torch_file

    detection = comfy["detection"]
    original = detection.detect_unet_config
    widths = {
        "num_attention_heads": config["num_attention_heads"],
        "attention_head_dim": config["attention_head_dim"],
        "joint_attention_dim": config["joint_attention_dim"],
        "axes_dims_rope": list(config["axes_dims_rope"]),
    }

    def detect_tiny(state_dict, key_prefix, metadata=None):
        found = original(state_dict, key_prefix, metadata=metadata)
        if found is None or found.get("image_model") != "qwen_image":
            raise RuntimeError(f"ComfyUI did not detect the test checkpoint as qwen_image: {found}")
        return {**found, **widths}

    detection.detect_unet_config = detect_tiny
    try:
        state = load_torch_file(path, safe_load=True)
        model = comfy["sd"].load_diffusion_model_state_dict(state, model_options={"dtype": torch.float32})
    finally:
        detection.detect_unet_config = original
    if model is None or type(model.model).__name__ != "QwenImage":
        raise RuntimeError(f"ComfyUI did not load the test checkpoint as its QwenImage: {model}")
    return model


def case_inputs(name: str, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The prompts' features ([1, T, text_dim], as the qwen_image text encoder gives them), their masks and the
    reference images' latents ([1, 16, 1, h/8, w/8], as VAEEncode with the Qwen-Image VAE gives them)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {"cond": torch.randn(1, case["text"], TEXT_DIM, generator=g)}
    if "negative_text" in case:
        tensors["neg_cond"] = torch.randn(1, case["negative_text"], TEXT_DIM, generator=g)
    if case.get("mask"):
        mask = torch.ones(1, case["text"], dtype=torch.long)
        mask[:, -case["mask"] :] = 0
        tensors["mask"] = mask
    for j, (h_px, w_px) in enumerate(case.get("refs", ())):
        tensors[f"ref{j}"] = torch.randn(1, 16, 1, h_px // 8, w_px // 8, generator=g) * 0.8 + 0.1
    if case.get("latent") == "random":  # an encoded image (VAEEncode with the Qwen-Image VAE)
        tensors["latent"] = torch.randn(1, 16, 1, case["height"] // 8, case["width"] // 8, generator=g) * 2.0
    return tensors


def conditioning(
    comfy: dict[str, Any], case: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str
) -> list:
    """CLIPTextEncode's conditioning (features, no pooled output, the mask when there is padding), then the
    reference latents and their placement as the edit templates set them."""
    extras: dict[str, Any] = {"pooled_output": None}
    if prefix == "" and "mask" in tensors:
        extras["attention_mask"] = tensors["mask"]
    cond: list = [[tensors[f"{prefix}cond"], extras]]
    for j in range(len(case.get("refs", ()))):
        cond = comfy["edit"].ReferenceLatent.execute(cond, {"samples": tensors[f"ref{j}"]})[0]
    if "ref_method" in case:
        cond = comfy["flux_nodes"].FluxKontextMultiReferenceLatentMethod.execute(cond, case["ref_method"])[0]
    return cond


def lora_file(case: dict[str, Any], folder: Path) -> str:
    from rocm_parallel.testing.writers import write_random_lora

    spec = case["lora"]
    path = folder / f"qwen-lora-{spec['format']}-{spec['seed']}.safetensors"
    return write_random_lora(
        path, qwen_config(case["model"]), spec["format"], rank=spec["rank"], seed=spec["seed"],
        family="qwen_image", relative=LORA_RELATIVE,
    )  # fmt: skip


def run_case(comfy: dict[str, Any], model: Any, name: str, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The case's graph on `model` (ComfyUI's own QwenImage, or the ROCm Parallel Model); a LoRA is applied
    by the caller (LoraLoaderModelOnly here, the pack's LoRA for the parallel MODEL)."""
    import comfy_extras.nodes_model_advanced as advanced

    tensors = case_inputs(name, case)
    positive = conditioning(comfy, case, tensors, "")
    negative = conditioning(comfy, case, tensors, "neg_") if "neg_cond" in tensors else positive
    model = advanced.ModelSamplingAuraFlow().patch_aura(model, case["shift"])[0]
    if case.get("cfg_norm"):
        import comfy_extras.nodes_cfg as cfg_nodes

        model = cfg_nodes.CFGNorm.execute(model, 1.0)[0]
    if case.get("latent") == "ref0":  # the edit templates start from the encoded input image
        latent = {"samples": tensors["ref0"][..., : case["height"] // 8, : case["width"] // 8].clone()}
    elif case.get("latent") == "random":
        latent = {"samples": tensors["latent"].clone()}
    else:
        import comfy_extras.nodes_sd3 as sd3

        latent = sd3.EmptySD3LatentImage.execute(case["width"], case["height"], 1)[0]
    out = comfy["nodes"].common_ksampler(
        model, case["seed"], case["steps"], case.get("cfg", 1.0), case.get("sampler", "euler"),
        case.get("scheduler", "simple"), positive, negative, latent, denoise=case.get("denoise", 1.0),
    )[0]  # fmt: skip
    tensors["output"] = out["samples"].to(torch.float32).contiguous()
    return {f"{name}.{k}": v for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="default: tests/data/qwen_references_<version>"
    )
    args = parser.parse_args()
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout")
    torch.set_num_threads(1)
    comfy = import_comfy(path)
    version = comfy_version(path)
    out_path = args.out or references_path(version)

    import folder_paths

    folder = Path(tempfile.mkdtemp(prefix="rp-qwen-"))
    folder_paths.add_model_folder_path("loras", str(folder))
    models = {name: load_in_comfy(comfy, write_model(name, folder), qwen_config(name)) for name in MODELS}
    tensors: dict[str, torch.Tensor] = {}
    cases = {name: case for name, case in CASES.items() if supported(case, version)}
    for name, case in cases.items():
        model = models[case["model"]]
        if "lora" in case:
            lora = Path(lora_file(case, folder)).name
            strength = case["lora"]["strength"]
            model = comfy["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, lora, strength)[0]
        with torch.no_grad():
            got = run_case(comfy, model, name, case)
            if "lora" in case:  # the LoRA must matter far above the tolerance, or the case checks nothing
                plain = run_case(comfy, models[case["model"]], name, case)
                moved = (got[f"{name}.output"] - plain[f"{name}.output"]).abs().max().item()
                print(f"{name}: the LoRA moves the output by {moved:.3f}")
        tensors.update({k: v.contiguous() for k, v in got.items()})
        print(f"{name}: {len(got)} tensors, output {tuple(got[f'{name}.output'].shape)}")
    metadata = {
        "comfyui_commit": comfy_commit(path),
        "comfyui_version": version,
        "torch": torch.__version__,
        "models": json.dumps(MODELS),
        "cases": json.dumps(cases),
        "lora_relative": json.dumps(LORA_RELATIVE),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_path), metadata=metadata)
    print(
        f"wrote {out_path} ({out_path.stat().st_size} bytes) from ComfyUI {version} {metadata['comfyui_commit']}"
    )


if __name__ == "__main__":
    main()
