"""FLUX.2 end to end through the public API: a BFL file loaded by `ParallelModel.load` on the workers and
called as ComfyUI's samplers call ComfyUI's own FLUX.2 (`ParallelModel.forward`), in every layout, against
the same call in one process; what the API refuses for FLUX.2, before any worker runs; and the planner
fed FLUX.2's sizes (1/16 latents, 512 text tokens) and reference latents' tokens."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from test_parallel_sampling import LAYOUTS

from rocm_parallel.backend.checkpoint import bfl_to_diffusers, inspect_checkpoint
from rocm_parallel.backend.checkpoint.lora import inspect_lora
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux2.forward import flux2_call, flux2_model_fn
from rocm_parallel.backend.flux2.model import FLUX2_DEV, build_flux2
from rocm_parallel.backend.plan import Setup, plan
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry
from rocm_parallel.nodes.runner import ModelRunner
from rocm_parallel.testing.models import tiny_flux2_config
from rocm_parallel.testing.writers import lora_targets, save_mixed_checkpoint, write_random_lora

TOL = 1e-5
# 32 latent channels (not FLUX.1's 16, so a FLUX.1 latent is refused), 8 heads for TP 2/4 and Ulysses 2.
CONFIG = tiny_flux2_config(
    heads=8, head_dim=16, double_blocks=2, single_blocks=2, text_dim=24, in_channels=32
)


@pytest.fixture(scope="module")
def flux2_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    model = build_flux2(CONFIG, seed=11)
    path = save_mixed_checkpoint(
        model, tmp_path_factory.mktemp("flux2") / "flux2-tiny.safetensors", comfy_prefix=True
    )
    return path, model


def loaded(group: WorkerGroup, path: str, layout: ParallelLayout) -> ParallelModel:
    flux = ParallelModel(group=group)
    flux.load(path, layout=layout, dtype="float32")
    return flux


def call_inputs(refs: int = 0, batch: int = 2, height: int = 5, width: int = 7) -> dict:
    """A CFG-like call (two latents, two prompts) of an odd size, as ComfyUI's Flux2 makes it."""
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(batch, 32, height, width, generator=g),
        "timestep": torch.tensor([0.8, 0.8])[:batch],
        "context": torch.randn(batch, 9, 24, generator=g),
        "guidance": torch.full((batch,), 4.0),
        "ref_latents": [torch.randn(batch, 32, 3 + i, 4, generator=g) for i in range(refs)],
    }


def one_process(model: torch.nn.Module, inputs: dict, ref_method: str = "index") -> torch.Tensor:
    with torch.no_grad():
        return flux2_call(
            flux2_model_fn(model), inputs["x"], inputs["timestep"], inputs["context"], None, inputs["guidance"],
            inputs["ref_latents"], ref_method,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("groups", "layout"),
    [(2, lay) for lay in LAYOUTS[2]] + [(4, ParallelLayout(tp=4)), (4, ParallelLayout(ring=2, ulysses=2))],
    indirect=["groups"],
    ids=str,
)
def test_flux2_forward_matches_one_process_in_every_layout(
    groups: WorkerGroup, layout: ParallelLayout, flux2_file: tuple[str, torch.nn.Module]
) -> None:
    path, model = flux2_file
    flux = loaded(groups, path, layout)
    assert flux.resident.info.family == "flux2"
    for refs in (0, 2):  # text-to-image, then two reference latents placed by FLUX.2's default ("index")
        inputs = call_inputs(refs)
        out = flux.forward(inputs["x"], inputs["timestep"], inputs["context"], None, inputs["guidance"],
                           ref_latents=inputs["ref_latents"])  # fmt: skip
        assert out.shape == (2, 32, 5, 7) and out.dtype == torch.float32
        assert (out - one_process(model, inputs)).abs().max().item() <= TOL


