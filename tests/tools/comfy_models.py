"""Small random FLUX.1 / FLUX.2 (and Qwen-Image) models built with ComfyUI's OWN model classes and saved by
ComfyUI's OWN ModelSave, so the pack's loader can be checked against files that no code of ours wrote.
Qwen-Image (`--models qwen-image,qwen-image-edit-2511`; the model engine's tests build it in process) is told
its heads, head width, text width and RoPE axes (its class defaults hold the released ones) and gets the
ModelSave, bf16, bare and prefix files only.

    export COMFYUI_PATH=/path/to/ComfyUI        # a ComfyUI checkout and its environment (docs/testing.md)
    python tests/tools/comfy_models.py --out DIR [--models flux1-dev,flux2-klein] [--no-fp8]
    python tests/tools/comfy_models.py --check DIR [DIR ...]   # load every file of DIR with THIS ComfyUI

Run it once per ComfyUI version (each version writes its own spellings: 0.3.75 names the q/k norms
`*_norm.scale`, 0.33.0 `*_norm.weight`). Nothing of the pack is imported: the weights live only in
ComfyUI's modules and the files are written by ComfyUI's code.

How a model is made (all ComfyUI's code, except the random numbers):

1. Detection: `comfy.model_detection.detect_unet_config` is run on a header-like dict (meta tensors with
   the keys and shapes it reads: img_in, txt_in, vector_in, guidance_in, the q/k norm, the block keys,
   FLUX.2's shared modulation). It derives in/out channels, hidden and text widths, depths, guidance,
   vec_in_dim, txt_ids_dims, ... exactly as it does for a real file. It hard-codes the released models'
   heads and RoPE axes (0.3.75: 24 / 48 heads; 0.33.0: heads = hidden // sum(axes)), which a small model
   cannot match, so exactly those two are replaced (`num_heads`, `axes_dim`): 4 heads x 16, axes
   (4, 6, 6) for FLUX.1 and (4, 4, 4, 4) for FLUX.2 (the split the pack's tiny configs use, so the pack
   derives the same RoPE from the shapes).
2. `comfy.model_detection.model_config_from_unet_config` picks the supported model (Flux, FluxSchnell,
   Flux2), `set_inference_dtype` and `get_model` build `comfy.model_base.Flux` / `Flux2` around
   `comfy.ldm.flux.model.Flux`.
3. Weights: ComfyUI's ops leave them uninitialised; every tensor of the diffusion model is filled from its
   own generator, seeded by (model seed, crc32 of the key with `_norm.weight` read as `_norm.scale`), so
   both versions' models hold the same numbers under their own key names. Linear weights N(0, 1/fan_in),
   biases N(0, 0.05^2), RMSNorm weights 1 + N(0, 0.1^2).
4. Saving: `comfy_extras.nodes_model_merging.ModelSave().save(model, filename_prefix)` - the node a user
   runs (it calls nodes_model_merging.save_checkpoint -> comfy.sd.save_checkpoint ->
   model_base.state_dict_for_saving -> comfy.utils.save_torch_file); only its output folder is a
   temporary one. The file is then renamed.

Files written per model (NAME.VARIANT.safetensors; `manifest.json` lists them with what wrote them):

- `modelsave`        ModelSave of the float32 model (`model.diffusion_model.` prefix, this version's norms)
- `modelsave-bf16`   ModelSave of the same model built in bfloat16
- `bare`             the `modelsave` file without its prefix (comfy.utils.state_dict_prefix_replace, the
                     function ComfyUI's loaders strip it with): the UNETLoader spelling of BFL's releases
- `bare-scale` / `modelsave-scale` (ComfyUI >= 0.14, which renames the norms at load): the norms renamed
                     back to BFL's `*_norm.scale`
                     (the inverse of supported_models.Flux.process_unet_state_dict), i.e. the spelling of
                     BFL's published flux1-dev / flux2-dev files, which 0.33 still loads
- `prefix-model`, `prefix-model_model`, `prefix-net`: the `bare` keys under `model.`, `model.model.`,
                     `net.`, the other prefixes ComfyUI's loader strips (unet_prefix_from_state_dict)
- `diffusers`        (FLUX.1) the same tensors in diffusers' key layout, cut along ComfyUI's own map
                     (comfy.utils.flux_to_diffusers), which its loader converts back (FLUX.2 it refuses)
- `scaled-fp8-input` (FLUX.1) a legacy "scaled fp8" file as distributed (`scaled_fp8` marker, every linear
                     fp8 with a scalar `scale_weight`, fp8 biases); written by this tool, loaded by ComfyUI
- `scaled-fp8`       that file loaded by ComfyUI's own loader and saved again by ModelSave: 0.3.75 writes
                     the legacy layout back, 0.33 its `comfy_quant` / `weight_scale` layout
- `fp8mixed-input`   (FLUX.2) Comfy-Org's "mixed" layout (block linears fp8 with `weight_scale`, declared by
                     `comfy_quant` tensors and the `_quantization_metadata` header key); written by this tool
- `fp8mixed`         that file loaded and saved by ModelSave (0.3.75's ModelSave fails on it: reported)

Every written file is loaded back with ComfyUI's own `comfy.sd.load_diffusion_model_state_dict` (the
UNETLoader's loader, detection told the small heads/axes) and compared with the model it came from;
`--check` does that for another version's folder (e.g. 0.3.75 cannot load 0.33's `*_norm.weight` files).
A file ComfyUI cannot load stays, with the error in its manifest entry (`comfy_loads`); a file ComfyUI
cannot write is reported under `failures`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch

PREFIX = "model.diffusion_model."
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Small but structurally complete: hidden 64 = 4 heads x 16, 2 double + 2 single blocks.
HEADS, HEAD_DIM, DOUBLE, SINGLE = 4, 16, 2, 2
FLUX1_AXES = [4, 6, 6]  # FLUX's (16, 56, 56) of 128 in proportion (the pack's rope_axes(16))
FLUX2_AXES = [4, 4, 4, 4]  # FLUX.2's (32, 32, 32, 32) of 128

# family, latent channels per token (img_in input), text width, pooled width (FLUX.1), guidance, seed;
# Qwen-Image: `blocks` dual-stream blocks, `marker`: Edit-2511's `__index_timestep_zero__` (0.33 reads it)
MODELS: dict[str, dict[str, Any]] = {
    "flux1-dev": {"family": "flux", "in": 64, "text": 32, "pooled": 24, "guidance": True, "seed": 1234},
    "flux1-schnell": {"family": "flux", "in": 64, "text": 32, "pooled": 24, "guidance": False, "seed": 4321},
    "flux2-dev": {"family": "flux2", "in": 128, "text": 32, "guidance": True, "seed": 5678},
    "flux2-klein": {"family": "flux2", "in": 128, "text": 24, "guidance": False, "seed": 8765},
    "qwen-image": {"family": "qwen_image", "in": 64, "text": 32, "blocks": 2, "seed": 2468},
    "qwen-image-edit-2511": {"family": "qwen_image", "in": 64, "text": 32, "blocks": 2, "marker": True, "seed": 2468},
}  # fmt: skip
FLUX_MODELS = [n for n, spec in MODELS.items() if spec["family"] != "qwen_image"]  # the CLI's default
QWEN_MARKER = "__index_timestep_zero__"  # comfy/model_detection.py: an Edit-2511 file (an empty tensor)


# --------------------------------------------------------------------------------------------------
# ComfyUI


def import_comfy(path: str | None) -> dict[str, Any]:
    """Import ComfyUI from `path` (or whatever `comfy` resolves to on sys.path) as `main.py --cpu` would."""
    if path:
        sys.path.insert(0, str(Path(path).resolve()))
    argv, sys.argv = sys.argv, [sys.argv[0], "--cpu"]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.model_detection
        import comfy.model_patcher
        import comfy.sd
        import comfy.utils
        import comfy_extras.nodes_model_merging as merging
    finally:
        sys.argv = argv
    root = Path(comfy.sd.__file__).resolve().parents[1]  # `comfy` is a namespace package
    return {
        "root": root,
        "version": comfy_version(root),
        "commit": comfy_commit(root),
        "detection": comfy.model_detection,
        "patcher": comfy.model_patcher,
        "sd": comfy.sd,
        "utils": comfy.utils,
        "ModelSave": merging.ModelSave,
    }


def comfy_version(root: Path) -> str:
    text = (root / "comfyui_version.py").read_text()
    return text.split("__version__ =")[-1].strip().strip("\"'")


def comfy_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def widths(spec: dict[str, Any]) -> dict[str, Any]:
    """What ComfyUI's detection cannot read from a small model's shapes (it hard-codes the released ones).
    A spec may name its own `heads`, `head_dim`, `axes`, `double`, `single` (the comfy tier's GGUF models
    are wider: K-quant rows are 256 values)."""
    axes = spec.get("axes", FLUX2_AXES if spec["family"] == "flux2" else FLUX1_AXES)
    if spec["family"] == "qwen_image":  # its class defaults hold the released widths (24 x 128, 3584)
        return {
            "num_attention_heads": spec.get("heads", HEADS),
            "attention_head_dim": spec.get("head_dim", HEAD_DIM),
            "joint_attention_dim": spec["text"],
            "axes_dims_rope": list(axes),
        }
    return {"num_heads": spec.get("heads", HEADS), "axes_dim": list(axes)}


def header_like(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The keys and shapes detect_unet_config reads, as meta tensors (a real file's header, abridged)."""
    head_dim = spec.get("head_dim", HEAD_DIM)
    hidden = spec.get("heads", HEADS) * head_dim
    t = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    if spec["family"] == "qwen_image":  # detected by txt_norm; reads img_in and counts the blocks
        sd = {"txt_norm.weight": t(spec["text"]), "img_in.weight": t(hidden, spec["in"]),
              "proj_out.weight": t(spec["in"], hidden)}  # fmt: skip
        sd.update(
            {f"transformer_blocks.{i}.attn.to_q.weight": t(hidden, hidden) for i in range(spec["blocks"])}
        )
        if spec.get("marker"):
            sd[QWEN_MARKER] = t(0)
        return sd
    sd = {
        "img_in.weight": t(hidden, spec["in"]),
        "txt_in.weight": t(hidden, spec["text"]),
        "double_blocks.0.img_attn.norm.key_norm.scale": t(head_dim),
    }
    sd.update(
        {
            f"double_blocks.{i}.img_attn.qkv.weight": t(3 * hidden, hidden)
            for i in range(spec.get("double", DOUBLE))
        }
    )
    sd.update(
        {f"single_blocks.{i}.linear2.weight": t(hidden, hidden) for i in range(spec.get("single", SINGLE))}
    )
    if spec["family"] == "flux2":
        sd["double_stream_modulation_img.lin.weight"] = t(6 * hidden, hidden)
    else:
        sd["vector_in.in_layer.weight"] = t(hidden, spec["pooled"])
    if spec["guidance"]:
        sd["guidance_in.in_layer.weight"] = t(hidden, 256)
    return sd


