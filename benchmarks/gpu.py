"""`bench gpu`: what one borrowed GPU can tell the project, in one command of at most 8 minutes.

A GPU is lent to the project now and then, for minutes, with no network (docs/gpu.md: the carried wheels
and the one-line command). This measures, on that one device, everything the CPU suite cannot:

1. **kernels**: the numeric LSE guard's verdict (backend/parallel/lse_check.py) for every attention kernel
   that runs on the device — flash SDPA, memory-efficient SDPA, cuDNN, flash-attn when installed, math;
2. **shards**: FLUX.1-dev, FLUX.2 [dev] with fp8 weights and Qwen-Image, each as rank 0 of TP 2 and TP 4
   (the rest of the group faked: torch's `fake` process group, testing/fake.py, collectives are no-ops),
   built by the engine's own tensor-parallel code with random weights: allocated and peak memory against
   the planner's figures, and one forward at 1024 px, the shard's and the whole model's: seconds, the
   compute-only speed-up TP gives, next to the planner's predicted step (PCIe 4.0 x16 link, this
   device's measured TFLOPS);
3. **compile**: FLUX.1-dev with its repeated blocks compiled by inductor (backend/compile.py) against eager;
4. **fp8**: FLUX.1-dev with its linear weights kept fp8 (backend/parallel/weights.py) against bf16;
5. **ComfyUI beside worker 0**: a real worker group of one worker on the same GPU holds a TP-2 FLUX.1-dev
   share; what ComfyUI's memory manager (comfy.model_management, when importable) sees before and after,
   and whether ComfyUI would still load the text encoders and VAE whole.

Writes `bench-gpu.json` and `bench-gpu.md` into `--out`. `--dry-run` runs the same code on tiny models
of each family at 64 px on the CPU (CI runs it: tests/test_bench_gpu.py); its numbers say nothing about
a GPU. Sections run in order while `--budget-s` lasts; one past it is listed as skipped, never run half.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..backend.config import ConfigError, ParallelLayout
from ..backend.family import ModelFamily, get_family
from ..backend.parallel import context as cp_kernels
from ..backend.parallel.lse_check import check_kernel, device_name
from ..backend.parallel.weights import keep_fp8_resident
from ..backend.text import GB, markdown_table
from ..testing.fake import fake_process_group
from ..testing.helpers import median_seconds, synchronize
from ..testing.meta import local_parameter_bytes
from ..testing.models import random_inputs, tiny_flux2_config, tiny_flux_config, tiny_qwen_image_config

DEFAULT_BUDGET_S = 480.0  # 8 minutes: what one lent GPU session can give (docs/gpu.md)
TP_DEGREES = (2, 4)

# The table of each section: its columns, in order (tests/test_bench_gpu.py checks them against the issue).
COLUMNS: dict[str, tuple[str, ...]] = {
    "kernels": ("kernel", "dtype", "verdict", "fix", "out error", "LSE error", "merge error", "detail"),
    "shards": (
        "model",
        "TP",
        "allocated (GB)",
        "peak (GB)",
        "planner weights (GB)",
        "planner per GPU (GB)",
        "forward (s)",
        "whole model (s)",
        "compute speed-up",
        "planner step (s)",
        "planner speed-up",
    ),
    "compile": ("model", "eager (s)", "compiled (s)", "speed-up", "first call (s)", "max difference"),
    "fp8": ("model", "weights", "allocated (GB)", "peak (GB)", "forward (s)", "max difference"),
    "comfy": ("what", "value"),
}


@dataclass(frozen=True)
class Model:
    label: str
    family: str
    preset: str
    weights: str  # 'compute' or an fp8 dtype: how its linear weights stay resident
    tiny: dict[str, Any]  # the dry run's config: the family's structure, small widths


# 8 heads so that TP 2 and 4 divide them, as in the released models (24 heads FLUX.1 / Qwen, 48 FLUX.2).
MODELS = (
    Model("FLUX.1-dev", "flux1", "flux1-dev", "compute", tiny_flux_config(heads=8, head_dim=16)),
    Model("FLUX.2 [dev] fp8", "flux2", "flux2-dev", "fp8_e4m3fn", tiny_flux2_config(heads=8, head_dim=16)),
    Model("Qwen-Image", "qwen_image", "qwen-image", "compute", tiny_qwen_image_config(heads=8, head_dim=16)),
)


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class Run:
    """One `bench gpu`: the device, the shapes, the clock."""

    device: torch.device
    dry: bool
    size: int
    budget_s: float
    started: float
    repeats: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def config(self, model: Model) -> dict[str, Any]:
        return dict(model.tiny if self.dry else get_family(model.family).presets[model.preset])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="tiny models of each family on the CPU (CI)")
    parser.add_argument("--out", default=".", help="folder for bench-gpu.json and bench-gpu.md (default .)")
    parser.add_argument("--device", default=None, help="the device (default cuda:0; the dry run: cpu)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"start no section after this many seconds (default {DEFAULT_BUDGET_S:.0f}; the dry run: none, so "
        "a loaded CI machine still runs every section)",
    )
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (1024; dry run 64)")


def run(args: argparse.Namespace) -> str:
    dry = args.dry_run
    device = torch.device(args.device or ("cpu" if dry or not torch.cuda.is_available() else "cuda:0"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not dry:
        raise ConfigError(
            f"bench gpu measures the released models on a GPU, and {device} is none (torch sees "
            f"{torch.cuda.device_count()} GPU(s)); run it on a GPU machine (docs/gpu.md), or pass --dry-run "
            "for the tiny CPU run CI makes"
        )
    budget = args.budget_s if args.budget_s is not None else float("inf") if dry else DEFAULT_BUDGET_S
    run_ = Run(device, dry, args.size or (64 if dry else 1024), budget, time.monotonic(), 1 if dry else 2)
    results: dict[str, Any] = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "hip": getattr(torch.version, "hip", None),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dry_run": dry,
        "size": run_.size,
        "budget_s": None if run_.budget_s == float("inf") else run_.budget_s,
        "tflops": device_tflops(device),
        "sections": {},
    }
    sections: dict[str, Callable[[Run, dict[str, Any]], list[dict[str, Any]]]] = {
        "kernels": kernel_rows,
        "shards": shard_rows,
        "compile": compile_rows,
        "fp8": fp8_rows,
        "comfy": comfy_rows,
    }
    for name, section in sections.items():
        if run_.left() <= 0:
            results["sections"][name] = {"skipped": f"the {run_.budget_s:.0f} s budget was spent", "rows": []}
            continue
        started = time.monotonic()
        print(f"bench gpu: {name} ...", flush=True)
        try:
            rows = section(run_, results)
            results["sections"][name] = {"rows": rows, "seconds": time.monotonic() - started}
        except Exception as exc:  # one section failing on a new device must not lose the others' figures
            results["sections"][name] = {"error": f"{type(exc).__name__}: {exc}", "rows": []}
        free_memory()
    results["seconds"] = time.monotonic() - run_.started
    text = markdown(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-gpu.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "bench-gpu.md").write_text(text + "\n")
    print(text)
    return text


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_tflops(device: torch.device) -> float:
    """Sustained matmul TFLOPS of the device in the compute dtype (the planner's `tflops`)."""
    side = 4096 if device.type == "cuda" else 256
    a = torch.randn(
        side, side, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device
    )
    return 2 * side**3 / median_seconds(lambda: a @ a, 5, device) / 1e12


# ---------------------------------------------------------------------------------------------- kernels


def efficient_forward_op(
    ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    return_lse: bool = False, _save_ctx: bool = True, _parallel_config: Any = None,
) -> Any:  # fmt: skip
    """Memory-efficient SDPA in diffusers' forward-op convention (no such op in diffusers): its LSE is
    padded along S to a multiple of 32 on CUDA, one of the layouts the guard must handle."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p, is_causal, scale=scale
    )
    out = out.transpose(1, 2)
    return (out, lse.transpose(1, 2)) if return_lse else out


def device_kernels(device: torch.device) -> dict[str, Any]:
    """Every attention kernel that may run ring attention on `device`, by the name the report uses."""
    if device.type != "cuda":
        return {"cpu_flash": cp_kernels.cpu_flash_forward_op, "math": cp_kernels.math_forward_op}
    found: dict[str, Any] = {}
    for name in ("native_flash", "cudnn", "flash"):
        try:
            found[name] = cp_kernels.choose_attention_kernel(device, torch.bfloat16, name).forward_op
        except Exception:  # not in this diffusers (flash-attn's op needs the package)
            continue
    if "flash" in found:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            del found["flash"]
    return {**found, "efficient (SDPA)": efficient_forward_op, "math": cp_kernels.math_forward_op}


def kernel_rows(run: Run, results: dict[str, Any]) -> list[dict[str, Any]]:
    dtypes = (torch.float32, torch.bfloat16) if run.device.type == "cpu" else (torch.bfloat16, torch.float16)
    rows = []
    for name, op in device_kernels(run.device).items():
        for dtype in dtypes:
            verdict = check_kernel(name, op, run.device, dtype, head_dim=16 if run.dry else 128)
            rows.append(verdict.as_dict())
    return rows


# ---------------------------------------------------------------------------------------------- models


def materialize(
    model: nn.Module, device: torch.device, weights: str, dtype: torch.dtype, seed: int = 0
) -> None:
    """Random weights for a meta (possibly sharded) model, tensor by tensor on `device` (never a second
    full copy); with fp8 `weights`, every linear weight is drawn in the compute dtype and kept fp8."""
    fp8 = None if weights == "compute" else getattr(torch, weights.replace("fp8_", "float8_"))
    g = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            data = torch.empty(param.shape, dtype=dtype, device=device).normal_(0, 0.02, generator=g)
            if fp8 is not None and isinstance(module, nn.Linear) and name == "weight":
                data = data.to(fp8)
            module._parameters[name] = nn.Parameter(data, requires_grad=False)
    if fp8 is not None:
        keep_fp8_resident(model, dtype)


@contextlib.contextmanager
def one_rank(tp: int) -> Iterator[None]:
    """Rank 0 of a TP group of `tp` (the others faked), or a plain process for the whole model."""
    if tp == 1:
        yield
        return
    with fake_process_group(tp, rank=0):
        yield


class Memory:
    """Allocated and peak bytes on the device since `reset` (CUDA's allocator; None on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.base = device, 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) - self.base if self.device.type == "cuda" else None

    def peak(self) -> int | None:
        return (
            torch.cuda.max_memory_allocated(self.device) - self.base if self.device.type == "cuda" else None
        )


def measure_forward(
    run: Run,
    model: Model,
    tp: int,
    weights: str | None = None,
    compile_mode: str = "off",
    output: bool = False,
) -> dict[str, Any]:
    """Rank 0 of TP `tp` (1: the whole model) built by the engine with random weights: bytes held, peak in
    one forward at `run.size`, median seconds of the forward; with `compile_mode`, its first call apart;
    with `output`, the output (on the CPU, float32)."""
    fam = get_family(model.family)
    config = run.config(model)
    memory = Memory(run.device)
    free_memory()
    memory.reset()
    with one_rank(tp), torch.inference_mode():
        net = fam.build(config, device="meta", dtype=run.dtype)
        if tp > 1:
            fam.tensor_parallel(net)
        materialize(net, run.device, weights or model.weights, run.dtype)
        held = memory.allocated()
        inputs = random_inputs(
            fam.dims(config), height=run.size, width=run.size, text_tokens=fam.text.tokens, family=fam
        )
        kwargs = inputs.to(run.device, run.dtype).as_kwargs()

        def forward() -> torch.Tensor:
            return net(**kwargs, return_dict=False)[0]

        out: dict[str, Any] = {"parameter_bytes": local_parameter_bytes(net)}
        out["allocated_bytes"] = held if held is not None else out["parameter_bytes"]
        if compile_mode != "off":
            from ..backend.compile import compile_repeated_blocks

            compile_repeated_blocks(net, compile_mode)
            started = time.perf_counter()
            forward()
            synchronize(run.device)
            out["first_call_s"] = time.perf_counter() - started
        out["seconds"] = median_seconds(forward, run.repeats, run.device)
        out["peak_bytes"] = memory.peak()
        if output:
            out["output"] = forward().float().cpu()
    return out


def planned(run: Run, model: Model, tp: int, tflops: float) -> Any:
    """The planner's estimate for rank 0 of TP `tp` on this device (PCIe 4.0 x16 assumed between GPUs)."""
    from ..backend.plan import PCIE4, Setup, estimate

    fam: ModelFamily = get_family(model.family)
    memory_gb = (
        torch.cuda.get_device_properties(run.device).total_memory / GB if run.device.type == "cuda" else 64
    )
    setup = Setup(
        fam.dims(run.config(model)), width=run.size, height=run.size, batch=1, text_tokens=fam.text.tokens,
        dtype=str(run.dtype).removeprefix("torch."), weight_dtype=model.weights, devices=tp,
        memory_gb=memory_gb, link=PCIE4, tflops=tflops, family=fam.name,
    )  # fmt: skip
    return estimate(setup, ParallelLayout(tp=tp))


def shard_rows(run: Run, results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for model in MODELS:
        whole = measure_forward(run, model, 1)
        whole_plan = planned(run, model, 1, results["tflops"])
        for tp in TP_DEGREES:
            if run.left() <= 0:
                rows.append({"model": model.label, "TP": tp, "skipped": "budget"})
                continue
            shard = measure_forward(run, model, tp)
            plan = planned(run, model, tp, results["tflops"])
            rows.append(
                {
                    "model": model.label,
                    "TP": tp,
                    "allocated_gb": shard["allocated_bytes"] / GB,
                    "peak_gb": None if shard["peak_bytes"] is None else shard["peak_bytes"] / GB,
                    "planner_weights_gb": plan.weights / GB,
                    "planner_per_gpu_gb": plan.per_gpu / GB,
                    "forward_s": shard["seconds"],
                    "whole_s": whole["seconds"],
                    "speedup": whole["seconds"] / shard["seconds"],
                    "planner_step_s": plan.step_s,
                    "planner_speedup": whole_plan.compute_s / plan.compute_s,
                    "whole_allocated_gb": whole["allocated_bytes"] / GB,
                    "whole_peak_gb": None if whole["peak_bytes"] is None else whole["peak_bytes"] / GB,
                }
            )
    return rows


def compile_rows(run: Run, results: dict[str, Any]) -> list[dict[str, Any]]:
    """FLUX.1-dev whole, eager against its repeated blocks compiled (inductor; the dry run: aot_eager,
    dynamo's tracing of the same graphs without code generation, which a CI minute cannot afford)."""
    model, mode = MODELS[0], "aot_eager" if run.dry else "inductor"
    eager = measure_forward(run, model, 1, output=True)
    compiled = measure_forward(run, model, 1, compile_mode=mode, output=True)
    import torch._dynamo

    torch._dynamo.reset()
    return [
        {
            "model": f"{model.label} ({mode})",
            "eager_s": eager["seconds"],
            "compiled_s": compiled["seconds"],
            "speedup": eager["seconds"] / compiled["seconds"],
            "first_call_s": compiled["first_call_s"],
            "max_difference": float((eager["output"] - compiled["output"]).abs().max()),
        }
    ]


def fp8_rows(run: Run, results: dict[str, Any]) -> list[dict[str, Any]]:
    model = MODELS[0]
    rows, outputs = [], {}
    for weights in ("compute", "fp8_e4m3fn"):
        done = measure_forward(run, model, 1, weights=weights, output=True)
        outputs[weights] = done["output"]
        rows.append(
            {
                "model": model.label,
                "weights": str(run.dtype).removeprefix("torch.") if weights == "compute" else weights,
                "allocated_gb": done["allocated_bytes"] / GB,
                "peak_gb": None if done["peak_bytes"] is None else done["peak_bytes"] / GB,
                "forward_s": done["seconds"],
            }
        )
    # fp8 rounds the random weights: a difference of the order of fp8's precision, not a bug
    rows[1]["max_difference"] = float((outputs["compute"] - outputs["fp8_e4m3fn"]).abs().max())
    rows[0]["max_difference"] = 0.0
    return rows


# ---------------------------------------------------------------------------------------------- ComfyUI


def comfy_memory_manager() -> tuple[Any, str]:
    """ComfyUI's `comfy.model_management`, from COMFYUI_PATH or the import path, or None and why not."""
    path = os.environ.get("COMFYUI_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        import comfy.model_management as mm  # type: ignore[import-not-found]
    except Exception as exc:  # not installed here, or it fails to start on this machine
        return (
            None,
            f"ComfyUI is not importable here ({type(exc).__name__}: {str(exc)[:120]}); set COMFYUI_PATH",
        )
    return mm, f"ComfyUI at {Path(mm.__file__).resolve().parents[1]}"


# ComfyUI's own models of a FLUX.1 workflow on GPU 0 (fp16 T5-XXL, CLIP-L, the VAE), in bytes.
TEXT_AND_VAE_BYTES = 9.52e9 + 0.25e9 + 0.17e9


def comfy_rows(run: Run, results: dict[str, Any]) -> list[dict[str, Any]]:
    """A real worker group of one worker on this device holds rank 0's TP-2 share of FLUX.1-dev (the
    planner's figure; the dry run: the tiny model's), and ComfyUI's memory manager is asked what it sees."""
    from ..backend.runtime.client import WorkerGroup
    from .gpu_methods import HoldShare

    mm, where = comfy_memory_manager()
    share = int(planned(run, MODELS[0], 2, results["tflops"]).per_gpu)
    rows = [
        {"what": "ComfyUI", "value": where},
        {"what": "worker 0 holds (TP-2 share, planner)", "value": share},
    ]

    def comfy_view(label: str) -> None:
        if mm is None:
            return
        device = mm.get_torch_device()
        free = mm.get_free_memory(device)
        rows.append({"what": f"ComfyUI get_free_memory, {label}", "value": free})
        rows.append(
            {
                "what": f"ComfyUI would load T5-XXL + CLIP-L + VAE whole, {label}",
                "value": bool(free - mm.minimum_inference_memory() >= TEXT_AND_VAE_BYTES),
            }
        )

    comfy_view("before the worker")
    # the workers import the pack as `rocm_parallel` whatever this process calls it (launch.py)
    with WorkerGroup([str(run.device)], methods=["rocm_parallel.benchmarks.gpu_methods"]) as group:
        held = group.call("hold_share", HoldShare(share))
        rows.append({"what": "worker 0's device free (its torch)", "value": held.free})
        if run.device.type == "cuda":
            rows.append(
                {
                    "what": "this process: device free (torch.cuda.mem_get_info)",
                    "value": torch.cuda.mem_get_info(run.device)[0],
                }
            )
        comfy_view("worker 0 holding its share")
        group.call("hold_share", HoldShare(0))
    if mm is not None:
        rows.append({"what": "ComfyUI minimum_inference_memory", "value": mm.minimum_inference_memory()})
    return rows


# ---------------------------------------------------------------------------------------------- report


def _gb(value: Any) -> str:
    return "n/a (CPU)" if value is None else f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if isinstance(value, bool) else "n/a"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and value > 10**6:
        return f"{value / GB:.2f} GB"
    return str(value)


def _table(name: str, rows: list[dict[str, Any]]) -> list[list[str]]:
    if name == "kernels":
        return [
            [r["kernel"], r["dtype"], r["status"], r["fix"] or "-", _cell(r["out_error"]), _cell(r["lse_error"]),
             _cell(r["merge_error"]), r["detail"]]
            for r in rows
        ]  # fmt: skip
    if name == "shards":
        return [
            [r["model"], r["TP"], *(["skipped (budget)"] * 9)]
            if "skipped" in r
            else [
                r["model"], r["TP"], _gb(r["allocated_gb"]), _gb(r["peak_gb"]), _gb(r["planner_weights_gb"]),
                _gb(r["planner_per_gpu_gb"]), f"{r['forward_s']:.3f}", f"{r['whole_s']:.3f}",
                f"{r['speedup']:.2f}x", f"{r['planner_step_s']:.3f}", f"{r['planner_speedup']:.2f}x",
            ]
            for r in rows
        ]  # fmt: skip
    if name == "compile":
        return [
            [r["model"], f"{r['eager_s']:.3f}", f"{r['compiled_s']:.3f}", f"{r['speedup']:.2f}x",
             f"{r['first_call_s']:.1f}", f"{r['max_difference']:.2g}"]
            for r in rows
        ]  # fmt: skip
    if name == "fp8":
        return [
            [r["model"], r["weights"], _gb(r["allocated_gb"]), _gb(r["peak_gb"]), f"{r['forward_s']:.3f}",
             f"{r['max_difference']:.2g}"]
            for r in rows
        ]  # fmt: skip
    return [[r["what"], _cell(r["value"])] for r in rows]


TITLES = {
    "kernels": "The numeric LSE guard on this device's attention kernels",
    "shards": "Shards as rank 0 of TP 2 / TP 4 (the rest faked) and the whole model: memory and one forward",
    "compile": "Compiled repeated blocks against eager, the whole model",
    "fp8": "fp8 weights kept fp8 against the compute dtype, the whole model",
    "comfy": "ComfyUI's process and worker 0 on the same GPU",
}


def markdown(results: dict[str, Any]) -> str:
    what = (
        "tiny models of each family, CPU: a check that the benchmark runs, no GPU figure"
        if results["dry_run"]
        else "the released models' shapes, random weights"
    )
    out = [
        f"## bench gpu: {results['device']}, torch {results['torch']}, {results['size']} px ({what})",
        "",
        f"Measured matmul: {results['tflops']:.3g} TFLOPS; {results.get('seconds', 0):.0f} s"
        + ("." if results["budget_s"] is None else f" of a {results['budget_s']:.0f} s budget."),
    ]
    for name, section in results["sections"].items():
        out += ["", f"### {TITLES[name]}", ""]
        if "skipped" in section or "error" in section:
            out.append(f"Not measured: {section.get('skipped') or section.get('error')}")
            continue
        out.append(markdown_table(list(COLUMNS[name]), _table(name, section["rows"])))
    return "\n".join(out)
