"""FLUX.2 checkpoints through the shared loader (backend/checkpoint/): BFL / ComfyUI single files (bf16, and
ComfyUI's quantized "mixed" fp8 files in both of the forms ComfyUI reads) and diffusers folders, sliced
per rank.

The fp8 bar is equality: a mixed file's weight is `fp8.to(float32) * weight_scale` (comfy/quant_ops.py
TensorCoreFP8Layout.dequantize), an exact float32 product, so a model holding fp8 + scale (upcast per
layer) and one upcast at load both hold exactly the `dequantize` of the file, on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_methods import Inputs
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rocm_parallel.backend.checkpoint import (
    CheckpointError,
    bfl_to_diffusers,
    diffusers_to_bfl,
    inspect_checkpoint,
    load_model,
    save_checkpoint,
)
from rocm_parallel.backend.checkpoint.quant import dequantize
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux2.keys import config_from_bfl
from rocm_parallel.backend.flux2.model import FLUX2_DEV, FLUX2_KLEIN_4B, build_flux2
from rocm_parallel.backend.parallel.weights import linear_weight
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import random_inputs, tiny_flux2_config
from rocm_parallel.testing.parallel import apply_tensor_parallel
from rocm_parallel.testing.writers import MIXED_FORMS, save_mixed_checkpoint

CONFIG = tiny_flux2_config(
    heads=8, head_dim=16, double_blocks=2, single_blocks=3, text_dim=32, in_channels=16
)
DIMS = FluxDims.from_diffusers_config(CONFIG)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_flux2(CONFIG, seed=3)


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _effective(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the forward uses it in float32: fp8 linear weights upcast with their scale."""
    out = {}
    for name, param in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        out[name] = linear_weight(module, torch.float32) if kind == "weight" and param.dim() == 2 else param
    return out


def _dequantized(path: str) -> torch.nn.Module:
    """The single-process reference: the whole file dequantized (fp8 x weight_scale in float32)."""
    reference = build_flux2(CONFIG, seed=None)
    reference.load_state_dict(bfl_to_diffusers(load_file(path)))
    return reference


def _forward(model: torch.nn.Module) -> torch.Tensor:
    inputs = random_inputs(DIMS, height=48, width=80, text_tokens=7, family="flux2")
    with torch.no_grad():
        return model(**inputs.as_kwargs(), return_dict=False)[0]


@pytest.mark.parametrize("config", [FLUX2_DEV, FLUX2_KLEIN_4B, CONFIG], ids=["dev", "klein-4b", "tiny"])
def test_config_from_bfl_shapes(config: dict) -> None:
    """The diffusers config is recovered from the BFL key layout alone (meta tensors: no weights)."""
    bfl = diffusers_to_bfl(build_flux2(config, device="meta").state_dict())
    assert config_from_bfl(bfl) == {**config, "axes_dims_rope": tuple(config["axes_dims_rope"])}


