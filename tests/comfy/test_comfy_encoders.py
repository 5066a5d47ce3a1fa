"""The pack's text encoders against ComfyUI's own, in a real ComfyUI imported in this process.

The files are small random encoders built with **ComfyUI's own** text-encoder classes (its `T5`, its
`Llama2_`, its CLIP-L `CLIPTextModel`) and saved as ComfyUI's CLIPLoader reads them. The checks:

* FLUX.1's CLIP (T5-XXL + CLIP-L, DualCLIPLoader type 'flux'): the pack's CLIP (nodes/comfy_clip.py: ComfyUI's
  own CLIP with T5 sharded on CPU workers) gives ComfyUI's own CLIP's conditioning and pooled output within
  1e-4 for the same prompt, ComfyUI's tokenizer and its dtype choices on both sides;
* the language models (FLUX.2 [dev]'s Mistral Small 3, Qwen-Image's Qwen2.5-VL LM, FLUX.2 [klein]'s Qwen3):
  ComfyUI's own `Llama2_` with each one's config class against the pack's sharded encoder on the same token
  ids, left-padded, with FLUX.2's selection of intermediate layers (no final norm);
* Qwen-Image's CLIP (CLIPLoader type 'qwen_image': ComfyUI's Qwen2.5-VL tokenizer, templates and template cut)
  with the language model sharded, under CLIPTextEncode and TextEncodeQwenImageEdit, against ComfyUI's own;
  an Edit prompt with two reference images through ComfyUI's own vision tower (TextEncodeQwenImageEditPlus);
* a Qwen-Image-Edit graph end to end with the encoder and the diffusion model on one worker group, against
  ComfyUI's own CLIP and model;
* FLUX.2 [klein]'s CLIP (type 'flux2' with Qwen3 4B: ComfyUI's tokenizer, template and three stacked layers)
  with the language model sharded, against ComfyUI's own (0.33.0: 0.3.75 has no klein encoder);
* a FLUX.2 [klein] graph end to end with that encoder and a small FLUX.2 (ComfyUI's own classes, its ModelSave)
  on one worker group, against ComfyUI's own CLIP and model (0.33.0);
* FLUX.2 [dev]'s CLIP (type 'flux2' with Mistral Small 3's pruned FLUX.2 variant, tests/comfy/mistral_fixture.py:
  ComfyUI's tekken tokenizer read from the file, its template, layers 10, 20 and 30 stacked) with the language
  model sharded, against ComfyUI's own, and a FLUX.2 [dev] graph end to end (FluxGuidance, BasicGuider) with
  that encoder and a small FLUX.2 [dev] on one worker group (0.33.0: 0.3.75's Mistral tokenizer needs a
  transformers older than its venv's);
* the loader node under ComfyUI's own CLIPTextEncode and CLIPTextEncodeFlux.

At TP 2 and TP 4 (attention heads, key/value groups and MLP split, token embeddings split by vocabulary), and
for FLUX.1's CLIP, Qwen-Image's CLIP, FLUX.2's CLIPs and the language models also on one worker ("single":
the whole encoder on one rank, the pack's code path without a split).

    source /work/comfy/env.sh 0.33.0 <pack checkout>
    python -m pytest -q -s -m comfy tests/comfy/test_comfy_encoders.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from comfy_server import COMFYUI_PATH, COMFYUI_VERSION, TESTS_DIR
from safetensors.torch import save_file

from rocm_parallel.backend.encoders.api import ParallelEncoder
from rocm_parallel.backend.encoders.t5.kind import T5_XXL
from rocm_parallel.backend.resident.group import ResidentGroup
from rocm_parallel.backend.runtime.client import WorkerGroup

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1800)]

TOLERANCE = 1e-4
# ComfyUI detects T5-XXL by block 23's wi_1 of 10240 rows: 24 blocks of that MLP width, everything else tiny
TINY_T5 = {**T5_XXL, "d_model": 32, "d_kv": 8, "num_heads": 4, "num_layers": 24}
TINY_CLIP_L = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}
# The language models' shapes, small; their norms' eps, rotary theta and sections stay ComfyUI's defaults, which
# the pack's kinds must match (backend/encoders/llama/kind.py)
TINY_LM = {
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4,
}  # fmt: skip


@pytest.fixture(scope="module")
def comfy() -> Any:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    from make_comfy_references import import_comfy

    import_comfy(COMFYUI_PATH)
    import comfy.clip_model
    import comfy.ops
    import comfy.sd
    import comfy.text_encoders.llama
    import comfy.text_encoders.t5

    return comfy


@pytest.fixture(scope="module")
def group1() -> Iterator[WorkerGroup]:
    """One worker ("single"): the session's groups are 2 and 4 ranks (tests/conftest.py); closed here, and its
    process really gone."""
    with WorkerGroup(["cpu"], threads=1) as group:
        yield group
    assert not [p for p in group.pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def _randomize(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """ComfyUI's classes leave their weights uninitialised: random ones of a sane scale, as a state dict."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in module.state_dict().items():
        if "norm" in name:
            values = 1 + 0.1 * torch.randn(value.shape, generator=g)
        elif value.ndim == 2 and "embed" not in name and "shared" not in name and "relative" not in name:
            values = torch.randn(value.shape, generator=g) / value.shape[1] ** 0.5
        elif value.is_floating_point():
            values = torch.randn(value.shape, generator=g) * (0.05 if name.endswith("bias") else 1.0)
        else:
            values = value
        out[name] = values.to(value.dtype).contiguous()
    return out


