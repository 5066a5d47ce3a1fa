"""Real kernels on real GPUs: bf16 at FLUX.1-dev size for one rank, and parity across GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_methods import BuildRandom, Inputs

from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import FLUX_DEV, build_flux
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import random_inputs, tiny_flux_config
from rocm_parallel.testing.parallel import apply_tensor_parallel

TESTS_DIR = str(Path(__file__).resolve().parents[1])  # on the workers' sys.path: model_methods lives there


def test_flux_dev_one_rank_of_tp4_in_bf16() -> None:
    """One rank of TP=4 at FLUX.1-dev size: its shard fits, and a 1024x1024 forward gives finite numbers."""
    dims = FluxDims.from_diffusers_config(FLUX_DEV)
    with fake_process_group(4, rank=1):
        model = apply_tensor_parallel(build_flux(FLUX_DEV, device="meta", dtype=torch.bfloat16))
        model.to_empty(device="cuda")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        assert parameter_bytes(model) <= 6.2e9
        inputs = random_inputs(dims, height=1024, width=1024, text_tokens=512).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            out = model(**inputs.as_kwargs(), return_dict=False)[0]
    assert out.shape == (1, 4096, 64)
    assert torch.isfinite(out).all()


def _one_gpu_reference():
    """A small FLUX, its inputs and its bf16 output in one process on cuda:0 (seed 3, as the workers')."""
    config = tiny_flux_config(
        heads=8, head_dim=64, double_blocks=2, single_blocks=2, text_dim=64, pooled_dim=32
    )
    inputs = random_inputs(FluxDims.from_diffusers_config(config), height=256, width=256, text_tokens=32)
    reference = build_flux(config, seed=3, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        output = reference(**inputs.to("cuda", torch.bfloat16).as_kwargs(), return_dict=False)[0]
    return config, inputs, output.float().cpu()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("layout", [{"tp": 2}, {"ring": 2}, {"ulysses": 2}])
def test_parallel_forward_matches_one_gpu(layout: dict) -> None:
    from rocm_parallel.backend.runtime.client import WorkerGroup

    config, inputs, expected = _one_gpu_reference()
    with WorkerGroup(["cuda:0", "cuda:1"], extra_sys_path=[TESTS_DIR], methods=["model_methods"]) as group:
        group.call_all("build_random", BuildRandom(config, 3, "bfloat16", **layout))
        out = group.call("forward", Inputs(inputs.as_kwargs())).output
    # bf16 with a different reduction order: compare relative to the output's scale
    assert (out - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()


# ----------------------------------------------------------------------------------------------------
# Meaningful on ONE GPU: the real kernels, several workers on the same device, doctor.


@pytest.mark.parametrize("kernel_name", ["default", "math"])
def test_gpu_attention_kernel_returns_the_lse_ring_needs(kernel_name: str) -> None:
    """The kernel context parallelism picks on this GPU (ROCm: flash SDPA through AOTriton; CUDA:
    cuDNN) in bf16 at FLUX's head size: output and log-sum-exp match float32 math, LSE as [B, S, H]
    or [B, S, H, 1] (the guard handles both)."""
    from rocm_parallel.backend.parallel.context import choose_attention_kernel, math_forward_op

    device = torch.device("cuda:0")
    kernel = choose_attention_kernel(
        device, torch.bfloat16, None if kernel_name == "default" else kernel_name
    )
    b, s, h, d = 1, 1024, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    with torch.inference_mode():
        out, lse = kernel.forward_op(None, q, k, v, return_lse=True, _save_ctx=False)
        ref_out, ref_lse = math_forward_op(None, q.float(), k.float(), v.float(), return_lse=True)
    assert out.shape == (b, s, h, d)
    assert lse.reshape(b, s, h).shape == (b, s, h) and lse.numel() == b * s * h
    assert (out.float() - ref_out).abs().max().item() <= 2e-2
    assert (lse.reshape(b, s, h).float() - ref_lse.reshape(b, s, h)).abs().max().item() <= 2e-2


def test_gpu_sdpa_is_not_the_math_fallback() -> None:
    """A math-only SDPA (RDNA3/4 without the AOTriton flag, a build without flash for this arch) is ~10x
    slower: doctor reports it; here it fails the tier."""
    with one_gpu_group(1) as group:
        (report,) = group.call_all("attention_kernels")
    assert report.fast, f"only the math SDPA kernel runs on {report.device}: {report.kernels}"


def one_gpu_group(workers: int):
    """`workers` workers on cuda:0; more than one share it through gloo (NCCL refuses two ranks per GPU)."""
    from rocm_parallel.backend.runtime.client import WorkerGroup

    return WorkerGroup(
        ["cuda:0"] * workers,
        backend="gloo" if workers > 1 else None,
        extra_sys_path=[TESTS_DIR],
        methods=["model_methods"],  # build_random, forward: test-only worker methods
    )


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ring": 2}, {"ulysses": 2}])
def test_two_workers_on_one_gpu_match_one_process(layout: dict) -> None:
    """The multi-rank paths (sharded weights, ring merge with the GPU kernel's LSE, Ulysses all-to-all)
    on a machine with one GPU: two workers share cuda:0 and talk through gloo over GPU tensors."""
    config, inputs, expected = _one_gpu_reference()
    with one_gpu_group(2) as group:
        assert [h.backend for h in group.health] == ["gloo", "gloo"]
        group.call_all("build_random", BuildRandom(config, 3, "bfloat16", **layout))
        out = group.call("forward", Inputs(inputs.as_kwargs())).output
    assert (out - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()


def test_doctor_on_the_gpu() -> None:
    """doctor over one GPU worker: the build is ROCm or CUDA, the GPU is listed with its arch and memory,
    the group's collectives are correct and a fast attention kernel runs."""
    from rocm_parallel.backend import doctor

    report = doctor.collect(["cuda:0"])
    machine, group = report["machine"], report["group"]
    assert machine["build"] in ("rocm", "cuda") and machine["torch"] == torch.__version__
    assert machine["gpus"][0]["memory_gb"] > 1 and machine["gpus"][0]["arch"]
    assert "error" not in group, group.get("error")
    assert group["correct"] is True and group["world_size"] == 1
    assert group["attention"][0]["fast"]
    assert "gpu 0:" in doctor.format_report(report)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-3), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("layout", ["tp", "context"])
def test_comfyui_references_on_one_gpu(dtype: str, tolerance: float, layout: str, tmp_path) -> None:
    """The latents a real ComfyUI produced, reproduced by two workers sharing cuda:0 (float32 within
    1e-3, bf16 within 5e-2 of the output's scale: GPU kernels and bf16 rounding, not the 1e-4 of CPU)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from safetensors.torch import save_file
    from test_parallel_sampling import run_case
    from test_sampling import CASES, flux_model, reference

    from rocm_parallel.backend.checkpoint import diffusers_to_bfl
    from rocm_parallel.backend.diffusion.api import ParallelModel

    path = tmp_path / "tiny-flux-dev.safetensors"
    save_file(diffusers_to_bfl(flux_model("dev").state_dict()), str(path))
    with one_gpu_group(2) as group:
        flux = ParallelModel(group=group)
        flux.load(str(path), layout=layout, dtype=dtype)
        for name in sorted(n for n, c in CASES.items() if c["variant"] == "dev"):
            expected = reference(name)["output"]
            diff = (run_case(flux, name) - expected).abs().max().item()
            assert diff <= tolerance * max(1.0, expected.abs().max().item()), (
                f"{layout} {dtype} {name}: {diff:.3g}"
            )


def test_plan_on_this_machines_gpus_prices_their_memory(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from rocm_parallel.backend import cli

    assert cli.main(["plan", "--devices", "all", "--json"]) in (0, 1)  # 1: nothing fits, still priced
    setup = json.loads(capsys.readouterr().out)["setup"]
    assert setup["devices"] == torch.cuda.device_count()
    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    assert setup["memory_gb"] == pytest.approx(smallest / 1e9)


def test_a_parked_text_encoder_leaves_the_gpu(tmp_path: Path) -> None:
    """backend/resident/parking.py on a real GPU: each rank's shard moves to pinned host memory (the GPU's allocated
    bytes drop by at least its weights) and back for the next encode, which gives the same hidden states."""
    from rocm_parallel.backend.diffusion.api import ParallelModel
    from rocm_parallel.backend.encoders.api import ParallelEncoder
    from rocm_parallel.testing.encoder_files import VOCAB, write_encoder

    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with one_gpu_group(2) as workers:
        group = ParallelModel(group=workers)
        encoder = ParallelEncoder(group, write_encoder("t5", tmp_path), slot="te")
        first = encoder.encode(ids).out
        on_gpu = [r.memory.allocated_gb for r in group.status()]
        encoder.place(False)
        parked = [r.memory.allocated_gb for r in group.status()]
        shard_gb = encoder.request.weight_bytes / 1e9
        assert all(a - b >= 0.9 * shard_gb for a, b in zip(on_gpu, parked, strict=True)), (on_gpu, parked)
        assert torch.equal(encoder.encode(ids).out, first)
        assert [r.memory.allocated_gb for r in group.status()] == pytest.approx(on_gpu, abs=shard_gb * 0.1)
