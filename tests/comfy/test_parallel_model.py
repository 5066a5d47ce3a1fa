"""ComfyUI's own sampling on the ROCm Parallel Model, in a real ComfyUI imported in this process.

For speed the layout sweep drives ComfyUI's `common_ksampler`, `SamplerCustom` and
`SamplerCustomAdvanced` + `CFGGuider` directly (as tests/tools/make_comfy_references.py does) with the
pack's MODEL (nodes/comfy_model.py) over real CPU workers; the results must equal what this ComfyUI version
sampled with its own model (its tests/data/comfy_references*.safetensors) within 1e-4, in TP 2, ring 2, Ulysses 2 and
ring 2 x Ulysses 2. The /prompt path with the nodes is in test_integration.py.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<pack parent>:<comfy shims>:<comfy deps> \\
        python -m pytest -q -m comfy tests/comfy/test_parallel_model.py
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import ALL_CASES as CASES
from comfy_server import COMFYUI_PATH, COMFYUI_VERSION, FLUX2_CASES, MODELS, REFERENCES, TESTS_DIR, reference
from test_sampling import flux_model

from rocm_parallel.backend.checkpoint import save_checkpoint
from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.nodes.checks import LORA_ON_MODEL_MESSAGE
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

LAYOUTS = {
    "tp2": (2, ParallelLayout(tp=2)),
    "ring2": (2, ParallelLayout(ring=2)),
    "ulysses2": (2, ParallelLayout(ulysses=2)),
    "ring2_ulysses2": (4, ParallelLayout(ring=2, ulysses=2)),
}
SAMPLING_CASES = [
    "dpmpp_2m_beta",
    "euler_ancestral_normal",
    "heun_sgm_uniform",
    "cfg_negative",
    "custom_advanced_cfg_guider",
    "odd_size",
    "model_sampling_flux",
    "custom_sigmas",
]
LORA_CASES = ["lora_bfl", "lora_kohya"]


@pytest.fixture(scope="module")
def comfy() -> dict[str, Any]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    from make_comfy_references import import_comfy

    return import_comfy(COMFYUI_PATH)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("models")
    out = {}
    for variant in MODELS:
        out[variant] = str(folder / f"tiny-{variant}.safetensors")
        save_checkpoint(flux_model(variant), out[variant])
    return out


@pytest.fixture(scope="module")
def registries() -> Iterator[dict[int, Registry]]:
    """One registry (one worker group) per device count, one thread per worker."""
    made = {n: Registry(factory=lambda devices: ParallelModel(list(devices), threads=1)) for n in (2, 4)}
    yield made
    for registry in made.values():
        registry.close()


def parallel_model(comfy, checkpoints, registries, variant: str, layout: str, loras=()) -> Any:
    from rocm_parallel.nodes import comfy_model

    devices, parallel = LAYOUTS[layout]
    handle = ParallelHandle(
        checkpoints[variant], Path(checkpoints[variant]).name, ("cpu",) * devices, "float32", tuple(loras)
    )
    return comfy_model.parallel_model(handle, LayoutRequest(parallel), registries[devices])


def storage_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ComfyUI really holds a weight in: a QuantizedTensor (0.3.75's mixed layers, every fp8 layer
    in 0.33) reports its logical dtype as `.dtype` in 0.33 (the compute dtype) and keeps the stored values in
    `_qdata`, in both versions."""
    return weight._qdata.dtype if type(weight).__name__ == "QuantizedTensor" else weight.dtype


def weight_scale(layer: torch.nn.Module) -> float:
    """A ComfyUI fp8 layer's per-tensor scale: `scale_weight` (0.3.75's scaled fp8 ops) or `weight_scale`
    (0.33's quantized layers, ComfyUI's state dict of them)."""
    state = layer.state_dict()
    return next(state[k] for k in ("weight_scale", "scale_weight") if k in state).item()


def conditioning(ref: dict[str, torch.Tensor], prefix: str, guidance: float | None) -> list:
    extras: dict[str, Any] = {"pooled_output": ref[f"{prefix}pooled"]}
    if guidance is not None:
        extras["guidance"] = guidance
    return [[ref[f"{prefix}cond"], extras]]


