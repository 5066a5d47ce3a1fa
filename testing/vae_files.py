"""Small random VAE files in the key layouts ComfyUI's VAELoader reads, for the CPU tier and the benchmarks:
the ldm (CompVis) AutoencoderKL layout of FLUX.1's ae.safetensors and FLUX.2's flux2-vae.safetensors (with
its batch-norm statistics), and the original Wan 2.1 layout of Qwen-Image's VAE. Written from the layouts'
definitions (comfy/ldm/modules/diffusionmodules/model.py, comfy/ldm/wan/vae.py), never through the pack's
converter, so loading them checks the converter. The comfy tier makes its files with ComfyUI's own classes
(tests/comfy/test_comfy_vae.py).

Lives outside the shipped package (the wheel has no `testing/`).
"""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path
from typing import Any

import torch

Shapes = dict[str, tuple[int, ...]]


def _norm(shapes: Shapes, name: str, channels: int) -> None:
    shapes[f"{name}.weight"] = (channels,)
    shapes[f"{name}.bias"] = (channels,)


def _conv(shapes: Shapes, name: str, out: int, inp: int, kernel: tuple[int, ...]) -> None:
    shapes[f"{name}.weight"] = (out, inp, *kernel)
    shapes[f"{name}.bias"] = (out,)


def _ldm_block(shapes: Shapes, name: str, inp: int, out: int) -> None:
    _norm(shapes, f"{name}.norm1", inp)
    _conv(shapes, f"{name}.conv1", out, inp, (3, 3))
    _norm(shapes, f"{name}.norm2", out)
    _conv(shapes, f"{name}.conv2", out, out, (3, 3))
    if inp != out:
        _conv(shapes, f"{name}.nin_shortcut", out, inp, (1, 1))


def _ldm_mid(shapes: Shapes, name: str, channels: int) -> None:
    _ldm_block(shapes, f"{name}.block_1", channels, channels)
    _norm(shapes, f"{name}.attn_1.norm", channels)
    for part in ("q", "k", "v", "proj_out"):
        _conv(shapes, f"{name}.attn_1.{part}", channels, channels, (1, 1))
    _ldm_block(shapes, f"{name}.block_2", channels, channels)


def ldm_kl_shapes(
    ch: int = 32, mult: tuple[int, ...] = (1, 2, 2), blocks: int = 1, z: int = 16, quant: bool = False,
    bn: bool = False,
) -> Shapes:  # fmt: skip
    """Key -> shape of an ldm AutoencoderKL (ComfyUI's names: `quant_conv` / `post_quant_conv` at the top
    level, `bn.*` for FLUX.2's batch-norm latent over 2 x 2 patches)."""
    shapes: Shapes = {}
    _conv(shapes, "encoder.conv_in", ch, 3, (3, 3))
    block_in = ch
    for i, m in enumerate(mult):
        for j in range(blocks):
            _ldm_block(shapes, f"encoder.down.{i}.block.{j}", block_in, ch * m)
            block_in = ch * m
        if i != len(mult) - 1:
            _conv(shapes, f"encoder.down.{i}.downsample.conv", block_in, block_in, (3, 3))
    _ldm_mid(shapes, "encoder.mid", block_in)
    _norm(shapes, "encoder.norm_out", block_in)
    _conv(shapes, "encoder.conv_out", 2 * z, block_in, (3, 3))
    block_in = ch * mult[-1]
    _conv(shapes, "decoder.conv_in", block_in, z, (3, 3))
    _ldm_mid(shapes, "decoder.mid", block_in)
    for i in reversed(range(len(mult))):
        for j in range(blocks + 1):
            _ldm_block(shapes, f"decoder.up.{i}.block.{j}", block_in, ch * mult[i])
            block_in = ch * mult[i]
        if i != 0:
            _conv(shapes, f"decoder.up.{i}.upsample.conv", block_in, block_in, (3, 3))
    _norm(shapes, "decoder.norm_out", block_in)
    _conv(shapes, "decoder.conv_out", 3, block_in, (3, 3))
    if quant:
        _conv(shapes, "quant_conv", 2 * z, 2 * z, (1, 1))
        _conv(shapes, "post_quant_conv", z, z, (1, 1))
    if bn:
        shapes["bn.running_mean"] = shapes["bn.running_var"] = (4 * z,)
        shapes["bn.num_batches_tracked"] = ()
    return shapes


def _wan_block(shapes: Shapes, name: str, inp: int, out: int) -> None:
    shapes[f"{name}.residual.0.gamma"] = (inp, 1, 1, 1)
    _conv(shapes, f"{name}.residual.2", out, inp, (3, 3, 3))
    shapes[f"{name}.residual.3.gamma"] = (out, 1, 1, 1)
    _conv(shapes, f"{name}.residual.6", out, out, (3, 3, 3))
    if inp != out:
        _conv(shapes, f"{name}.shortcut", out, inp, (1, 1, 1))


