"""Files ComfyUI itself wrote (issue 22): every FLUX.1 / FLUX.2 file this ComfyUI's UNETLoader loads, in
every key spelling it loads (its ModelSave output with and without the prefix, `.scale` / `.weight` norms,
the other prefixes it strips, diffusers keys, scaled and mixed fp8 and its re-save of them), loaded by the
pack, and a model call equal to ComfyUI's own model loaded from the same file within 1e-4. Then
index_timestep_zero (ComfyUI >= 0.17) sampled on a ModelSave file of FLUX.2 [klein] (batch 2, CFG) and
[dev] (batch 1) through ComfyUI's own nodes, the ROCm Parallel Model in TP 2, ring 2 and Ulysses 2 equal to
ComfyUI's own Flux2; and ComfyUI's FluxKVCache node refused by name.

The files are made per session by tests/tools/comfy_models.py with the running ComfyUI: its own model
classes, its own ModelSave node; no code of the pack writes them.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -s -m comfy tests/comfy/test_comfy_files.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, COMFYUI_VERSION, TESTS_DIR

from rocm_parallel.backend.checkpoint import inspect_checkpoint
from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.nodes.checks import KV_CACHE_MESSAGE
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]
TOL = 1e-4
ITZ = "index_timestep_zero"


@pytest.fixture(scope="module")
def tool() -> Any:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    if str(TESTS_DIR / "tools") not in sys.path:
        sys.path.insert(0, str(TESTS_DIR / "tools"))
    import comfy_models

    return comfy_models


@pytest.fixture(scope="module")
def comfy(tool: Any) -> dict[str, Any]:
    from make_comfy_references import import_comfy as import_nodes

    return {**tool.import_comfy(COMFYUI_PATH), "nodes": import_nodes(COMFYUI_PATH)}


@pytest.fixture(scope="module")
def made(tool: Any, comfy: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every file comfy_models.py makes with this ComfyUI (and its manifest: what ComfyUI loads)."""
    folder = tmp_path_factory.mktemp("comfy-files")
    with torch.no_grad():
        files = tool.make(comfy, folder, list(tool.MODELS), fp8=True)
    assert comfy["version"] == COMFYUI_VERSION
    return {"folder": folder, "files": files}


@pytest.fixture(scope="module")
def registries() -> Iterator[dict[int, Registry]]:
    made = {2: Registry(factory=lambda devices: ParallelModel(list(devices), threads=1))}
    yield made
    for registry in made.values():
        registry.close()


def call_inputs(spec: dict[str, Any], batch: int = 1, refs: int = 0) -> dict[str, Any]:
    """A model call's inputs for a model of comfy_models' `spec`: an odd-sized latent, random text."""
    g = torch.Generator().manual_seed(7)
    flux2 = spec["family"] == "flux2"
    channels, size = (128, (3, 5)) if flux2 else (16, (6, 10))
    out = {
        "x": torch.randn(batch, channels, *size, generator=g),
        "timestep": torch.full((batch,), 0.63),
        "context": torch.randn(batch, 5, spec["text"], generator=g),
        "y": None if flux2 else torch.randn(batch, spec["pooled"], generator=g),
        "guidance": torch.full((batch,), 3.5) if spec["guidance"] else None,
    }
    out["ref_latents"] = [torch.randn(batch, channels, 2, 4 - i, generator=g) for i in range(refs)]
    return out


def comfys_call(model: Any, inputs: dict[str, Any], method: str | None = None) -> torch.Tensor:
    """ComfyUI's own diffusion model called as its samplers call it (model_base's apply_model aside)."""
    kwargs = {} if method is None else {"ref_latents_method": method}
    refs = inputs["ref_latents"] or None
    with torch.no_grad():
        return model.model.diffusion_model(
            inputs["x"], inputs["timestep"], inputs["context"], y=inputs["y"], guidance=inputs["guidance"],
            ref_latents=refs, **kwargs,
        ).float()  # fmt: skip


