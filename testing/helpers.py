"""What both the tests and the benchmarks need, written once: small FLUX configs, a random BFL checkpoint,
device sync, timing with one statistic (the median), a Markdown table, and the meta-device tracer.

Lives outside the shipped package (the wheel has no `testing/`); import it from a checkout as
`rocm_parallel.testing.helpers`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..backend.config import FluxDims, ParallelLayout
from ..backend.demo import DEMO_CONFIG
from ..backend.family import get_family
from ..backend.flux.convert import save_bfl_checkpoint
from ..backend.flux.model import build_flux, random_inputs, tiny_flux_config
from ..backend.parallel.comm import CountCollectives, synchronize
from ..backend.parallel.context import apply_context_parallel
from ..backend.parallel.fake import fake_process_group
from ..backend.parallel.tensor import apply_tensor_parallel
from ..backend.text import markdown_row, markdown_table

# The tests' parallel FLUX: 8 heads (TP and Ulysses 2, 4, 8 divide it) x 16, 2 double + 3 single blocks.
TEST_CONFIG = tiny_flux_config(heads=8, head_dim=16, double_blocks=2, single_blocks=3)
# The smallest FLUX the group benchmarks time (their figures are the group's own cost, not compute).
TINY_CONFIG = tiny_flux_config(heads=4, head_dim=16, text_dim=32, pooled_dim=24)

__all__ = [
    "DEMO_CONFIG",
    "TEST_CONFIG",
    "TINY_CONFIG",
    "flash_attention_on_meta",
    "local_parameter_bytes",
    "markdown_row",
    "markdown_table",
    "measure_on_meta",
    "median_seconds",
    "sampling_job",
    "synchronize",
    "write_random_checkpoint",
    "write_random_lora",
]


def write_random_checkpoint(path: str | Path, config: dict[str, Any], seed: int = 0) -> str:
    """A FLUX with random weights drawn from `seed`, saved as a BFL/ComfyUI single file; returns the path."""
    return save_bfl_checkpoint(build_flux(config, seed=seed), path)


# LoRA key layouts `write_random_lora` writes; the names ComfyUI 0.3.64's `model_lora_keys_unet` maps for
# FLUX (comfy/lora.py): BFL module names under `diffusion_model.`, the same with "." -> "_" under
# `lora_unet_` (kohya / sd-scripts), and diffusers module names under `transformer.` (diffusers / PEFT).
LORA_FORMATS = ("bfl", "kohya", "peft")


def lora_targets(config: dict[str, Any], family: str = "flux1") -> list[str]:
    """Every BFL module of this model that a LoRA can patch: the linears (norm scales are vectors)."""
    shapes = get_family(family).bfl_shapes(config)
    return sorted(k.removesuffix(".weight") for k, s in shapes.items() if len(s) == 2)


def write_random_lora(
    path: str | Path,
    config: dict[str, Any],
    fmt: str,
    *,
    rank: int = 4,
    seed: int = 0,
    alpha: float | None = 2.0,
    targets: list[str] | tuple[str, ...] | None = None,
    relative: float = 0.1,
    family: str = "flux1",
) -> str:
    """A random LoRA for the `family` model of `config` (FLUX.1: `build_flux(config)`) saved as safetensors in format `fmt`; returns the path.

    The factors are drawn once per BFL module in BFL layout (`targets`: BFL module names such as
    'double_blocks.0.img_attn.qkv'; default every linear) from `seed`, then written as
    * "bfl":   `diffusion_model.<module>.lora_down.weight` / `.lora_up.weight` / `.alpha`
    * "kohya": `lora_unet_<module with . as _>.lora_down.weight` / `.lora_up.weight` / `.alpha`
    * "peft":  `transformer.<diffusers module>.lora_A.weight` / `.lora_B.weight`, split per diffusers
      module (qkv -> to_q/to_k/to_v, linear1 -> to_q/to_k/to_v/proj_mlp, the final AdaLN's (shift, scale)
      rows swapped into diffusers' (scale, shift)), with no alpha: ComfyUI then scales by 1, so
      alpha / rank is folded into lora_B.
    so one seed gives the same effective delta `alpha / rank * up @ down` in every format (bit for bit
    when alpha / rank is a power of two, as the default 2 / 4 is). alpha=None writes no alpha (scale 1).
    `relative` sizes the delta's spread against build_flux's weights (std 0.05): 0.1 changes outputs
    visibly without swamping them.
    """
    from safetensors.torch import save_file

    if fmt not in LORA_FORMATS:
        raise ValueError(f"fmt='{fmt}' is not one of {LORA_FORMATS}")
    fam = get_family(family)
    shapes = fam.bfl_shapes(config)
    names = sorted(targets) if targets is not None else lora_targets(config, family)
    scale = 1.0 if alpha is None else alpha / rank
    # each factor entry ~ N(0, sigma^2): delta entries have std scale * sqrt(rank) * sigma^2
    sigma = (relative * 0.05 / (scale * rank**0.5)) ** 0.5
    g = torch.Generator().manual_seed(seed)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        out_features, in_features = shapes[f"{name}.weight"]
        up = torch.randn(out_features, rank, generator=g) * sigma
        down = torch.randn(rank, in_features, generator=g) * sigma
        factors[name] = (up, down)
    tensors: dict[str, torch.Tensor] = {}
    if fmt in ("bfl", "kohya"):
        for name, (up, down) in factors.items():
            key = f"diffusion_model.{name}" if fmt == "bfl" else "lora_unet_" + name.replace(".", "_")
            tensors[f"{key}.lora_up.weight"] = up
            tensors[f"{key}.lora_down.weight"] = down
            if alpha is not None:
                tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
    else:
        for param, source in fam.bfl_sources(config).items():
            module = source.key.removesuffix(".weight")
            if not param.endswith(".weight") or module not in factors:
                continue
            up, down = factors[module]
            rows = source.rows or ((0, up.shape[0]),)
            b = torch.cat([up[r0:r1] for r0, r1 in rows]) * scale
            key = "transformer." + param.removesuffix(".weight")
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
            tensors[f"{key}.lora_A.weight"] = down.clone()
    save_file(tensors, str(path))
    return str(path)


def sampling_job(config: dict[str, Any], size: int, steps: int, seed: int) -> dict[str, Any]:
    """A ComfyUI-shaped job for `ParallelFlux.sample`: random conditioning (16 tokens) and an empty latent."""
    dims = FluxDims.from_diffusers_config(config)
    g = torch.Generator().manual_seed(0)
    positive = [
        [torch.randn(1, 16, dims.text_dim, generator=g), {"pooled_output": torch.randn(1, dims.pooled_dim)}]
    ]
    return {
        "positive": positive,
        "latent": {"samples": torch.zeros(1, 16, size // 8, size // 8)},
        "seed": seed,
        "steps": steps,
    }


def median_seconds(
    fn: Callable[[], Any], repeats: int, device: torch.device | None = None, warmup: int = 1
) -> float:
    """The median wall time of `repeats` calls of `fn` after `warmup` calls, the device synced around each."""
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: DTensor shards count their local part, meta tensors their size."""
    from torch.distributed.tensor import DTensor

    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )


