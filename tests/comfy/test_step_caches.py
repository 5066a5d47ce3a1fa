"""ComfyUI's step-cache nodes on the ROCm Parallel Model (issue 24), in a real ComfyUI imported here.

Every cache node the ComfyUI under test ships is applied, as its node does, to ComfyUI's own model
(loaded by ComfyUI from the same weights, in this test) and to the parallel MODEL (TP 2); both then sample
with ComfyUI's KSampler. A cache that wraps whole model calls (EasyCache's diffusion_model wrapper,
LazyCache's predict_noise wrapper) must give ComfyUI's own result within 1e-4 and skip the same calls; a
cache that patches inside the transformer (FluxKVCache's attention patch) is refused by name. A node this
ComfyUI lacks (FluxKVCache before 0.33) is skipped.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -s -p no:cacheprovider -m comfy tests/comfy/test_step_caches.py
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, TESTS_DIR
from test_sampling import flux_model

from rocm_parallel.backend.checkpoint import diffusers_to_bfl, save_checkpoint
from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.nodes import checks
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1800)]

# node id -> (module, class) in the ComfyUI 0.33.0 source: comfy_extras/nodes_easycache.py registers
# EasyCache and LazyCache, comfy_extras/nodes_flux.py FluxKVCache. (WanAnimate2Cache, nodes_wan.py, caches
# Wan's pose branch and only sets a transformer_options key that FLUX models never read.)
EQUAL = {
    "EasyCache": ("comfy_extras.nodes_easycache", "EasyCacheNode"),
    "LazyCache": ("comfy_extras.nodes_easycache", "LazyCacheNode"),
}
REFUSED = {
    "FluxKVCache": ("comfy_extras.nodes_flux", "FluxKVCache", ("patches", ["attn1_patch", "post_input"]))
}
# A run long enough for the caches to skip calls: dpmpp_2m, 24 steps, cfg 2.5 with a negative prompt (one
# batched cond + uncond call per step), as the issue measured LazyCache.
RUN = {"steps": 24, "cfg": 2.5, "sampler": "dpmpp_2m", "scheduler": "simple", "seed": 3, "size": 64}
THRESHOLD = 0.2  # the nodes' default reuse_threshold


@pytest.fixture(scope="module")
def comfy() -> dict[str, Any]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    from make_comfy_references import import_comfy

    return import_comfy(COMFYUI_PATH)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("models") / "tiny-dev.safetensors")
    save_checkpoint(flux_model("dev"), path)
    return path


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    made = Registry(factory=lambda devices: ParallelModel(list(devices), threads=1))
    yield made
    made.close()


def node_class(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        version = importlib.import_module("comfyui_version").__version__
        pytest.skip(f"ComfyUI {version} has no {module}.{name}")


def apply_node(cls: Any, model: Any) -> Any:
    """The node's own code (V3 `execute`, V1 method otherwise) with its default inputs."""
    if cls.__name__ == "FluxKVCache":
        return cls.execute(model)[0]
    return cls.execute(model, THRESHOLD, 0.15, 0.95, False)[0]


def own_model(comfy: dict[str, Any]) -> Any:
    from make_comfy_references import load_in_comfy

    reference = flux_model("dev")
    return load_in_comfy(comfy, dict(reference.config), diffusers_to_bfl(reference.state_dict()))


def parallel_model(checkpoint: str, registry: Registry) -> Any:
    from rocm_parallel.nodes import comfy_model

    handle = ParallelHandle(checkpoint, Path(checkpoint).name, ("cpu", "cpu"), "float32")
    return comfy_model.parallel_model(handle, LayoutRequest(ParallelLayout(tp=2)), registry)


def sample(comfy: dict[str, Any], model: Any) -> torch.Tensor:
    from make_comfy_references import cond_for

    positive, _ = cond_for("dev", 1, 501, 3.5)
    negative, _ = cond_for("dev", 1, 901, 3.5)
    side = RUN["size"] // 8
    latent = {"samples": torch.zeros(1, 16, side, side)}
    with torch.no_grad():
        out = comfy["nodes"].common_ksampler(
            model, RUN["seed"], RUN["steps"], RUN["cfg"], RUN["sampler"], RUN["scheduler"], positive, negative,
            latent,
        )[0]  # fmt: skip
    return out["samples"].float()


def counted(model: Any) -> list[int]:
    """Counts the real forwards of ComfyUI's own Flux (img_in runs once per call that is not skipped)."""
    calls: list[int] = []
    model.model.diffusion_model.img_in.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("node", sorted(EQUAL))
def test_a_cache_node_on_the_parallel_model_equals_comfyuis_own_model_with_it(
    comfy, checkpoint, registry, node
):
    cls = node_class(*EQUAL[node])
    own = own_model(comfy)
    own_calls = counted(own)
    plain = sample(comfy, own)
    assert len(own_calls) == RUN["steps"]  # one batched cond + uncond call per step without a cache
    own_calls.clear()
    want = sample(comfy, apply_node(cls, own))
    ours = parallel_model(checkpoint, registry)
    runner = ours.model.diffusion_model.runner
    got = sample(comfy, apply_node(cls, ours))
    diff = (got - want).abs().max().item()
    effect = (want - plain).abs().max().item()
    print(f"{node}: max |diff| {diff:.2e}; calls {runner.calls} (ComfyUI's own {len(own_calls)}) of "
          f"{RUN['steps']}; the cache moved ComfyUI's own result by {effect:.2e}")  # fmt: skip
    assert len(own_calls) < RUN["steps"]  # not vacuous: the cache skipped calls on ComfyUI's own model ...
    assert runner.calls == len(own_calls)  # ... and the same ones on the workers
    assert effect > 1e-3  # ... which changed the image
    assert diff <= 1e-4


@pytest.mark.parametrize("node", sorted(REFUSED))
def test_a_cache_that_patches_inside_the_transformer_is_refused_by_name(comfy, checkpoint, registry, node):
    module, name, (kind, patches) = REFUSED[node]
    ours = apply_node(node_class(module, name), parallel_model(checkpoint, registry))
    with pytest.raises(RuntimeError) as err:
        sample(comfy, ours)
    # FluxKVCache is refused by name, with the node that does run (nodes/checks.py KV_CACHE_MESSAGE)
    expected = checks.KV_CACHE_MESSAGE if name == "FluxKVCache" else checks.patches_message(kind, patches)
    assert str(err.value) == expected


def test_a_diffusion_model_wrapper_reaching_for_the_blocks_is_refused_by_name(comfy, checkpoint, registry):
    """A wrapper around the whole call may read the model (`executor.class_obj`) but its layers are in the
    workers: reaching for them is refused with the patch message naming the wrapper, and no call reaches
    the workers. Mutation tried: without the AttributeError conversion in ParallelDiffusionModel.forward this
    failed with a bare AttributeError."""
    import comfy.patcher_extension as extension

    def reaches_inside(executor, *args, **kwargs):
        blocks = executor.class_obj.double_blocks  # what a block-level cache would read
        return executor(*args, **kwargs) if blocks else None

    ours = parallel_model(checkpoint, registry).clone()
    ours.add_wrapper_with_key(extension.WrappersMP.DIFFUSION_MODEL, "block_cache", reaches_inside)
    with pytest.raises(RuntimeError) as err:
        sample(comfy, ours)
    assert str(err.value) == checks.patches_message("diffusion_model wrappers", ["block_cache"])
    assert ours.model.diffusion_model.runner.calls == 0
