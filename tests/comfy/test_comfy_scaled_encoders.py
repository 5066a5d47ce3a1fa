"""ComfyUI's scaled fp8 text encoder files on the pack's workers, against ComfyUI's own CLIPLoader on the same file.

The files ComfyUI's templates ship for Qwen-Image (qwen_2.5_vl_7b_fp8_scaled) and FLUX.1
(t5xxl_fp8_e4m3fn_scaled) are "scaled fp8": every linear weight fp8 with one float32 `scale_weight`, a
`scale_input` of 1.0, a `scaled_fp8` marker, the rest (norms, biases, token table) bf16. Small ones are built
here with ComfyUI's own classes (its `T5`, its `Llama2_` with Qwen2.5-VL's config), each linear weight
quantized per tensor as ComfyUI does (scale = max |w| / 448, comfy/quant_ops.py `quantize` with
scale="recalculate"). The newer form (`weight_scale` + a `comfy_quant` tag per layer) is what ComfyUI 0.33's
own `comfy.utils.convert_old_quants` makes of that file, saved as is (0.33 only: 0.3.75 has no such function).

ComfyUI's numbers differ between versions, and the pack follows each: 0.33 converts the legacy file to its
quantized layers and dequantizes each weight in its text encoder's dtype, bf16 here (`fp8.to(bf16) *
scale.to(bf16)`), before the float32 matmul; 0.3.75 keeps `scaled_fp8_ops`, the product formed in float32.

    source /work/comfy/env.sh 0.33.0 <pack checkout>
    python -m pytest -q -s -m comfy tests/comfy/test_comfy_scaled_encoders.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, COMFYUI_VERSION
from safetensors.torch import save_file
from test_comfy_encoders import TINY_CLIP_L, TINY_QWEN25, TINY_T5, _randomize

from rocm_parallel.backend.resident.group import ResidentGroup
from rocm_parallel.backend.runtime.client import WorkerGroup

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1800)]

TOLERANCE = 1e-4
FORMS = ["scaled_fp8", "comfy_quant", "quantization_metadata"]


@pytest.fixture(scope="module")
def comfy() -> Any:
    """ComfyUI imported in this process (test_comfy_encoders.py's fixture)."""
    import test_comfy_encoders

    return test_comfy_encoders.comfy.__wrapped__()


@pytest.fixture(scope="module")
def group1() -> Iterator[WorkerGroup]:
    with WorkerGroup(["cpu"], threads=1) as group:
        yield group


def _scaled_fp8(sd: dict[str, torch.Tensor], linear: set[str]) -> dict[str, torch.Tensor]:
    """The legacy scaled fp8 layout: each weight in `linear` fp8 e4m3fn with its per-tensor float32 scale
    (max |w| / 448, as ComfyUI's quantize with scale="recalculate"), `scale_input` 1.0, the `scaled_fp8` marker;
    everything else bf16."""
    out: dict[str, torch.Tensor] = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    fp8 = torch.finfo(torch.float8_e4m3fn).max
    for key, value in sd.items():
        if key in linear:
            scale = (value.abs().amax() / fp8).to(torch.float32)
            layer = key.removesuffix(".weight")
            out[key] = (value / scale).clamp(-fp8, fp8).to(torch.float8_e4m3fn)
            out[f"{layer}.scale_weight"] = scale.reshape(())
            out[f"{layer}.scale_input"] = torch.ones((), dtype=torch.float32)
        else:
            out[key] = value.to(torch.bfloat16)
    return out


def _save(comfy: Any, legacy: dict[str, torch.Tensor], form: str, path: Path) -> Path:
    if form == "comfy_quant":
        if not hasattr(comfy.utils, "convert_old_quants"):
            pytest.skip(
                f"ComfyUI {COMFYUI_VERSION} has no convert_old_quants (the comfy_quant form is newer)"
            )
        sd, _ = comfy.utils.convert_old_quants(dict(legacy), model_prefix="", metadata={})
        assert any(k.endswith(".comfy_quant") for k in sd) and "scaled_fp8" not in sd
        legacy = sd
    metadata = None
    if form == "quantization_metadata":  # the layers declared in the header (what ComfyUI 0.3.75 reads)
        layers = [k.removesuffix(".scale_weight") for k in legacy if k.endswith(".scale_weight")]
        metadata = {"_quantization_metadata": json.dumps(
            {"format_version": "1.0", "layers": {layer: {"format": "float8_e4m3fn"} for layer in layers}}
        )}  # fmt: skip
        legacy = {
            k.replace(".scale_weight", ".weight_scale"): v
            for k, v in legacy.items()
            if k != "scaled_fp8" and not k.endswith(".scale_input")
        }
    save_file(legacy, str(path), metadata=metadata)
    return path


def _linear_weights(module: torch.nn.Module, prefix: str = "") -> set[str]:
    return {
        f"{prefix}{name}.weight"
        for name, m in module.named_modules()
        if type(m).__name__ == "Linear" and name
    }


@pytest.fixture(scope="module")
def t5_legacy(comfy: Any) -> dict[str, torch.Tensor]:
    t5 = comfy.text_encoders.t5.T5(TINY_T5, torch.float32, "cpu", comfy.ops.manual_cast)
    return _scaled_fp8(_randomize(t5, 11), _linear_weights(t5))


@pytest.fixture(scope="module")
def clip_l_file(comfy: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    with open(Path(COMFYUI_PATH) / "comfy" / "sd1_clip_config.json") as f:
        clip_l = comfy.clip_model.CLIPTextModel(
            {**json.load(f), **TINY_CLIP_L}, torch.float32, "cpu", comfy.ops.manual_cast
        )
    path = tmp_path_factory.mktemp("clip_l") / "tiny-clip-l.safetensors"
    save_file(_randomize(clip_l, 12), str(path))
    return path


@pytest.fixture(scope="module")
def qwen_legacy(comfy: Any) -> dict[str, torch.Tensor]:
    llama = comfy.text_encoders.llama
    model = llama.Llama2_(
        llama.Qwen25_7BVLI_Config(**TINY_QWEN25), device="cpu", dtype=torch.float32, ops=comfy.ops.manual_cast
    )
    sd = {f"model.{k}": v for k, v in _randomize(model, 13).items()}
    return _scaled_fp8(sd, _linear_weights(model, "model."))


def _dequantized_reference(comfy: Any, form: str) -> bool:
    return form == "quantization_metadata" and not hasattr(comfy.utils, "convert_old_quants")


def _dtype_for(comfy: Any, form: str) -> dict[str, Any]:
    """ComfyUI's `model_options` dtype for both CLIPs: float32 against a dequantized reference (`_reference`)."""
    return {"dtype": torch.float32} if _dequantized_reference(comfy, form) else {}


def _reference(comfy: Any, legacy: dict[str, torch.Tensor], form: str, path: Path) -> Path:
    """The file ComfyUI's own CLIP is loaded from: the tested one, except where this ComfyUI cannot read it.
    ComfyUI 0.3.75 reads a header's `_quantization_metadata` for the language models only, and then fails
    (`te() got an unexpected keyword argument 'llama_quantization_metadata'`); for T5 it ignores it and runs
    the fp8 weights unscaled. There the reference is 0.3.75's own CLIP on the dequantized weights in float32
    (fp8 x scale, exact in float32; the bf16 tensors as they are): what 0.33 computes from that file. Both
    CLIPs are then told ComfyUI's dtype float32 (`DTYPE_FOR`), which ComfyUI would otherwise narrow to fp16."""
    if not _dequantized_reference(comfy, form):
        return path
    plain = {}
    for key, value in legacy.items():
        if key.endswith(".weight") and f"{key.removesuffix('.weight')}.scale_weight" in legacy:
            plain[key] = value.to(torch.float32) * legacy[f"{key.removesuffix('.weight')}.scale_weight"]
        elif key != "scaled_fp8" and not key.endswith((".scale_weight", ".scale_input")):
            plain[key] = value.to(torch.float32)
    reference = path.with_name(f"dequantized-{path.name}")
    save_file(plain, str(reference))
    return reference


def _comfy_own(comfy: Any, paths: list[Path], clip_type: str, options: dict[str, Any]) -> Any:
    """ComfyUI's own CLIPLoader / DualCLIPLoader path on the files: `comfy.sd.load_clip`."""
    return comfy.sd.load_clip(
        [str(p) for p in paths], clip_type=comfy.sd.CLIPType[clip_type.upper()], model_options=options
    )


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("form", FORMS)
def test_flux1_scaled_t5_on_the_workers_equals_comfyuis_own(
    request: pytest.FixtureRequest,
    comfy: Any,
    t5_legacy: Any,
    clip_l_file: Path,
    tmp_path: Path,
    form: str,
    world: int,
) -> None:
    """FLUX.1's DualCLIPLoader pair with t5xxl as ComfyUI's scaled fp8 file: the pack's CLIP (T5 sharded, its
    weights fp8 on the ranks) gives ComfyUI's own conditioning and pooled output within 1e-4."""
    from rocm_parallel.nodes.comfy_clip import build_clip

    t5 = _save(comfy, t5_legacy, form, tmp_path / "tiny-t5xxl_fp8_e4m3fn_scaled.safetensors")
    own = _comfy_own(
        comfy,
        [_reference(comfy, t5_legacy, form, t5), clip_l_file],
        "flux",
        {"t5xxl_model_config": TINY_T5, "model_config": dict(TINY_CLIP_L), **_dtype_for(comfy, form)},
    )
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ours = build_clip(
        group,
        [str(t5), str(clip_l_file)],
        "flux",
        comfy_options={"model_config": dict(TINY_CLIP_L), **_dtype_for(comfy, form)},
    )
    prompt = "a tiny red fox reading a newspaper on a park bench, morning light"
    expected, expected_pooled = own.encode_from_tokens(own.tokenize(prompt), return_pooled=True)
    got, pooled = ours.encode_from_tokens(ours.tokenize(prompt), return_pooled=True)
    assert got.shape == expected.shape == (1, 256, TINY_T5["d_model"])
    diff = (got - expected).abs().max()
    print(
        f"\nT5 {form} world {world} ComfyUI {COMFYUI_VERSION}: max |diff| {diff:.3g} of {expected.abs().max():.3g}"
    )
    assert diff < TOLERANCE
    assert (pooled - expected_pooled).abs().max() < TOLERANCE
    _assert_held_as_planned(ours, group, "text encoder")


def _assert_held_as_planned(clip: Any, group: ResidentGroup, slot: str) -> None:
    """The fp8 weights stayed fp8 on the ranks, and every rank holds the bytes the planner priced for it."""
    (encoder,) = [
        m.parallel_encoder for m in clip.cond_stage_model.modules() if hasattr(m, "parallel_encoder")
    ]
    held = [m for s in group.status() for m in s.models if m.slot == slot]
    assert len(held) == len(group.devices)
    for model in held:
        assert model.parameter_bytes == encoder.request.weight_bytes
        # every linear weight is split by tensor parallelism: each rank holds 1/world of the file's fp8 bytes
        fp8 = sum(
            t.shape[0] * t.shape[1] for n, t in encoder.info.tensors.items() if n in encoder.info.scales
        )
        assert model.parameter_bytes_by_dtype.get("float8_e4m3fn") == fp8 // len(group.devices)
    group.unload(slot)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("form", FORMS)
def test_qwen_image_scaled_encoder_on_the_workers_equals_comfyuis_own(
    request: pytest.FixtureRequest, comfy: Any, qwen_legacy: Any, tmp_path: Path, form: str, world: int
) -> None:
    """Qwen-Image's CLIPLoader with qwen_2.5_vl_7b as ComfyUI's scaled fp8 file, under CLIPTextEncode and
    TextEncodeQwenImageEdit: the pack's conditioning equals ComfyUI's own within 1e-4."""
    import comfy_extras.nodes_qwen as qwen_nodes

    import nodes
    from rocm_parallel.nodes.comfy_clip import build_clip

    path = _save(comfy, qwen_legacy, form, tmp_path / "tiny-qwen_2.5_vl_7b_fp8_scaled.safetensors")
    own = _comfy_own(
        comfy,
        [_reference(comfy, qwen_legacy, form, path)],
        "qwen_image",
        {"qwen25_7b_model_config": TINY_QWEN25, **_dtype_for(comfy, form)},
    )
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ours = build_clip(
        group, [str(path)], "qwen_image", slot="qwen scaled", comfy_options=_dtype_for(comfy, form)
    )
    prompt = 'a neon sign that reads "ROCm" above a rainy street, night'
    for encode in (
        lambda clip: nodes.CLIPTextEncode().encode(clip, prompt)[0][0],
        lambda clip: qwen_nodes.TextEncodeQwenImageEdit.execute(clip, prompt).args[0][0],
    ):
        (expected, _), (got, _) = encode(own), encode(ours)
        assert got.shape == expected.shape and got.shape[-1] == TINY_QWEN25["hidden_size"]
        diff = (got - expected).abs().max()
        print(
            f"\nQwen {form} world {world} ComfyUI {COMFYUI_VERSION}: max |diff| {diff:.3g} of {expected.abs().max():.3g}"
        )
        assert diff < TOLERANCE
    _assert_held_as_planned(ours, group, "qwen scaled")
