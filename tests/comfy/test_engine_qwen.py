"""The model engine on Qwen-Image (backend/models/plans/qwen_image.py) against ComfyUI's own model, every layout.

Tiny Qwen-Image and Qwen-Image-Edit-2511 files are built and saved by ComfyUI's own classes and ModelSave
(tests/tools/comfy_models.py); ComfyUI's own loader loads each in this process and its
`diffusion_model.forward` is the reference. The pack loads the same file with `engine='comfy'` on CPU
workers. Both sides' detection is told the small heads, head width, text width and RoPE axes (ComfyUI's class
defaults hold the released ones), nothing else.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<stand-ins>:<pack parent> \\
        python -m pytest -q tests/comfy/test_engine_qwen.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH
from test_engine import (
    LAYOUTS,
    assert_bytes_not_above_the_diffusers_engines,
    comfy_forward,
    import_comfy,
    saved_models,
    tiny,
)

from rocm_parallel.backend.api import ParallelModel

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOL = 1e-5  # float32 on gloo (the bar is 1e-4); measured up to 1e-6
# case -> (file, reference latents): Qwen-Image (text to image); Qwen-Image-Edit (the same file and class,
# its default ref method 'index': reference tokens appended to the image stream); Edit-2511 (its file's
# marker picks 'index_timestep_zero': the reference tokens modulated at timestep 0 from a token index on)
CASES = {
    "qwen-image": ("qwen-image", False),
    "qwen-image-edit": ("qwen-image", True),
    "qwen-image-edit-2511": ("qwen-image-edit-2511", True),
}
UNMASKED = ("0.3.75",)  # ComfyUI versions whose Qwen-Image ignores the text mask


@pytest.fixture(scope="module")
def comfy() -> dict[str, Any]:
    return import_comfy()


@pytest.fixture(scope="module")
def files(comfy: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """name -> (a file ComfyUI's ModelSave wrote, ComfyUI's own diffusion model loaded from it)."""
    return saved_models(comfy, tmp_path_factory.mktemp("engine-qwen"), ("qwen-image", "qwen-image-edit-2511"))


@pytest.fixture(scope="module")
def groups(comfy: dict[str, Any]) -> Iterator[dict[int, ParallelModel]]:
    made = {n: ParallelModel(["cpu"] * n, threads=1) for n in (2, 4)}
    yield made
    for model in made.values():
        model.close()


def call_inputs(name: str, references: bool, seed: int = 0) -> dict[str, Any]:
    """A CFG-like call: two latents [B, C, T=1, H, W] at 10 x 14 (35 image tokens: uneven over 2 ranks), 7
    text tokens, the second prompt padded (ComfyUI's text mask, 1 per real token: its last 2 dropped); with
    `references`, one reference latent at 6 x 8 (12 more image tokens)."""
    g = torch.Generator().manual_seed(seed)
    channels, text = tiny(name)["in"] // 4, tiny(name)["text"]
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    inputs = {
        "x": torch.randn(2, channels, 1, 10, 14, generator=g),
        "timestep": torch.tensor([0.7, 0.7]),
        "context": torch.randn(2, 7, text, generator=g),
        "attention_mask": mask,
    }
    if references:
        inputs["ref_latents"] = [torch.randn(2, channels, 1, 6, 8, generator=g)]
    return inputs


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda s: s.replace(" ", ""))
@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_equals_comfyuis_own_qwen_image(comfy, files, groups, case, layout) -> None:
    import comfy_models

    name, references = CASES[case]
    path, reference = files[name]
    inputs = call_inputs(name, references)
    expected = comfy_forward(reference, inputs)
    # the text mask is not a no-op in this call: the padded prompt's output moves without it (0.3.75's
    # Qwen-Image takes the mask and attends unmasked: its Attention passes `attention_mask`, None, on)
    unmasked = comfy_forward(reference, {**inputs, "attention_mask": None})
    moved = (unmasked[1] - expected[1]).abs().max().item()
    assert moved == 0.0 if comfy["version"] in UNMASKED else moved > 1e-3
    groups[LAYOUTS[layout]].load(
        path, layout=layout, dtype="float32", engine="comfy", comfyui=COMFYUI_PATH,
        detection=comfy_models.widths(tiny(name)),
    )  # fmt: skip
    out = groups[LAYOUTS[layout]].forward(**inputs)
    assert out.shape == expected.shape
    diff = (out - expected).abs().max().item()
    print(f"{case} {layout}: max |diff| {diff:.2e}")
    assert diff <= TOL


def test_compiled_blocks_on_the_engine_equal_comfyuis_own_qwen_image(files, groups) -> None:
    """compile='aot_eager' on the plan's blocks (ComfyUI's QwenImageTransformerBlock) with the block split's
    hooks on them: ring 2, Edit-2511's reference latent and timestep-zero index in the call."""
    import comfy_models

    path, reference = files["qwen-image-edit-2511"]
    inputs = call_inputs("qwen-image-edit-2511", references=True)
    group = groups[2]
    group.load(
        path, layout="ring 2", dtype="float32", engine="comfy", comfyui=COMFYUI_PATH,
        detection=comfy_models.widths(tiny("qwen-image-edit-2511")), compile="aot_eager",
    )  # fmt: skip
    diff = (group.forward(**inputs) - comfy_forward(reference, inputs)).abs().max().item()
    print(f"compiled: max |diff| {diff:.2e}; {group.compiles[-1:]}")
    assert group.compiles and "compiled the repeated blocks" in group.compiles[0]
    assert diff <= TOL


