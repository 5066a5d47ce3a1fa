"""Model families (issue 13): the registry, and FLUX.1 Kontext and Fill through the forward service.

Kontext's reference latents become extra image tokens with their own ids and Fill's masked image and mask
arrive as extra channels of x; both must match a real ComfyUI's own Flux.forward (calls recorded by
tests/tools/make_comfy_references.py) and the same call in one process in every layout, including token
counts that do not divide by the number of ranks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_parallel_sampling import LAYOUTS
from test_sampling import flux_model, reference

from rocm_parallel.backend import family as registry
from rocm_parallel.backend.checkpoint import diffusers_to_bfl, inspect_checkpoint, save_checkpoint
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.flux.family import FLUX1
from rocm_parallel.backend.flux.forward import flux_call, patch_ids, reference_placements
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.flux.sampling import diffusers_model_fn
from rocm_parallel.backend.flux.tp import FLUX_TP_PLAN
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.models import tiny_flux_config

TOL = 1e-5  # parity with the same call in one process, and with ComfyUI's own Flux.forward; float32


# --------------------------------------------------------------------------------------------------
# The registry


def test_flux1_is_a_registered_family_with_the_tp_plan_as_data() -> None:
    assert registry.get_family("flux1") is FLUX1
    assert FLUX1 in registry.families()
    assert FLUX1.tp.plan is FLUX_TP_PLAN and FLUX1.diffusers_class == "FluxTransformer2DModel"
    assert registry.family_for_class("FluxTransformer2DModel") is FLUX1
    assert registry.family_for_class("UNet2DConditionModel") is None


def test_an_unknown_family_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        registry.get_family("sd3")
    assert str(err.value) == "model family 'sd3' is not known; known families: " + ", ".join(
        f.name for f in registry.families()
    )


def test_a_family_name_registers_once() -> None:
    other = registry.ModelFamily(**{**FLUX1.__dict__, "title": "another FLUX.1"})
    with pytest.raises(
        ValueError, match=r"^model family 'flux1' is registered twice \(FLUX.1, another FLUX.1\)$"
    ):
        registry.register(other)
    assert registry.register(FLUX1) is FLUX1  # the same entry again is harmless (a module re-imported)


@pytest.mark.parametrize("variant", ["dev", "schnell", "fill"])
def test_the_familys_bfl_shapes_are_the_converters(variant: str) -> None:
    config = tiny_flux_config(**_spec(variant))
    converted = diffusers_to_bfl(build_flux(config, device="meta").state_dict())
    assert FLUX1.bfl_shapes(config) == {k: tuple(v.shape) for k, v in converted.items()}


def _spec(variant: str) -> dict:
    from test_sampling import MODELS

    return MODELS[variant]["config"]


@pytest.mark.parametrize(
    ("variant", "name", "channels", "comfy_class"),
    [
        ("dev", "FLUX.1-dev", 16, "Flux"),
        ("schnell", "FLUX.1-schnell", 16, "FluxSchnell"),
        ("fill", "FLUX.1 Fill", 96, "FluxInpaint"),
    ],
)
def test_the_variant_is_detected_from_the_header(
    tmp_path: Path, variant: str, name: str, channels: int, comfy_class: str
) -> None:
    path = save_checkpoint(flux_model(variant), tmp_path / f"{variant}.safetensors")
    info = inspect_checkpoint(path)
    assert (info.family, info.model_name, info.input_channels) == ("flux1", name, channels)
    assert info.variant == ("schnell" if variant == "schnell" else "dev")
    comfy = FLUX1.comfy_model(info.config)
    # comfy/model_detection.py: in_channels = img_in.weight.shape[1] // 4, out_channels 16.
    assert comfy.config_class == comfy_class
    assert dict(comfy.unet_config) == {
        "image_model": "flux",
        "guidance_embed": variant != "schnell",
        "in_channels": channels,
        "out_channels": 16,
        "patch_size": 2,
    }
    if variant == "fill":
        assert (info.config["in_channels"], info.config["out_channels"]) == (384, 64)


# --------------------------------------------------------------------------------------------------
# Kontext placement: comfy/ldm/flux/model.py Flux._forward


def test_reference_placement_follows_comfyuis_three_methods() -> None:
    refs = [(5, 7), (3, 4), (6, 2)]
    # offset: below the references so far, or right of them when that keeps the canvas squarer
    assert reference_placements(9, 7, refs, "offset") == [(1, 0, 0), (1, 5, 0), (1, 0, 7)]
    assert reference_placements(9, 7, refs, "index") == [(1, 0, 0), (2, 0, 0), (3, 0, 0)]
    # uxo: past the main latent (padded to 10 x 8), then diagonally past the previous references
    assert reference_placements(9, 7, refs, "uxo") == [(0, 10, 8), (0, 15, 15), (0, 18, 19)]


def test_patch_ids_round_offsets_to_patches_like_comfyui() -> None:
    ids = patch_ids(3, 5, index=1, h_offset=5, w_offset=0).reshape(2, 3, 3)
    assert torch.equal(ids[..., 0], torch.ones(2, 3))
    assert torch.equal(ids[:, 0, 1], torch.tensor([3.0, 4.0]))  # (5 + 1) // 2 = 3
    assert torch.equal(ids[0, :, 2], torch.tensor([0.0, 1.0, 2.0]))


# --------------------------------------------------------------------------------------------------
# Against ComfyUI's own Flux.forward


def recorded_calls(case: str) -> list[dict[str, torch.Tensor]]:
    ref = reference(case)
    count = len({k.split(".")[0] for k in ref})
    return [{k.split(".", 1)[1]: v for k, v in ref.items() if k.startswith(f"{i}.")} for i in range(count)]


def refs_of(call: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [call[f"ref{j}"] for j in range(sum(k.startswith("ref") for k in call))]


def capturing(model_fn, seen: list):
    """`model_fn` that also keeps the image ids it is given."""

    def fn(img, context, pooled, timestep, img_ids, txt_ids, guidance):
        seen.append(img_ids)
        return model_fn(img, context, pooled, timestep, img_ids, txt_ids, guidance)

    return fn


COMFY_CASES = {  # case -> (model, ComfyUI's ref_latents_method after its node's mapping)
    "kontext_calls": ("dev", "offset"),
    "kontext_index_calls": ("dev", "index"),
    "kontext_uxo_calls": ("dev", "uxo"),
    "fill_calls": ("fill", None),
}


@pytest.mark.parametrize("case", list(COMFY_CASES))
def test_one_process_equals_comfyuis_own_flux_forward(case: str) -> None:
    variant, method = COMFY_CASES[case]
    calls = recorded_calls(case)
    assert calls
    for call in calls:
        refs = refs_of(call)
        assert bool(refs) == (variant == "dev")
        assert call["x"].shape[1] == (96 if variant == "fill" else 16)
        seen: list[torch.Tensor] = []
        with torch.no_grad():
            got = flux_call(
                capturing(diffusers_model_fn(flux_model(variant)), seen), call["x"], call["timestep"],
                call["context"], call["y"], call["guidance"], ref_latents=refs, ref_latents_method=method or "offset",
            )  # fmt: skip
        assert got.shape == call["output"].shape
        assert (got - call["output"]).abs().max().item() <= TOL
        if refs:  # the reference tokens' position ids are ComfyUI's exactly (the output is not sensitive
            # enough to them in a small random model to catch a misplaced reference on its own)
            assert torch.equal(seen[0], call["img_ids"][0])


@pytest.mark.parametrize(
    ("groups", "layout"),
    [(2, ParallelLayout(tp=2)), (2, ParallelLayout(ring=2)), (4, ParallelLayout(ring=2, ulysses=2))],
    indirect=["groups"],
    ids=str,
)
def test_the_service_equals_comfyuis_own_flux_forward(
    groups: WorkerGroup, layout: ParallelLayout, checkpoints: dict[str, str]
) -> None:
    for case, (variant, method) in COMFY_CASES.items():
        flux = ParallelModel(group=groups)
        flux.load(checkpoints[variant], layout=layout, dtype="float32")
        for call in recorded_calls(case):
            got = flux.forward(
                call["x"],
                call["timestep"],
                call["context"],
                call["y"],
                call["guidance"],
                refs_of(call),
                method,
            )
            assert (got - call["output"]).abs().max().item() <= TOL, case


# --------------------------------------------------------------------------------------------------
# Every layout against one process, odd token counts


def kontext_inputs(seed: int = 0) -> dict:
    """A CFG-like Kontext call: 7x9 latent (20 tokens) + references 5x5 (9) and 3x7 (8): 37 tokens."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(2, 16, 7, 9, generator=g),
        "timestep": torch.full((2,), 0.7),
        "context": torch.randn(2, 8, 32, generator=g),
        "y": torch.randn(2, 24, generator=g),
        "guidance": torch.full((2,), 2.5),
        "ref_latents": [torch.randn(2, 16, 5, 5, generator=g), torch.randn(2, 16, 3, 7, generator=g)],
        "ref_method": "offset",
    }


