"""Compiled blocks (backend/compile.py): parity with the eager model and the exact number of compiles.

The workers compile with 'aot_eager' (dynamo traces the blocks, TP's all-reduce becomes a functional
collective, the graphs run eagerly: what can break is all there, without inductor's code-generation
time); one in-process test runs inductor itself on a single block. `ParallelModel.compiles` holds rank 0's
line for each call in which its backend compiled graphs, so its length is the count of compiling calls.
"""

from __future__ import annotations

import pytest
import torch
from cp_checks import Route
from test_sampling import flux_model

from rocm_parallel.backend.compile import LOG, compile_mode, compile_repeated_blocks
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.flux.forward import flux_call
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.flux.sampling import diffusers_model_fn
from rocm_parallel.backend.flux2.forward import flux2_call, flux2_model_fn
from rocm_parallel.backend.flux2.model import build_flux2
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.models import tiny_flux2_config, tiny_flux_config
from rocm_parallel.testing.writers import save_mixed_checkpoint

TOL = 1e-5


def flux_inputs(height: int = 8, width: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """A cfg > 1 call as ComfyUI batches it: cond and uncond in one batch of two."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(2, 16, height, width, generator=g),
        "context": torch.randn(2, 7, 32, generator=g),
        "y": torch.randn(2, 24, generator=g),
        "guidance": torch.full((2,), 3.5),
    }


def eager(model: torch.nn.Module, inputs: dict[str, torch.Tensor], sigma: float) -> torch.Tensor:
    t = torch.full((2,), sigma)
    with torch.no_grad():
        return flux_call(
            diffusers_model_fn(model), inputs["x"], t, inputs["context"], inputs["y"], inputs["guidance"]
        )


def parallel(flux: ParallelModel, inputs: dict[str, torch.Tensor], sigma: float) -> torch.Tensor:
    t = torch.full((2,), sigma)
    return flux.forward(inputs["x"], t, inputs["context"], inputs["y"], inputs["guidance"])


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.torch_api
def test_tp_compiles_once_per_size_and_matches_eager(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    model = flux_model("dev").float()
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32", compile="aot_eager")
    first, other_prompt = flux_inputs(), flux_inputs(seed=2)  # same shapes, other cond / uncond tensors
    for sigma in (1.0, 0.75, 0.5):  # steps: only the tensors' values change
        assert diff(parallel(flux, first, sigma), eager(model, first, sigma)) <= TOL
    assert diff(parallel(flux, other_prompt, 0.25), eager(model, other_prompt, 0.25)) <= TOL
    assert len(flux.compiles) == 1, flux.compiles  # the first call compiled; steps and prompts did not
    assert "compiled the repeated blocks" in flux.compiles[0] and "2x16x8x8, 2x7x32" in flux.compiles[0]

    wider = flux_inputs(height=6)  # another image size: one recompile, named
    assert diff(parallel(flux, wider, 0.5), eager(model, wider, 0.5)) <= TOL
    assert len(flux.compiles) == 2, flux.compiles
    assert "recompiled (new input size)" in flux.compiles[1] and "2x16x6x8" in flux.compiles[1]
    smaller = flux_inputs(height=4)  # the changed dimension is dynamic now: no more compiles
    assert diff(parallel(flux, smaller, 0.5), eager(model, smaller, 0.5)) <= TOL
    assert len(flux.compiles) == 2, flux.compiles
    flux.unload()


@pytest.mark.torch_api
@pytest.mark.parametrize("through_host", [False, True], ids=["direct", "through_host"])
def test_context_parallel_compiles_around_its_attention(
    group2: WorkerGroup, checkpoints: dict[str, str], through_host: bool
) -> None:
    """Ring attention's dispatch stays eager (parallel/context.py says why): the blocks compile around it,
    once, and the numbers match eager. `through_host`: ring over gloo on a GPU gathers through host memory
    (parallel/comm.py), forced here on CPU; the route must not cost the compile. Mutation tried: the route
    as a dispatch mode around the forward (torch leaves frames uncompiled under one) gave the same numbers
    and no compile at all."""
    group2.call_all("route_collectives_through_host", Route(through_host))
    try:
        model = flux_model("dev").float()
        flux = ParallelModel(group=group2)
        flux.load(checkpoints["dev"], layout="ring 2", dtype="float32", compile="aot_eager")
        inputs = flux_inputs()
        for sigma in (1.0, 0.5):
            assert diff(parallel(flux, inputs, sigma), eager(model, inputs, sigma)) <= TOL
        assert len(flux.compiles) == 1, flux.compiles
        # Two block classes, each in two pieces around its attention call (and the double blocks' second
        # input layout): a bounded number, not one graph per block and step.
        graphs = int(flux.compiles[0].split(" graphs")[0].rsplit(" ", 1)[1])
        assert graphs <= 6, flux.compiles
        routed = [s.routed for s in group2.call_all("context_state")]
        assert all(r > 0 for r in routed) if through_host else routed == [-1, -1]
        flux.unload()
    finally:
        group2.call_all("route_collectives_through_host", Route(False))


def test_flux2_tp_compiled_matches_eager(group2: WorkerGroup, tmp_path: pytest.TempPathFactory) -> None:
    config = tiny_flux2_config(
        heads=8, head_dim=16, double_blocks=2, single_blocks=2, text_dim=24, in_channels=32
    )
    model = build_flux2(config, seed=11)
    path = save_mixed_checkpoint(model, tmp_path / "flux2-tiny.safetensors", comfy_prefix=True)
    g = torch.Generator().manual_seed(3)
    x, context = torch.randn(2, 32, 5, 7, generator=g), torch.randn(2, 9, 24, generator=g)
    t, guidance = torch.tensor([0.8, 0.8]), torch.full((2,), 4.0)
    flux = ParallelModel(group=group2)
    flux.load(path, layout="tp", dtype="float32", compile="aot_eager")
    for sigma in (0.8, 0.4):
        out = flux.forward(x, t * 0 + sigma, context, None, guidance)
        with torch.no_grad():
            ref = flux2_call(flux2_model_fn(model), x, t * 0 + sigma, context, None, guidance, (), "index")
        assert diff(out, ref) <= TOL
    assert len(flux.compiles) == 1, flux.compiles
    flux.unload()


@pytest.mark.torch_api
@pytest.mark.slow
def test_inductor_block_matches_eager_in_process() -> None:
    """Inductor itself (C++ code generated and built) on a one double + one single block FLUX, in this
    process: the smallest model with both block classes, so CI builds two kernels' worth of C++."""
    config = tiny_flux_config(double_blocks=1, single_blocks=1)
    model, reference = build_flux(config, seed=0).float(), build_flux(config, seed=0).float()
    inputs = flux_inputs(height=4, width=4)
    try:
        assert compile_repeated_blocks(model, "inductor") == 2
        assert diff(eager(model, inputs, 0.5), eager(reference, inputs, 0.5)) <= TOL
        assert LOG.graphs == 2  # one graph per block class
        assert diff(eager(model, inputs, 0.25), eager(reference, inputs, 0.25)) <= TOL
        assert LOG.graphs == 2  # another sigma: nothing compiled
    finally:
        torch.compiler.reset()


@pytest.mark.torch_api
def test_a_bad_compile_mode_fails_before_any_worker_starts(checkpoints: dict[str, str]) -> None:
    flux = ParallelModel(["cpu", "cpu"], threads=1)
    with pytest.raises(ConfigError) as error:
        flux.load(checkpoints["dev"], layout="tp", compile="fast")
    assert str(error.value) == (
        "compile='fast' is not a compile mode; use one of off, inductor, aot_eager ('inductor' compiles the "
        "repeated transformer blocks on every worker at the first call, 'off' runs eager)"
    )
    assert not flux.started
    assert compile_mode(None) == "off" and compile_mode(" Inductor ") == "inductor"