def test_flux2_forward_ignores_a_pooled_vector_and_takes_other_ref_methods(
    group2: WorkerGroup, flux2_file: tuple[str, torch.nn.Module]
) -> None:
    path, model = flux2_file
    flux = loaded(group2, path, ParallelLayout(ring=2))
    inputs = call_inputs(refs=1)
    pooled = torch.randn(2, 768)  # what a FLUX.1-style caller might pass: FLUX.2 has no vector_in
    out = flux.forward(inputs["x"], inputs["timestep"], inputs["context"], pooled, inputs["guidance"],
                       ref_latents=inputs["ref_latents"], ref_method="offset")  # fmt: skip
    error = (out - one_process(model, inputs, "offset")).abs().max().item()
    assert error <= TOL
    # the method reached the ranks: "index" places the reference elsewhere (a small change in a random
    # model, whose attention is nearly uniform, but far above the layout's rounding)
    assert (out - one_process(model, inputs, "index")).abs().max().item() > 10 * error


def test_flux2_forward_refuses_flux1_inputs_before_any_rank_runs(
    group2: WorkerGroup, flux2_file: tuple[str, torch.nn.Module]
) -> None:
    path, _ = flux2_file
    flux = loaded(group2, path, ParallelLayout(tp=2))
    inputs = call_inputs()
    no_call = mock.patch.object(group2, "call", side_effect=AssertionError("a rank was called"))
    no_call.start()
    try:
        _refusals(flux, inputs)
    finally:
        no_call.stop()


def _refusals(flux: ParallelModel, inputs: dict) -> None:
    with pytest.raises(ConfigError) as err:
        flux.forward(
            torch.randn(2, 16, 5, 7), inputs["timestep"], inputs["context"], None, inputs["guidance"]
        )
    assert str(err.value) == (
        "x has shape (2, 16, 5, 7); FLUX.2 (8 heads, 2+2 blocks) takes [batch, 32, height, width] latents "
        "(encode with the FLUX.2 VAE (flux2-vae.safetensors), or use EmptyFlux2LatentImage)"
    )
    with pytest.raises(ConfigError) as err:
        flux.forward(inputs["x"], inputs["timestep"], torch.randn(2, 9, 4096), None, inputs["guidance"])
    assert str(err.value) == (
        "context has shape (2, 9, 4096); FLUX.2 (8 heads, 2+2 blocks) expects [2, tokens, 24] (text features "
        "for each latent): encode the prompt with a CLIPLoader of type flux2 (mistral_3_small_flux2 for [dev], "
        "qwen_3_4b / qwen_3_8b for [klein])"
    )
    with pytest.raises(
        ConfigError, match=r"guidance is None; FLUX.2 \(8 heads, 2\+2 blocks\) needs one per latent"
    ):
        flux.forward(inputs["x"], inputs["timestep"], inputs["context"], None, None)
    with pytest.raises(ConfigError, match=r"a reference latent is \[2, 32, height, width\]"):
        flux.forward(**{**call_inputs(), "ref_latents": [torch.randn(2, 16, 4, 4)]}, y=None)


def test_the_planner_prices_flux2_text_and_reference_tokens() -> None:
    dims = FluxDims.from_diffusers_config(FLUX2_DEV)
    plain = Setup(
        dims, 1024, 1024, devices=4, memory_gb=16, family="flux2", text_tokens=512, weight_dtype="fp8_e4m3fn"
    )
    edit = Setup(dims, 1024, 1024, devices=4, memory_gb=16, family="flux2", text_tokens=512,
                 weight_dtype="fp8_e4m3fn", reference_tokens=2 * 4096)  # fmt: skip
    assert (plain.tokens, edit.tokens) == (4096 + 512, 3 * 4096 + 512)
    by_name = {e.name: e for e in plan(plain)}
    for e in plan(edit):  # every layout holds and moves more for the reference images' tokens
        assert e.activations > by_name[e.name].activations
        assert e.step_s > by_name[e.name].step_s
    with pytest.raises(ConfigError, match="reference_tokens=-1 must be 0 or a positive integer"):
        Setup(dims, family="flux2", reference_tokens=-1)