def run_case(comfy: dict[str, Any], model: Any, name: str) -> torch.Tensor:
    """The case exactly as tests/tools/make_comfy_references.py ran it with ComfyUI's own model (the same
    code: inputs from the case's seeds, ModelSamplingFlux, KSampler / SamplerCustom / SamplerCustomAdvanced),
    with `model` in its place. A case's LoRA is left out: on the parallel MODEL the pack's own LoRA node
    applies it (ComfyUI's LoraLoaderModelOnly is refused there)."""
    from make_comfy_references import run_case as reference_run_case

    case = {k: v for k, v in CASES[name].items() if k != "lora"}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        return reference_run_case(comfy, {case["variant"]: model}, name, case, Path(folder))[f"{name}.output"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", SAMPLING_CASES)
def test_comfyuis_samplers_on_the_parallel_model_match_comfyui(comfy, checkpoints, registries, layout, name):
    model = parallel_model(comfy, checkpoints, registries, CASES[name]["variant"], layout)
    runner = model.model.diffusion_model.runner
    out = run_case(comfy, model, name)
    diff = (out - reference(name)["output"]).abs().max().item()
    print(f"{name} {layout}: max |diff| {diff:.2e}")
    assert diff <= 1e-4
    if name == "cfg_negative":  # euler: one model call per step, positive and negative as one batch
        assert runner.calls == CASES[name]["steps"]


def _lora_file(folder: Path, name: str) -> str:
    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    spec = CASES[name]["lora"]
    config = tiny_flux_config(**MODELS[CASES[name]["variant"]]["config"])
    path = folder / f"{name}.safetensors"
    return write_random_lora(path, config, spec["format"], rank=spec["rank"], seed=spec["seed"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", LORA_CASES)
def test_the_parallel_lora_matches_comfyuis_lora_loader(
    comfy, checkpoints, registries, layout, name, tmp_path
):
    path = _lora_file(tmp_path, name)
    model = parallel_model(
        comfy, checkpoints, registries, "dev", layout, loras=[(path, CASES[name]["lora"]["strength"])]
    )
    diff = (run_case(comfy, model, name) - reference(name)["output"]).abs().max().item()
    print(f"{name} {layout}: max |diff| {diff:.2e}")
    assert diff <= 1e-4


def test_comfyuis_lora_loader_on_the_parallel_model_fails_pointing_to_the_pack_node(
    comfy, checkpoints, registries, tmp_path
):
    """Mutation tried: without ParallelModelPatcher.add_patches, the LoRA was silently dropped (the
    MODEL has no weights to patch: ComfyUI only logs 'NOT LOADED')."""
    import comfy.sd
    import comfy.utils

    model = parallel_model(comfy, checkpoints, registries, "dev", "tp2")
    lora = comfy.utils.load_torch_file(_lora_file(tmp_path, "lora_bfl"), safe_load=True)
    with pytest.raises(RuntimeError) as err:
        comfy.sd.load_lora_for_models(model, None, lora, 0.8, 0)  # what LoraLoaderModelOnly does
    assert str(err.value) == LORA_ON_MODEL_MESSAGE
    assert "'ROCm Parallel LoRA'" in str(err.value)
    # Clones (every ComfyUI model node clones) keep the refusal.
    with pytest.raises(RuntimeError, match="ROCm Parallel LoRA"):
        model.clone().clone().add_patches({"x": ()}, 1.0)


def test_the_parallel_model_is_comfyuis_flux(comfy, checkpoints, registries):
    """The dev/schnell choice and the inputs' dtype come from ComfyUI's own config classes."""
    import comfy.model_base

    dev = parallel_model(comfy, checkpoints, registries, "dev", "tp2")
    schnell = parallel_model(comfy, checkpoints, registries, "schnell", "tp2")
    assert isinstance(dev.model, comfy.model_base.Flux) and isinstance(schnell.model, comfy.model_base.Flux)
    assert dev.model.model_type == comfy.model_base.ModelType.FLUX
    assert schnell.model.model_type == comfy.model_base.ModelType.FLOW
    assert dev.model.model_sampling.shift == pytest.approx(1.15)
    assert dev.model_dtype() == torch.float32
    assert dev.model_size() == 40000  # only model_sampling's sigma table (10000 x float32): no weights
    assert dev.load_device == torch.device("cpu")


@pytest.mark.parametrize("layout", ["tp2", "ring2_ulysses2"])
def test_ksampler_advanced_and_basic_guider_on_the_parallel_model(comfy, checkpoints, registries, layout):
    """ComfyUI's KSamplerAdvanced (all steps, noise added) and SamplerCustomAdvanced with BasicGuider are
    KSampler by other roads: on the parallel MODEL both give ComfyUI's own dpmpp_2m/beta and
    euler/simple results."""
    import nodes as comfy_nodes

    custom = comfy["custom"]
    model = parallel_model(comfy, checkpoints, registries, "dev", layout)
    case, ref = CASES["dpmpp_2m_beta"], reference("dpmpp_2m_beta")
    positive = conditioning(ref, "", case["guidance"])
    out = comfy_nodes.KSamplerAdvanced().sample(
        model, "enable", case["seed"], case["steps"], 1.0, "dpmpp_2m", "beta", positive, positive,
        {"samples": ref["latent"].clone()}, 0, 10000, "disable",
    )[0]["samples"]  # fmt: skip
    assert (out - ref["output"]).abs().max().item() <= 1e-4
    case, ref = CASES["dev_4steps"], reference("dev_4steps")
    positive = conditioning(ref, "", case["guidance"])
    out = custom.SamplerCustomAdvanced().sample(
        custom.RandomNoise().get_noise(case["seed"])[0],
        custom.BasicGuider().get_guider(model, positive)[0],
        custom.KSamplerSelect().get_sampler("euler")[0],
        custom.BasicScheduler().get_sigmas(model, "simple", case["steps"], 1.0)[0],
        {"samples": ref["latent"].clone()},
    )[0]["samples"]
    assert (out - ref["output"]).abs().max().item() <= 1e-4


def test_fp8_weights_match_comfyuis_own_fp8_model(comfy, registries, tmp_path_factory, monkeypatch):
    """An fp8 e4m3fn checkpoint: ComfyUI's own model loaded with weight dtype fp8 (its UNETLoader
    `weight_dtype`, manual cast to float32 on CPU) and the pack's model keeping the fp8 weights resident
    ('default' for an fp8 file, TP 2) sample the same latent within the tier's 1e-4; the workers hold
    the linear weights in one byte each."""
    from make_comfy_references import load_in_comfy
    from safetensors.torch import save_file

    from rocm_parallel.backend.checkpoint import diffusers_to_bfl
    from rocm_parallel.nodes import comfy_model

    reference_model = flux_model("dev")
    bfl = {
        k: v.to(torch.float8_e4m3fn).contiguous()
        for k, v in diffusers_to_bfl(reference_model.state_dict()).items()
    }
    path = tmp_path_factory.mktemp("fp8") / "tiny-dev-fp8.safetensors"
    save_file(bfl, str(path))
    load = comfy["sd"].load_diffusion_model_state_dict
    monkeypatch.setattr(
        comfy["sd"],
        "load_diffusion_model_state_dict",
        lambda sd, model_options: load(sd, model_options={"dtype": torch.float8_e4m3fn}),
    )
    own = load_in_comfy(comfy, dict(reference_model.config), bfl)
    monkeypatch.undo()
    assert storage_dtype(own.model.diffusion_model.img_in.weight) == torch.float8_e4m3fn
    handle = ParallelHandle(str(path), path.name, ("cpu", "cpu"), "float32", (), None)
    ours = comfy_model.parallel_model(handle, LayoutRequest(ParallelLayout(tp=2)), registries[2])
    want, got = run_case(comfy, own, "dev_4steps"), run_case(comfy, ours, "dev_4steps")
    flux = registries[2].group_for(handle.devices)
    assert flux.resident.weight_dtype == "default"
    assert "float8_e4m3fn" in flux.status()[0].parameter_bytes_by_dtype
    assert (got - want).abs().max().item() <= 1e-4  # measured 1.4e-6
    # not vacuous: fp8 rounding moves ComfyUI's own result by 0.17 from its float32 model's
    assert (want - reference("dev_4steps")["output"]).abs().max().item() > 0.1


def test_scaled_fp8_matches_comfyuis_own_scaled_fp8_model(comfy, registries, tmp_path_factory):
    """A ComfyUI "scaled fp8" checkpoint (fp8 weights with a `scale_weight` each, the `scaled_fp8` marker):
    ComfyUI's own loader (scaled_fp8_ops) and the pack (scales applied per layer, TP 2) sample the same
    latent within 1e-4.

    The linear biases are stored in fp8 here, as ComfyUI saves them: its scaled Linear creates the bias
    in fp8 too, so a file with wider biases is rounded by ComfyUI and not by the pack (which keeps
    biases in the compute dtype); with float32 biases the two differed by 0.022."""
    from make_comfy_references import load_in_comfy
    from safetensors.torch import save_file

    from rocm_parallel.backend.checkpoint import diffusers_to_bfl
    from rocm_parallel.nodes import comfy_model

    reference_model = flux_model("dev")
    bfl: dict[str, torch.Tensor] = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    state = diffusers_to_bfl(reference_model.state_dict())
    for k, v in state.items():
        if v.ndim == 2:
            scale = v.abs().max() / 448.0
            bfl[k] = (v / scale).to(torch.float8_e4m3fn).contiguous()
            bfl[k.removesuffix(".weight") + ".scale_weight"] = scale.reshape(()).float()
        elif k.endswith(".bias") and state[k.removesuffix(".bias") + ".weight"].ndim == 2:
            bfl[k] = v.to(torch.float8_e4m3fn)  # ComfyUI's scaled Linear holds its bias in fp8, unscaled
        else:
            bfl[k] = v.contiguous()
    path = tmp_path_factory.mktemp("scaled") / "tiny-dev-scaled-fp8.safetensors"
    save_file(bfl, str(path))
    own = load_in_comfy(comfy, dict(reference_model.config), bfl)
    assert storage_dtype(own.model.diffusion_model.img_in.weight) == torch.float8_e4m3fn
    assert weight_scale(own.model.diffusion_model.img_in) == bfl["img_in.scale_weight"].item()
    handle = ParallelHandle(str(path), path.name, ("cpu", "cpu"), "float32", (), None)
    ours = comfy_model.parallel_model(handle, LayoutRequest(ParallelLayout(tp=2)), registries[2])
    want, got = run_case(comfy, own, "dev_4steps"), run_case(comfy, ours, "dev_4steps")
    assert (got - want).abs().max().item() <= 1e-4  # measured 9.5e-7


# Kontext and Fill (issue 13): the recorded cases run exactly as the reference tool ran them, through
# ComfyUI's ReferenceLatent / FluxKontextMultiReferenceLatentMethod and Fill's c_concat (FluxInpaint's
# concat_cond), with the parallel MODEL in place of ComfyUI's own; every recorded model call (inputs,
# reference latents and ComfyUI's own output) must match.
FAMILY_CASES = ["kontext_calls", "kontext_index_calls", "kontext_uxo_calls", "fill_calls"]


@pytest.mark.parametrize("layout", ["tp2", "ring2", "ring2_ulysses2"])
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_kontext_and_fill_through_comfyuis_nodes_match_comfyuis_own_calls(
    comfy, checkpoints, registries, layout, name, tmp_path
):
    from make_comfy_references import run_case as reference_run_case

    case = CASES[name]
    model = parallel_model(comfy, checkpoints, registries, case["variant"], layout)
    with torch.no_grad():
        got = reference_run_case(comfy, {case["variant"]: model}, name, case, tmp_path)
    # img_ids: ComfyUI's own ids inside its Flux (the proxy has none; tests/test_family.py checks the pack's)
    expected = {f"{name}.{k}": v for k, v in reference(name).items() if not k.endswith(".img_ids")}
    assert sorted(got) == sorted(expected)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"{name} {layout}: max |diff| {diff:.2e}")
    assert diff <= 1e-5  # seen: <= 5e-7


def test_auto_plans_for_the_reference_latents_in_comfyuis_conds(comfy, checkpoints, registries, tmp_path):
    """Kontext with layout 'auto': the planner is told the reference latents' tokens, read from ComfyUI's
    own guider conds (ReferenceLatent), and the run still matches ComfyUI's recorded calls."""
    from unittest import mock

    from make_comfy_references import run_case as reference_run_case

    from rocm_parallel.nodes import comfy_model

    name = "kontext_calls"
    case = CASES[name]
    path = checkpoints[case["variant"]]
    handle = ParallelHandle(path, Path(path).name, ("cpu", "cpu"), "float32")
    model = comfy_model.parallel_model(handle, LayoutRequest(None), registries[2])
    spy = mock.patch.object(
        ParallelModel, "auto_layout", autospec=True, side_effect=ParallelModel.auto_layout
    )
    with spy as planned, torch.no_grad():
        got = reference_run_case(comfy, {case["variant"]: model}, name, case, tmp_path)
    recorded = reference(name)
    refs = [recorded[k].shape[-2:] for k in sorted(recorded) if k.startswith("0.ref")]
    tokens = sum(-(-h // 2) * -(-w // 2) for h, w in refs)  # FLUX.1: 2x2 patches, partial ones padded
    assert tokens == 16 and planned.call_args.kwargs["reference_tokens"] == tokens
    expected = {f"{name}.{k}": v for k, v in recorded.items() if not k.endswith(".img_ids")}
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5


def test_a_fill_checkpoint_becomes_comfyuis_flux_inpaint(comfy, checkpoints, registries):
    """ComfyUI's own loader picks FluxInpaint for Fill (in_channels 96), whose concat_cond appends the
    masked image and mask; the parallel MODEL must be the same config."""
    import comfy.supported_models

    fill = parallel_model(comfy, checkpoints, registries, "fill", "tp2")
    assert type(fill.model.model_config) is comfy.supported_models.FluxInpaint
    assert fill.model.model_config.unet_config["in_channels"] == 96


# FLUX.2 (ComfyUI >= 0.3.75): the graph of ComfyUI's FLUX.2 template (RandomNoise + EmptyFlux2LatentImage +
# Flux2Scheduler + FluxGuidance + BasicGuider + KSamplerSelect + SamplerCustomAdvanced, and ReferenceLatent)
# run by the reference tool's own code with the parallel MODEL in place of ComfyUI's own Flux2, loaded by
# ComfyUI from the same random FLUX.2 weights in the BFL single-file layout.
FLUX2_LAYOUTS = ["tp2", "ring2"]


def _needs_flux2() -> None:
    if not FLUX2_CASES:
        pytest.fail(f"{REFERENCES} has no FLUX.2 cases: run make_comfy_references.py with this ComfyUI")
    if not hasattr(importlib.import_module("comfy.model_base"), "Flux2"):
        pytest.skip("this ComfyUI predates FLUX.2 (0.3.75)")


@pytest.fixture(scope="module")
def flux2_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from make_comfy_references import FLUX2_MODELS, flux2_model

    from rocm_parallel.testing.writers import save_mixed_checkpoint

    folder = tmp_path_factory.mktemp("flux2")
    return {
        variant: save_mixed_checkpoint(flux2_model(variant), folder / f"tiny-{variant}.safetensors")
        for variant in FLUX2_MODELS
    }


def run_flux2_case(comfy: dict[str, Any], model: Any, name: str) -> dict[str, torch.Tensor]:
    from make_comfy_references import run_case as reference_run_case

    case = FLUX2_CASES[name]
    with torch.no_grad():
        return reference_run_case(comfy, {case["variant"]: model}, name, case, Path(tempfile.gettempdir()))


@pytest.mark.parametrize("node", ["RocmParallelTPSampler", "RocmParallelRingSampler"])
def test_the_samplers_run_flux2_with_flux2_scheduler_sigmas(
    comfy, flux2_checkpoints, registries, monkeypatch, node
):
    """The TP / Ring Attention Sampler on a FLUX.2 file, fed ComfyUI's EmptyFlux2LatentImage and its
    Flux2Scheduler's SIGMAS (SamplerCustom's path at cfg 1), equal ComfyUI's own FLUX.2 template run."""
    from make_comfy_references import flux2_conditioning, flux2_inputs

    from rocm_parallel.nodes import classes

    _needs_flux2()
    name = "flux2_4steps"
    case = FLUX2_CASES[name]
    monkeypatch.setattr(classes, "REGISTRY", registries[2])
    path = flux2_checkpoints[case["variant"]]
    handle = ParallelHandle(path, Path(path).name, ("cpu", "cpu"), "float32")
    conditioning = flux2_conditioning(comfy, case, flux2_inputs(name, case))
    flux_nodes = comfy["flux_nodes"]
    latent = flux_nodes.EmptyFlux2LatentImage.execute(case["width"], case["height"], 1)[0]
    sigmas = flux_nodes.Flux2Scheduler.execute(case["steps"], case["width"], case["height"])[0]
    args = (
        handle,
        conditioning,
        latent,
        case["seed"],
        case["steps"],
        1.0,
        case.get("sampler", "euler"),
        "simple",
    )
    extra = {"ring_degree": 0, "ulysses_degree": 0} if node == "RocmParallelRingSampler" else {}
    with torch.no_grad():
        (out,) = getattr(classes, node)().sample(*args, 1.0, sigmas=sigmas, **extra)
    diff = (out["samples"].float() - reference(name)["output"]).abs().max().item()
    print(f"{node} FLUX.2: max |diff| {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("layout", FLUX2_LAYOUTS)
@pytest.mark.parametrize("name", ["flux2_4steps", "flux2_klein_3steps", "flux2_ref_2steps"])
def test_flux2_template_graph_on_the_parallel_model_matches_comfyuis_own_flux2(
    comfy, flux2_checkpoints, registries, layout, name
):
    """Mutations tried: the proxy's FLUX.1 patch size (2) or 'offset' as FLUX.2's default reference
    placement, and requiring a pooled vector, each fail here."""
    # importlib: `import comfy.x` here would rebind the `comfy` fixture's name
    _needs_flux2()
    model = parallel_model(comfy, flux2_checkpoints, registries, FLUX2_CASES[name]["variant"], layout)
    assert type(model.model) is importlib.import_module("comfy.model_base").Flux2
    assert type(model.model.model_config) is importlib.import_module("comfy.supported_models").Flux2
    assert model.model.latent_format.latent_channels == 128
    got = run_flux2_case(comfy, model, name)
    ref = reference(name)
    assert torch.equal(got[f"{name}.sigmas"], ref["sigmas"])  # Flux2Scheduler: ComfyUI's own, same size
    diff = (got[f"{name}.output"] - ref["output"]).abs().max().item()
    print(f"{name} {layout}: max |diff| {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("layout", FLUX2_LAYOUTS)
@pytest.mark.parametrize("name", ["flux2_ref_calls", "flux2_klein_itz_calls", "flux2_itz_calls"])
def test_flux2_reference_latents_match_comfyuis_own_calls(comfy, flux2_checkpoints, registries, layout, name):
    """ReferenceLatent on FLUX.2 (two references, placed by FLUX.2's default 'index' method with
    ref_index_scale 10; and by index_timestep_zero, ComfyUI >= 0.17's Edit Model Reference Method: [klein]
    at batch 2 through CFG, [dev] at batch 1): every recorded model call (inputs, references and ComfyUI's
    own output)."""
    _needs_flux2()
    if name not in FLUX2_CASES:  # the references of a ComfyUI that cannot run the case leave it out
        from make_comfy_references import FLUX2_CASES as TOOL_CASES
        from make_comfy_references import ref_methods

        method = TOOL_CASES[name]["ref_method"]
        assert method not in ref_methods(comfy)
        pytest.skip(
            f"ComfyUI {COMFYUI_VERSION} offers no {method!r} (ComfyUI >= 0.17): no reference to match"
        )
    model = parallel_model(comfy, flux2_checkpoints, registries, FLUX2_CASES[name]["variant"], layout)
    got = run_flux2_case(comfy, model, name)
    expected = {f"{name}.{k}": v for k, v in reference(name).items() if not k.endswith(".img_ids")}
    assert sorted(got) == sorted(expected)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"{name} {layout}: max |diff| {diff:.2e}")
    # The recorded outputs came from another CPU, and these cases' larger random init (outputs ~3) shows
    # the float32 kernels' differences: 5.1e-5 on an AVX-512/AMX Xeon; held to the ComfyUI-parity bound.
    assert diff <= 1e-4


def test_flux2_fp8_mixed_matches_comfyuis_own_fp8_mixed_model(comfy, registries, tmp_path_factory):
    """Comfy-Org's fp8 "mixed" layout (block linears float8_e4m3fn with a per-tensor `weight_scale`, the rest
    bf16): ComfyUI 0.3.75 reads which layers are quantized from the safetensors metadata key
    `_quantization_metadata` ({"format_version": "1.0", "layers": {layer: {"format": ...}}},
    comfy/model_detection.py detect_layer_quantization, comfy/ops.py MixedPrecisionOps); later ComfyUI
    versions read per-layer `comfy_quant` tensors. The file carries both. ComfyUI's own model and the
    pack's (fp8 resident, TP 2) sample the same latent."""
    from make_comfy_references import FLUX2_MODELS, flux2_model, load_flux2_in_comfy
    from safetensors.torch import load_file, save_file

    from rocm_parallel.nodes import comfy_model
    from rocm_parallel.testing.writers import save_mixed_checkpoint

    _needs_flux2()
    reference_model = flux2_model("flux2")
    path = tmp_path_factory.mktemp("flux2-fp8") / "tiny-flux2-fp8mixed.safetensors"
    save_mixed_checkpoint(reference_model, path, fp8_mixed=True)
    state = load_file(str(path))
    layers = {
        key.removesuffix(".comfy_quant"): json.loads(bytes(value.tolist()).decode())
        for key, value in state.items()
        if key.endswith(".comfy_quant")
    }
    assert layers and all(v == {"format": "float8_e4m3fn"} for v in layers.values())
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    save_file(state, str(path), metadata=metadata)

    sd, header = importlib.import_module("comfy.utils").load_torch_file(
        str(path), safe_load=True, return_metadata=True
    )
    load = comfy["sd"].load_diffusion_model_state_dict
    try:  # ComfyUI's UNETLoader passes the file's metadata; load_flux2_in_comfy wraps the detection
        comfy["sd"].load_diffusion_model_state_dict = lambda s, model_options: load(
            s, model_options=model_options, metadata=header
        )
        own = load_flux2_in_comfy(comfy, dict(reference_model.config), sd)
    finally:
        comfy["sd"].load_diffusion_model_state_dict = load
    qkv = own.model.diffusion_model.double_blocks[0].img_attn.qkv.weight
    assert type(qkv).__name__ == "QuantizedTensor" and storage_dtype(qkv) == torch.float8_e4m3fn  # really fp8
    handle = ParallelHandle(str(path), path.name, ("cpu", "cpu"), "float32", (), None)
    ours = comfy_model.parallel_model(handle, LayoutRequest(ParallelLayout(tp=2)), registries[2])
    name = "flux2_4steps"
    want = run_flux2_case(comfy, own, name)[f"{name}.output"]
    got = run_flux2_case(comfy, ours, name)[f"{name}.output"]
    flux = registries[2].group_for(handle.devices)
    assert "float8_e4m3fn" in flux.status()[0].parameter_bytes_by_dtype
    diff = (got - want).abs().max().item()
    print(f"{name} fp8 mixed tp2: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    # not vacuous: fp8 rounding moves ComfyUI's own result away from its float32 model's
    assert (want - reference(name)["output"]).abs().max().item() > 1e-3
    assert FLUX2_MODELS["flux2"]["config"]["in_channels"] == 128


@pytest.mark.parametrize("fmt", ["bfl", "kohya"])
def test_flux2_parallel_lora_matches_comfyuis_lora_loader_on_its_own_flux2(
    comfy, flux2_checkpoints, registries, tmp_path, fmt
):
    """A FLUX.2 LoRA on every linear (packed linear1 = [q|k|v|gate|up], shared modulation) in the keys
    ComfyUI maps for FLUX.2 (`diffusion_model.*`, kohya `lora_unet_*`): the ROCm Parallel LoRA at TP 2
    equals ComfyUI's LoraLoaderModelOnly (comfy.sd.load_lora_for_models) on ComfyUI's own Flux2, loaded
    here from the same file."""
    from make_comfy_references import flux2_model, load_flux2_in_comfy
    from safetensors.torch import load_file

    from rocm_parallel.testing.writers import write_random_lora

    _needs_flux2()
    name = "flux2_4steps"
    variant = FLUX2_CASES[name]["variant"]
    config = dict(flux2_model(variant).config)
    lora = write_random_lora(tmp_path / f"flux2-{fmt}.safetensors", config, fmt, seed=5, family="flux2")
    own = load_flux2_in_comfy(comfy, config, load_file(flux2_checkpoints[variant]))
    patches = importlib.import_module("comfy.utils").load_torch_file(lora, safe_load=True)
    own_lora, _ = importlib.import_module("comfy.sd").load_lora_for_models(own, None, patches, 0.8, 0)
    ours = parallel_model(comfy, flux2_checkpoints, registries, variant, "tp2", loras=[(lora, 0.8)])
    want = run_flux2_case(comfy, own_lora, name)[f"{name}.output"]
    got = run_flux2_case(comfy, ours, name)[f"{name}.output"]
    without = reference(name)["output"]
    diff = (got - want).abs().max().item()
    print(
        f"FLUX.2 LoRA {fmt} tp2: max |diff| {diff:.2e}, LoRA effect {(want - without).abs().max().item():.2e}"
    )
    assert (want - without).abs().max().item() > 1e-2  # ComfyUI applied it (no key left unmapped)
    assert diff <= 1e-5