def model_config(comfy: dict[str, Any], spec: dict[str, Any]):
    """ComfyUI's supported-model config for `spec`, from its own detection (+ the small heads/axes)."""
    detection = comfy["detection"]
    probe = header_like(spec)
    unet_config = detection.detect_unet_config(probe, "")
    want = {"flux2": "flux2", "qwen_image": "qwen_image"}.get(spec["family"], "flux")
    if unet_config is None or unet_config.get("image_model") != want:
        raise RuntimeError(f"ComfyUI's detection did not see {want} in the probe: {unet_config}")
    unet_config.update(widths(spec))
    config = detection.model_config_from_unet_config(unet_config, probe)
    if config is None:
        raise RuntimeError(f"ComfyUI has no supported model for {unet_config}")
    return config


def canonical(key: str) -> str:
    """The key the random numbers are drawn for: 0.33's `*_norm.weight` is 0.3.75's `*_norm.scale`."""
    return key[: -len(".weight")] + ".scale" if key.endswith("_norm.weight") else key


def fill_random(module: torch.nn.Module, seed: int) -> None:
    """Seeded random weights, one generator per tensor (independent of order and of the norms' names)."""
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            name = canonical(key)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            x = torch.randn(tuple(tensor.shape), generator=g, dtype=torch.float32)
            if name.endswith("_norm.scale") or name.rpartition(".")[0].rpartition(".")[2].startswith("norm_"):
                # (FLUX's *_norm.scale, Qwen-Image's attn.norm_q.weight, ...)
                x = 1.0 + 0.1 * x
            elif name.endswith(".bias"):
                x = 0.05 * x
            elif tensor.ndim >= 2:
                x = x / tensor.shape[-1] ** 0.5
            tensor.copy_(x.to(tensor.dtype))