@pytest.mark.parametrize("name", ["flux1-dev", "flux1-schnell", "flux2-dev", "flux2-klein"])
def test_every_file_comfyui_loads_loads_in_the_pack_and_calls_equal_comfyuis_own(
    tool: Any, comfy: dict[str, Any], made: dict[str, Any], registries: dict[int, Registry], name: str
) -> None:
    """For each file of this model that ComfyUI loads: the pack reads its header, loads it at TP 2 (each rank
    its slices; fp8 kept fp8) and one model call equals ComfyUI's own model from the same file."""
    spec = tool.MODELS[name]
    entries = [e for e in made["files"] if e["model"] == name]
    loadable = [e for e in entries if e["comfy_loads"].startswith("yes")]
    assert loadable and loadable == entries, [e["comfy_loads"] for e in entries if e not in loadable]
    variants = {e["variant"] for e in loadable}
    assert {
        "modelsave",
        "modelsave-bf16",
        "bare",
        "prefix-model",
        "prefix-model_model",
        "prefix-net",
    } <= variants
    inputs = call_inputs(spec)
    flux = registries[2].group_for(("cpu", "cpu"))
    rows = []
    for entry in loadable:
        path = made["folder"] / entry["file"]
        info = inspect_checkpoint(path)
        assert info.family == ("flux2" if spec["family"] == "flux2" else "flux1"), entry["file"]
        own = tool.load_in_comfy(comfy, path, spec)
        want = comfys_call(own, inputs)
        flux.load(str(path), layout=ParallelLayout(tp=2), dtype="float32")
        got = flux.forward(
            inputs["x"], inputs["timestep"], inputs["context"], inputs["y"], inputs["guidance"]
        )
        diff = (got - want).abs().max().item()
        held = sorted(flux.status()[0].parameter_bytes_by_dtype)
        rows.append((entry["file"], info.prefix or "-", info.quantization or "-", "+".join(held), diff))
        assert diff <= TOL, (entry["file"], diff)
        if "fp8" in entry["variant"]:  # kept fp8 on the ranks, as ComfyUI keeps it
            assert "float8_e4m3fn" in held, entry["file"]
    print(f"\nComfyUI {COMFYUI_VERSION}, {name}: file | prefix | quantization | held | max |pack - ComfyUI|")
    for row in rows:
        print(f"  {row[0]:42} {row[1]:24} {row[2]:22} {row[3]:22} {row[4]:.2e}")


# --------------------------------------------------------------------------------------------------
# index_timestep_zero on ComfyUI's own ModelSave files


def offers_timestep_zero(comfy: dict[str, Any]) -> bool:
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    from make_comfy_references import ref_methods

    return ITZ in ref_methods(comfy["nodes"])


def parallel_model(path: Path, layout: ParallelLayout, registry: Registry) -> Any:
    from rocm_parallel.nodes import comfy_model

    handle = ParallelHandle(str(path), path.name, ("cpu", "cpu"), "float32")
    return comfy_model.parallel_model(handle, LayoutRequest(layout), registry)


def sample_with_references(comfy: dict[str, Any], model: Any, spec: dict[str, Any], batch: int) -> dict:
    """ComfyUI's FLUX.2 edit graph with two references placed by index_timestep_zero (Edit Model Reference
    Method), FluxGuidance for [dev], CFGGuider at cfg 2.5 for [klein] (the negative batched with the
    positive: batch 2), Flux2Scheduler, SamplerCustomAdvanced; every model call recorded."""
    from make_comfy_references import record_calls

    nodes = comfy["nodes"]
    flux_nodes, custom, edit = nodes["flux_nodes"], nodes["custom"], nodes["edit"]
    g = torch.Generator().manual_seed(11)
    refs = [torch.randn(1, 128, 3, 2, generator=g), torch.randn(1, 128, 2, 4, generator=g)]

    def prompt() -> list:
        conditioning = [[torch.randn(1, 6, spec["text"], generator=g), {"pooled_output": None}]]
        if spec["guidance"]:
            conditioning = flux_nodes.FluxGuidance.execute(conditioning, 4.0)[0]
        for ref in refs:
            conditioning = edit.ReferenceLatent.execute(conditioning, {"samples": ref})[0]
        return flux_nodes.FluxKontextMultiReferenceLatentMethod.execute(conditioning, ITZ)[0]

    positive = prompt()
    model = model.clone()
    calls: dict[str, torch.Tensor] = {}
    record_calls(model, 3, calls)
    if batch == 2:
        guider = custom.CFGGuider().get_guider(model, positive, prompt(), 2.5)[0]
    else:
        guider = custom.BasicGuider().get_guider(model, positive)[0]
    latent = flux_nodes.EmptyFlux2LatentImage.execute(80, 48, 1)[0]
    with torch.no_grad():
        out = custom.SamplerCustomAdvanced().sample(
            custom.RandomNoise().get_noise(5)[0], guider, custom.KSamplerSelect().get_sampler("euler")[0],
            flux_nodes.Flux2Scheduler.execute(3, 80, 48)[0], latent,
        )[0]  # fmt: skip
    return {**calls, "output": out["samples"].float()}


