"""The ROCm Parallel VAE Decode / Encode nodes against ComfyUI's own VAE Decode / Encode, in a real ComfyUI
imported in this process.

Each VAE is built with ComfyUI's own classes (the FLUX.1 AutoencodingEngine, the FLUX.2 AutoencoderKL with its
batch-norm latent, the Wan 2.1 WanVAE), given random weights and saved in models/vae/. ComfyUI's VAELoader
fixes the ldm VAEs' widths (and 0.3.75 the Wan VAE's), so those are full size; 0.33.0 reads the Wan VAE's
width from the file, a small one here. ComfyUI loads the file as its VAELoader does and decodes / encodes
with its VAEDecode / VAEEncode nodes (untiled); the pack's nodes run the same file on 2 and 4 CPU workers, in
bands whose heights differ (7 latent rows over 4 ranks: 1 + 2 + 2 + 2), at sizes that are not multiples of
64 px and an image width ComfyUI crops. They must agree within 1e-4.

    source /work/comfy/env.sh 0.33.0 <pack>; python -m pytest -q -s -m comfy tests/comfy/test_comfy_vae.py
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH

from rocm_parallel.backend.config import ConfigError
from rocm_parallel.nodes.inputs import ParallelHandle
from rocm_parallel.testing.vae_files import random_weights

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOLERANCE = 1e-4  # pixel values in 0..1 (decode); latent values (encode)
LDM = {"double_z": True, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4],
       "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}  # fmt: skip
# latent rows x columns: not divisible by 2 or 4 ranks; the images are not multiples of 64 px
LATENT = {"flux1-vae": (16, 7, 5), "flux2-vae": (128, 5, 3), "wan21-vae": (16, 13, 9)}
DOWNSCALE = {"flux1-vae": 8, "flux2-vae": 16, "wan21-vae": 8}


def _comfy_model(name: str) -> torch.nn.Module:
    """The VAE as ComfyUI's VAELoader would build it for a file of this kind (comfy/sd.py VAE), on meta."""
    from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine
    from comfy.ldm.wan.vae import WanVAE

    with torch.device("meta"):
        if name == "flux1-vae":
            ddconfig = {**LDM, "z_channels": 16}
            return AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                encoder_config={
                    "target": "comfy.ldm.modules.diffusionmodules.model.Encoder",
                    "params": ddconfig,
                },
                decoder_config={
                    "target": "comfy.ldm.modules.diffusionmodules.model.Decoder",
                    "params": ddconfig,
                },
            )
        if name == "flux2-vae":
            return AutoencoderKL(ddconfig={**LDM, "z_channels": 32, "batch_norm_latent": True}, embed_dim=32)
        wan = {"dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
               "temperal_downsample": [False, True, True]}  # fmt: skip
        # ComfyUI 0.33.0 reads the width from the file (a small one here), 0.3.75 builds the released 96
        if "image_channels" in inspect.signature(WanVAE).parameters:
            wan.update(dim=16, image_channels=3, conv_out_channels=3)
        return WanVAE(**wan)


@pytest.fixture(scope="module")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    from make_comfy_references import comfy_version, import_comfy

    modules = import_comfy(COMFYUI_PATH)
    import comfy.utils
    import folder_paths

    folder = tmp_path_factory.mktemp("vae")
    folder_paths.add_model_folder_path("vae", str(folder))
    vaes = {}
    for name in LATENT:
        shapes = {k: tuple(v.shape) for k, v in _comfy_model(name).state_dict().items()}
        weights = random_weights(shapes)
        path = folder / f"{name}.safetensors"
        from safetensors.torch import save_file

        save_file(weights, str(path))
        # as ComfyUI's VAELoader loads it
        vaes[name] = modules["sd"].VAE(sd=comfy.utils.load_torch_file(str(path)))
        assert vaes[name].latent_channels == LATENT[name][0], name
    return {**modules, "version": comfy_version(COMFYUI_PATH), "vaes": vaes}


@pytest.fixture(scope="module")
def registry(comfy: dict[str, Any]) -> Iterator[Any]:
    from rocm_parallel.nodes.registry import REGISTRY

    yield REGISTRY
    REGISTRY.close()


def handle(ranks: int) -> ParallelHandle:
    return ParallelHandle("unused.safetensors", "unused", ("cpu",) * ranks, "float32")


def latent(name: str) -> torch.Tensor:
    channels, rows, cols = LATENT[name]
    shape = (1, channels, 1, rows, cols) if name == "wan21-vae" else (1, channels, rows, cols)
    return torch.randn(shape, generator=torch.Generator().manual_seed(3))


def image(name: str) -> torch.Tensor:
    _, rows, cols = LATENT[name]
    scale = DOWNSCALE[name]
    return torch.rand(1, rows * scale, cols * scale + 3, 3, generator=torch.Generator().manual_seed(5))


CASES = [(ranks, name) for ranks in (2, 4) for name in LATENT]  # one group size after the other


@pytest.mark.parametrize(("ranks", "name"), CASES)
def test_parallel_decode_equals_comfyuis_vae_decode(comfy, registry, ranks: int, name: str) -> None:
    from rocm_parallel.nodes import NODE_CLASS_MAPPINGS

    samples = {"samples": latent(name)}
    want = comfy["nodes"].VAEDecode().decode(comfy["vaes"][name], samples)[0]
    node = NODE_CLASS_MAPPINGS["RocmParallelVAEDecode"]()
    got = node.decode(handle(ranks), samples, f"{name}.safetensors")[0]
    diff = (got - want).abs().max().item()
    print(
        f"ComfyUI {comfy['version']} {name} decode on {ranks} ranks: {list(got.shape)}, max |diff| {diff:.2e}"
    )
    assert got.shape == want.shape
    assert want.std() > 0.01 and ((want > 0) & (want < 1)).float().mean() > 0.9  # an image, not saturated
    assert diff <= TOLERANCE


