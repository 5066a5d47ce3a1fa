"""ComfyUI's scaled fp8 text encoder files on the workers: each rank's slices of the fp8 weights and their
shared scale, the encoding against transformers on the dequantized weights, the bytes the planner prices, and
every malformed file refused before a rank runs.

The files are the small random encoders of testing/encoder_files.py written as ComfyUI's scaled fp8 files hold
them (`write_scaled_encoder`: the legacy `scaled_fp8` layout and the newer `comfy_quant` one). The real-ComfyUI
tier (tests/comfy/test_comfy_scaled_encoders.py) checks the same against ComfyUI's own CLIPLoader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from load_checks import EncoderWeights
from safetensors.torch import load_file, save_file

from rocm_parallel.backend.checkpoint.files import CheckpointError
from rocm_parallel.backend.encoders.api import ParallelEncoder
from rocm_parallel.backend.encoders.files import inspect_encoder
from rocm_parallel.backend.resident.group import ResidentGroup
from rocm_parallel.testing.encoder_files import SCALED_FORMS, VOCAB, reference, write_scaled_encoder

TOLERANCE = 1e-4
FIX = (
    "Use ComfyUI's fp8_scaled, fp8 or bf16 file of this encoder (e.g. qwen_2.5_vl_7b_fp8_scaled.safetensors, "
    "t5xxl_fp8_e4m3fn_scaled.safetensors), or load this one with ComfyUI's own CLIPLoader"
)


def _dequantized(path: Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The file's weights as float32 (fp8 x scale: exact in float32), scales and markers dropped."""
    sd = load_file(str(path))
    out = {}
    for key, value in sd.items():
        layer = key.removesuffix(".weight")
        scale = sd.get(f"{layer}.scale_weight", sd.get(f"{layer}.weight_scale"))
        if key.endswith(".weight") and scale is not None:
            out[key] = value.to(torch.float32) * scale
        elif (
            value.is_floating_point() and value.ndim and not key.endswith((".scale_weight", ".weight_scale"))
        ):
            out[key] = value.to(torch.float32)
    plain = folder / f"dequantized-{path.name}"
    save_file(out, str(plain))
    return plain, out


@pytest.mark.parametrize("kind", ["t5", "qwen25"])
@pytest.mark.parametrize("form", SCALED_FORMS)
def test_each_rank_holds_its_fp8_slices_and_the_shared_scale(
    group2: object, tmp_path: Path, form: str, kind: str
) -> None:
    """At TP 2 every rank holds its half of each linear weight in fp8, as stored, and the weight's one scale;
    the ranks' halves times that scale put together are the whole file's dequantized weight. The encoding
    equals transformers' model on the dequantized weights, and each rank holds the bytes the planner priced."""
    path = write_scaled_encoder(kind, tmp_path, form)
    info = inspect_encoder(path)
    assert info.quantization == form and info.scales
    plain, whole = _dequantized(path, tmp_path)
    file = load_file(str(path))
    group = ResidentGroup(group=group2)
    encoder = ParallelEncoder(group, path, slot="te scaled")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    got = encoder.encode(ids)
    assert (got.out - reference(kind, plain, ids)).abs().max() < TOLERANCE
    ranks = [r.state for r in group2.call_all("encoder_weights", EncoderWeights("te scaled"))]  # type: ignore[attr-defined]
    prefix = info.encoder.prefix
    for name, stored in info.tensors.items():
        if name not in info.scales:
            continue
        layer = name.removesuffix(".weight")
        scale = file[info.scales[name].key]
        halves = [r[name] for r in ranks]
        assert all(h.dtype == torch.float8_e4m3fn for h in halves), name
        assert all(torch.equal(r[f"{layer}.scale_weight"], scale.to(torch.float32)) for r in ranks), name
        dim = 0 if halves[0].shape[0] != stored.shape[0] else 1
        assert halves[0].shape[dim] * 2 == stored.shape[dim], name
        joined = torch.cat([h.to(torch.float32) * scale for h in halves], dim)
        assert torch.equal(joined, whole[prefix + name]), name
    for status in group.status():
        held = next(m for m in status.models if m.slot == "te scaled")
        assert held.parameter_bytes == encoder.request.weight_bytes
    group.unload("te scaled")