@contextmanager
def flash_attention_on_meta() -> Iterator[None]:
    """Route diffusers' native SDPA call to the flash kernel (meta has kernels for it, no score matrix)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def flash(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
        if attn_mask is not None or enable_gqa:
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _parallelize_like_the_engine(layout: ParallelLayout) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        if layout.tp > 1:
            apply_tensor_parallel(model)
        if layout.ring * layout.ulysses > 1:
            apply_context_parallel(model, layout.ring, layout.ulysses)
        return model

    return apply


def measure_on_meta(
    config: dict[str, Any],
    layout: ParallelLayout,
    width: int,
    height: int,
    batch: int = 1,
    text_tokens: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
    *,
    parallelize: Callable[[nn.Module], nn.Module] | None = None,
    memory: bool = True,
    family: str = "flux1",
) -> dict[str, Any]:
    """One rank of `layout` on the meta device, under the `fake` process group: one forward, traced.

    `family` ("flux1", "flux2": backend/family.py) picks the transformer `config` describes; both have one
    image token per 16 x 16 pixels of width x height.

    The model is parallelised by the engine itself (`apply_tensor_parallel` / `apply_context_parallel`),
    or by `parallelize` (e.g. diffusers' own TP plan). Returns the parameter bytes the rank holds
    (`weights`), the collectives issued (`counts`, `payload` by kind, and the whole `log`), the image
    tokens, and with `memory` the peak of live activations from torch's MemTracker (weights excluded;
    attention runs the CPU flash kernel on meta, standing in for the GPUs' flash kernels: without it SDPA
    on meta falls back to the math path and materialises the score matrix, which no GPU path does).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_flush_denormal(True)  # the fake group's all-gathers return uninitialised memory
    dims = FluxDims.from_diffusers_config(config)
    with fake_process_group(layout.world_size, rank=rank):
        model = get_family(family).build(config, device="meta", dtype=dtype)
        if layout.world_size > 1:
            (parallelize or _parallelize_like_the_engine(layout))(model)
        weights = local_parameter_bytes(model)
        inputs = random_inputs(dims, batch, height, width, text_tokens, device="meta", family=family)
        inputs = inputs.to("meta", dtype)
        if memory:
            for p in model.parameters():
                p.requires_grad_(True)  # MemTracker hooks every parameter's gradient; TP shards have none
            tracker = MemTracker()
            tracker.track_external(model)
            with flash_attention_on_meta(), tracker, CountCollectives() as counter, torch.no_grad():
                model(**inputs.as_kwargs(), return_dict=False)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
            activations = sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k))
        else:
            with CountCollectives() as counter, torch.no_grad():
                model(**inputs.as_kwargs(), return_dict=False)
            activations = None
    return {
        "weights": weights,
        "activations": activations,
        "counts": dict(counter.log.counts),
        "payload": dict(counter.log.payload_bytes),
        "log": counter.log,
        "image_tokens": inputs.hidden_states.shape[1],
    }