def fill_inputs(seed: int = 0) -> dict:
    """A Fill call: 96 channels (latent, masked image, mask) on a 5x9 latent: 15 tokens."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(2, 96, 5, 9, generator=g),
        "timestep": torch.full((2,), 0.7),
        "context": torch.randn(2, 8, 32, generator=g),
        "y": torch.randn(2, 24, generator=g),
        "guidance": torch.full((2,), 30.0),
    }


def one_process(variant: str, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return flux_call(
            diffusers_model_fn(flux_model(variant)), inputs["x"], inputs["timestep"], inputs["context"],
            inputs["y"], inputs["guidance"], ref_latents=inputs.get("ref_latents", ()),
            ref_latents_method=inputs.get("ref_method", "offset"),
        )  # fmt: skip


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
def test_kontext_and_fill_match_one_process_in_every_layout(
    groups: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    for variant, inputs in (("dev", kontext_inputs()), ("fill", fill_inputs())):
        expected = one_process(variant, inputs)
        assert expected.shape == (2, 16, *inputs["x"].shape[-2:])
        for layout in LAYOUTS[groups.world_size]:
            flux = ParallelModel(group=groups)
            flux.load(checkpoints[variant], layout=layout, dtype="float32")
            got = flux.forward(**inputs)
            assert (got - expected).abs().max().item() <= TOL, (variant, layout)


def test_reference_latents_are_sent_once_and_found_by_content(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    inputs = kontext_inputs(seed=1)
    sent = sum(t.numel() * 4 for t in (inputs["context"], inputs["y"], *inputs["ref_latents"]))
    for _ in range(2):
        fresh = {k: [r.clone() for r in v] if k == "ref_latents" else v for k, v in inputs.items()}
        out = flux.forward(**fresh)
    assert flux.conditioning_bytes_sent == sent
    assert (out - one_process("dev", inputs)).abs().max().item() <= TOL
    other = {**inputs, "ref_latents": [inputs["ref_latents"][0] + 0.5, inputs["ref_latents"][1]]}
    got = flux.forward(**other)
    assert flux.conditioning_bytes_sent == 2 * sent
    assert (got - one_process("dev", other)).abs().max().item() <= TOL
    assert (got - out).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("variant", "change", "message"),
    [
        ("dev", {"ref_latents": [torch.zeros(1, 16, 4, 4)]},
         r"^ref_latents\[0\] has shape \(1, 16, 4, 4\); a reference latent is \[2, 16, height, width\]"),
        ("dev", {"ref_method": "left"}, "^" + re.escape(
            "ref_latents_method='left' is not a reference placement ComfyUI's models run (index, "
            "index_timestep_zero, negative_index, offset, uxo); it came with the conditioning (the Edit Model Reference Method "
            "(FluxKontextMultiReferenceLatentMethod) node, or a custom node that sets it): set that node to one "
            "of offset, index, uxo/uno for FLUX.1-dev") + "$"),
        # ComfyUI 0.33's fourth method is FLUX.2's: its own FLUX.1 fails on it
        ("dev", {"ref_method": "index_timestep_zero"}, "^" + re.escape(
            "ref_latents_method='index_timestep_zero' is a FLUX.2 and Qwen-Image placement, not one of FLUX.1's (offset, index, "
            "uxo/uno): it modulates the reference tokens as at timestep 0, which takes FLUX.2's shared "
            "modulation; FLUX.1 modulates in every block from one timestep, and ComfyUI's own FLUX.1 fails on "
            "it with a shape error. Set the Edit Model Reference Method (FluxKontextMultiReferenceLatentMethod) "
            "node to one of offset, index, uxo/uno, or load a FLUX.2 or Qwen-Image checkpoint") + "$"),
        ("fill", {"x": torch.zeros(2, 16, 5, 9), "ref_latents": None, "ref_method": None},
         r"^x has shape \(2, 16, 5, 9\); FLUX.1 Fill takes \[batch, 96, height, width\]: the 16-channel latent "
         r"with the 80 channels of the masked image and mask appended"),
        ("fill", {"ref_latents": [torch.zeros(2, 16, 4, 4)], "ref_method": "offset"},
         r"^reference latents \(ReferenceLatent\) cannot be combined with a 96-channel model \(FLUX.1 Fill\)"),
    ],
)  # fmt: skip
def test_bad_kontext_and_fill_calls_fail_before_any_rank_runs(
    group2: WorkerGroup, checkpoints: dict[str, str], variant: str, change: dict, message: str
) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints[variant], layout="tp", dtype="float32")
    base = kontext_inputs() if variant == "dev" else fill_inputs()
    before = group2._job
    with pytest.raises(ConfigError, match=message):
        flux.forward(**{**base, **change})
    assert group2._job == before


def test_fill_is_refused_by_the_built_in_sampler(checkpoints: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelModel.check_sample(
            [[torch.zeros(1, 8, 32), {"pooled_output": torch.zeros(1, 24)}]],
            {"samples": torch.zeros(1, 16, 8, 8)},
            checkpoint=checkpoints["fill"], seed=0, steps=2,
        )  # fmt: skip
    assert str(err.value) == (
        "FLUX.1 Fill takes the masked image and mask in every step (96 input channels), which sample() does "
        "not supply: drive it step by step with forward() (in ComfyUI: the ROCm Parallel Model with "
        "InpaintModelConditioning and KSampler)"
    )