def _save(comfy_module: torch.nn.Module, path: Path, seed: int) -> dict[str, torch.Tensor]:
    sd = _randomize(comfy_module, seed)
    save_file(sd, str(path))
    return sd


@pytest.fixture(scope="module")
def flux_files(comfy: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("text_encoders")
    ops = comfy.ops.manual_cast
    t5 = comfy.text_encoders.t5.T5(TINY_T5, torch.float32, "cpu", ops)
    with open(Path(COMFYUI_PATH) / "comfy" / "sd1_clip_config.json") as f:
        clip_l = comfy.clip_model.CLIPTextModel({**json.load(f), **TINY_CLIP_L}, torch.float32, "cpu", ops)
    return {
        "t5": _save_path(t5, folder / "tiny-t5xxl.safetensors", 1),
        "clip_l": _save_path(clip_l, folder / "tiny-clip-l.safetensors", 2),
    }


def _save_path(module: torch.nn.Module, path: Path, seed: int) -> Path:
    _save(module, path, seed)
    return path


def _comfy_clip(comfy: Any, paths: list[Path], clip_type: str, options: dict[str, Any]) -> Any:
    """ComfyUI's own CLIP for the files, as its CLIPLoader / DualCLIPLoader builds it."""
    import comfy.utils

    sds = [comfy.utils.load_torch_file(str(p), safe_load=True) for p in paths]
    return comfy.sd.load_text_encoder_state_dicts(
        sds,
        # as ComfyUI's CLIPLoader reads its type (0.3.75 lists 'flux2' without a CLIPType for it)
        clip_type=getattr(comfy.sd.CLIPType, clip_type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION),
        model_options=options,
    )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flux1_clip_on_the_workers_equals_comfyuis_own(
    request: pytest.FixtureRequest, comfy: Any, flux_files: dict[str, Path], world: int
) -> None:
    from rocm_parallel.nodes.comfy_clip import build_clip

    # ComfyUI sets the CLIP-L's config from "model_config" (plus the file's positions: long_clipl.py)
    options = {"t5xxl_model_config": TINY_T5, "model_config": dict(TINY_CLIP_L)}
    own = _comfy_clip(comfy, [flux_files["t5"], flux_files["clip_l"]], "flux", options)
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ours = build_clip(
        group, [str(flux_files["t5"]), str(flux_files["clip_l"])], "flux",
        comfy_options={"model_config": dict(TINY_CLIP_L)},
    )  # fmt: skip
    prompt = "a tiny red fox reading a newspaper on a park bench, morning light"
    expected, expected_pooled = own.encode_from_tokens(own.tokenize(prompt), return_pooled=True)
    got, pooled = ours.encode_from_tokens(ours.tokenize(prompt), return_pooled=True)
    assert got.shape == expected.shape == (1, 256, TINY_T5["d_model"])
    assert (got - expected).abs().max() < TOLERANCE
    assert (pooled - expected_pooled).abs().max() < TOLERANCE
    # the sharded T5 really ran on the workers: its slot is resident on every rank
    assert all(any(m.slot == "text encoder" for m in s.models) for s in group.status())
    group.unload("text encoder")


# ComfyUI's config class of each language model, and what its prompts carry besides token ids
LANGUAGE_MODELS = {
    "mistral3": "Mistral3Small24BConfig",  # FLUX.2 [dev]
    "qwen25": "Qwen25_7BVLI_Config",  # Qwen-Image: q/k/v biases, multimodal rotary sections
    "qwen3": "Qwen3_4BConfig",  # FLUX.2 [klein]: per-head q/k norms
}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", list(LANGUAGE_MODELS))
def test_language_models_on_the_workers_equal_comfyuis_own(
    request: pytest.FixtureRequest, comfy: Any, tmp_path: Path, kind: str, world: int
) -> None:
    """ComfyUI's own `Llama2_` with each encoder's config class against the pack's sharded encoder: FLUX.2's
    selection of intermediate layers without the final norm, a left-padded prompt, and for Qwen2.5-VL the
    3-row position ids of an image prompt (temporal, height, width sections of the rotary embedding)."""
    llama = comfy.text_encoders.llama
    # ComfyUI builds a Mistral Small 3 file of fewer than 40 layers as FLUX.2's pruned variant: no final norm
    config = getattr(llama, LANGUAGE_MODELS[kind])(
        **TINY_LM, **({"final_norm": False} if kind == "mistral3" else {})
    )
    model = llama.Llama2_(config, device="cpu", dtype=torch.float32, ops=comfy.ops.manual_cast)
    sd = _randomize(model, 3)
    model.load_state_dict(sd)
    path = tmp_path / f"tiny-{kind}.safetensors"
    save_file({f"model.{k}": v for k, v in sd.items()}, str(path))
    ids = torch.randint(0, TINY_LM["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # ComfyUI's Mistral tokenizer pads on the left
    positions = None
    if kind == "qwen25":  # an image's tokens: height and width rows differ from the temporal one
        positions = torch.stack([torch.arange(11), torch.arange(11) // 3, torch.arange(11) % 3])
    layers = [1, 2, 3]  # FLUX.2 takes three intermediate layers, without the final norm
    with torch.no_grad():
        expected, expected_mid = model(
            ids, mask, intermediate_output=layers, final_layer_norm_intermediate=False, dtype=torch.float32,
            position_ids=positions,
        )  # fmt: skip
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    encoder = ParallelEncoder(group, path, slot=f"te {kind}")
    assert encoder.kind.name == {"mistral3": "mistral3_24b", "qwen25": "qwen25_7b", "qwen3": "qwen3"}[kind]
    got = encoder.encode(
        ids, attention_mask=mask, intermediate_output=layers, final_layer_norm_intermediate=False,
        position_ids=positions,
    )  # fmt: skip
    assert got.intermediate is not None and got.intermediate.shape == expected_mid.shape
    # ComfyUI 0.3.75 masks with -inf: a left-padded prompt's padding rows see no key, and their NaN reaches
    # every row of that prompt through the masked keys' values (0 x NaN). Later ComfyUI masks with
    # finfo.min / 4, as the pack does; there every prompt is compared, on 0.3.75 the unpadded one only.
    compared = expected.flatten(1).isfinite().all(1)
    assert compared[0] and (compared.all() or COMFYUI_VERSION == "0.3.75")
    assert got.out.isfinite().all()
    assert (got.out[compared] - expected[compared]).abs().max() < TOLERANCE
    assert (got.intermediate[compared] - expected_mid[compared]).abs().max() < TOLERANCE
    group.unload(f"te {kind}")


def test_the_loader_node_gives_comfyuis_own_conditioning_to_comfyuis_text_nodes(
    comfy: Any, flux_files: dict[str, Path], tmp_path: Path
) -> None:
    """The ROCm Parallel Text Encoder Loader node, as ComfyUI's executor calls it, under ComfyUI's own
    CLIPTextEncode and CLIPTextEncodeFlux: the same CONDITIONING as ComfyUI's own CLIP. The CLIP-L beside
    T5 is full size here (ComfyUI's own class, random weights in bf16): the node passes ComfyUI no config."""
    import comfy_extras.nodes_flux as flux_nodes
    import folder_paths

    import nodes
    from rocm_parallel.nodes.encoder_node import RocmParallelTextEncoderLoader
    from rocm_parallel.nodes.registry import REGISTRY

    with open(Path(COMFYUI_PATH) / "comfy" / "sd1_clip_config.json") as f:
        config = json.load(f)
    clip_l = comfy.clip_model.CLIPTextModel(config, torch.bfloat16, "cpu", comfy.ops.manual_cast)
    folder = tmp_path / "text_encoders"
    folder.mkdir()
    (folder / "t5.safetensors").symlink_to(flux_files["t5"])
    _save(clip_l, folder / "clip_l.safetensors", 5)
    del clip_l
    folder_paths.add_model_folder_path("text_encoders", str(folder))
    own = _comfy_clip(
        comfy,
        [folder / "t5.safetensors", folder / "clip_l.safetensors"],
        "flux",
        {"t5xxl_model_config": TINY_T5},
    )
    try:
        (ours,) = RocmParallelTextEncoderLoader().load(
            "t5.safetensors", "clip_l.safetensors", "flux", "cpu x2", unique_id="12"
        )
        prompt = "a lighthouse on a cliff at dusk, oil painting"
        for encode in (
            lambda clip: nodes.CLIPTextEncode().encode(clip, prompt)[0],
            lambda clip: flux_nodes.CLIPTextEncodeFlux.execute(clip, "a lighthouse", prompt, 3.5).args[0],
        ):
            (expected, expected_extra), (got, extra) = encode(own)[0], encode(ours)[0]
            assert got.shape == expected.shape == (1, 256, TINY_T5["d_model"])
            assert (got - expected).abs().max() < TOLERANCE
            assert (extra["pooled_output"] - expected_extra["pooled_output"]).abs().max() < TOLERANCE
            assert extra.get("guidance") == expected_extra.get("guidance")
        held = [m.slot for s in REGISTRY.current.status() for m in s.models]
        assert held == ["text encoder 12", "text encoder 12"]
    finally:
        REGISTRY.close()


# Qwen-Image's CLIP as ComfyUI detects it (comfy/sd.py detect_te_model): Qwen2.5-VL 7B by its k_proj bias of
# 512 = 4 key/value heads x 128, at any width; ComfyUI's own tokenizer and template, so the whole vocabulary
TINY_QWEN25 = {**TINY_LM, "vocab_size": 152064}


@pytest.fixture(scope="module")
def qwen_file(comfy: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen2.5-VL language model built with ComfyUI's own `Llama2_` and `Qwen25_7BVLI_Config`, saved as
    ComfyUI's qwen_2.5_vl_7b file keys it (no vision tower: ComfyUI's stays uninitialised, and a text prompt
    never reaches it)."""
    llama = comfy.text_encoders.llama
    model = llama.Llama2_(
        llama.Qwen25_7BVLI_Config(**TINY_QWEN25), device="cpu", dtype=torch.float32, ops=comfy.ops.manual_cast
    )
    path = tmp_path_factory.mktemp("qwen") / "tiny-qwen25-vl.safetensors"
    save_file({f"model.{k}": v for k, v in _randomize(model, 6).items()}, str(path))
    return path


def _qwen_conditioning(clip: Any, prompt: str) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """What Qwen-Image graphs encode with: CLIPTextEncode, and TextEncodeQwenImageEdit without a reference
    image (its own template: ComfyUI drops the template's tokens from the output)."""
    import comfy_extras.nodes_qwen as qwen_nodes

    import nodes

    return [
        nodes.CLIPTextEncode().encode(clip, prompt)[0][0],
        qwen_nodes.TextEncodeQwenImageEdit.execute(clip, prompt).args[0][0],
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_qwen_image_clip_on_the_workers_equals_comfyuis_own(
    request: pytest.FixtureRequest, comfy: Any, qwen_file: Path, world: int
) -> None:
    """ComfyUI's own CLIP for type 'qwen_image' (its Qwen2.5-VL tokenizer and prompt templates, its cut of the
    template's tokens) with the language model sharded on the workers, under ComfyUI's own text nodes: the
    conditioning and its attention mask equal ComfyUI's own CLIP's."""
    from rocm_parallel.nodes.comfy_clip import build_clip

    own = _comfy_clip(comfy, [qwen_file], "qwen_image", {"qwen25_7b_model_config": TINY_QWEN25})
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ours = build_clip(group, [str(qwen_file)], "qwen_image", slot="qwen te")
    assert type(own.cond_stage_model).__name__ == type(ours.cond_stage_model).__name__
    prompt = 'a neon sign that reads "ROCm" above a rainy street, night'
    for (expected, expected_extra), (got, extra) in zip(
        _qwen_conditioning(own, prompt), _qwen_conditioning(ours, prompt), strict=True
    ):
        assert got.shape == expected.shape and got.shape[-1] == TINY_QWEN25["hidden_size"]
        assert (got - expected).abs().max() < TOLERANCE
        assert sorted(extra) == sorted(expected_extra)
        for key, value in expected_extra.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(extra[key], value), key
    assert all(any(m.slot == "qwen te" for m in s.models) for s in group.status())
    group.unload("qwen te")


@pytest.fixture(scope="module")
def qwen_vl_file(comfy: Any, qwen_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small language model with ComfyUI's own Qwen2.5-VL vision tower beside it (`visual.*`, full size:
    ComfyUI's class takes no config; random bf16 weights), as Comfy-Org's qwen_2.5_vl_7b file holds both."""
    from comfy.text_encoders import qwen_vl
    from safetensors.torch import load_file

    tower = qwen_vl.Qwen2VLVisionTransformer(
        hidden_size=1280, output_hidden_size=TINY_QWEN25["hidden_size"], device="cpu", dtype=torch.float32,
        ops=comfy.ops.manual_cast,
    )  # fmt: skip
    sd = {f"visual.{k}": v.to(torch.bfloat16) for k, v in _randomize(tower, 7).items()}
    del tower
    path = tmp_path_factory.mktemp("qwen_vl") / "tiny-qwen25-vl-vision.safetensors"
    save_file({**load_file(str(qwen_file)), **sd}, str(path))
    return path


def test_a_qwen_image_edit_prompt_with_two_reference_images_equals_comfyuis_own(
    group2: Any, comfy: Any, qwen_vl_file: Path
) -> None:
    """TextEncodeQwenImageEditPlus with two reference images: ComfyUI's own vision tower (kept in ComfyUI's
    process, filled from the file by ComfyUI's load_sd) turns each into embedding rows that ComfyUI splices into
    the prompt, with 3-row rotary positions for them; the pack's workers get those rows as they are and the
    token ids of the rest. The conditioning equals ComfyUI's own CLIP's."""
    import comfy_extras.nodes_qwen as qwen_nodes

    from rocm_parallel.nodes.comfy_clip import build_clip

    own = _comfy_clip(comfy, [qwen_vl_file], "qwen_image", {"qwen25_7b_model_config": TINY_QWEN25})
    group = ResidentGroup(group=group2)
    ours = build_clip(group, [str(qwen_vl_file)], "qwen_image", slot="qwen vl")
    g = torch.Generator().manual_seed(8)
    images = [torch.rand(1, 48, 64, 3, generator=g), torch.rand(1, 72, 40, 3, generator=g)]
    prompt = "put the cat from picture 1 on the sofa from picture 2"
    edit = qwen_nodes.TextEncodeQwenImageEditPlus.execute
    (expected, _), (got, _) = (edit(clip, prompt, None, *images).args[0][0] for clip in (own, ours))
    text_only = edit(own, prompt).args[0][0][0]
    assert got.shape == expected.shape and got.shape[1] > text_only.shape[1] + 100  # two images' tokens
    assert (got - expected).abs().max() < TOLERANCE
    group.unload("qwen vl")


def _sample_flux2(modules: dict[str, Any], guider: Any, seed: int) -> torch.Tensor:
    """ComfyUI's FLUX.2 template sampling of a 64 x 48 latent: SamplerCustomAdvanced, euler, Flux2Scheduler
    3 steps, EmptyFlux2LatentImage."""
    custom, flux_nodes = modules["custom"], modules["flux_nodes"]
    with torch.no_grad():
        out = custom.SamplerCustomAdvanced().sample(
            custom.RandomNoise().get_noise(seed)[0], guider, custom.KSamplerSelect().get_sampler("euler")[0],
            flux_nodes.Flux2Scheduler.execute(3, 64, 48)[0], flux_nodes.EmptyFlux2LatentImage.execute(64, 48, 1)[0],
        )[0]  # fmt: skip
    return out["samples"].to(torch.float32)


def _sample_on_the_pack(
    checkpoint: Path, encoder: Path, clip_type: str, sample: Callable[[Any, Any], torch.Tensor]
) -> torch.Tensor:
    """`sample(clip, model)` with the pack's CLIP and the ROCm Parallel Model (TP 2) on one worker group: both
    resident side by side, every model call on the workers."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.diffusion.api import ParallelModel
    from rocm_parallel.nodes import comfy_model
    from rocm_parallel.nodes.comfy_clip import build_clip
    from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
    from rocm_parallel.nodes.registry import Registry

    registry = Registry(factory=lambda devices: ParallelModel(list(devices), threads=1))
    try:
        handle = ParallelHandle(str(checkpoint), checkpoint.name, ("cpu", "cpu"), "float32", ())
        model = comfy_model.parallel_model(handle, LayoutRequest(ParallelLayout(tp=2)), registry)
        clip = build_clip(registry.group_for(("cpu", "cpu")), [str(encoder)], clip_type, slot="graph te")
        got = sample(clip, model)
        held = sorted({m.slot for s in registry.current.status() for m in s.models})
        assert held == ["default", "graph te"]  # the model and the encoder resident side by side
        assert model.model.diffusion_model.runner.calls >= 3
        return got
    finally:
        registry.close()


def test_a_qwen_image_edit_graph_with_encoder_and_model_on_the_pack_equals_comfyuis_own(
    comfy: Any, qwen_vl_file: Path, tmp_path: Path
) -> None:
    """The Qwen-Image-Edit-2511 graph (0.3.75: Qwen-Image-Edit's) end to end with both the text encoder and the diffusion model on one
    worker group (TP 2): TextEncodeQwenImageEditPlus with a reference image (and its ReferenceLatent) for the
    positive prompt, TextEncodeQwenImageEdit for the negative, ModelSamplingAuraFlow 3.1, KSampler at cfg 2.5.
    The pack's CLIP and the ROCm Parallel Model against ComfyUI's own CLIP and ComfyUI's own QwenImage
    (its loader, float32) on the same files: the sampled latent within 1e-4."""
    import comfy_extras.nodes_model_advanced as advanced
    import comfy_extras.nodes_qwen as qwen_nodes
    import comfy_extras.nodes_sd3 as sd3
    from make_comfy_references import import_comfy
    from make_qwen_references import load_in_comfy

    from rocm_parallel.backend.checkpoint import save_checkpoint
    from rocm_parallel.backend.qwen_image.model import build_qwen_image
    from rocm_parallel.testing.models import tiny_qwen_image_config

    modules = import_comfy(COMFYUI_PATH)
    # Edit-2511's model; on 0.3.75, which lacks its reference placement (index_timestep_zero), the Edit model's
    edit_2511 = not COMFYUI_VERSION.startswith("0.3.")
    config = tiny_qwen_image_config(text_dim=TINY_QWEN25["hidden_size"], zero_cond_t=edit_2511)
    checkpoint = save_checkpoint(
        build_qwen_image(config, seed=97), tmp_path / "tiny-qwen-edit.safetensors", prefix=True
    )
    g = torch.Generator().manual_seed(9)
    image = torch.rand(1, 56, 40, 3, generator=g)
    reference = {"samples": torch.randn(1, 16, 1, 8, 8, generator=g)}  # VAEEncode's latent of the image

    def sample(clip: Any, model: Any) -> torch.Tensor:
        positive = qwen_nodes.TextEncodeQwenImageEditPlus.execute(clip, "make it night", None, image).args[0]
        positive = modules["edit"].ReferenceLatent.execute(positive, reference)[0]
        negative = qwen_nodes.TextEncodeQwenImageEdit.execute(clip, "").args[0]
        model = advanced.ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]
        latent = sd3.EmptySD3LatentImage.execute(64, 64, 1)[0]
        with torch.no_grad():
            out = modules["nodes"].common_ksampler(
                model, 5, 3, 2.5, "euler", "simple", positive, negative, latent
            )[0]  # fmt: skip
        return out["samples"].to(torch.float32)

    own_clip = _comfy_clip(comfy, [qwen_vl_file], "qwen_image", {"qwen25_7b_model_config": TINY_QWEN25})
    expected = sample(own_clip, load_in_comfy(modules, checkpoint, config))
    del own_clip
    got = _sample_on_the_pack(Path(checkpoint), qwen_vl_file, "qwen_image", sample)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < TOLERANCE, (got - expected).abs().max()


# FLUX.2 [klein]'s encoder as ComfyUI detects it: Qwen3 4B by its q/k norms and residual width of 2560, and its
# CLIP reads layers 9, 18 and 27, so 28 layers; everything else small (4 heads, 2 key/value groups, MLP 96)
KLEIN_QWEN3 = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 96, "num_hidden_layers": 28,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def _klein_available(comfy: Any) -> None:
    if not hasattr(comfy.sd.CLIPType, "FLUX2"):  # 0.3.75 reads a Qwen3 4B file as Z-Image's encoder only
        pytest.skip(f"ComfyUI {COMFYUI_VERSION} has no FLUX.2 [klein] text encoder (CLIP type 'flux2')")


@pytest.fixture(scope="module")
def klein_file(comfy: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 4B as ComfyUI detects it (KLEIN_QWEN3), built with ComfyUI's own `Llama2_` and `Qwen3_4BConfig`,
    saved as Comfy-Org's qwen_3_4b file keys it."""
    _klein_available(comfy)
    llama = comfy.text_encoders.llama
    model = llama.Llama2_(
        llama.Qwen3_4BConfig(**KLEIN_QWEN3), device="cpu", dtype=torch.float32, ops=comfy.ops.manual_cast
    )
    path = tmp_path_factory.mktemp("klein") / "tiny-qwen3-4b.safetensors"
    save_file({f"model.{k}": v for k, v in _randomize(model, 10).items()}, str(path))
    return path


@pytest.mark.parametrize("world", [1, 2])  # 2 key/value groups: TP 4 does not divide them
def test_flux2_klein_clip_on_the_workers_equals_comfyuis_own(
    request: pytest.FixtureRequest, comfy: Any, klein_file: Path, world: int
) -> None:
    """ComfyUI's own CLIP for type 'flux2' with a Qwen3 4B file (FLUX.2 [klein]: its Qwen3 tokenizer and chat
    template, padding to 512 tokens, three intermediate layers stacked, no final norm) with the language model
    sharded on the workers (or whole on one), under CLIPTextEncode: the conditioning equals ComfyUI's own CLIP's."""
    import nodes
    from rocm_parallel.nodes.comfy_clip import build_clip

    own = _comfy_clip(comfy, [klein_file], "flux2", {"qwen3_4b_model_config": KLEIN_QWEN3})
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ours = build_clip(group, [str(klein_file)], "flux2", slot="klein te")
    assert type(ours.cond_stage_model).__name__ == type(own.cond_stage_model).__name__
    prompt = "a paper boat on a puddle, macro photograph"
    (expected, _), (got, _) = (nodes.CLIPTextEncode().encode(clip, prompt)[0][0] for clip in (own, ours))
    assert got.shape == expected.shape == (1, 512, 3 * KLEIN_QWEN3["hidden_size"])
    assert (got - expected).abs().max() < TOLERANCE
    group.unload("klein te")


def test_a_flux2_klein_graph_with_encoder_and_model_on_the_pack_equals_comfyuis_own(
    comfy: Any, klein_file: Path, tmp_path: Path
) -> None:
    """FLUX.2 [klein]'s graph end to end with both the text encoder and the diffusion model on one worker group
    (TP 2): CLIPTextEncode for the positive and the (empty) negative prompt, CFGGuider at cfg 2.5,
    EmptyFlux2LatentImage, Flux2Scheduler, SamplerCustomAdvanced (euler). The model is a small FLUX.2 built with
    ComfyUI's own classes for the encoder's width (3 x 2560) and written by ComfyUI's own ModelSave
    (tests/tools/comfy_models.py). The pack's CLIP and the ROCm Parallel Model against ComfyUI's own CLIP and
    ComfyUI's own Flux2 (its UNETLoader's loader, float32) on the same files: the sampled latent within 1e-4."""
    import comfy_models
    from make_comfy_references import import_comfy

    modules, tool = import_comfy(COMFYUI_PATH), comfy_models.import_comfy(COMFYUI_PATH)
    # klein's text width: three of Qwen3 4B's layers stacked (3 x 2560); no guidance embedding
    spec = {"family": "flux2", "in": 128, "text": 3 * KLEIN_QWEN3["hidden_size"], "guidance": False, "seed": 11}  # fmt: skip
    checkpoint = tmp_path / "tiny-flux2-klein.safetensors"
    with torch.no_grad():
        comfy_models.model_save(tool, comfy_models.build(tool, spec, torch.float32), checkpoint)
    custom = modules["custom"]

    def sample(clip: Any, model: Any) -> torch.Tensor:
        positive, negative = (
            modules["nodes"].CLIPTextEncode().encode(clip, text)[0]
            for text in ("a paper boat on a puddle, macro photograph", "")
        )
        guider = custom.CFGGuider().get_guider(model, positive, negative, 2.5)[0]
        return _sample_flux2(modules, guider, seed=5)

    own_clip = _comfy_clip(comfy, [klein_file], "flux2", {"qwen3_4b_model_config": KLEIN_QWEN3})
    expected = sample(own_clip, comfy_models.load_in_comfy(tool, checkpoint, spec))
    del own_clip
    got = _sample_on_the_pack(checkpoint, klein_file, "flux2", sample)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    print(
        f"\nFLUX.2 [klein] graph: max |pack - ComfyUI| {diff:.2e} of max |latent| {expected.abs().max():.2f}"
    )
    assert diff < TOLERANCE


def _flux2_dev_available(comfy: Any) -> None:
    """ComfyUI 0.3.75 builds Mistral's tokenizer with transformers' `MistralConverter(vocab=...,
    additional_special_tokens=...)`, which transformers 5 replaced by `MistralConverter(vocab_file)`: with its
    venv's transformers it cannot read any FLUX.2 [dev] text encoder (its own CLIPLoader fails the same way)."""
    import inspect

    import comfy.text_encoders.flux as flux

    if hasattr(flux, "from_tekken_json"):  # 0.33.0: ComfyUI's own BPE reads the tekken JSON
        return
    from transformers.integrations.mistral import MistralConverter

    if "vocab" not in inspect.signature(MistralConverter).parameters:
        import transformers

        pytest.skip(
            f"ComfyUI {COMFYUI_VERSION} reads Mistral's tokenizer through transformers' MistralConverter(vocab=...), "
            f"which transformers {transformers.__version__} (this ComfyUI's venv) no longer takes: put a "
            "transformers 4.x first on PYTHONPATH to run these (docs/testing.md)"
        )


FLUX2_DEV_PROMPT = 'a red fox reading a newspaper in a snowy forest, the headline reads "FLUX.2"'


@pytest.fixture(scope="module")
def mistral_file(comfy: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.2 [dev]'s text encoder as ComfyUI detects its pruned variant, with a tekken tokenizer in the file
    (tests/comfy/mistral_fixture.py); ComfyUI's own Mistral3Small24B class, ~0.7 GB."""
    from mistral_fixture import save_pruned_mistral

    _flux2_dev_available(comfy)
    path = tmp_path_factory.mktemp("mistral") / "tiny-mistral3-flux2-pruned.safetensors"
    return save_pruned_mistral(comfy, path, [FLUX2_DEV_PROMPT], seed=13)


def _own_flux2_dev_clip(comfy: Any, path: Path) -> Any:
    from mistral_fixture import MISTRAL3_PRUNED

    return _comfy_clip(comfy, [path], "flux2", {"mistral3_24b_model_config": MISTRAL3_PRUNED})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flux2_dev_clip_on_the_workers_equals_comfyuis_own(
    request: pytest.FixtureRequest, comfy: Any, mistral_file: Path, world: int
) -> None:
    """ComfyUI's own CLIP for type 'flux2' with FLUX.2 [dev]'s pruned Mistral Small 3 (ComfyUI's tekken tokenizer
    from the file, FLUX.2's system-prompt template, left padding, layers 10, 20 and 30 stacked, no final norm)
    with the language model sharded on the workers (or whole on one), under CLIPTextEncode: the conditioning
    equals ComfyUI's own CLIP's."""
    import nodes
    from rocm_parallel.nodes.comfy_clip import build_clip

    own = _own_flux2_dev_clip(comfy, mistral_file)
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ours = build_clip(group, [str(mistral_file)], "flux2", slot="dev te")
    assert type(ours.cond_stage_model).__name__ == type(own.cond_stage_model).__name__ == "Flux2TEModel_"
    tokens = own.tokenize(FLUX2_DEV_PROMPT)["mistral3_24b"][0]
    # ComfyUI's tokenizer really read the file's vocabulary: <s>, [SYSTEM_PROMPT] ... [INST] prompt [/INST],
    # the words merged (far fewer tokens than bytes)
    assert [t[0] for t in tokens[:2]] == [1, 17] and tokens[-1][0] == 4
    assert len(tokens) < len(FLUX2_DEV_PROMPT) // 2 + 40
    (expected, _), (got, _) = (
        nodes.CLIPTextEncode().encode(clip, FLUX2_DEV_PROMPT)[0][0] for clip in (own, ours)
    )
    assert got.shape == expected.shape == (1, len(tokens), 3 * 5120)
    diff = (got - expected).abs().max().item()
    print(
        f"\nFLUX.2 [dev] CLIP at {world} rank(s): max |pack - ComfyUI| {diff:.2e} of {expected.abs().max():.1f}"
    )
    assert diff < TOLERANCE
    group.unload("dev te")


def test_a_flux2_dev_graph_with_encoder_and_model_on_the_pack_equals_comfyuis_own(
    comfy: Any, mistral_file: Path, tmp_path: Path
) -> None:
    """FLUX.2 [dev]'s graph (its template's nodes) end to end with both the text encoder and the diffusion model
    on one worker group (TP 2): CLIPTextEncode, FluxGuidance 4.0, BasicGuider, EmptyFlux2LatentImage,
    Flux2Scheduler, SamplerCustomAdvanced (euler). The model is a small FLUX.2 [dev] (guidance embedding) built
    with ComfyUI's own classes for Mistral's text width (3 x 5120 = 15360) and written by ComfyUI's own ModelSave.
    The pack's CLIP and the ROCm Parallel Model against ComfyUI's own CLIP and ComfyUI's own Flux2 on the same
    files: the sampled latent within 1e-4."""
    import comfy_models
    from make_comfy_references import import_comfy

    modules, tool = import_comfy(COMFYUI_PATH), comfy_models.import_comfy(COMFYUI_PATH)
    spec = {**comfy_models.MODELS["flux2-dev"], "text": 3 * 5120, "seed": 14}
    checkpoint = tmp_path / "tiny-flux2-dev.safetensors"
    with torch.no_grad():
        comfy_models.model_save(tool, comfy_models.build(tool, spec, torch.float32), checkpoint)
    custom, flux_nodes = modules["custom"], modules["flux_nodes"]

    def sample(clip: Any, model: Any) -> torch.Tensor:
        positive = modules["nodes"].CLIPTextEncode().encode(clip, FLUX2_DEV_PROMPT)[0]
        positive = flux_nodes.FluxGuidance.execute(positive, 4.0)[0]
        guider = custom.BasicGuider().get_guider(model, positive)[0]
        return _sample_flux2(modules, guider, seed=6)

    own_clip = _own_flux2_dev_clip(comfy, mistral_file)
    expected = sample(own_clip, comfy_models.load_in_comfy(tool, checkpoint, spec))
    del own_clip
    got = _sample_on_the_pack(checkpoint, mistral_file, "flux2", sample)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    print(f"\nFLUX.2 [dev] graph: max |pack - ComfyUI| {diff:.2e} of max |latent| {expected.abs().max():.2f}")
    assert diff < TOLERANCE