@pytest.mark.parametrize("layout", ["tp 2", "ring 2 x tp 2"], ids=lambda s: s.replace(" ", ""))
def test_loras_on_the_engine_equal_comfyuis_loras_on_qwen_image(
    comfy, files, groups, layout, tmp_path
) -> None:
    """Every adapter kind ComfyUI reads (LoRA, LoHa, LoKr, full difference, DoRA, bias differences) under
    ComfyUI's `diffusion_model.` keys, patched by ComfyUI's own code on ComfyUI's model and on each rank's
    slices."""
    import comfy_models

    from rocm_parallel.backend.checkpoint import inspect_checkpoint
    from rocm_parallel.testing.writers import LORA_KINDS, write_random_lora

    path, plain = files["qwen-image"]
    lora = write_random_lora(
        tmp_path / "qwen-kinds.safetensors", inspect_checkpoint(path).config, "bfl", kind=list(LORA_KINDS),
        dora=[None, "output", "input"], bias=True, seed=1, relative=0.3, family="qwen_image",
    )  # fmt: skip
    patcher = comfy_models.load_in_comfy(comfy, Path(path), tiny("qwen-image"))
    lora_sd = comfy["utils"].load_torch_file(lora, safe_load=True)
    patcher = comfy["sd"].load_lora_for_models(patcher, None, lora_sd, 0.8, 0)[0]
    patcher.patch_model()
    inputs = call_inputs("qwen-image", references=False)
    expected = comfy_forward(patcher.model.diffusion_model, inputs)
    reports = groups[LAYOUTS[layout]].load(
        path, layout=layout, dtype="float32", engine="comfy", comfyui=COMFYUI_PATH,
        detection=comfy_models.widths(tiny("qwen-image")), loras=[(lora, 0.8)],
    )  # fmt: skip
    assert reports[0].lora_tensors > 0
    diff = (groups[LAYOUTS[layout]].forward(**inputs) - expected).abs().max().item()
    away = (expected - comfy_forward(plain, inputs)).abs().max().item()
    print(f"LoRAs {layout}: max |diff| {diff:.2e} (the LoRAs move the output by {away:.2e})")
    assert away > 1e-2
    assert diff <= TOL


# the released Qwen-Image's header shapes (tests/tools/comfy_models.py header_like): 60 blocks of 24 x 128
RELEASED = {"family": "qwen_image", "in": 64, "text": 3584, "heads": 24, "head_dim": 128, "blocks": 60}


def test_bytes_per_rank_at_the_released_config_are_not_above_the_diffusers_engines(comfy) -> None:
    """ComfyUI's own class as its detection configures it from the released header (its class defaults hold
    the released widths), the plan applied on the meta device: bytes per rank at TP 1, 2 and 4, bf16 and fp8,
    not above the planner's count of the diffusers engine's shards."""
    assert_bytes_not_above_the_diffusers_engines(comfy, "qwen_image", "qwen-image", RELEASED)
