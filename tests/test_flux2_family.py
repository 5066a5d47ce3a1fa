"""FLUX.2 as a registered model family: detection, the generic loader, and ComfyUI's model call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rocm_parallel.backend import family as registry
from rocm_parallel.backend.checkpoint import bfl_to_diffusers, inspect_checkpoint, load_model, save_checkpoint
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux2.family import FLUX2
from rocm_parallel.backend.flux2.forward import flux2_call, flux2_model_fn, flux2_text_ids
from rocm_parallel.backend.flux2.keys import config_from_diffusers
from rocm_parallel.backend.flux2.model import FLUX2_DEV, FLUX2_KLEIN_9B, build_flux2
from rocm_parallel.backend.flux2.tp import FLUX2_TP_PLAN
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import tiny_flux2_config
from rocm_parallel.testing.parallel import apply_tensor_parallel

CONFIG = tiny_flux2_config(
    heads=8, head_dim=16, double_blocks=2, single_blocks=3, text_dim=32, in_channels=16
)


def test_flux2_is_registered_next_to_flux1() -> None:
    assert registry.get_family("flux2") is FLUX2
    assert FLUX2.tp.plan is FLUX2_TP_PLAN
    assert registry.family_for_class("Flux2Transformer2DModel") is FLUX2
    assert {f.name for f in registry.families()} == {"flux1", "flux2", "qwen_image", "wan"}


@pytest.mark.parametrize("config", [FLUX2_DEV, FLUX2_KLEIN_9B, CONFIG], ids=["dev", "klein-9b", "tiny"])
def test_config_from_diffusers_shapes(config: dict) -> None:
    shapes = {k: tuple(v.shape) for k, v in build_flux2(config, device="meta").state_dict().items()}
    assert config_from_diffusers(shapes) == {**config, "axes_dims_rope": tuple(config["axes_dims_rope"])}


@pytest.mark.parametrize("degree", [1, 2])
def test_generic_loader_detects_and_shards_flux2(tmp_path: Path, degree: int) -> None:
    model = build_flux2(CONFIG, seed=5)
    path = save_checkpoint(model, tmp_path / "flux2.safetensors", prefix=True)
    info = inspect_checkpoint(path)
    assert (info.family, info.format, info.variant) == ("flux2", "bfl", "dev")
    assert FLUX2.describe(info.config) == "FLUX.2 (8 heads, 2+3 blocks)"
    reference = build_flux2(CONFIG, seed=None)
    reference.load_state_dict(bfl_to_diffusers(load_file(path)))
    with fake_process_group(degree, rank=degree - 1):
        got = load_model(path, dtype="float32", tp=degree).state_dict()
        want = (apply_tensor_parallel(reference) if degree > 1 else reference).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)


def flux2_image_ids(rows: int, cols: int) -> torch.Tensor:
    """(t, h, w, l) = (0, row, col, 0) for a rows x cols token grid, row-major (diffusers' pipeline_flux2.py)."""
    ids = torch.zeros(rows, cols, 4)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 4)


@pytest.mark.parametrize("refs", [0, 2])
def test_call_is_the_diffusers_forward_on_comfyuis_tokens_and_ids(refs: int) -> None:
    """x [B, C, H, W] -> tokens row-major with ids (index, row, col, 0); text ids (0, 0, 0, i)."""
    model = build_flux2(CONFIG, seed=5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 3, 5, generator=g)
    context = torch.randn(2, 7, 32, generator=g)
    timestep, guidance = torch.tensor([0.6, 0.6]), torch.tensor([4.0, 4.0])
    ref_latents = [torch.randn(2, 16, 2, 2, generator=g) for _ in range(refs)]
    got = flux2_call(flux2_model_fn(model), x, timestep, context, None, guidance, ref_latents)
    tokens = x.flatten(2).transpose(1, 2)
    ids = flux2_image_ids(3, 5)
    for k, ref in enumerate(ref_latents, 1):  # ComfyUI's "index" method: index 10k at the origin
        tokens = torch.cat([tokens, ref.flatten(2).transpose(1, 2)], dim=1)
        ref_ids = flux2_image_ids(2, 2)
        ref_ids[:, 0] = 10.0 * k
        ids = torch.cat([ids, ref_ids])
    with torch.no_grad():
        out = model(
            hidden_states=tokens, encoder_hidden_states=context, timestep=timestep, img_ids=ids,
            txt_ids=flux2_text_ids(7), guidance=guidance, return_dict=False,
        )[0]  # fmt: skip
    want = out[:, :15].transpose(1, 2).reshape(2, 16, 3, 5)
    assert got.shape == x.shape
    assert torch.equal(got, want)


def test_comfy_model_is_comfyuis_flux2_detection() -> None:
    comfy = FLUX2.comfy_model(FLUX2_DEV)
    assert comfy.config_class == "Flux2"
    unet = comfy.unet_config
    assert (unet["image_model"], unet["hidden_size"], unet["num_heads"], unet["patch_size"]) == (
        "flux2",
        6144,
        48,
        1,
    )
    assert (unet["depth"], unet["depth_single_blocks"], unet["context_in_dim"]) == (8, 48, 15360)
    assert FluxDims.from_diffusers_config(FLUX2_DEV).mlp == 18432


def test_auto_prices_a_flux2_checkpoint_as_flux2(tmp_path: Path, group2) -> None:
    """check_load(layout='auto') on a FLUX.2 file: the planner's weights are FLUX.2's, per layout."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.diffusion.api import ParallelModel
    from rocm_parallel.backend.flux.dims import FluxDims
    from rocm_parallel.backend.plan import weight_bytes

    path = save_checkpoint(build_flux2(CONFIG, seed=5), tmp_path / "flux2.safetensors")
    flux = ParallelModel(group=group2)
    resident = flux.check_load(path, layout="auto", dtype="float32")
    choice = flux.auto_choice
    assert resident.layout == choice.layout
    dims = FluxDims.from_diffusers_config(CONFIG)
    for estimate in choice.estimates:
        assert estimate.weights == weight_bytes(dims, estimate.layout, 4, family="flux2")
    # FLUX.2's dims are no FLUX.1 (whose MLP is 4 x hidden): they are not priced as one
    with pytest.raises(ConfigError, match=r"FLUX\.1.s transformer has MLP ratio 4, these dims have 3"):
        weight_bytes(dims, ParallelLayout(tp=2), 4)
