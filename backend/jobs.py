"""The jobs a worker runs for users: load a checkpoint in a layout, sample, unload, report status.

Where a step runs: `sample` → `flux.sampling.run_euler`, one model forward per step on every rank,
then `WorkerContext.step_done` (progress to the caller, cancel agreed by all ranks).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import CheckpointInfo, apply_loras, inspect_checkpoint, inspect_lora, load_model
from .config import ConfigError, ParallelLayout
from .flux.sampling import FluxConditioning, SamplingPlan, diffusers_model_fn, run_euler
from .parallel.context import apply_context_parallel
from .parallel.tensor import parameter_bytes
from .parallel.weights import compute_dtype, resident_bytes_by_dtype
from .worker import WorkerContext, handler


def _memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated_gb": torch.cuda.memory_allocated(device) / 1e9,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        "free_gb": free / 1e9,
        "total_gb": total / 1e9,
    }


@handler("unload")
def unload(ctx: WorkerContext) -> dict[str, Any]:
    """Drop the resident model and give its memory back to the device."""
    had = ctx.resident.clear()
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rank": ctx.rank, "unloaded": had}


def _apply_loras(
    ctx: WorkerContext, model: torch.nn.Module, info: CheckpointInfo, loras: list[tuple[str, float]], tp: int
) -> dict[str, Any]:
    """Set the model's weights to the checkpoint plus `loras`; undo what the previous set patched.

    What is patched now is kept on the model (`LORA_PATCHED`), so the next change restores exactly
    those parameters, even if a LoRA file changed on disk meanwhile.
    """
    started = time.perf_counter()
    previous = getattr(model, LORA_PATCHED, frozenset())
    parsed = [(inspect_lora(path, info), strength) for path, strength in loras]
    rank, degree = (dist.get_rank(), tp) if tp > 1 else (0, 1)
    patched = apply_loras(
        model, info, parsed, restore=previous, rank=rank, degree=degree, progress=ctx.load_progress
    )
    setattr(model, LORA_PATCHED, patched)
    ctx.synchronize()
    return {"lora_tensors": len(patched | previous), "lora_seconds": time.perf_counter() - started}


# Attribute of a resident model: the parameters that currently hold LoRA deltas.
LORA_PATCHED = "_rocm_parallel_lora_patched"


@handler("load")
def load(
    ctx: WorkerContext,
    checkpoint: str,
    dtype: str | None = None,
    weight_dtype: str | None = None,
    tp: int = 1,
    ring: int = 1,
    ulysses: int = 1,
    attention: str | None = None,
    loras: list[tuple[str, float]] | tuple[tuple[str, float], ...] = (),
) -> dict[str, Any]:
    """Make `checkpoint` resident in the given layout with `loras` ((path, strength) pairs) applied; a
    no-op when it already is. When only the LoRAs differ, only the affected tensors are re-read.

    A failure or cancel while LoRAs are applied leaves some tensors patched and others not: the model is
    dropped then, so no rank keeps weights that no record describes.
    """
    loras = [(str(path), float(strength)) for path, strength in loras]
    key = {
        "checkpoint": checkpoint,
        "dtype": dtype,
        "weight_dtype": weight_dtype,
        "tp": tp,
        "ring": ring,
        "ulysses": ulysses,
        "attention": attention,
    }
    held = ctx.resident.key
    if held is not None and {k: v for k, v in held.items() if k != "loras"} == key:
        if held.get("loras", []) == loras:
            return {**status(ctx), "reused": True}
        model = ctx.resident.model
        ctx.resident.clear()  # until the new set is on every tensor, this rank holds no described model
        try:
            report = _apply_loras(ctx, model, inspect_checkpoint(checkpoint), loras, tp)
        except BaseException:
            del model
            unload(ctx)
            raise
        ctx.resident.set(model, {**key, "loras": loras})
        return {**status(ctx), "reused": True, **report}
    unload(ctx)
    info = inspect_checkpoint(checkpoint)
    layout = ParallelLayout(tp=tp, ring=ring, ulysses=ulysses)
    layout.validate(info.dims, devices=ctx.world_size)
    started = time.perf_counter()
    model = load_model(
        info, device=ctx.device, dtype=dtype, weight_dtype=weight_dtype, tp=tp, progress=ctx.load_progress
    )
    report = _apply_loras(ctx, model, info, loras, tp) if loras else {}
    if layout.ring * layout.ulysses > 1:
        apply_context_parallel(model, ring_degree=ring, ulysses_degree=ulysses, attention=attention)
    ctx.synchronize()
    ctx.resident.set(model, {**key, "loras": loras})
    return {**status(ctx), "reused": False, "seconds": time.perf_counter() - started, **report}


@handler("status")
def status(ctx: WorkerContext) -> dict[str, Any]:
    model = ctx.resident.model
    return {
        "rank": ctx.rank,
        "device": str(ctx.device),
        "loaded": ctx.resident.key,
        # resident parameter bytes (fp8 weights count 1 byte each), also split by dtype
        "parameter_bytes": parameter_bytes(model) if model is not None else 0,
        "parameter_bytes_by_dtype": resident_bytes_by_dtype(model) if model is not None else {},
        **_memory(ctx.device),
    }


def plan_from_data(data: dict[str, Any], device: torch.device) -> SamplingPlan:
    """Rebuild the SamplingPlan the client decided, on this rank's device."""

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    cond = FluxConditioning(**{k: put(v) for k, v in data["cond"].items()})
    fields = {k: put(v) for k, v in data.items() if k != "cond"}
    return SamplingPlan(cond=cond, **fields)


def _agree(ctx: WorkerContext, plan: SamplingPlan) -> None:
    """Every rank must run the same schedule on the same noise, or collectives deadlock or mix images.

    The plan reaches every rank from the same files, so this is a cheap belt-and-braces check: one
    all-gather of a fingerprint before the first step.
    """
    if ctx.world_size == 1:
        return
    fingerprint = torch.tensor(
        [
            len(plan.sigmas),
            float(plan.sigmas.double().sum()),
            float(plan.noise.double().sum()),
            float(plan.cond.encoder_hidden_states.double().sum()),
        ],
        dtype=torch.float64,
        device=ctx.device if ctx.device.type != "cpu" else "cpu",
    )
    gathered = [torch.empty_like(fingerprint) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, fingerprint)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise RuntimeError(f"ranks disagree on the sampling inputs: {[g.tolist() for g in gathered]}")


@handler("sample")
def sample(ctx: WorkerContext, plan: dict[str, Any]) -> dict[str, Any]:
    """Run the whole denoising loop on the resident model; rank 0 returns the latent (VAE space)."""
    model = ctx.resident.model
    if model is None:
        raise ConfigError("no model is loaded on the workers; load a checkpoint first")
    sampling = plan_from_data(plan, ctx.device)
    _agree(ctx, sampling)
    dtype = compute_dtype(model)
    started = time.perf_counter()
    with torch.inference_mode():
        samples = run_euler(diffusers_model_fn(model), sampling, callback=ctx.step_done, model_dtype=dtype)
    ctx.synchronize()
    return {
        "rank": ctx.rank,
        "samples": samples.cpu() if ctx.rank == 0 else None,
        "seconds": time.perf_counter() - started,
        "steps": sampling.steps,
        **_memory(ctx.device),
    }