def build(comfy: dict[str, Any], spec: dict[str, Any], dtype: torch.dtype):
    """A ModelPatcher around ComfyUI's own Flux / Flux2 model with seeded random weights, on the CPU."""
    config = model_config(comfy, spec)
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, "")
    fill_random(model.diffusion_model, spec["seed"])
    cpu = torch.device("cpu")
    return comfy["patcher"].ModelPatcher(model, load_device=cpu, offload_device=cpu)


def model_save(comfy: dict[str, Any], patcher, out: Path) -> dict[str, str]:
    """ComfyUI's ModelSave node (a temporary output folder), its file moved to `out`; its metadata."""
    from safetensors import safe_open

    node = comfy["ModelSave"]()
    with tempfile.TemporaryDirectory() as tmp:
        node.output_dir = tmp
        node.save(patcher, filename_prefix="model")
        written = sorted(Path(tmp).glob("*.safetensors"))
        if len(written) != 1:
            raise RuntimeError(f"ModelSave wrote {[p.name for p in written]}, expected one file")
        shutil.move(str(written[0]), out)
    with safe_open(str(out), "pt") as f:
        return dict(f.metadata() or {})


def load_in_comfy(comfy: dict[str, Any], path: Path, spec: dict[str, Any]):
    """The UNETLoader's loader (comfy.sd.load_diffusion_model_state_dict with the file's metadata), its
    detection told the small heads and axes; returns ComfyUI's ModelPatcher."""
    detection = comfy["detection"]
    original = detection.detect_unet_config

    def detect_small(state_dict, key_prefix, metadata=None):
        config = original(state_dict, key_prefix, metadata=metadata)
        return None if config is None else {**config, **widths(spec)}

    sd, metadata = comfy["utils"].load_torch_file(str(path), safe_load=True, return_metadata=True)
    detection.detect_unet_config = detect_small
    try:
        model = comfy["sd"].load_diffusion_model_state_dict(
            sd, model_options={"dtype": torch.float32}, metadata=metadata
        )
    finally:
        detection.detect_unet_config = original
    if model is None:
        raise RuntimeError("ComfyUI could not detect the model type (load_diffusion_model_state_dict: None)")
    return model


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A ComfyUI weight as plain float32 (QuantizedTensor -> dequantize(); legacy fp8 stays raw)."""
    if hasattr(tensor, "dequantize") and type(tensor).__name__ == "QuantizedTensor":
        return tensor.dequantize().float()
    return tensor.float()


def residency(model) -> str:
    """How ComfyUI holds the first image qkv weight: its class, .dtype and storage dtype."""
    blocks = model.model.diffusion_model
    w = (
        blocks.transformer_blocks[0].attn.to_q.weight
        if hasattr(blocks, "transformer_blocks")
        else (blocks.double_blocks[0].img_attn.qkv.weight)
    )
    storage = getattr(w, "storage_dtype", None) or getattr(getattr(w, "_qdata", None), "dtype", None)
    text = f"{type(w).__name__} dtype={str(w.dtype).removeprefix('torch.')}"
    if storage is not None:
        text += f" storage={str(storage).removeprefix('torch.')}"
    layout = getattr(w, "_layout_cls", None) or getattr(w, "_layout_type", None)
    return text + (f" layout={layout}" if layout else "")


def compare(model, reference: dict[str, torch.Tensor]) -> float:
    """max |ComfyUI's loaded weight - reference| over the reference's keys (norm names compared
    canonically); an fp8 weight counts times its per-tensor scale."""
    loaded = {canonical(k): v for k, v in model.model.diffusion_model.state_dict().items()}
    worst = 0.0
    for key, want in reference.items():
        got = loaded.get(canonical(key))
        if got is None:
            raise RuntimeError(f"ComfyUI's loaded model has no '{key}'")
        if not want.numel():  # a marker (Qwen-Image-Edit-2511's empty __index_timestep_zero__)
            continue
        raw_fp8 = type(got).__name__ != "QuantizedTensor" and got.dtype in FP8
        got = dequantized(got)
        layer = key.removesuffix(".weight")
        # the state dict of a quantized layer holds the raw fp8 weight beside its per-tensor scale:
        # `scale_weight` (0.3.75 scaled fp8 ops) or `weight_scale` (0.33's quantized layers)
        scale = loaded.get(f"{layer}.scale_weight", loaded.get(f"{layer}.weight_scale"))
        if raw_fp8 and key.endswith(".weight") and scale is not None:
            got = got * scale.float()
        worst = max(worst, (got - want.float()).abs().max().item())
    return worst


# --------------------------------------------------------------------------------------------------
# Derived spellings and fp8 inputs (made from ComfyUI's own output, with ComfyUI's own helpers)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def write(comfy: dict[str, Any], sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    comfy["utils"].save_torch_file(sd, str(path), metadata=metadata or None)


def strip_prefix(comfy: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return comfy["utils"].state_dict_prefix_replace(sd, {PREFIX: ""}, filter_keys=True)


def norms_as_scale(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL's published norm names: the inverse of ComfyUI 0.33's Flux.process_unet_state_dict."""
    return {canonical(k): v for k, v in sd.items()}


