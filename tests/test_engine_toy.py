"""The model engine's plan machinery on gloo, without ComfyUI: a toy in ComfyUI's conventions (engine_toy.py)
sharded by its plan in every layout, against the same toy in one process.

What ComfyUI's real classes add (detection, ops, its FLUX forward, its LoRA code) is checked in the comfy
tier (tests/comfy/test_engine.py); this keeps the machinery itself under CI, where no ComfyUI is installed.
"""

from __future__ import annotations

import pytest
import torch
from engine_toy import TOY_PLAN, ToyInputs, ToyLayout, block_inputs, build, frame_inputs, inputs

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.models.options import check_engine, resolve_comfyui
from rocm_parallel.backend.models.plans import plan_for
from rocm_parallel.backend.runtime.client import WorkerGroup

TOL = 1e-5
LAYOUTS = [
    (2, ParallelLayout(tp=2)),
    (2, ParallelLayout(ring=2)),
    (2, ParallelLayout(ulysses=2)),
    (4, ParallelLayout(ring=2, tp=2)),
    (4, ParallelLayout(ulysses=2, tp=2)),
]


@pytest.mark.parametrize(("groups", "layout"), LAYOUTS, indirect=["groups"], ids=str)
@pytest.mark.parametrize(("images", "texts"), [(9, 5), (8, 6)], ids=["uneven", "even"])
def test_a_plan_shards_its_model_like_one_process(groups: WorkerGroup, layout, images, texts) -> None:
    """Columns by sections, Rows over cat(attention, mlp), a Gathered bank, per-rank heads, the token streams
    and their ids split alike (padded when uneven), attention through the override: the one-process output."""
    given = inputs(images, texts)
    with torch.no_grad():
        expected = build()(**given)
    reports = groups.call_all("toy_engine", ToyLayout(layout))
    whole = sum(p.numel() * p.element_size() for p in build().parameters())
    if layout.tp > 1:
        assert all(r.bytes < whole * 0.75 for r in reports)  # the blocks' linears are split
    out = groups.call("toy_forward", ToyInputs(given)).out
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= TOL


@pytest.mark.parametrize(("groups", "layout"), LAYOUTS, indirect=["groups"], ids=str)
@pytest.mark.parametrize(("images", "texts"), [(9, 5), (8, 6)], ids=["uneven", "even"])
def test_a_block_split_shards_its_model_like_one_process(groups: WorkerGroup, layout, images, texts) -> None:
    """BlockSplit: the streams split at the first block, the whole position table cut into its streams' parts
    at every block, the text mask split with the text (its dropped keys dropped on every rank), the image
    index made local: the one-process output."""
    given = block_inputs(images, texts)
    with torch.no_grad():
        expected = build(toy="block toy")(**given)
        unmasked = build(toy="block toy")(**{**given, "mask": None})
    assert (unmasked[-1] - expected[-1]).abs().max().item() > 1e-3  # the mask is not a no-op here
    groups.call_all("toy_engine", ToyLayout(layout, toy="block toy"))
    out = groups.call("toy_forward", ToyInputs(given)).out
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= TOL


def test_a_plan_whose_head_count_is_divided_per_rank_is_refused() -> None:
    from dataclasses import replace

    from engine_toy import BLOCK_TOY_PLAN

    with pytest.raises(ValueError, match=r"block toy: heads='blocks\.0\.num_heads' is divided per rank by "
                       r"per_rank\['blocks\.\*'\]; name an attribute holding the whole model's value"):  # fmt: skip
        replace(BLOCK_TOY_PLAN, heads="blocks.0.num_heads")


@pytest.mark.parametrize(("groups", "layout"), LAYOUTS, indirect=["groups"], ids=str)
@pytest.mark.parametrize("per_frame", [False, True], ids=["one-timestep", "per-frame"])
def test_a_token_split_shards_a_model_that_makes_its_tokens_like_one_process(
    groups, layout, per_frame
) -> None:
    """TokenSplit (Wan's way): tokens made inside the forward (3 frames x 5 positions: 15, uneven), split where
    they enter the first block, the per-token table and the per-frame modulation cut to each rank's tokens
    (a rank's tokens span frames), the head's output gathered before the model reshapes it: one process's."""
    given = frame_inputs(3, 5, per_frame)
    with torch.no_grad():
        expected = build(toy="frames")(**given)
    groups.call_all("toy_engine", ToyLayout(layout, toy="frames"))
    for _ in range(2):  # a second forward: nothing of the first is held
        out = groups.call("toy_forward", ToyInputs(given)).out
        assert out.shape == expected.shape
        assert (out - expected).abs().max().item() <= TOL


def test_the_plan_registry_picks_by_class_and_detected_config() -> None:
    flux = "comfy.ldm.flux.model.Flux"
    assert plan_for(flux, {"image_model": "flux"}).name == "FLUX.1"
    assert plan_for(flux, {"image_model": "flux2"}).name == "FLUX.2"
    assert plan_for(flux, {"image_model": "chroma"}) is None
    assert (
        plan_for("comfy.ldm.wan.model.WanModel", {"image_model": "wan2.1", "model_type": "t2v"}).name == "Wan"
    )
    assert plan_for(TOY_PLAN.model_class, {}) is None  # a test's plan is not registered


def test_engine_options_are_refused_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    with pytest.raises(ConfigError, match="engine='comfyui' is not an engine; use 'diffusers' or 'comfy'"):
        check_engine("comfyui")
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    with pytest.raises(
        ConfigError, match="pass comfyui=<the ComfyUI folder>, set COMFYUI_PATH, or run inside ComfyUI"
    ):
        resolve_comfyui(None)
    with pytest.raises(
        ConfigError, match=r"is not a ComfyUI checkout \(no comfy/model_detection\.py in it\)"
    ):
        resolve_comfyui(tmp_path)
