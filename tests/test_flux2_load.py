"""FLUX.2 checkpoints: BFL / ComfyUI single files (bf16, fp8 mixed) and diffusers folders, sliced per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rocm_parallel.backend.config import FluxDims
from rocm_parallel.backend.flux.convert import CheckpointError
from rocm_parallel.backend.flux.model import random_inputs
from rocm_parallel.backend.flux2.convert import (
    flux2_bfl_to_diffusers,
    flux2_config_from_bfl,
    flux2_diffusers_to_bfl,
    save_flux2_checkpoint,
)
from rocm_parallel.backend.flux2.load import inspect_flux2_checkpoint, load_flux2
from rocm_parallel.backend.flux2.model import (
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    build_flux2,
    tiny_flux2_config,
)
from rocm_parallel.backend.parallel.fake import fake_process_group
from rocm_parallel.backend.parallel.tensor import apply_tensor_parallel

CONFIG = tiny_flux2_config(
    heads=8, head_dim=16, double_blocks=2, single_blocks=3, text_dim=32, in_channels=16
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_flux2(CONFIG, seed=3)


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("config", [FLUX2_DEV, FLUX2_KLEIN_4B, CONFIG], ids=["dev", "klein-4b", "tiny"])
def test_config_from_bfl_shapes(config: dict) -> None:
    """The diffusers config is recovered from the BFL key layout alone (meta tensors: no weights)."""
    bfl = flux2_diffusers_to_bfl(build_flux2(config, device="meta"))
    assert flux2_config_from_bfl(bfl) == {**config, "axes_dims_rope": tuple(config["axes_dims_rope"])}


def test_bfl_key_layout_matches_diffusers_converter(model: torch.nn.Module) -> None:
    """Our BFL file converts back with diffusers' own single-file converter to the same weights."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    bfl = flux2_diffusers_to_bfl(model)
    assert "single_blocks.0.linear1.weight" in bfl and "double_blocks.1.img_attn.qkv.weight" in bfl
    _same_state(convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl)), model.state_dict())
    _same_state(flux2_bfl_to_diffusers(bfl), model.state_dict())


@pytest.mark.parametrize("comfy_prefix", [False, True], ids=["bfl", "comfy-prefix"])
def test_load_bfl_file_whole(tmp_path: Path, model: torch.nn.Module, comfy_prefix: bool) -> None:
    path = save_flux2_checkpoint(model, tmp_path / "flux2.safetensors", comfy_prefix=comfy_prefix)
    info = inspect_flux2_checkpoint(path)
    assert info.format == "bfl" and info.config == flux2_config_from_bfl(load_file(path))
    loaded = load_flux2(path, dtype="float32")
    _same_state(loaded.state_dict(), model.state_dict())
    inputs = random_inputs(
        FluxDims.from_diffusers_config(CONFIG), height=48, width=80, text_tokens=7, family="flux2"
    )
    with torch.no_grad():
        got = loaded(**inputs.as_kwargs(), return_dict=False)[0]
        want = model(**inputs.as_kwargs(), return_dict=False)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("fp8_mixed", [False, True], ids=["bf16-or-fp32", "fp8mixed"])
def test_each_rank_reads_its_slices(
    tmp_path: Path, model: torch.nn.Module, degree: int, fp8_mixed: bool
) -> None:
    """load_flux2(tp=N) on rank r == the whole file converted, then sharded with the TP plan on rank r."""
    path = save_flux2_checkpoint(model, tmp_path / "flux2.safetensors", fp8_mixed=fp8_mixed)
    whole = flux2_bfl_to_diffusers(load_file(path))
    for rank in range(degree):
        with fake_process_group(degree, rank=rank):
            got = load_flux2(path, dtype="float32", tp=degree).state_dict()
            reference = build_flux2(CONFIG, seed=None)
            reference.load_state_dict(whole)
            want = apply_tensor_parallel(reference).state_dict()
        _same_state(got, want)


def test_fp8_mixed_layout(tmp_path: Path, model: torch.nn.Module) -> None:
    """Block linears fp8 e4m3fn + float32 weight_scale + comfy_quant marker; the rest bf16."""
    path = save_flux2_checkpoint(model, tmp_path / "flux2_fp8mixed.safetensors", fp8_mixed=True)
    with safe_open(path, "pt") as f:
        assert f.get_tensor("single_blocks.0.linear1.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("single_blocks.0.linear1.weight_scale").shape == ()
        marker = f.get_tensor("double_blocks.0.img_attn.qkv.comfy_quant")
        assert json.loads(bytes(marker.tolist())) == {"format": "float8_e4m3fn"}
        assert f.get_tensor("double_stream_modulation_img.lin.weight").dtype == torch.bfloat16
    info = inspect_flux2_checkpoint(path)
    assert info.stored_dtypes == ("bfloat16", "float32", "float8_e4m3fn")
    loaded = load_flux2(path, dtype="float32").state_dict()
    # fp8 rounding: within one e4m3 step (2^-3 relative) of the original weights
    original = model.state_dict()
    for name in (
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
        "transformer_blocks.1.attn.to_k.weight",
    ):
        assert (loaded[name] - original[name]).abs().max() <= original[name].abs().max() / 8


def test_load_diffusers_folder(tmp_path: Path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path / "transformer")
    info = inspect_flux2_checkpoint(tmp_path)
    assert info.format == "diffusers"
    with fake_process_group(2, rank=1):
        got = load_flux2(tmp_path, dtype="float32", tp=2).state_dict()
        want = apply_tensor_parallel(build_flux2(CONFIG, seed=3)).state_dict()
    _same_state(got, want)


def test_not_flux2_names_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"img_in.weight": torch.zeros(4, 4)}, str(path))
    with pytest.raises(
        CheckpointError, match=r"is not a FLUX.2 checkpoint: it has no 'single_stream_modulation"
    ):
        inspect_flux2_checkpoint(path)
