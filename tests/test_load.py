"""Checkpoint loading: every format and stored dtype, per-rank shards equal to slicing the full model,
forward parity between a BFL file and its diffusers twin, and exact error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from load_checks import LoadShards
from model_methods import Inputs
from safetensors.torch import save_file
from torch import nn

from rocm_parallel.backend.checkpoint import (
    COMFY_PREFIX,
    CheckpointError,
    bfl_to_diffusers,
    diffusers_to_bfl,
    inspect_checkpoint,
    load_model,
    resolve_dtype,
)
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import random_inputs, tiny_flux_config
from rocm_parallel.testing.parallel import apply_tensor_parallel

# 8 heads so that TP 2 and 4 both split them.
CONFIG = tiny_flux_config(heads=8, head_dim=16, double_blocks=2, single_blocks=2)
SCHNELL = {**CONFIG, "guidance_embeds": False}
SEED = 11


def _model(config: dict = CONFIG, stored: torch.dtype = torch.float32) -> nn.Module:
    return nn.Module.to(build_flux(config, seed=SEED), dtype=stored)


def _contiguous(sd: dict) -> dict:
    return {k: v.contiguous() for k, v in sd.items()}


def write_bfl(
    folder: Path, config: dict = CONFIG, stored: torch.dtype = torch.float32, prefix: str = ""
) -> Path:
    path = folder / "flux.safetensors"
    bfl = diffusers_to_bfl(_model(config, stored).state_dict())
    save_file(_contiguous({prefix + k: v for k, v in bfl.items()}), str(path))
    return path


def write_diffusers_file(folder: Path, config: dict = CONFIG, stored: torch.dtype = torch.float32) -> Path:
    path = folder / "flux-diffusers-keys.safetensors"
    save_file(_contiguous(_model(config, stored).state_dict()), str(path))
    return path


def write_diffusers_folder(folder: Path, config: dict = CONFIG, stored: torch.dtype = torch.float32) -> Path:
    """diffusers' own save_pretrained, sharded so that the index file is exercised."""
    out = folder / "FLUX.1-tiny"
    _model(config, stored).save_pretrained(out / "transformer", max_shard_size="2MB", safe_serialization=True)
    (out / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return out


WRITERS = {
    "bfl": write_bfl,
    "comfy-prefixed": lambda folder, config=CONFIG, stored=torch.float32: write_bfl(
        folder, config, stored, COMFY_PREFIX
    ),
    "diffusers-file": write_diffusers_file,
    "diffusers-folder": write_diffusers_folder,
}


def expected_shard(
    stored: torch.dtype, compute: torch.dtype, degree: int, rank: int
) -> dict[str, torch.Tensor]:
    """Reference: the seeded model rounded to the stored dtype, cast, sharded by apply_tensor_parallel."""
    model = nn.Module.to(_model(CONFIG, stored), dtype=compute)
    if degree == 1:
        return model.state_dict()
    with fake_process_group(degree, rank):
        return apply_tensor_parallel(model).state_dict()


def _load(path: Path, degree: int, rank: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    # upcast at load ('compute'): the slicing under test is the same for fp8-resident weights, whose
    # dtypes and bytes tests/test_weights.py checks
    if degree == 1:
        return load_model(path, dtype=dtype, weight_dtype="compute").state_dict()
    with fake_process_group(degree, rank):
        return load_model(path, dtype=dtype, weight_dtype="compute", tp=degree).state_dict()


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        # owns exactly its bytes: not a view of the file's memory map or of a larger tensor
        assert got[k].is_contiguous() and got[k].untyped_storage().nbytes() == v.numel() * v.element_size(), k


STORED = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8-e4m3fn": torch.float8_e4m3fn,
    "fp8-e5m2": torch.float8_e5m2,
}
CASES = [("bfl", s) for s in STORED] + [
    ("comfy-prefixed", "bf16"),
    ("diffusers-file", "fp16"),
    ("diffusers-folder", "bf16"),
    ("diffusers-folder", "fp8-e4m3fn"),
]


@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize(("fmt", "stored"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_sharded_load_equals_full_model_sliced(tmp_path: Path, fmt: str, stored: str, degree: int) -> None:
    path = WRITERS[fmt](tmp_path, stored=STORED[stored])
    for rank in range(degree):
        _assert_same(_load(path, degree, rank), expected_shard(STORED[stored], torch.float32, degree, rank))


def test_tp_load_equals_loading_whole_then_applying_tp(tmp_path: Path) -> None:
    path = write_bfl(tmp_path, stored=torch.bfloat16)
    full = load_model(path, dtype="bfloat16")
    for rank in range(4):
        with fake_process_group(4, rank):
            want = apply_tensor_parallel(load_model(path, dtype="bfloat16")).state_dict()
            _assert_same(load_model(path, dtype="bfloat16", tp=4).state_dict(), want)
    assert full.dtype == torch.bfloat16


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_upcast_is_exact(tmp_path: Path, fp8: torch.dtype, compute: torch.dtype) -> None:
    bfl = {k: v.to(fp8) for k, v in diffusers_to_bfl(build_flux(CONFIG, seed=SEED).state_dict()).items()}
    path = tmp_path / "flux-fp8.safetensors"
    save_file(_contiguous(bfl), str(path))
    loaded = load_model(path, dtype=compute, weight_dtype="compute").state_dict()
    stored = bfl_to_diffusers(bfl)
    assert loaded.keys() == stored.keys()
    for name, tensor in loaded.items():
        # fp8 -> fp32 is exact, and so is fp32 -> bf16 of an fp8 value (fewer mantissa bits, wider range)
        assert tensor.dtype == compute and torch.equal(tensor, stored[name].to(torch.float32).to(compute)), (
            name
        )


@pytest.mark.parametrize(
    ("fmt", "config"), [("bfl", CONFIG), ("bfl", SCHNELL), ("diffusers-folder", SCHNELL)]
)
def test_inspect_reports_format_config_variant(tmp_path: Path, fmt: str, config: dict) -> None:
    path = WRITERS[fmt](tmp_path, config, torch.bfloat16)
    info = inspect_checkpoint(path)
    assert info.format == ("bfl" if fmt == "bfl" else "diffusers")
    assert info.variant == ("dev" if config["guidance_embeds"] else "schnell")
    assert info.stored_dtypes == ("bfloat16",)
    assert {k: info.config[k] for k in config} == config
    n = sum(p.numel() for p in build_flux(config, device="meta").parameters())
    assert (info.parameters, info.stored_bytes) == (n, 2 * n)


def test_mixed_fp8_and_bf16_file(tmp_path: Path) -> None:
    bfl = diffusers_to_bfl(build_flux(CONFIG, seed=SEED).state_dict())
    mixed = {k: v.to(torch.float8_e4m3fn if v.ndim == 2 else torch.bfloat16) for k, v in bfl.items()}
    save_file(_contiguous(mixed), str(tmp_path / "m.safetensors"))
    assert inspect_checkpoint(tmp_path / "m.safetensors").stored_dtypes == ("bfloat16", "float8_e4m3fn")


def test_bfl_file_and_diffusers_twin_give_the_same_forward(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bfl = load_model(write_bfl(tmp_path / "a", stored=torch.bfloat16))
    twin = load_model(write_diffusers_folder(tmp_path / "b", stored=torch.bfloat16))
    original = nn.Module.to(_model(CONFIG, torch.bfloat16), dtype=torch.float32)
    inputs = random_inputs(FluxDims.from_diffusers_config(CONFIG)).as_kwargs()
    with torch.no_grad():
        outs = [m(**inputs, return_dict=False)[0] for m in (bfl, twin, original)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])


# --------------------------------------------------------------------------------------------------
# Errors: raised by inspect_checkpoint (before any worker starts), exact text.


def _error(path: Path | str) -> str:
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(path)
    assert isinstance(err.value, ConfigError)
    return str(err.value)


def test_missing_file_lists_the_folder(tmp_path: Path) -> None:
    write_bfl(tmp_path)
    (tmp_path / "old").mkdir()
    assert _error(tmp_path / "flux1-dev.safetensors") == (
        f"checkpoint '{tmp_path}/flux1-dev.safetensors' does not exist; '{tmp_path}' has: flux.safetensors, "
        "old/. Pick one of those, or put the FLUX file into that folder"
    )
    assert _error(tmp_path / "nope" / "x.safetensors") == (
        f"checkpoint '{tmp_path}/nope/x.safetensors' does not exist, nor does its folder; check the path"
    )


def test_sdxl_unet_is_recognized(tmp_path: Path) -> None:
    keys = ["input_blocks.0.0.weight", "label_emb.0.0.weight", "middle_block.0.in_layers.0.weight"]
    save_file({COMFY_PREFIX + k: torch.zeros(2) for k in keys}, str(tmp_path / "sdxl.safetensors"))
    assert _error(tmp_path / "sdxl.safetensors") == (
        f"'{tmp_path}/sdxl.safetensors' is not a FLUX.1, FLUX.2, Qwen-Image or Wan checkpoint: it looks like an "
        "SDXL UNet. Pick a FLUX.1, FLUX.2, Qwen-Image or Wan transformer file (e.g. flux1-dev.safetensors, "
        "flux2-dev.safetensors, qwen-image.safetensors, wan2.1-t2v-1.3b.safetensors) from models/diffusion_models"
    )


def test_unknown_model_lists_keys(tmp_path: Path) -> None:
    save_file({k: torch.zeros(2) for k in ["w3", "w1", "w2", "w0", "w4"]}, str(tmp_path / "x.safetensors"))
    assert _error(tmp_path / "x.safetensors") == (
        f"'{tmp_path}/x.safetensors' is not a FLUX.1, FLUX.2, Qwen-Image or Wan checkpoint: none of its keys is "
        "a FLUX.1, FLUX.2, Qwen-Image or Wan transformer's (first keys: w0, w1, w2, w3). Pick a FLUX.1, FLUX.2, "
        "Qwen-Image or Wan transformer file (e.g. flux1-dev.safetensors, flux2-dev.safetensors, "
        "qwen-image.safetensors, wan2.1-t2v-1.3b.safetensors) from models/diffusion_models"
    )


def test_truncated_file(tmp_path: Path) -> None:
    path = write_bfl(tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    assert _error(path) == (
        f"'{path}' is truncated or corrupt: its header promises {size} bytes but the file has {size - 1000}. "
        "Download or copy it again"
    )
    path.write_bytes(b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}")
    assert _error(path) == (
        f"'{path}' is truncated or corrupt: its 18 bytes do not start with a safetensors header. "
        "Download or copy it again"
    )
    path.write_bytes(b"\xff\x00\x00\x00\x00\x00\x00\x00{}")
    assert _error(path) == (
        f"'{path}' is truncated or corrupt: its header length field says 255 bytes but the file has only 10. "
        "Download or copy it again"
    )


def test_gguf_and_pickle_are_named(tmp_path: Path) -> None:
    # GGUF files are read (tests/test_gguf.py); a damaged one is named as such by the gguf package's reader
    gguf = tmp_path / "flux1-dev-Q8_0.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(64)))
    assert _error(gguf).startswith(
        f"'{gguf}' is truncated or corrupt: the gguf package cannot read its header (72 bytes; "
    )
    ckpt = tmp_path / "flux.ckpt"
    torch.save({"img_in.weight": torch.zeros(2)}, ckpt)
    assert _error(ckpt) == (
        f"'{ckpt}' is a PyTorch pickle (torch.save / .ckpt / .bin), not safetensors; convert it with "
        "safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
    )


def test_header_length_starting_with_0x80_is_safetensors_not_a_pickle(tmp_path: Path) -> None:
    """The 8-byte header length is little-endian: its first byte is 0x80 for 1 file in 32 (8-byte
    padding), e.g. an 8320-byte header. A pickle's magic byte alone must not reject such a file."""
    bfl = _contiguous(diffusers_to_bfl(_model().state_dict()))
    path = tmp_path / "flux-0x80.safetensors"
    for pad in range(0, 256 * 8):
        save_file(bfl, str(path), metadata={"note": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80
    info = inspect_checkpoint(path)
    model = load_model(info, device="cpu", dtype="float32")
    reference = _model().state_dict()
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_unsupported_stored_dtype(tmp_path: Path) -> None:
    bfl = diffusers_to_bfl(build_flux(CONFIG, seed=SEED).state_dict())
    bfl["txt_in.bias"] = bfl["txt_in.bias"].to(torch.float64)
    save_file(_contiguous(bfl), str(tmp_path / "f64.safetensors"))
    assert _error(tmp_path / "f64.safetensors") == (
        f"'{tmp_path}/f64.safetensors': tensor 'txt_in.bias' is stored as F64; supported stored dtypes are "
        "BF16, F16, F32, F8_E4M3, F8_E5M2. Use a bf16, fp16, fp32 or fp8 safetensors checkpoint"
    )


def test_scale_on_a_weight_that_is_not_fp8_is_refused(tmp_path: Path) -> None:
    # Scaled fp8 files load (tests/test_weights.py); a scale beside a float32 weight is a damaged file.
    bfl = diffusers_to_bfl(build_flux(CONFIG, seed=SEED).state_dict())
    bfl["img_in.scale_weight"] = torch.ones(1)
    bfl["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(_contiguous(bfl), str(tmp_path / "s.safetensors"))
    assert _error(tmp_path / "s.safetensors") == (
        f"'{tmp_path}/s.safetensors': 'img_in.weight' is stored as F32 but has a scale 'img_in.scale_weight'; "
        "only fp8 weights are scaled. The file is damaged; use a plain fp8, bf16 or fp16 FLUX file"
    )


def test_incomplete_or_foreign_bfl_tensors(tmp_path: Path) -> None:
    bfl = diffusers_to_bfl(build_flux(CONFIG, seed=SEED).state_dict())
    path = tmp_path / "f.safetensors"
    save_file(_contiguous({k: v for k, v in bfl.items() if k != "double_blocks.1.txt_mlp.2.bias"}), str(path))
    assert _error(path) == (
        f"'{path}' lacks 1 FLUX.1 tensors (e.g. 'double_blocks.1.txt_mlp.2.bias'); the file is incomplete "
        "or a different model. Download the full checkpoint again"
    )
    save_file(_contiguous({**bfl, "double_blocks.0.extra.weight": torch.zeros(1)}), str(path))
    assert _error(path) == (
        f"'{path}' has 1 tensors FLUX.1 does not (e.g. 'double_blocks.0.extra.weight'); "
        "it is a FLUX.1 variant this loader does not know"
    )
    save_file(_contiguous({**bfl, "txt_in.bias": torch.zeros(100)}), str(path))
    assert _error(path) == (
        f"'{path}': tensor 'txt_in.bias' has shape [100] but this FLUX.1 layout needs [128]; "
        "the checkpoint is not a FLUX.1 transformer"
    )


def test_diffusers_folder_errors(tmp_path: Path) -> None:
    folder = write_diffusers_folder(tmp_path)
    transformer = folder / "transformer"
    index = json.loads((transformer / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (transformer / shard).unlink()
    assert _error(folder) == (
        f"'{transformer}/diffusion_pytorch_model.safetensors.index.json' names the shard '{shard}', which is "
        f"missing; '{transformer}' has: {', '.join(sorted(p.name for p in transformer.iterdir()))}. "
        "Download the missing shard"
    )
    config = json.loads((transformer / "config.json").read_text())
    (transformer / "config.json").write_text(json.dumps({**config, "_class_name": "AutoencoderKL"}))
    assert _error(transformer) == (
        f"'{transformer}/config.json' describes a AutoencoderKL, not a FluxTransformer2DModel, "
        "Flux2Transformer2DModel, QwenImageTransformer2DModel or WanTransformer3DModel; pass a FLUX pipeline "
        "folder or its transformer/ folder"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("")
    assert _error(empty) == (
        f"'{empty}' is a folder without config.json, so not a diffusers model; it has: notes.txt. "
        "Pass a .safetensors file, or a diffusers FLUX folder (or its transformer/ folder)"
    )
    (empty / "config.json").write_text(json.dumps(config))
    torch.save({}, empty / "diffusion_pytorch_model.bin")
    assert _error(empty) == (
        f"'{empty}' has neither diffusion_pytorch_model.safetensors nor "
        "diffusion_pytorch_model.safetensors.index.json; it has: config.json, diffusion_pytorch_model.bin, "
        "notes.txt. Only safetensors weights are read; re-save the model with "
        "save_pretrained(safe_serialization=True)"
    )


def test_compute_dtype_errors_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(CheckpointError) as err:
        resolve_dtype("float8_e4m3fn", "cpu")
    assert str(err.value) == (
        "dtype='float8_e4m3fn' is not a compute dtype; use bfloat16, float16 or float32 (fp8 is a weight "
        "dtype: pass weight_dtype='fp8_e4m3fn' or 'fp8_e5m2' to keep weights in fp8)"
    )
    with pytest.raises(CheckpointError) as err:
        resolve_dtype(torch.float8_e5m2, "cpu")
    assert str(err.value).startswith("dtype=torch.float8_e5m2 is not a compute dtype; use bfloat16")
    # Only the capability query is faked: no GPU is touched.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype(None, "cuda:1") == torch.float16
    with pytest.raises(CheckpointError) as err:
        resolve_dtype("bfloat16", "cuda:1")
    assert str(err.value) == "device cuda:1 does not support bfloat16; use dtype='float16' or 'float32'"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype(None, "cuda:0") == torch.bfloat16


def test_tp_needs_a_group_of_that_size(tmp_path: Path) -> None:
    path = write_bfl(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_model(path, tp=2)
    assert str(err.value) == "load_model(tp=2) needs a process group of 2 ranks, got no process group"
    with fake_process_group(4, 0), pytest.raises(CheckpointError) as err:
        load_model(path, tp=2)
    assert str(err.value) == "load_model(tp=2) needs a process group of 2 ranks, got 4"
    with (
        fake_process_group(3, 0),
        pytest.raises(ConfigError, match="tp_degree=3 does not divide 8 attention heads"),
    ):
        load_model(path, tp=3)


def test_workers_load_their_shards_and_match_one_process(tmp_path: Path, group2: WorkerGroup) -> None:
    """Real gloo group: each worker reads its own shard, and the TP forward matches a single-process load."""
    path = write_bfl(tmp_path, stored=torch.bfloat16)
    inputs = random_inputs(FluxDims.from_diffusers_config(CONFIG)).as_kwargs()
    with torch.no_grad():
        expected = load_model(path, dtype="float32")(**inputs, return_dict=False)[0]
    loaded = group2.call_all("load_shards", LoadShards(str(path), "float32", 2))
    full_bytes = 4 * sum(p.numel() for p in build_flux(CONFIG, device="meta").parameters())
    assert [r.rank for r in loaded] == [0, 1]
    assert loaded[0].parameter_bytes == loaded[1].parameter_bytes < 0.6 * full_bytes
    out = group2.call("forward", Inputs(inputs)).output
    assert (out - expected).abs().max().item() <= 1e-5
