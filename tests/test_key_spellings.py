"""Every key spelling ComfyUI's UNETLoader loads, loaded by the pack (issue 22): the prefixes ComfyUI strips
(`model.diffusion_model.`, `model.model.`, `net.`, `model.`, none), both names of the q/k norms (BFL's
`*_norm.scale`, ComfyUI >= 0.14's ModelSave `*_norm.weight`), full checkpoints, ComfyUI 0.33's ModelSave
fp8 layout; each rank reads only its slices. The files ComfyUI itself wrote are loaded in the comfy tier
(tests/comfy/test_comfy_files.py); these are the same spellings written here, for the CPU suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rocm_parallel.backend.checkpoint import (
    CheckpointError,
    bfl_to_diffusers,
    diffusers_to_bfl,
    inspect_checkpoint,
    load_model,
)
from rocm_parallel.backend.checkpoint import load as load_module
from rocm_parallel.backend.checkpoint.keys import transformer_prefix
from rocm_parallel.backend.family import get_family
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import tiny_flux2_config, tiny_flux_config
from rocm_parallel.testing.parallel import apply_tensor_parallel
from rocm_parallel.testing.writers import quantize_fp8

MODELS = {
    "flux1": tiny_flux_config(heads=4, head_dim=16),
    "flux2": tiny_flux2_config(heads=4, head_dim=16, text_dim=24, in_channels=128),
}
SEED = 5
PREFIX = "model.diffusion_model."


def _model(family: str) -> nn.Module:
    return get_family(family).build(MODELS[family], seed=SEED)


def _bfl(family: str) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in diffusers_to_bfl(_model(family).state_dict()).items()}


def _norms_as_weight(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI >= 0.14's ModelSave names: torch RMSNorm's `weight` for BFL's `*_norm.scale`."""
    return {
        k.removesuffix("_norm.scale") + "_norm.weight" if k.endswith("_norm.scale") else k: v
        for k, v in sd.items()
    }