@pytest.mark.parametrize(("ranks", "name"), CASES)
def test_parallel_encode_equals_comfyuis_vae_encode(comfy, registry, ranks: int, name: str) -> None:
    from rocm_parallel.nodes import NODE_CLASS_MAPPINGS

    pixels = image(name)
    want = comfy["nodes"].VAEEncode().encode(comfy["vaes"][name], pixels)[0]["samples"]
    node = NODE_CLASS_MAPPINGS["RocmParallelVAEEncode"]()
    got = node.encode(handle(ranks), pixels, f"{name}.safetensors")[0]["samples"]
    diff = (got - want).abs().max().item()
    print(
        f"ComfyUI {comfy['version']} {name} encode on {ranks} ranks: {list(got.shape)}, max |diff| {diff:.2e}"
    )
    assert got.shape == want.shape and tuple(got.shape[-2:]) == LATENT[name][1:]
    assert want.std() > 0.01
    assert diff <= TOLERANCE


def test_the_nodes_refuse_before_a_worker_runs(comfy, registry) -> None:
    """A latent of another VAE and a split with more ranks than latent rows: refused by name, no rank asked."""
    from rocm_parallel.nodes import NODE_CLASS_MAPPINGS

    node = NODE_CLASS_MAPPINGS["RocmParallelVAEDecode"]()
    group = registry.group_for(handle(4).devices)
    calls: list[str] = []
    real = group.call_resident
    group.call_resident = lambda *a, **k: calls.append(a[1]) or real(*a, **k)  # type: ignore[method-assign]
    try:
        with pytest.raises(ConfigError, match=r"the latent has 128 channels, FLUX\.1's VAE .* decodes 16"):
            node.decode(handle(4), {"samples": torch.zeros(1, 128, 8, 8)}, "flux1-vae.safetensors")
        with pytest.raises(ConfigError, match=r"a latent of 3 rows cannot be split into 4 bands"):
            node.decode(handle(4), {"samples": torch.zeros(1, 16, 3, 8)}, "flux1-vae.safetensors")
    finally:
        del group.call_resident
    assert calls == []
    assert "cannot be split into 4 bands" in registry.snapshot()["error"]


def test_the_nodes_are_listed_with_comfyuis_vae_folder(comfy) -> None:
    from rocm_parallel.nodes import NODE_CLASS_MAPPINGS

    for node_id in ("RocmParallelVAEDecode", "RocmParallelVAEEncode"):
        files = NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()["required"]["vae_name"][0]
        assert {f"{name}.safetensors" for name in LATENT} <= set(files)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_comfyuis_own_untiled_decode_is_measured_as_bench_vae_prices_it(comfy, dtype: torch.dtype) -> None:
    """ComfyUI's own untiled VAE Decode of the FLUX.1 VAE (the released widths), measured the way the CPU
    workers measure theirs (backend/vae/peak.py `LiveBytes`: the peak of tensor storages alive at once, the
    weights not counted), at two sizes and in both dtypes: `bench vae`'s COMFY_UNTILED_UNITS full-resolution
    maps (128 channels x the image's pixels x dtype bytes), what BENCHMARKS' "ComfyUI untiled" column prices.
    Beside it the planner's one-rank activations for the pack's own decode (6.0 units in float32, 10.0 in
    bfloat16: its diffusers decoder and the whole-image GroupNorm hold more)."""
    import folder_paths
    from comfy.utils import load_torch_file

    from rocm_parallel.backend.flux.vae import FLUX1_VAE, RELEASED
    from rocm_parallel.backend.plan.vae import vae_memory
    from rocm_parallel.backend.vae.peak import LiveBytes
    from rocm_parallel.benchmarks.vae import COMFY_UNTILED_UNITS

    path = folder_paths.get_full_path("vae", "flux1-vae.safetensors")
    vae = comfy["sd"].VAE(sd=load_torch_file(path), dtype=dtype)
    assert vae.vae_dtype == dtype
    full, _ = FLUX1_VAE.widths(RELEASED)
    for rows, cols in ((32, 24), (40, 48)):  # 192 x 256 and 384 x 320 px
        samples = {"samples": torch.randn(1, 16, rows, cols, generator=torch.Generator().manual_seed(9))}
        comfy["nodes"].VAEDecode().decode(vae, samples)  # ComfyUI moves and casts its model on the first call
        with torch.no_grad(), LiveBytes() as live:
            image = comfy["nodes"].VAEDecode().decode(vae, samples)[0]
        units = live.peak / (full * rows * 8 * cols * 8 * dtype.itemsize)
        planned = vae_memory(FLUX1_VAE, RELEASED, cols * 8, rows * 8, ranks=1, dtype_bytes=dtype.itemsize)
        print(
            f"ComfyUI {comfy['version']} untiled decode, {cols * 8}x{rows * 8} px, {dtype}: live peak "
            f"{live.peak / 1e6:.1f} MB = {units:.2f} full-resolution maps; the pack on one rank (planner) "
            f"{planned.activations / 1e6:.1f} MB"
        )
        assert tuple(image.shape) == (1, rows * 8, cols * 8, 3)
        assert abs(units / COMFY_UNTILED_UNITS - 1) <= 0.03
