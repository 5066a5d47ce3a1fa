"""The command line answers a wrong input with one line on stderr and exit status 2, never a traceback,
and spells devices as everything else does ('all', '0,1', 'cuda:0,cuda:1', 'cpu x2')."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rocm_parallel.backend import cli


def _error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    return line


def test_demo_refuses_an_unknown_layout_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error_line(["demo", "--layouts", "ring"], capsys) == (
        "error: --layouts 'ring': 'ring' is not a demo layout; use tp or context, or both: 'tp,context'"
    )


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without GPUs")
def test_demo_on_gpus_a_cpu_only_torch_cannot_see(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error_line(["demo", "--devices", "cuda:0,cuda:1"], capsys) == (
        f"error: devices='cuda:0,cuda:1' asks for GPU 0 but no GPU is visible: {_no_gpu_reason()}; or use 'cpu x2' "
        "to test on CPU workers"
    )


def test_demo_takes_the_shared_device_words(capsys: pytest.CaptureFixture[str]) -> None:
    """'cpu x0' reaches the shared parser (the demo used to split on commas: 'cpu x0' was one device)."""
    assert _error_line(["demo", "--devices", "cpu x0"], capsys) == (
        "error: devices='cpu x0' asks for 0 CPU workers; use at least 1, e.g. 'cpu x2'"
    )


def _no_gpu_reason() -> str:
    """What the message says of this torch build on a machine without a GPU (CI runs a CPU-only torch and
    a CUDA build that sees no GPU)."""
    from rocm_parallel.backend.platforms import build_kind, torch_build

    if build_kind() == "cpu":
        return (
            f"torch {torch.__version__} is a CPU-only build. Install the ROCm or CUDA build of torch (README, "
            "section 'Platforms')"
        )
    return f"{torch_build()} sees no GPU (check the driver and HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)"


def test_plan_prices_a_count_of_gpus_that_need_not_be_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--devices", "4", "--size", "512"]) == 0
    assert "4 device(s) x 24 GB" in capsys.readouterr().out.splitlines()[0]


def test_plan_refuses_cpu_workers_and_a_count_of_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert _error_line(["plan", "--devices", "cpu x2"], capsys) == (
        "error: devices='cpu x2' names CPU workers, but the planner prices GPUs; give a GPU count (--devices 4) "
        "or this machine's GPUs ('all', '0,1', 'cuda:0,cuda:1')"
    )
    assert _error_line(["plan", "--devices", "0"], capsys) == (
        "error: devices='0' prices no GPU; give a count of 1 or more, e.g. 4"
    )


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="needs a machine without GPUs")
def test_plan_on_named_gpus_this_torch_cannot_see(capsys: pytest.CaptureFixture[str]) -> None:
    """Named GPUs are this machine's (their memory is read from them); a count prices GPUs elsewhere."""
    assert _error_line(["plan", "--devices", "cuda:0,cuda:1"], capsys) == (
        f"error: devices='cuda:0,cuda:1' asks for GPU 0 but no GPU is visible: {_no_gpu_reason()}; or give a "
        "count to price GPUs that are not here (--devices 4)"
    )


def test_bench_scaling_takes_its_workers_from_the_shared_device_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _error_line(["bench", "scaling", "--workers", "1,4", "--devices", "cpu x2"], capsys) == (
        "error: --workers asks for 4 workers but --devices 'cpu x2' names 2; name at least 4 devices or use "
        "smaller counts"
    )
    assert _error_line(["bench", "scaling", "--devices", "cpu x0"], capsys) == (
        "error: devices='cpu x0' asks for 0 CPU workers; use at least 1, e.g. 'cpu x2'"
    )


def test_plan_prints_a_short_table_unless_full(capsys: pytest.CaptureFixture[str]) -> None:
    """What a user asks first (does it fit, how fast), the fitting layouts first; --full adds the engineering
    columns."""
    args = "plan --model flux2-dev --devices 4 --memory-gb 16 --weight-dtype fp8_e4m3fn".split()
    assert cli.main(args) == 0
    short = capsys.readouterr().out.splitlines()
    assert short[2:4] == ["| layout | per GPU (GB) | fits | step (s) |", "|---|---:|---|---:|"]
    assert short[4].startswith("| tp 4 | 8.7 | yes | ")  # the one layout that fits comes first
    assert "(--full: weights, activations, collectives and bytes sent per layout)" in short
    assert cli.main([*args, "--full"]) == 0
    full = capsys.readouterr().out.splitlines()
    assert full[2].startswith(
        "| layout | weights (GB) | activations (GB) | of which buffers (GB) | per GPU (GB) |"
    )
    assert len(full[2].split("|")) - 2 == 11


def test_plan_imports_no_other_commands_modules() -> None:
    # Every command's arguments come from its own modules (the demo's, each benchmark's), which import the API
    # and the test models; `plan` must build its own parser only (issue 42: it answers in seconds on 2 cores).
    code = (
        "import sys\n"
        "from rocm_parallel.backend.cli import main\n"
        "rc = main(['plan', '--model', 'flux2-dev', '--devices', '4', '--memory-gb', '16', '--json'])\n"
        "others = ('rocm_parallel.benchmarks', 'rocm_parallel.testing', 'rocm_parallel.backend.diffusion.api',\n"
        "          'rocm_parallel.backend.doctor', 'rocm_parallel.backend.flux.demo')\n"
        "print('rc', rc, sorted(m for m in sys.modules if m.startswith(others)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stderr == ""
    assert done.stdout.splitlines()[-1] == "rc 1 []", done.stdout[-2000:]


# What `plan` must not import: torch alone is ~2.4 s of CPU, diffusers and its compiler tens of seconds on a
# busy 2-core machine (issue 42: `plan` answers in under 3 s). The registry holds each family's torch-free
# facts and imports its torch parts on first use (backend/family.py FamilyParts).
HEAVY = ("torch", "diffusers", "transformers", "safetensors", "numpy", "gguf", "accelerate")


def test_plan_through_python_m_imports_no_torch() -> None:
    # `python -m rocm_parallel plan ...` exactly: the package's __init__ (ComfyUI's entry: nodes, routes, the
    # torch range check) runs first, then __main__. A deterministic stand-in for the wall-clock promise, which
    # a loaded machine cannot test: without these modules the command takes ~0.2 s of CPU.
    code = (
        "import runpy, sys\n"
        "sys.argv = ['rocm_parallel', 'plan', '--model', 'flux2-dev', '--devices', '4', '--memory-gb', '16']\n"
        "try:\n"
        "    runpy.run_module('rocm_parallel', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    print('rc', exc.code)\n"
        f"heavy = {HEAVY!r}\n"
        "print('heavy', sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stderr == ""
    out = done.stdout.splitlines()
    assert out[-2:] == ["rc 1", "heavy []"], done.stdout[-2000:]
    # it priced the model: FLUX.2 [dev] needs fp8 weights on 4 x 16 GB
    assert "use fp8 weights (weight_dtype fp8_e4m3fn: tp 4, 8.7 GB per GPU)" in done.stdout