def test_bfl_key_layout_matches_diffusers_converter(model: torch.nn.Module) -> None:
    """Our BFL file converts back with diffusers' own single-file converter to the same weights."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    bfl = diffusers_to_bfl(model.state_dict())
    assert "single_blocks.0.linear1.weight" in bfl and "double_blocks.1.img_attn.qkv.weight" in bfl
    _same_state(convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl)), model.state_dict())
    _same_state(bfl_to_diffusers(bfl), model.state_dict())


@pytest.mark.parametrize("comfy_prefix", [False, True], ids=["bfl", "comfy-prefix"])
def test_load_bfl_file_whole(tmp_path: Path, model: torch.nn.Module, comfy_prefix: bool) -> None:
    path = save_checkpoint(model, tmp_path / "flux2.safetensors", prefix=comfy_prefix)
    info = inspect_checkpoint(path)
    assert (info.family, info.format, info.quantization) == ("flux2", "bfl", "")
    assert info.config == config_from_bfl(load_file(path))
    loaded = load_model(path, dtype="float32")
    _same_state(loaded.state_dict(), model.state_dict())
    assert torch.equal(_forward(loaded), _forward(model))


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("fp8_mixed", [None, *MIXED_FORMS], ids=["fp32", *MIXED_FORMS])
def test_each_rank_reads_its_slices(
    tmp_path: Path, model: torch.nn.Module, degree: int, fp8_mixed: str | None
) -> None:
    """load_model(tp=N) on rank r == the whole file dequantized, then sharded with the TP plan on rank r:
    upcast at load, and fp8-resident (raw fp8 shards + the layer's scale, upcast per layer)."""
    path = save_mixed_checkpoint(model, tmp_path / "flux2.safetensors", fp8_mixed=fp8_mixed)
    for rank in range(degree):
        with fake_process_group(degree, rank=rank):
            want = apply_tensor_parallel(_dequantized(path)).state_dict()
            _same_state(
                load_model(path, dtype="float32", weight_dtype="compute", tp=degree).state_dict(), want
            )
            resident = load_model(path, dtype="float32", tp=degree)
        _same_state(_effective(resident), want)
        fp8 = {n for n, p in resident.named_parameters() if p.dtype == torch.float8_e4m3fn}
        assert bool(fp8) == bool(fp8_mixed)


@pytest.mark.parametrize("fp8_mixed", MIXED_FORMS)
@pytest.mark.parametrize("comfy_prefix", [False, True], ids=["bfl", "comfy-prefix"])
def test_fp8_mixed_resident_and_upcast_equal_dequantize(
    tmp_path: Path, model: torch.nn.Module, fp8_mixed: str, comfy_prefix: bool
) -> None:
    """Block linears fp8 e4m3fn + float32 weight_scale, declared by comfy_quant tensors or the header's
    _quantization_metadata; the rest bf16. Held as fp8 (+ `scale_weight`) or upcast, each weight is
    exactly dequantize(fp8) * scale, and the two forwards are equal.

    Mutations tried: no `scale_weight` buffer on the resident layers fails here (the fp8 layer has no
    scale); not reading the header's _quantization_metadata refuses the "metadata" files (their
    weight_scales look undeclared)."""
    path = save_mixed_checkpoint(
        model, tmp_path / "flux2_fp8mixed.safetensors", fp8_mixed=fp8_mixed, comfy_prefix=comfy_prefix
    )
    prefix = "model.diffusion_model." if comfy_prefix else ""
    stored = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    assert stored[prefix + "single_blocks.0.linear1.weight"].dtype == torch.float8_e4m3fn
    assert stored[prefix + "single_blocks.0.linear1.weight_scale"].shape == ()
    assert stored[prefix + "double_stream_modulation_img.lin.weight"].dtype == torch.bfloat16
    if fp8_mixed == "comfy_quant":
        marker = stored[prefix + "double_blocks.0.img_attn.qkv.comfy_quant"]
        assert json.loads(bytes(marker.tolist())) == {"format": "float8_e4m3fn"}
        assert "_quantization_metadata" not in metadata
    else:
        layers = json.loads(metadata["_quantization_metadata"])["layers"]
        assert layers["double_blocks.0.img_attn.qkv"] == {"format": "float8_e4m3fn"}
        assert not any(k.endswith(".comfy_quant") for k in stored)
        assert stored[prefix + "double_blocks.0.img_attn.qkv.input_scale"].shape == ()
    info = inspect_checkpoint(path)
    assert info.quantization == {"comfy_quant": "comfy_quant", "metadata": "quantization_metadata"}[fp8_mixed]
    assert info.stored_dtypes == ("bfloat16", "float8_e4m3fn")  # scales and markers are not weights
    assert len(info.scales) == sum(k.endswith(".weight_scale") for k in stored) == 2 * 8 + 3 * 2

    resident = load_model(path, dtype="float32")
    upcast = load_model(path, dtype="float32", weight_dtype="compute")
    qkv = resident.single_transformer_blocks[0].attn.to_qkv_mlp_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.scale_weight.dtype == torch.float32
    exact = dequantize(
        {k.removeprefix(prefix): v for k, v in stored.items()}, "single_blocks.0.linear1.weight"
    )
    assert torch.equal(upcast.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight, exact)
    reference = _dequantized(path)
    _same_state(upcast.state_dict(), reference.state_dict())
    _same_state(_effective(resident), reference.state_dict())
    assert torch.equal(_forward(resident), _forward(upcast))
    # fp8 rounding: within one e4m3 step (2^-3 relative) of the original weights
    original = model.state_dict()
    for name in (
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
        "transformer_blocks.1.attn.to_k.weight",
    ):
        assert (reference.state_dict()[name] - original[name]).abs().max() <= original[name].abs().max() / 8


def test_workers_fp8_mixed_tp_and_ring_equal_dequantized(
    tmp_path: Path, model: torch.nn.Module, group2: WorkerGroup
) -> None:
    """Through the API on a gloo group: TP=2 and ring=2 of an fp8 mixed file, fp8-resident and upcast at
    load, give the same output exactly, within float32 rounding of the single-process forward of the
    dequantized file."""
    from rocm_parallel.backend.diffusion.api import ParallelModel

    path = save_mixed_checkpoint(model, tmp_path / "flux2_fp8mixed.safetensors", fp8_mixed="metadata")
    expected = _forward(_dequantized(path))
    inputs = random_inputs(DIMS, height=48, width=80, text_tokens=7, family="flux2").as_kwargs()
    flux = ParallelModel(group=group2)
    try:
        for layout in ("tp", "context"):
            outs = {}
            for weights in ("default", "compute"):
                flux.unload()
                flux.load(path, layout=layout, dtype="float32", weight_dtype=weights)
                outs[weights] = group2.call("forward_flux2", Inputs(inputs)).output
            assert torch.equal(outs["default"], outs["compute"]), layout
            assert (outs["default"] - expected).abs().max().item() <= 1e-5, layout
    finally:
        flux.unload()


def test_load_diffusers_folder(tmp_path: Path, model: torch.nn.Module) -> None:
    model.save_pretrained(tmp_path / "transformer")
    info = inspect_checkpoint(tmp_path)
    assert (info.family, info.format) == ("flux2", "diffusers")
    with fake_process_group(2, rank=1):
        got = load_model(tmp_path, dtype="float32", tp=2).state_dict()
        want = apply_tensor_parallel(build_flux2(CONFIG, seed=3)).state_dict()
    _same_state(got, want)


# --------------------------------------------------------------------------------------------------
# What the shared loader refuses, from the header, before a worker starts


def _error(path: Path | str) -> str:
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(path)
    return str(err.value)


def _mixed(tmp_path: Path, model: torch.nn.Module, form: str = "comfy_quant") -> tuple[Path, dict, dict]:
    path = Path(save_mixed_checkpoint(model, tmp_path / "mixed.safetensors", fp8_mixed=form))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    return path, load_file(path), metadata


def _marker(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


UNKNOWN = (
    "this loader reads ComfyUI's float8_e4m3fn and float8_e5m2 layers (one scale per weight) only. Use an "
    "fp8 (e.g. flux2_dev_fp8mixed.safetensors), bf16 or fp16 version of the model, or load this file with "
    "ComfyUI's own Load Diffusion Model"
)


def test_unknown_quant_formats_are_refused_naming_the_layer(tmp_path: Path, model: torch.nn.Module) -> None:
    """nvfp4 (block scales + a second scale) declared either way is refused, and so before any worker
    starts (check_load of a group that was never started)."""
    from rocm_parallel.backend.diffusion.api import ParallelModel

    path, tensors, _ = _mixed(tmp_path, model)
    tensors["single_blocks.2.linear2.comfy_quant"] = _marker("nvfp4")
    save_file(tensors, str(path))
    assert _error(path) == (
        f"'{path}': layer 'single_blocks.2.linear2' is quantized as 'nvfp4' (its 'comfy_quant' tensor); "
        + UNKNOWN
    )
    flux = ParallelModel(["cpu", "cpu"])
    with pytest.raises(CheckpointError, match="is quantized as 'nvfp4'"):
        flux.check_load(str(path))
    assert not flux.started

    path, tensors, metadata = _mixed(tmp_path, model, "metadata")
    declared = json.loads(metadata["_quantization_metadata"])
    declared["layers"]["double_blocks.1.txt_mlp.0"] = {"format": "nvfp4"}
    save_file(tensors, str(path), metadata={"_quantization_metadata": json.dumps(declared)})
    assert _error(path) == (
        f"'{path}': layer 'double_blocks.1.txt_mlp.0' is quantized as 'nvfp4' (the header's "
        "_quantization_metadata); " + UNKNOWN
    )
    declared["layers"]["double_blocks.1.txt_mlp.0"] = {}
    save_file(tensors, str(path), metadata={"_quantization_metadata": json.dumps(declared)})
    assert _error(path) == (
        f"'{path}': layer 'double_blocks.1.txt_mlp.0' is quantized as no format (the header's "
        "_quantization_metadata); " + UNKNOWN
    )
    save_file(tensors, str(path), metadata={"_quantization_metadata": json.dumps({"layers": []})})
    assert _error(path) == (
        f"'{path}': the header's _quantization_metadata is not ComfyUI's JSON "
        '{"format_version": ..., "layers": {"<layer>": {"format": ...}}}; the file is damaged. Download it again'
    )


def test_scales_that_are_not_one_per_weight_are_refused(tmp_path: Path, model: torch.nn.Module) -> None:
    path, tensors, _ = _mixed(tmp_path, model)
    rows = tensors["single_blocks.0.linear1.weight"].shape[0]
    tensors["single_blocks.0.linear1.weight_scale"] = torch.ones(rows, 1)
    save_file(tensors, str(path))
    assert _error(path) == (
        f"'{path}': 'single_blocks.0.linear1.weight_scale' is a F32 tensor of shape [{rows}, 1]; ComfyUI's fp8 "
        "layers store one float scale per weight (shape []), and per-channel or block scales are not supported. "
        "Use a plain fp8, bf16 or fp16 FLUX file"
    )


def test_damaged_mixed_files_are_refused(tmp_path: Path, model: torch.nn.Module) -> None:
    path, tensors, _ = _mixed(tmp_path, model)
    save_file({k: v for k, v in tensors.items() if k != "double_blocks.0.img_mlp.2.weight_scale"}, str(path))
    assert _error(path) == (
        f"'{path}': layer 'double_blocks.0.img_mlp.2' is declared float8_e4m3fn (its 'comfy_quant' tensor) but "
        "the file has no 'double_blocks.0.img_mlp.2.weight_scale'; ComfyUI's quantized layers need a weight and "
        "its weight_scale. The file is damaged; download it again. Use a plain fp8, bf16 or fp16 FLUX file"
    )
    save_file({k: v for k, v in tensors.items() if k != "double_blocks.0.img_mlp.2.comfy_quant"}, str(path))
    assert _error(path) == (
        f"'{path}': 'double_blocks.0.img_mlp.2.weight_scale' is a ComfyUI weight scale, but neither a "
        "'double_blocks.0.img_mlp.2.comfy_quant' tensor nor the header's _quantization_metadata declares its "
        "layer quantized; the file is damaged or from a tool this loader does not know. Use a plain fp8, bf16 "
        "or fp16 FLUX file"
    )
    bf16 = {
        **tensors,
        "double_blocks.0.img_mlp.2.weight": tensors["double_blocks.0.img_mlp.2.weight"].bfloat16(),
    }
    save_file(bf16, str(path))
    assert _error(path) == (
        f"'{path}': 'double_blocks.0.img_mlp.2.weight' is stored as BF16 but its layer is declared float8_e4m3fn "
        "(its 'comfy_quant' tensor); the file is damaged. Download it again, or use a plain fp8, bf16 or fp16 "
        "FLUX file"
    )
    save_file(
        {**tensors, "double_blocks.0.img_mlp.2.comfy_quant": torch.zeros(3, dtype=torch.uint8)}, str(path)
    )
    assert _error(path) == (
        f"'{path}': 'double_blocks.0.img_mlp.2.comfy_quant' does not hold the UTF-8 JSON object ComfyUI writes "
        'there (e.g. {"format": "float8_e4m3fn"}); the file is damaged. Download it again'
    )


def test_fp8_mixed_weights_are_not_converted_to_another_fp8(tmp_path: Path, model: torch.nn.Module) -> None:
    path, _, _ = _mixed(tmp_path, model)
    with pytest.raises(CheckpointError) as err:
        load_model(path, weight_dtype="fp8_e5m2")
    assert str(err.value) == (
        f"weight_dtype='fp8_e5m2' but '{path}' is a ComfyUI quantized (fp8 mixed) checkpoint stored as "
        "float8_e4m3fn: its scaled weights are not converted to another fp8 format. Use weight_dtype='default' "
        "(keeps the file's fp8 weights and scales) or 'compute'"
    )
    kept = load_model(path, dtype="float32", weight_dtype="fp8_e4m3fn")
    assert kept.x_embedder.weight.dtype == torch.float8_e4m3fn  # a bf16 linear of the file, converted


def test_flux2_shape_checks_name_flux2(tmp_path: Path, model: torch.nn.Module) -> None:
    """The checks load_flux2 had, in the shared loader, in FLUX.2's words."""
    bfl = diffusers_to_bfl(model.state_dict())
    path = tmp_path / "f.safetensors"
    save_file({k: v for k, v in bfl.items() if k != "double_blocks.1.txt_mlp.2.weight"}, str(path))
    assert _error(path) == (
        f"'{path}' lacks 1 FLUX.2 tensors (e.g. 'double_blocks.1.txt_mlp.2.weight'); the file is incomplete "
        "or a different model. Download the full checkpoint again"
    )
    save_file({**bfl, "double_blocks.0.extra.weight": torch.zeros(1)}, str(path))
    assert _error(path) == (
        f"'{path}' has 1 tensors FLUX.2 does not (e.g. 'double_blocks.0.extra.weight'); "
        "it is a FLUX.2 variant this loader does not know"
    )
    save_file({**bfl, "double_blocks.0.img_attn.proj.weight": torch.zeros(128, 3)}, str(path))
    assert _error(path) == (
        f"'{path}': tensor 'double_blocks.0.img_attn.proj.weight' has shape [128, 3] but this FLUX.2 layout "
        "needs [128, 128]; the checkpoint is not a FLUX.2 transformer"
    )


def test_not_flux_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"img_in.weight": torch.zeros(4, 4)}, str(path))
    assert _error(path) == (
        f"'{path}' is not a FLUX.1, FLUX.2, Qwen-Image or Wan checkpoint: none of its keys is a FLUX.1, FLUX.2, "
        "Qwen-Image or Wan transformer's (first keys: img_in.weight). Pick a FLUX.1, FLUX.2, Qwen-Image or Wan "
        "transformer file (e.g. flux1-dev.safetensors, flux2-dev.safetensors, qwen-image.safetensors, "
        "wan2.1-t2v-1.3b.safetensors) from models/diffusion_models"
    )


def test_float8_e5m2_layers_load_with_their_scale(tmp_path: Path, model: torch.nn.Module) -> None:
    """Newer ComfyUI's other per-tensor format (comfy/quant_ops.py QUANT_ALGOS 'float8_e5m2'): e5m2 weight
    x weight_scale, held resident as e5m2 or upcast, both exactly the dequantized weight."""
    path, tensors, _ = _mixed(tmp_path, model)
    layer = "single_blocks.1.linear1"
    tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"].float().to(torch.float8_e5m2)
    tensors[f"{layer}.comfy_quant"] = _marker("float8_e5m2")
    save_file(tensors, str(path))
    exact = dequantize(tensors, f"{layer}.weight")
    resident = load_model(path, dtype="float32").single_transformer_blocks[1].attn.to_qkv_mlp_proj
    upcast = load_model(path, dtype="float32", weight_dtype="compute").single_transformer_blocks[1].attn
    assert resident.weight.dtype == torch.float8_e5m2
    assert torch.equal(linear_weight(resident, torch.float32), exact)
    assert torch.equal(upcast.to_qkv_mlp_proj.weight, exact)