def test_auto_plans_flux2_latents_and_their_references(
    group2: WorkerGroup, flux2_file: tuple[str, torch.nn.Module], tmp_path: Path
) -> None:
    path, _ = flux2_file
    registry = Registry(factory=lambda devices: ParallelModel(group=group2))
    handle = ParallelHandle(path, "flux2-tiny.safetensors", ("cpu", "cpu"), "float32")
    runner = ModelRunner(registry, handle, LayoutRequest(None))
    with mock.patch.object(
        ParallelModel, "auto_layout", autospec=True, side_effect=ParallelModel.auto_layout
    ) as spy:
        runner.prepare((1, 32, 5, 7), references=[(1, 32, 3, 4), (1, 32, 4, 4)])
    try:
        ((args, kwargs),) = [(c.args, c.kwargs) for c in spy.call_args_list]
        # a 5x7 FLUX.2 latent is 80x112 pixels (1/16, patch 1); the references add 12 + 16 tokens
        assert args[2:5] == (112, 80, 1)
        assert kwargs["family"] == "flux2" and kwargs["reference_tokens"] == 28
        assert registry.snapshot()["auto"].startswith("auto: ")
        assert runner.layout == registry.current.resident.layout
    finally:
        registry.current.unload()


# --------------------------------------------------------------------------------------------------
# LoRAs on FLUX.2: the same per-rank patching as FLUX.1, through FLUX.2's sources and TP plan


def merged_flux2(checkpoint: str, loras: list[tuple[str, float]]) -> torch.nn.Module:
    """`checkpoint` with BFL-format `loras` merged by plain math on the BFL tensors (W += strength * alpha /
    rank * up @ down, fp32), converted with bfl_to_diffusers, independently of lora.py."""
    bfl = {k.removeprefix("model.diffusion_model."): v.float() for k, v in load_file(checkpoint).items()}
    for path, strength in loras:
        lora = load_file(path)
        for key in [k for k in lora if k.endswith(".lora_up.weight")]:
            name = key.removesuffix(".lora_up.weight")
            up, down = lora[key].float(), lora[f"{name}.lora_down.weight"].float()
            scale = lora[f"{name}.alpha"].item() / down.shape[0] if f"{name}.alpha" in lora else 1.0
            bfl[f"{name.removeprefix('diffusion_model.')}.weight"] += (strength * scale) * (up @ down)
    model = build_flux2(CONFIG, device="meta")
    model.load_state_dict(bfl_to_diffusers(bfl), assign=True)
    return model.eval()


def test_flux2_loras_patch_each_rank_and_restore_exactly(
    group2: WorkerGroup, flux2_file: tuple[str, torch.nn.Module], tmp_path: Path
) -> None:
    """Every linear of a FLUX.2 (packed linear1 = [q|k|v|gate|up], shared modulation, SwiGLU) in BFL and
    PEFT keys: the TP 2 and ring 2 forwards equal the independently merged model's, and `loras=()` gives
    back the fresh load's output bit for bit."""
    path, _ = flux2_file
    bfl = write_random_lora(tmp_path / "flux2-lora.safetensors", CONFIG, "bfl", seed=3, family="flux2")
    peft = write_random_lora(tmp_path / "flux2-peft.safetensors", CONFIG, "peft", seed=3, family="flux2")
    targets = lora_targets(CONFIG, "flux2")
    assert "single_blocks.0.linear1" in targets and "double_stream_modulation_img.lin" in targets
    info = inspect_checkpoint(path)
    assert len(inspect_lora(bfl, info).modules) == len(targets)
    expected = one_process(merged_flux2(path, [(bfl, 0.7)]), call_inputs(refs=1))
    flux = ParallelModel(group=group2)
    try:
        for layout in (ParallelLayout(tp=2), ParallelLayout(ring=2)):
            flux.unload()
            flux.load(path, layout=layout, dtype="float32")
            fresh = flux.forward(**call_inputs(refs=1), y=None)
            for lora in (bfl, peft):
                flux.load(path, layout=layout, dtype="float32", loras=[(lora, 0.7)])
                out = flux.forward(**call_inputs(refs=1), y=None)
                assert (out - expected).abs().max().item() <= TOL, (layout, lora)
            flux.load(path, layout=layout, dtype="float32", loras=[])
            assert torch.equal(flux.forward(**call_inputs(refs=1), y=None), fresh), layout
    finally:
        flux.unload()