def _fp8_modelsave(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI 0.33's ModelSave of a scaled fp8 model (comfy/utils.py convert_old_quants, ops.py): every block
    linear fp8 + `weight_scale` + a `comfy_quant` JSON tensor, biases in the compute dtype, no marker."""
    out = dict(sd)
    marker = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    for key, value in sd.items():
        if (
            key.endswith(".weight")
            and value.ndim == 2
            and key.startswith(("double_blocks.", "single_blocks."))
        ):
            layer = key.removesuffix(".weight")
            out[key], out[layer + ".weight_scale"] = quantize_fp8(value)
            out[layer + ".comfy_quant"] = marker.clone()
    return out


# spelling -> the file's tensors, from the BFL state dict (norms `.scale`, no prefix)
SPELLINGS = {
    "bfl": lambda sd: sd,
    "modelsave-0.3.75": lambda sd: {PREFIX + k: v for k, v in sd.items()},
    "modelsave-0.33": lambda sd: {PREFIX + k: v for k, v in _norms_as_weight(sd).items()},
    "bare-weight-norms": _norms_as_weight,
    "prefix-model": lambda sd: {"model." + k: v for k, v in _norms_as_weight(sd).items()},
    "prefix-model.model": lambda sd: {"model.model." + k: v for k, v in sd.items()},
    "prefix-net": lambda sd: {"net." + k: v for k, v in _norms_as_weight(sd).items()},
    # a full checkpoint: ComfyUI's loader keeps the transformer and drops the text encoder and VAE
    "full-checkpoint": lambda sd: {
        **{PREFIX + k: v for k, v in sd.items()},
        "first_stage_model.decoder.conv_in.weight": torch.zeros(4, 4),
        "cond_stage_model.t5xxl.transformer.shared.weight": torch.zeros(4, 4),
    },
    "fp8-modelsave-0.33": lambda sd: {PREFIX + k: v for k, v in _fp8_modelsave(_norms_as_weight(sd)).items()},
}


def _write(tmp_path: Path, family: str, spelling: str) -> Path:
    path = tmp_path / f"{family}-{spelling}.safetensors"
    save_file(SPELLINGS[spelling](_bfl(family)), str(path))
    return path


class ReadCounter:
    """Counts the elements `load_model` reads through safetensors' slices (its reads of the weights)."""

    def __init__(self) -> None:
        self.elements = 0

    def open(self, *args, **kwargs):
        counter, inner = self, safe_open(*args, **kwargs)

        class Slice:
            def __init__(self, sl):
                self.sl = sl

            def __getitem__(self, index):
                piece = self.sl[index]
                counter.elements += piece.numel()
                return piece

        class Opened:
            def __enter__(self):
                inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def get_slice(self, key):
                return Slice(inner.get_slice(key))

            def get_tensor(self, key):  # a scale (one element): not part of the shard
                return inner.get_tensor(key)

        return Opened()


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_comfyui_spelling_loads_the_same_shards_reading_only_them(
    tmp_path, monkeypatch, family, spelling
):
    """Each spelling gives, on each TP 2 rank, exactly the shard of the BFL file (the fp8 one: of its own
    dequantized weights), and a rank reads exactly the elements its shard holds from the weights."""
    reference = load_model(_write(tmp_path, family, "bfl"), dtype="float32", weight_dtype="compute")
    path = _write(tmp_path, family, spelling)
    info = inspect_checkpoint(path)
    assert (info.family, info.format) == (get_family(family).name, "bfl")
    assert info.prefix == {"bfl": "", "bare-weight-norms": "", "prefix-model": "model.",
                           "prefix-model.model": "model.model.", "prefix-net": "net."}.get(spelling, PREFIX)  # fmt: skip
    fp8 = spelling.startswith("fp8")
    assert info.quantization == ("comfy_quant" if fp8 else "")
    if fp8:  # the reference: ComfyUI's dequantization of the same file (fp8 x weight_scale, float32)
        stored = {k.removeprefix(PREFIX): v for k, v in safe_open_all(path).items()}
        reference = get_family(family).build(MODELS[family], device="meta")
        state = bfl_to_diffusers(stored, family, torch.float32)
        reference.load_state_dict(state, assign=True)
    for rank in range(2):
        counter = ReadCounter()
        monkeypatch.setattr(load_module, "safe_open", counter.open)
        with fake_process_group(2, rank):
            got = load_model(path, dtype="float32", weight_dtype="compute", tp=2).state_dict()
            want = apply_tensor_parallel(_copy(reference)).state_dict()
        monkeypatch.undo()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (spelling, rank, key)
        held = sum(v.numel() for v in got.values())
        assert counter.elements == held, (counter.elements, held)


def safe_open_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize(
    ("keys", "prefix"),
    [
        (["img_in.weight"] * 1, ""),
        ([f"model.diffusion_model.k{i}" for i in range(6)], PREFIX),
        ([f"model.model.k{i}" for i in range(6)] + ["model.diffusion_model.k"], "model.model."),
        ([f"net.k{i}" for i in range(6)], "net."),
        # 5 keys are not enough for a candidate: ComfyUI falls back to `model.` (and drops every other key)
        ([f"model.diffusion_model.k{i}" for i in range(5)], "model."),
        ([f"model.k{i}" for i in range(3)] + ["other"], "model."),
        # a tie: the first of ComfyUI's list
        ([f"net.k{i}" for i in range(6)] + [f"model.model.k{i}" for i in range(6)], "model.model."),
        # `transformer.` and `diffusion_model.` are not ComfyUI prefixes: nothing is stripped
        ([f"diffusion_model.k{i}" for i in range(9)], ""),
    ],
)
def test_transformer_prefix_is_comfyuis_rule(keys, prefix):
    assert transformer_prefix(keys) == prefix


def test_a_file_with_both_spellings_of_a_norm_is_refused(tmp_path):
    sd = {PREFIX + k: v for k, v in _bfl("flux2").items()}
    key = PREFIX + "double_blocks.0.img_attn.norm.key_norm.scale"
    sd[key.removesuffix(".scale") + ".weight"] = sd[key].clone()
    path = tmp_path / "both.safetensors"
    save_file(sd, str(path))
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(path)
    assert str(err.value) == (
        f"'{path}' holds both 'double_blocks.0.img_attn.norm.key_norm.scale' and "
        "'double_blocks.0.img_attn.norm.key_norm.weight', two spellings of one RMS norm's scale (BFL's and "
        "ComfyUI >= 0.14's); which one ComfyUI uses depends on its version. Keep one of them: re-save the "
        "model with ComfyUI's ModelSave, or use the original file"
    )


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_missing_tensor_is_named_with_the_path_only_when_missing(tmp_path, family):
    """The `.weight` norms are no longer reported missing; a norm that really is, is, with the path."""
    sd = _norms_as_weight(_bfl(family))
    path = tmp_path / "ok.safetensors"
    save_file(sd, str(path))
    inspect_checkpoint(path)  # complete: nothing is said missing
    del sd["double_blocks.0.img_attn.norm.query_norm.weight"]
    save_file({PREFIX + k: v for k, v in sd.items()}, str(path))
    title = get_family(family).title
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(path)
    assert str(err.value) == (
        f"'{path}': tensor 'double_blocks.0.img_attn.norm.query_norm.scale' is missing; the checkpoint is "
        f"incomplete or not {title}"
    )


@pytest.mark.parametrize("family", sorted(MODELS))
def test_bfl_to_diffusers_reads_comfyuis_modelsave_state_dict(family):
    model = _model(family)
    saved = SPELLINGS["modelsave-0.33"](_bfl(family))
    got = bfl_to_diffusers(saved, family)
    for key, value in model.state_dict().items():
        assert torch.equal(got[key], value), key