# --------------------------------------------------------------------------------------------------
# Refusals: from the header, before any rank runs


def _rewrite(
    path: Path, change: dict[str, torch.Tensor | None], metadata: dict[str, str] | None = None
) -> Path:
    sd = load_file(str(path))
    for key, value in change.items():
        if value is None:
            del sd[key]
        else:
            sd[key] = value
    bad = path.with_name(f"bad-{path.name}")
    save_file(sd, str(bad), metadata=metadata)
    return bad


LAYER = "encoder.block.0.layer.0.SelfAttention.q"  # T5's first query projection


def _refused(group2: object, path: Path) -> str:
    """The message of the refusal, from inspection and from the encoder's constructor; no rank holds it."""
    with pytest.raises(CheckpointError) as inspected:
        inspect_encoder(path)
    group = ResidentGroup(group=group2)
    with pytest.raises(CheckpointError) as constructed:
        ParallelEncoder(group, path, slot="te refused")
    assert str(constructed.value) == str(inspected.value)
    assert not any(m.slot == "te refused" for s in group.status() for m in s.models)
    return str(inspected.value)


def test_a_quantized_layer_without_its_scale_is_refused(group2: object, tmp_path: Path) -> None:
    path = _rewrite(write_scaled_encoder("t5", tmp_path, "comfy_quant"), {f"{LAYER}.weight_scale": None})
    assert _refused(group2, path) == (
        f"'{path}': layer '{LAYER}' is declared float8_e4m3fn (its 'comfy_quant' tensor) but the file has no "
        f"'{LAYER}.weight_scale'; ComfyUI's quantized layers need a weight and its weight_scale. The file is "
        f"damaged; download it again. {FIX}"
    )


def test_a_scale_per_row_is_refused(group2: object, tmp_path: Path) -> None:
    path = _rewrite(write_scaled_encoder("t5", tmp_path), {f"{LAYER}.scale_weight": torch.ones(32)})
    assert _refused(group2, path) == (
        f"'{path}': '{LAYER}.scale_weight' is a F32 tensor of shape [32]; ComfyUI scaled fp8 stores one float "
        f"scale per weight (shape []), and per-channel or block scales are not supported. {FIX}"
    )


def test_a_scaled_weight_in_an_fp8_dtype_the_pack_cannot_hold_is_refused(
    group2: object, tmp_path: Path
) -> None:
    e8m0 = torch.ones(32, 32, dtype=torch.float8_e8m0fnu)  # safetensors' F8_E8M0: a scale format, no weights
    path = _rewrite(write_scaled_encoder("t5", tmp_path), {f"{LAYER}.weight": e8m0})
    assert _refused(group2, path) == (
        f"'{path}': '{LAYER}.weight' is stored as F8_E8M0 but has a scale '{LAYER}.scale_weight'; only fp8 "
        f"weights are scaled. The file is damaged. {FIX}"
    )


def test_a_layer_quantized_in_a_format_the_pack_does_not_read_is_refused(
    group2: object, tmp_path: Path
) -> None:
    nvfp4 = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    path = _rewrite(write_scaled_encoder("t5", tmp_path, "comfy_quant"), {f"{LAYER}.comfy_quant": nvfp4})
    assert _refused(group2, path) == (
        f"'{path}': layer '{LAYER}' is quantized as 'nvfp4' (its 'comfy_quant' tensor); this loader reads "
        f"ComfyUI's float8_e4m3fn and float8_e5m2 layers (one scale per weight) only. {FIX}"
    )


def test_a_scale_on_the_token_table_is_refused(group2: object, tmp_path: Path) -> None:
    path = write_scaled_encoder("t5", tmp_path)
    table = load_file(str(path))["shared.weight"]
    fp8 = table.to(torch.float8_e4m3fn)
    path = _rewrite(path, {"shared.weight": fp8, "shared.scale_weight": torch.tensor(1.0)})
    assert _refused(group2, path) == (
        f"text encoder '{path}': 'shared.scale_weight' scales 'shared.weight', which is not a linear layer's "
        f"weight; ComfyUI's scaled fp8 T5-XXL files scale linear weights only. {FIX}"
    )