def _wan_middle(shapes: Shapes, name: str, channels: int) -> None:
    _wan_block(shapes, f"{name}.0", channels, channels)
    shapes[f"{name}.1.norm.gamma"] = (channels, 1, 1)
    _conv(shapes, f"{name}.1.to_qkv", 3 * channels, channels, (1, 1))
    _conv(shapes, f"{name}.1.proj", channels, channels, (1, 1))
    _wan_block(shapes, f"{name}.2", channels, channels)


def wan21_shapes(dim: int = 16, z: int = 16) -> Shapes:
    """Key -> shape of a Wan 2.1 VAE of base width `dim` (its multipliers 1, 2, 4, 4; 2 residual blocks;
    temporal downsampling after levels 1 and 2), in the original layout ComfyUI's WanVAE has."""
    mult = (1, 2, 4, 4)
    shapes: Shapes = {}
    dims = [dim * u for u in (1, *mult)]
    _conv(shapes, "encoder.conv1", dim, 3, (3, 3, 3))
    index = 0
    for i, (inp, out) in enumerate(itertools.pairwise(dims)):
        for _ in range(2):
            _wan_block(shapes, f"encoder.downsamples.{index}", inp, out)
            inp, index = out, index + 1
        if i != len(mult) - 1:
            _conv(shapes, f"encoder.downsamples.{index}.resample.1", out, out, (3, 3))
            if i in (1, 2):  # temporal downsampling: [False, True, True]
                _conv(shapes, f"encoder.downsamples.{index}.time_conv", out, out, (3, 1, 1))
            index += 1
    _wan_middle(shapes, "encoder.middle", dims[-1])
    shapes["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    _conv(shapes, "encoder.head.2", 2 * z, dims[-1], (3, 3, 3))
    _conv(shapes, "conv1", 2 * z, 2 * z, (1, 1, 1))
    _conv(shapes, "conv2", z, z, (1, 1, 1))
    dims = [dim * u for u in (mult[-1], *mult[::-1])]
    _conv(shapes, "decoder.conv1", dims[0], z, (3, 3, 3))
    _wan_middle(shapes, "decoder.middle", dims[0])
    index = 0
    for i, (inp, out) in enumerate(itertools.pairwise(dims)):
        inp = inp // 2 if i in (1, 2, 3) else inp
        for _ in range(3):
            _wan_block(shapes, f"decoder.upsamples.{index}", inp, out)
            inp, index = out, index + 1
        if i != len(mult) - 1:
            _conv(shapes, f"decoder.upsamples.{index}.resample.1", out // 2, out, (3, 3))
            if i in (0, 1):  # temporal upsampling: [True, True, False]
                _conv(shapes, f"decoder.upsamples.{index}.time_conv", out * 2, out, (3, 1, 1))
            index += 1
    shapes["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    _conv(shapes, "decoder.head.2", 3, dims[-1], (3, 3, 3))
    return shapes


def random_weights(shapes: Shapes, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights that keep a random VAE's activations O(1): convolutions N(0, 1/fan_in) (the output conv a
    quarter of that, so the image stays mostly inside -1..1 and the clamp hides nothing), norm weights 1 +
    N(0, 0.1^2), biases N(0, 0.02^2), batch-norm statistics near (0, 1). Each key from its own generator."""
    out = {}
    for key, shape in shapes.items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        if key.endswith("num_batches_tracked"):
            out[key] = torch.tensor(0, dtype=torch.int64)
            continue
        noise = torch.randn(shape, generator=g)
        if key.endswith("running_var"):
            value = 1.0 + 0.1 * noise.abs()
        elif key.endswith("running_mean"):
            value = 0.1 * noise
        elif len(shape) >= 2 and not key.endswith("gamma"):
            fan_in = 1
            for s in shape[1:]:
                fan_in *= s
            gain = 0.25 if ".conv_out." in key or key.startswith("decoder.head.2") else 1.0
            value = noise * gain / fan_in**0.5
        elif key.endswith("gamma") or (".norm" in key and key.endswith("weight")):
            value = 1.0 + 0.1 * noise
        else:
            value = 0.02 * noise
        out[key] = value.contiguous()
    return out


def write_vae(path: str | Path, shapes: Shapes, seed: int = 0) -> str:
    """A safetensors VAE file of `shapes` with `random_weights`; its path."""
    from safetensors.torch import save_file

    save_file(random_weights(shapes, seed), str(path))
    return str(path)


# The CPU tier's three files: small widths, the real layouts (FLUX.2: 2 x 2 patches of 8 channels = 32).
SMALL: dict[str, dict[str, Any]] = {
    "flux1-vae": {"shapes": lambda: ldm_kl_shapes(ch=32, mult=(1, 2, 2, 2), z=16)},
    "flux2-vae": {"shapes": lambda: ldm_kl_shapes(ch=32, mult=(1, 2, 2, 2), z=8, quant=True, bn=True)},
    "wan21-vae": {"shapes": lambda: wan21_shapes(dim=16, z=16)},
}


__all__ = ["SMALL", "ldm_kl_shapes", "random_weights", "wan21_shapes", "write_vae"]