@pytest.mark.parametrize("layout", ["tp2", "ring2", "ulysses2"])
@pytest.mark.parametrize(("name", "batch"), [("flux2-klein", 2), ("flux2-dev", 1)])
def test_index_timestep_zero_on_comfyuis_modelsave_file_equals_comfyuis_own_flux2(
    tool: Any,
    comfy: dict[str, Any],
    made: dict[str, Any],
    registries: dict[int, Registry],
    name,
    batch,
    layout,
) -> None:
    if not offers_timestep_zero(comfy):
        pytest.skip(f"ComfyUI {COMFYUI_VERSION}'s Edit Model Reference Method has no {ITZ} (since 0.17)")
    spec, path = tool.MODELS[name], made["folder"] / f"{name}.modelsave.safetensors"
    assert inspect_checkpoint(path).prefix == "model.diffusion_model."
    own = tool.load_in_comfy(comfy, path, spec)
    want = sample_with_references(comfy, own, spec, batch)
    degrees = {"tp2": {"tp": 2}, "ring2": {"ring": 2}, "ulysses2": {"ulysses": 2}}[layout]
    ours = parallel_model(path, ParallelLayout(**degrees), registries[2])
    got = sample_with_references(comfy, ours, spec, batch)
    assert sorted(got) == sorted(want) and want["0.x"].shape[0] == batch
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    # not vacuous: ComfyUI's own index placement gives another result
    index = comfys_call(own, {**call_inputs(spec, batch, refs=2)}, "index")
    itz = comfys_call(own, {**call_inputs(spec, batch, refs=2)}, ITZ)
    print(f"{name} batch {batch} {layout}: max |pack - ComfyUI| {diff:.2e} over {len(want)} tensors; "
          f"ComfyUI's index vs {ITZ}: {(index - itz).abs().max().item():.3f}")  # fmt: skip
    assert diff <= TOL
    assert (index - itz).abs().max().item() > 100 * TOL


def test_comfyuis_flux_kv_cache_node_is_refused_by_name(
    tool: Any, comfy: dict[str, Any], made: dict[str, Any], registries: dict[int, Registry]
) -> None:
    """ComfyUI's own FluxKVCache node on the ROCm Parallel Model: its attention patch would be lost in the
    workers, so the first model call fails naming the node (nothing is sampled without it)."""
    flux_nodes = comfy["nodes"]["flux_nodes"]
    if not hasattr(flux_nodes, "FluxKVCache"):
        pytest.skip(f"ComfyUI {COMFYUI_VERSION} has no FluxKVCache node (since 0.17)")
    spec, path = tool.MODELS["flux2-klein"], made["folder"] / "flux2-klein.modelsave.safetensors"
    patched = flux_nodes.FluxKVCache.execute(parallel_model(path, ParallelLayout(tp=2), registries[2]))[0]
    with pytest.raises(RuntimeError) as err:
        sample_with_references(comfy, patched, spec, 1)
    assert str(err.value) == KV_CACHE_MESSAGE
    assert "Flux KV Cache" in KV_CACHE_MESSAGE


def test_the_manifest_says_what_wrote_each_file(made: dict[str, Any]) -> None:
    """The files are ComfyUI's: the ModelSave ones by its node (metadata `prompt`), none by the pack."""
    manifest = json.loads((made["folder"] / "manifest.json").read_text())
    assert manifest["comfyui_version"] == COMFYUI_VERSION
    saved = [e for e in manifest["files"] if e["variant"] in ("modelsave", "modelsave-bf16")]
    assert len(saved) == 8 and all(e["written_by"].startswith("ModelSave") for e in saved)
