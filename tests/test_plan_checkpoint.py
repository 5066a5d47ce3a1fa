"""`plan --checkpoint` prices the file the user has (its family, released model and weight dtype, read from
its header without torch), and `plan --references` prices reference images as the engine counts them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rocm_parallel.backend import cli
from rocm_parallel.backend.checkpoint import inspect_checkpoint, planned_weight_dtype, save_checkpoint
from rocm_parallel.backend.diffusion import call
from rocm_parallel.backend.family import get_family
from rocm_parallel.backend.plan.checkpoint import inspect_for_plan
from rocm_parallel.testing.gguf_files import save_gguf
from rocm_parallel.testing.header_files import bf16, fp8_blocks, write_released_header
from rocm_parallel.testing.models import tiny_flux2_config, tiny_flux_config, tiny_qwen_image_config
from rocm_parallel.testing.writers import save_mixed_checkpoint

HEAVY = ("torch", "diffusers", "transformers", "safetensors", "numpy", "gguf", "accelerate")  # test_cli.py's
FLUX2_BLOCKS = ("double_blocks.", "single_blocks.")


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = cli.main(["plan", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _tiny_files(folder: Path) -> dict[str, str]:
    """Small files of every kind the loader reads, each as the pack's writers write it."""
    flux = get_family("flux1").build(tiny_flux_config(heads=8, head_dim=128), seed=0)
    flux2 = get_family("flux2").build(tiny_flux2_config(), seed=0)
    qwen = get_family("qwen_image").build(tiny_qwen_image_config(zero_cond_t=True), seed=0)
    flux.save_pretrained(folder / "diffusers-flux")
    # float32 first: .to() below casts the model in place
    return {
        "flux1 full checkpoint (float32)": save_checkpoint(flux, folder / "flux1-full.safetensors", prefix=True),
        "flux1 bf16": save_checkpoint(flux.to(torch.bfloat16), folder / "flux1.safetensors"),
        "flux2 fp8 mixed (comfy_quant)": save_mixed_checkpoint(flux2, folder / "f2-cq.safetensors", fp8_mixed=True),
        "flux2 fp8 mixed (metadata)": save_mixed_checkpoint(flux2, folder / "f2-md.safetensors", fp8_mixed="metadata"),
        "qwen-image-edit-2511": save_checkpoint(qwen, folder / "qwen.safetensors"),
        "flux1 GGUF Q8_0": save_gguf(flux, folder / "flux1-Q8_0.gguf", "Q8_0"),
        "flux1 GGUF Q4_K": save_gguf(flux, folder / "flux1-Q4_K.gguf", "Q4_K"),
        "flux1 diffusers folder": str(folder / "diffusers-flux"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _tiny_files(tmp_path_factory.mktemp("models"))


def test_the_header_says_what_the_loader_says(tiny: dict[str, str]) -> None:
    for kind, path in tiny.items():
        info = inspect_checkpoint(path)
        planned = inspect_for_plan(path)
        assert (planned.family.name, planned.dims) == (info.family, info.dims), kind
        assert planned.weight_dtype == planned_weight_dtype(None, info), kind
        assert planned.preset is None  # tiny: no released model's dims
    expected = {
        "flux2 fp8 mixed (comfy_quant)": "fp8_e4m3fn",
        "flux1 GGUF Q4_K": "Q4_K",
        "flux1 bf16": "compute",
    }
    assert {k: inspect_for_plan(tiny[k]).weight_dtype for k in expected} == expected
    assert inspect_for_plan(tiny["qwen-image-edit-2511"]).name == "Qwen-Image-Edit-2511 (4 heads, 2 blocks)"


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """FLUX.2 [dev] as ComfyUI's fp8 mixed file and as the bf16 release: real headers, sparse data."""
    folder = tmp_path_factory.mktemp("released")
    return {
        "fp8": write_released_header(folder / "flux2_dev_fp8mixed.safetensors", "flux2", "flux2-dev", fp8_blocks(FLUX2_BLOCKS)),
        "bf16": write_released_header(folder / "flux2-dev.safetensors", "flux2", "flux2-dev", bf16),
    }  # fmt: skip


def test_plan_prices_the_dtype_the_file_has(
    released: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = ["--devices", "4", "--memory-gb", "16"]
    rc, by_file = _plan_json(capsys, "--checkpoint", released["fp8"], *gpus)
    rc_model, by_name = _plan_json(capsys, "--model", "flux2-dev", "--weight-dtype", "fp8_e4m3fn", *gpus)
    assert (rc, rc_model) == (0, 0)
    assert by_file["setup"]["model"] == "flux2-dev" and by_file["setup"]["weight_dtype"] == "fp8_e4m3fn"
    assert by_file["layouts"] == by_name["layouts"]
    assert by_file["auto"]["layout"] == "tp 4"
    # the bf16 release does not fit these cards: the refusal still names fp8 and the GGUF that would fit
    assert cli.main(["plan", "--checkpoint", released["bf16"], *gpus]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"checkpoint {released['bf16']}: FLUX.2 [dev] (flux2-dev), linear weights stored as BF16, priced as "
        "the compute dtype"
    )
    assert "use fp8 weights (weight_dtype fp8_e4m3fn: tp 4, 8.7 GB per GPU)" in out
    assert "gguf: a Q8_0 GGUF file of this model fits (tp 4: " in out
    # asked for another dtype than the file's: priced as asked (the loader converts bf16 to fp8 at load)
    assert _plan_json(capsys, "--checkpoint", released["bf16"], "--weight-dtype", "fp8_e4m3fn", *gpus)[0] == 0


def _plan_subprocess(*args: str) -> list[str]:
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['rocm_parallel', 'plan', *{list(args)!r}]\n"
        "try:\n"
        "    runpy.run_module('rocm_parallel', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    print('rc', exc.code)\n"
        f"print('heavy', sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return done.stderr.splitlines() + done.stdout.splitlines()


def test_plan_reads_a_header_without_torch(released: dict[str, str], tiny: dict[str, str]) -> None:
    out = _plan_subprocess("--checkpoint", released["fp8"], "--devices", "4", "--memory-gb", "16")
    assert out[-2:] == ["rc 0", "heavy []"], out[-20:]
    # a .gguf file is read with the gguf package, which imports numpy: that much, and no torch
    out = _plan_subprocess("--checkpoint", tiny["flux1 GGUF Q4_K"])
    assert out[-2:] == ["rc 2", "heavy ['gguf', 'numpy']"], out[-20:]


def test_plan_checkpoint_refusals(
    tiny: dict[str, str], released: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def error(*args: str) -> str:
        assert cli.main(["plan", *args]) == 2
        return capsys.readouterr().err.strip()

    path = tiny["flux1 bf16"]
    assert error("--checkpoint", path) == (
        f"error: --checkpoint '{path}' is a FLUX.1 transformer of 8 heads x 128, 2+2 blocks, which no released "
        "model has (flux1-dev: 24 heads x 128, 19+38 blocks; flux1-schnell: 24 heads x 128, 19+38 blocks); "
        "`plan` keeps the parameter shapes, TP splits and work of the released models only, and deriving them "
        "for other dims builds the model on torch's meta device (torch and diffusers). Plan the released model "
        "nearest to it (--model), or load it with layout 'auto', which plans from the file"
    )
    assert error("--model", "flux2-dev", "--checkpoint", released["fp8"]) == (
        f"error: --model flux2-dev and --checkpoint {released['fp8']}: the file says which model it is; give one "
        "of them"
    )
    gguf = tiny["flux1 GGUF Q4_K"]
    assert error("--checkpoint", gguf, "--weight-dtype", "fp8_e4m3fn").startswith(
        f"error: --weight-dtype fp8_e4m3fn but --checkpoint {gguf} is a Q4_K GGUF file: its blocks are not "
        "converted."
    )
    assert error("--checkpoint", str(tmp_path / "nope.safetensors")).startswith(
        f"error: checkpoint '{tmp_path / 'nope.safetensors'}' does not exist; "
    )
    cut = tmp_path / "cut.safetensors"
    with open(released["fp8"], "rb") as whole:
        cut.write_bytes(whole.read(4 << 20))  # a download stopped early: the header and a little data
    assert error("--checkpoint", str(cut)).startswith(f"error: '{cut}' is truncated or corrupt: ")


def _engine_tokens(
    family: str, latent: tuple[int, ...], references: list[tuple[int, ...]]
) -> tuple[int, int]:
    """(image tokens, reference tokens) as the engine counts them for a call (backend/diffusion/call.py)."""
    info = SimpleNamespace(model_family=get_family(family))
    inputs = {"ref_latents": [torch.empty(shape, device="meta") for shape in references]}
    x = torch.empty(latent, device="meta")
    return call.image_tokens(info, x, inputs), call.reference_tokens(info, inputs)


@pytest.mark.parametrize(
    ("model", "size", "refs", "ref_size", "family", "latent", "ref_latent"),
    [
        ("qwen-image-edit", "1024x768", "2", None, "qwen_image", (1, 16, 1, 96, 128), (1, 16, 1, 96, 128)),
        ("qwen-image-edit-2511", "1024", "1", "832x1216", "qwen_image", (1, 16, 1, 128, 128), (1, 16, 1, 152, 104)),
        ("flux2-dev", "1024", "3", "512", "flux2", (1, 128, 64, 64), (1, 128, 32, 32)),
    ],
)  # fmt: skip
def test_reference_tokens_are_the_engines(
    capsys: pytest.CaptureFixture[str], model: str, size: str, refs: str, ref_size: str | None, family: str,
    latent: tuple[int, ...], ref_latent: tuple[int, ...],
) -> None:  # fmt: skip
    args = ["--model", model, "--size", size, "--references", refs]
    _, answer = _plan_json(capsys, *args, *(["--reference-size", ref_size] if ref_size else []))
    image, references = _engine_tokens(family, latent, [ref_latent] * int(refs))
    assert answer["tokens"]["image"] + answer["tokens"]["references"] == image
    assert answer["tokens"]["references"] == references > 0
    assert answer["tokens"]["sequence"] == image + get_family(family).text.tokens


def test_references_are_priced_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    _, edit = _plan_json(capsys, "--model", "qwen-image-edit", "--references", "1")
    _, plain = _plan_json(capsys, "--model", "qwen-image-edit")
    _, one = _plan_json(capsys, "--model", "qwen-image", "--references", "1")
    assert (edit["tokens"]["references"], plain["tokens"]["references"]) == (4096, 0)
    assert edit["layouts"] == one["layouts"] != plain["layouts"]  # Qwen-Image's weights, one input image
    assert cli.main(["plan", "--model", "wan2.1-t2v-14b", "--references", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --references 1: Wan takes no reference images; leave --references out"
    )
    assert cli.main(["plan", "--model", "qwen-image-edit", "--references", "-1"]) == 2
    assert capsys.readouterr().err == "error: --references -1: give 0 or more reference images\n"


def test_a_gguf_that_does_not_fit_is_told_the_lighter_one_that_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # what `plan --checkpoint` of a Q8_0 FLUX.2 [dev] file prices (its type is the file's weight dtype)
    assert (
        cli.main(
            ["plan", "--model", "flux2-dev", "--weight-dtype", "Q8_0", "--devices", "2", "--memory-gb", "16"]
        )
        == 1
    )
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gguf: "))
    assert line.startswith("gguf: a Q6_K GGUF file of this model fits (tp 2: ") and "; Q8_0 does not." in line