# comfy/model_detection.py unet_prefix_from_state_dict: `model.diffusion_model.`, `model.model.` and `net.`
# are stripped when more than 5 keys carry them, else `model.` (every other key is then dropped).
OTHER_PREFIXES = {"prefix-model": "model.", "prefix-model_model": "model.model.", "prefix-net": "net."}
# diffusers names in comfy.utils.flux_to_diffusers that alias another diffusers name of the same BFL tensor
# (LyCORIS LoKr names, FLUX.2's fused single-block names, a controlnet input): not FLUX.1's diffusers keys.
DIFFUSERS_ALIASES = ("linear_in", "linear_out", "to_qkv_mlp_proj", "controlnet_")


def diffusers_from_bfl(comfy: dict[str, Any], bare: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FLUX.1 in diffusers' key layout, cut out of the BFL tensors along ComfyUI's own map
    (comfy.utils.flux_to_diffusers, the map its loader converts diffusers files back with)."""
    named = {canonical(k): v for k, v in bare.items()}
    hidden = bare["img_in.weight"].shape[0]
    count = lambda p: len({k.split(".")[1] for k in bare if k.startswith(p)})  # noqa: E731
    config = {
        "depth": count("double_blocks."),
        "depth_single_blocks": count("single_blocks."),
        "hidden_size": hidden,
    }
    out: dict[str, torch.Tensor] = {}
    for key, target in comfy["utils"].flux_to_diffusers(config, output_prefix="").items():
        if any(a in key for a in DIFFUSERS_ALIASES) or (key.startswith("single_") and ".attn.to_out." in key):
            continue
        name, offset, fun = (
            (target, None, None) if isinstance(target, str) else (*target[:2], (target[2:] or [None])[0])
        )
        source = named.get(canonical(name))
        if source is None:
            continue
        piece = source if offset is None else source.narrow(offset[0], offset[1], offset[2])
        # `fun` is swap_scale_shift (final_layer.adaLN_modulation), its own inverse
        out[key] = (fun(piece) if fun is not None else piece).contiguous()
    return out


def linear_weights(sd: dict[str, torch.Tensor], blocks_only: bool) -> list[str]:
    keys = [k for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2]
    if blocks_only:
        keys = [k for k in keys if k.split(".")[0] in ("double_blocks", "single_blocks")]
    return keys


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor fp8 e4m3fn: (fp8 weight, float32 scale) with weight ~ fp8 * scale."""
    scale = weight.float().abs().max() / 448.0
    return (weight.float() / scale).to(torch.float8_e4m3fn).contiguous(), scale.reshape(()).float()


def scaled_fp8_input(bare: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's legacy scaled fp8 layout: marker `scaled_fp8`, every linear fp8 with `scale_weight`,
    linear biases fp8 (ComfyUI's scaled Linear holds them in fp8), the rest as it is."""
    out: dict[str, torch.Tensor] = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    weights = set(linear_weights(bare, blocks_only=False))
    for key, value in bare.items():
        layer = key.rsplit(".", 1)[0]
        if key in weights:
            out[key], out[layer + ".scale_weight"] = quantize(value)
        elif key.endswith(".bias") and layer + ".weight" in weights:
            out[key] = value.to(torch.float8_e4m3fn)
        else:
            out[key] = value
    return out


def fp8_mixed_input(bare: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Comfy-Org's "mixed" layout: block linears fp8 + `weight_scale`, declared twice (per-layer
    `comfy_quant` JSON tensors, read by 0.33, and the `_quantization_metadata` header key, read by 0.3.75)."""
    out = dict(bare)
    layers: dict[str, dict[str, str]] = {}
    marker = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    for key in linear_weights(bare, blocks_only=True):
        layer = key.removesuffix(".weight")
        out[key], out[layer + ".weight_scale"] = quantize(bare[key])
        out[layer + ".comfy_quant"] = marker.clone()
        layers[layer] = {"format": "float8_e4m3fn"}
    return out, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}


# --------------------------------------------------------------------------------------------------
# Running


def summary(path: Path) -> str:
    sd, metadata = read(path)
    dtypes: dict[str, int] = {}
    for v in sd.values():
        name = str(v.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + 1
    first = lambda *ends: [k for k in sorted(sd) if k.endswith(ends)][:1]  # noqa: E731
    sample = (
        first("img_in.weight") + first("img_attn.qkv.weight") + first("query_norm.scale", "query_norm.weight")
    )
    sample += first(".scale_weight") + first(".weight_scale") + first(".comfy_quant") + first("scaled_fp8")
    sample += [] if sample else [k for k in sorted(sd) if "transformer_blocks.0." in k][:3]
    meta = {k: (v if len(v) < 40 else v[:37] + "...") for k, v in metadata.items()}
    return f"{len(sd)} tensors {dtypes}; keys e.g. {sample}; metadata {meta}"


def make(comfy: dict[str, Any], out: Path, names: list[str], fp8: bool) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    # ComfyUI >= 0.14 (commit e1add563) holds the q/k norms as torch RMSNorm `.weight` and renames BFL's
    # `*_norm.scale` at load (supported_models.Flux.process_unet_state_dict); older ones keep `.scale`
    renames_norms = "process_unet_state_dict" in vars(type(model_config(comfy, MODELS["flux1-dev"])))
    files: list[dict[str, Any]] = []
    failures: list[str] = []

    def record(name: str, variant: str, how: str, reference: dict[str, torch.Tensor], **extra: Any) -> None:
        path = out / f"{name}.{variant}.safetensors"
        entry = {"file": path.name, "model": name, "variant": variant, "written_by": how, **extra}
        try:
            loaded = load_in_comfy(comfy, path, MODELS[name])
            entry["comfy_loads"] = f"yes, as {type(loaded.model).__name__} ({loaded.model.model_type.name})"
            entry["comfy_residency"] = residency(loaded)
            entry["max_abs_diff_to_model"] = compare(loaded, reference)
        except Exception as err:  # reported; the file stays for the pack's check
            entry["comfy_loads"] = f"NO: {type(err).__name__}: {err}"
        entry["summary"] = summary(path)
        files.append(entry)
        print(f"\n{path.name}\n  written by: {how}\n  {entry['summary']}")
        print(f"  ComfyUI {comfy['version']} loads it: {entry['comfy_loads']}")
        if "comfy_residency" in entry:
            print(f"  qkv weight in ComfyUI: {entry['comfy_residency']}; max |diff| to the model "
                  f"{entry['max_abs_diff_to_model']:.3g}")  # fmt: skip

    for name in names:
        spec = MODELS[name]
        model = build(comfy, spec, torch.float32)
        reference = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
        main = out / f"{name}.modelsave.safetensors"
        metadata = model_save(comfy, model, main)
        record(name, "modelsave", "ModelSave (float32 model)", reference)

        bf16 = build(comfy, spec, torch.bfloat16)
        model_save(comfy, bf16, out / f"{name}.modelsave-bf16.safetensors")
        record(name, "modelsave-bf16", "ModelSave (bfloat16 model)", reference, note="diff: bf16 rounding")

        saved, _ = read(main)
        bare = strip_prefix(comfy, dict(saved))  # (state_dict_prefix_replace pops from its input)
        write(comfy, bare, out / f"{name}.bare.safetensors", metadata)
        record(
            name, "bare", "ModelSave file, prefix stripped (comfy.utils.state_dict_prefix_replace)", reference
        )
        if (
            renames_norms and spec["family"] != "qwen_image"
        ):  # Qwen-Image's norms are `.weight` in every version
            write(comfy, norms_as_scale(bare), out / f"{name}.bare-scale.safetensors", metadata)
            record(
                name, "bare-scale", "ModelSave file, prefix stripped, norms renamed *_norm.scale", reference
            )
            write(comfy, norms_as_scale(saved), out / f"{name}.modelsave-scale.safetensors", metadata)
            record(name, "modelsave-scale", "ModelSave file, norms renamed *_norm.scale", reference)

        for variant, prefix in OTHER_PREFIXES.items():
            write(
                comfy,
                {prefix + k: v for k, v in bare.items()},
                out / f"{name}.{variant}.safetensors",
                metadata,
            )
            record(name, variant, f"ModelSave file, prefix {PREFIX!r} replaced by {prefix!r}", reference)
        if spec["family"] == "flux":  # ComfyUI converts diffusers-keyed FLUX.1 files; FLUX.2 ones it refuses
            write(comfy, diffusers_from_bfl(comfy, bare), out / f"{name}.diffusers.safetensors", metadata)
            record(
                name,
                "diffusers",
                "ModelSave file cut into diffusers keys along comfy.utils.flux_to_diffusers",
                reference,
            )

        if not fp8 or spec["family"] == "qwen_image":
            continue
        canonical_bare = norms_as_scale(bare)  # what ComfyUI 0.3.75 detects; 0.33 reads either
        flux1 = spec["family"] == "flux"
        variant = "scaled-fp8" if flux1 else "fp8mixed"
        how = "legacy scaled fp8 input" if flux1 else "Comfy-Org fp8 mixed input"
        source, src_meta = (
            (scaled_fp8_input(canonical_bare), {}) if flux1 else fp8_mixed_input(canonical_bare)
        )
        src = out / f"{name}.{variant}-input.safetensors"
        write(comfy, source, src, src_meta)
        record(name, f"{variant}-input", f"this tool ({how}, comfy.utils.save_torch_file)", reference,
               note="fp8: the diff is the quantization error")  # fmt: skip
        try:
            loaded = load_in_comfy(comfy, src, spec)
            model_save(comfy, loaded, out / f"{name}.{variant}.safetensors")
        except Exception as err:  # ComfyUI's own failure is a finding: reported, not raised
            message = f"{name}.{variant}: ComfyUI {comfy['version']} failed: {type(err).__name__}: {err}"
            failures.append(message)
            print(f"\n{message}\n{traceback.format_exc(limit=-4)}")
            continue
        record(name, variant, f"ModelSave of ComfyUI's model loaded from a {how}", reference,
               note="fp8: the diff is the quantization error")  # fmt: skip

    manifest = {
        "comfyui_version": comfy["version"],
        "comfyui_commit": comfy["commit"],
        "widths": {"heads": HEADS, "head_dim": HEAD_DIM, "double_blocks": DOUBLE, "single_blocks": SINGLE,
                   "flux1_axes": FLUX1_AXES, "flux2_axes": FLUX2_AXES},
        "models": MODELS,
        "files": files,
        "failures": failures,
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return files


def check(comfy: dict[str, Any], folder: Path) -> None:
    """Load every file listed in folder/manifest.json with this ComfyUI; compare with its `modelsave`."""
    manifest = json.loads((folder / "manifest.json").read_text())
    print(
        f"\nComfyUI {comfy['version']} loading files written by ComfyUI {manifest['comfyui_version']} ({folder})"
    )
    references: dict[str, dict[str, torch.Tensor]] = {}
    for entry in manifest["files"]:
        spec, path = MODELS[entry["model"]], folder / entry["file"]
        if entry["model"] not in references:
            sd, _ = read(folder / f"{entry['model']}.modelsave.safetensors")
            references[entry["model"]] = strip_prefix(comfy, sd)
        try:
            model = load_in_comfy(comfy, path, spec)
            diff = compare(model, references[entry["model"]])
            result = f"loads as {type(model.model).__name__}; {residency(model)}; max |diff| {diff:.3g}"
        except Exception as err:  # reported per file
            result = f"REFUSED: {type(err).__name__}: {str(err).splitlines()[0]}"
        print(f"  {entry['file']:40} {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the model files (+ manifest.json)")
    parser.add_argument("--check", type=Path, nargs="*", default=[], help="folders to load with this ComfyUI")
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI checkout")
    parser.add_argument("--models", default=",".join(FLUX_MODELS), help=f"subset of {','.join(MODELS)}")
    parser.add_argument("--no-fp8", action="store_true", help="skip the scaled fp8 / fp8 mixed files")
    args = parser.parse_args()
    if args.out is None and not args.check:
        parser.error("give --out DIR and/or --check DIR")
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    try:
        comfy = import_comfy(args.comfyui)
    except ModuleNotFoundError as err:
        parser.error(
            f"{err}: give --comfyui PATH or set COMFYUI_PATH to a ComfyUI checkout (docs/testing.md)"
        )
    print(f"ComfyUI {comfy['version']} ({comfy['commit'][:8]}) at {comfy['root']}")
    if args.out is not None:
        make(comfy, args.out, names, fp8=not args.no_fp8)
    for folder in args.check:
        check(comfy, folder)


if __name__ == "__main__":
    main()
