"""Weight dtype separate from compute dtype: fp8 weights stay resident and are upcast per layer.

What is checked: which parameters stay fp8 and how many bytes a rank holds (equal to the planner's count),
forward and sampled latents equal to upcast-at-load bit for bit (TP, ring, single), conversion of bf16
files to fp8, ComfyUI "scaled fp8" files, LoRAs on fp8 weights, and the error messages, exactly.

Why the bar is equality, not "within bf16 rounding": every e4m3fn and e5m2 value is exactly a bf16, fp16
and fp32 value (3 or 2 mantissa bits, exponents within bf16's range), so the weight an fp8-resident layer
multiplies by is the very tensor an upcast-at-load model holds, and the same kernel runs on it. Any
difference at all would be a bug (a missed scale, a layer that kept its input in fp8, another dtype).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from model_methods import Inputs
from safetensors.torch import load_file, save_file
from torch import nn

from rocm_parallel.backend.checkpoint import CheckpointError, diffusers_to_bfl, inspect_checkpoint, load_model
from rocm_parallel.backend.checkpoint.lora import apply_loras, inspect_lora
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import FLUX_DEV, build_flux
from rocm_parallel.backend.flux.sampling import diffusers_model_fn, run_euler
from rocm_parallel.backend.parallel.tensor import RowParallelLinear, parameter_bytes
from rocm_parallel.backend.parallel.weights import UpcastLinear, compute_dtype
from rocm_parallel.backend.plan import weight_bytes
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.helpers import TEST_CONFIG, sampling_job
from rocm_parallel.testing.models import random_inputs
from rocm_parallel.testing.writers import write_random_lora

CONFIG = TEST_CONFIG  # 8 heads x 16, 2 double + 3 single blocks
DIMS = FluxDims.from_diffusers_config(CONFIG)
FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _bfl(seed: int = 5) -> dict[str, torch.Tensor]:
    return {
        k: v.contiguous() for k, v in diffusers_to_bfl(build_flux(CONFIG, seed=seed).state_dict()).items()
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same random model as an all-fp8 e4m3fn file (as ComfyUI's fp8 FLUX files), e5m2, and bf16."""
    folder = tmp_path_factory.mktemp("fp8")
    bfl = _bfl()
    out = {}
    for name, dtype in (
        ("e4m3fn", torch.float8_e4m3fn),
        ("e5m2", torch.float8_e5m2),
        ("bf16", torch.bfloat16),
    ):
        out[name] = str(folder / f"flux-{name}.safetensors")
        save_file({k: v.to(dtype) for k, v in bfl.items()}, out[name])
    # a LoRA on some linears (fused qkv, single-block linear1 = q|k|v|mlp, the final AdaLN): the others stay fp8
    targets = ["double_blocks.0.img_attn.qkv", "single_blocks.1.linear1", "final_layer.adaLN_modulation.1"]
    out["lora"] = write_random_lora(folder / "lora.safetensors", CONFIG, "kohya", seed=3, targets=targets)
    return out


def _load(path: str, weight_dtype: str, dtype: str = "bfloat16", degree: int = 1, rank: int = 0) -> nn.Module:
    if degree == 1:
        return load_model(path, dtype=dtype, weight_dtype=weight_dtype)
    with fake_process_group(degree, rank):
        return load_model(path, dtype=dtype, weight_dtype=weight_dtype, tp=degree)


def _forward(model: nn.Module) -> torch.Tensor:
    inputs = random_inputs(DIMS, seed=1).to("cpu", compute_dtype(model)).as_kwargs()
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


# --------------------------------------------------------------------------------------------------
# What stays resident, and its bytes


@pytest.mark.parametrize("degree", [1, 2])
def test_fp8_file_keeps_linear_weights_fp8_at_the_planned_bytes(files: dict[str, str], degree: int) -> None:
    """'default' keeps an fp8 file's linear weights fp8 (everything else bf16); the bytes a rank holds
    equal the planner's count with 1-byte linear weights, and 'compute' equals the 2-byte count."""
    for rank in range(degree):
        fp8 = _load(files["e4m3fn"], "default", degree=degree, rank=rank)
        upcast = _load(files["e4m3fn"], "compute", degree=degree, rank=rank)
        for (name, p), (_, q) in zip(fp8.named_parameters(), upcast.named_parameters(), strict=True):
            linear = p.ndim == 2
            assert p.dtype == (torch.float8_e4m3fn if linear else torch.bfloat16), name
            assert q.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), q), name
        layout = ParallelLayout(tp=degree)
        assert parameter_bytes(fp8) == weight_bytes(DIMS, layout, 2, rank=rank, linear_bytes=1)
        assert parameter_bytes(upcast) == weight_bytes(DIMS, layout, 2, rank=rank)
        assert compute_dtype(fp8) == torch.bfloat16
        assert type(fp8.x_embedder) is UpcastLinear and type(upcast.x_embedder) is nn.Linear
        if degree > 1:
            assert isinstance(fp8.transformer_blocks[0].attn.to_out[0], RowParallelLinear)


def test_flux_dev_resident_bytes_halve() -> None:
    """FLUX.1-dev per rank, from the planner (the count the loader matches above): fp8 vs bf16 weights."""
    dims = FluxDims.from_diffusers_config(FLUX_DEV)
    got = {
        (tp, w): weight_bytes(dims, ParallelLayout(tp=tp), 2, linear_bytes=w)
        for tp in (1, 2, 4)
        for w in (1, 2)
    }
    assert got[(1, 2)] == 23_802_816_640  # 11.90 B parameters in bf16
    assert (got[(1, 1)], got[(2, 1)], got[(4, 1)]) == (11_904_493_696, 5_975_251_072, 3_010_629_760)
    assert (got[(2, 2)], got[(4, 2)]) == (11_947_022_464, 6_019_125_376)
    for tp in (1, 2, 4):
        assert 0.500 < got[(tp, 1)] / got[(tp, 2)] < 0.5004


# --------------------------------------------------------------------------------------------------
# Same outputs as upcast-at-load


@pytest.mark.parametrize("stored", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forward_equals_upcast_at_load_bit_for_bit(files: dict[str, str], stored: str, dtype: str) -> None:
    """Mutation tried: `linear_weight` returning the weight without the cast: the forward fails
    ('self and mat2 must have the same dtype, but got BFloat16 and Float8_e4m3fn')."""
    fp8 = _forward(_load(files[stored], "default", dtype))
    upcast = _forward(_load(files[stored], "compute", dtype))
    assert fp8.dtype == getattr(torch, dtype) and torch.equal(fp8, upcast)


def test_sampled_latent_equals_upcast_at_load(files: dict[str, str]) -> None:
    """A whole 4-step bf16 sampling on CPU: the latents are identical (the bar 'within bf16 rounding' is
    met with a difference of 0; see the module docstring for why nothing larger is acceptable)."""
    job = sampling_job(CONFIG, 64, 4, seed=7)
    plan = ParallelModel.check_sample(
        job["positive"], job["latent"], checkpoint=files["e4m3fn"], seed=7, steps=4
    )
    out = {}
    for weights in ("default", "compute"):
        model = _load(files["e4m3fn"], weights)
        out[weights] = run_euler(diffusers_model_fn(model), plan, model_dtype=compute_dtype(model))
    assert out["default"].abs().max() > 0.1  # a real latent
    assert torch.equal(out["default"], out["compute"])


def test_workers_fp8_resident_tp_and_ring_equal_upcast(files: dict[str, str], group2: WorkerGroup) -> None:
    """Through the API on a gloo group: TP=2 (RowParallelLinear, the gathered AdaLN) and ring=2
    (diffusers' context-parallel hooks on the fp8 `proj_out`) give the upcast-at-load output exactly,
    and the status reports the fp8 bytes.

    Mutation tried: `gather_modulation` reading `m.weight` instead of `linear_weight(m, ...)`: the TP
    forward fails on the workers ('self and mat2 must have the same dtype, but got Float and
    Float8_e4m3fn')."""
    flux = ParallelModel(group=group2)
    inputs = random_inputs(DIMS, seed=1).as_kwargs()
    try:
        for layout in ("tp", "context"):
            outs, bytes_ = {}, {}
            for weights in ("fp8_e4m3fn", "compute"):
                flux.unload()
                reports = flux.load(files["e4m3fn"], layout=layout, dtype="float32", weight_dtype=weights)
                assert flux.resident.weight_dtype == weights
                bytes_[weights] = [r.parameter_bytes for r in reports]
                outs[weights] = group2.call("forward", Inputs(inputs)).output
            assert torch.equal(outs["fp8_e4m3fn"], outs["compute"]), layout
            tp = 2 if layout == "tp" else 1
            assert bytes_["fp8_e4m3fn"] == [
                weight_bytes(DIMS, ParallelLayout(tp=tp), 4, rank=r % tp, linear_bytes=1) for r in range(2)
            ]
            assert reports[0].parameter_bytes_by_dtype == {"float32": bytes_["compute"][0]}
    finally:
        flux.unload()


# --------------------------------------------------------------------------------------------------
# Converting to fp8 at load


@pytest.mark.parametrize("weights", ["fp8_e4m3fn", "fp8_e5m2", "float8_e5m2"])
def test_bf16_file_converted_to_fp8(files: dict[str, str], weights: str) -> None:
    model = _load(files["bf16"], weights)
    want = FP8[weights.replace("float8", "fp8")]
    assert model.x_embedder.weight.dtype == want and model.x_embedder.bias.dtype == torch.bfloat16
    stored = load_file(files["bf16"])["img_in.weight"]
    assert torch.equal(model.x_embedder.weight, stored.to(want))


def test_conversion_out_of_range_is_refused(tmp_path: Path) -> None:
    bfl = _bfl()
    bfl["img_in.weight"][0, 0] = 1000.0
    path = tmp_path / "big.safetensors"
    save_file(bfl, str(path))
    with pytest.raises(CheckpointError) as err:
        load_model(path, weight_dtype="fp8_e4m3fn")
    assert str(err.value) == (
        f"'{path}': tensor 'img_in.weight' holds values up to 1000, beyond fp8_e4m3fn's range (+-448); "
        "converting would clip them. Use weight_dtype='fp8_e5m2', 'default' or 'compute'"
    )
    assert load_model(path, weight_dtype="fp8_e5m2").x_embedder.weight.float().abs().max() == 1024


def test_unknown_weight_dtype(files: dict[str, str]) -> None:
    message = (
        "weight_dtype='fp8' is not a weight dtype; use one of default, fp8_e4m3fn, fp8_e5m2, compute "
        "(fp8 weights stay resident at 1 byte each and are upcast per layer to the compute dtype)"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_model(files["bf16"], weight_dtype="fp8")
    with pytest.raises(ConfigError, match=re.escape(message)):
        ParallelModel(["cpu", "cpu"]).check_load(files["bf16"], weight_dtype="fp8")


# --------------------------------------------------------------------------------------------------
# ComfyUI scaled fp8


def write_scaled(path: Path, scale_shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """A scaled fp8 file as ComfyUI writes it (model_base.state_dict_for_saving, ops.scaled_fp8_ops):
    every 2-D weight as fp8(w / s) with its float32 `scale_weight` s, a `scale_input`, the `scaled_fp8`
    marker; other tensors bf16. Returns the file's tensors."""
    out: dict[str, torch.Tensor] = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for k, v in _bfl().items():
        if v.ndim == 2:
            s = v.abs().max() / 448.0
            out[k] = (v / s).to(torch.float8_e4m3fn)
            out[k.removesuffix(".weight") + ".scale_weight"] = s.reshape(scale_shape).float()
            out[k.removesuffix(".weight") + ".scale_input"] = torch.ones((), dtype=torch.float32)
        else:
            out[k] = v.to(torch.bfloat16)
    save_file(out, str(path))
    return out


def test_scaled_fp8_loads_with_its_scales(tmp_path: Path) -> None:
    """Resident: raw fp8 plus the scale, applied per layer; upcast at load: weight.to(bf16) * scale.to(bf16)
    (ComfyUI's arithmetic). Both give the same forward, equal to a model holding those products.

    Mutation tried: `linear_weight` ignoring `scale_weight`: the resident forward no longer equals the
    upcast one."""
    path = tmp_path / "scaled.safetensors"
    stored = write_scaled(path)
    info = inspect_checkpoint(path)
    assert info.scaled_fp8 and len(info.scales) == sum(v.ndim == 2 for v in _bfl().values())
    assert info.quantization == "scaled_fp8"
    resident, upcast = _load(str(path), "default"), _load(str(path), "compute")
    w, s = stored["img_in.weight"], stored["img_in.scale_weight"]
    assert resident.x_embedder.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(resident.x_embedder.scale_weight, s)
    assert torch.equal(upcast.x_embedder.weight, w.to(torch.bfloat16) * s.to(torch.bfloat16))
    assert torch.equal(_forward(resident), _forward(upcast))
    assert parameter_bytes(resident) == weight_bytes(DIMS, ParallelLayout(), 2, linear_bytes=1)


def test_scaled_fp8_errors(tmp_path: Path) -> None:
    per_channel = tmp_path / "per-channel.safetensors"
    write_scaled(per_channel, (1, 1))
    assert inspect_checkpoint(per_channel).scaled_fp8  # one element in any shape is one scale
    tensors = load_file(str(per_channel))
    tensors["img_in.scale_weight"] = torch.ones(tensors["img_in.weight"].shape[0], 1)
    save_file(tensors, str(per_channel))
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(per_channel)
    assert str(err.value) == (
        f"'{per_channel}': 'img_in.scale_weight' is a F32 tensor of shape [128, 1]; ComfyUI scaled fp8 "
        "stores one float scale per weight (shape []), and per-channel or block scales are not supported. "
        "Use a plain fp8, bf16 or fp16 FLUX file"
    )
    path = tmp_path / "scaled.safetensors"
    write_scaled(path)
    with pytest.raises(CheckpointError) as err:
        load_model(path, weight_dtype="fp8_e5m2")
    assert str(err.value) == (
        f"weight_dtype='fp8_e5m2' but '{path}' is a ComfyUI scaled fp8 checkpoint stored as float8_e4m3fn: "
        "its scaled weights are not converted to another fp8 format. Use weight_dtype='default' (keeps the "
        "file's fp8 weights and scales) or 'compute'"
    )


# --------------------------------------------------------------------------------------------------
# LoRA on fp8 weights


@pytest.mark.parametrize("degree", [1, 2])
def test_lora_on_fp8_weights_is_held_in_the_compute_dtype(files: dict[str, str], degree: int) -> None:
    """A patched fp8 weight becomes a compute-dtype weight equal, bit for bit, to the same LoRA on an
    upcast-at-load model (fp8 could not hold the delta: 3 mantissa bits); the forward is identical; and
    removing the LoRA gives back the fp8 load exactly."""
    info = inspect_checkpoint(files["e4m3fn"])
    lora = inspect_lora(files["lora"], info)
    for rank in range(degree):
        with fake_process_group(degree, rank):
            fp8 = load_model(info, dtype="bfloat16", weight_dtype="default", tp=degree)
            upcast = load_model(info, dtype="bfloat16", weight_dtype="compute", tp=degree)
            fresh = {k: v.clone() for k, v in fp8.state_dict().items()}
            patched = apply_loras(fp8, info, [(lora, 0.8)], rank=rank, degree=degree)
            apply_loras(upcast, info, [(lora, 0.8)], rank=rank, degree=degree)
            got, want = fp8.state_dict(), upcast.state_dict()
            for name in patched:
                assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want[name]), name
            assert len(patched) == 3 + 4 + 1
            kept = [k for k, v in got.items() if v.dtype == torch.float8_e4m3fn]
            assert len(kept) == sum(v.ndim == 2 for v in got.values()) - len(patched)
            if degree == 1:
                assert torch.equal(_forward(fp8), _forward(upcast))
            apply_loras(fp8, info, [], restore=patched, rank=rank, degree=degree)
            back = fp8.state_dict()
            assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in fresh.items())


def test_plan_cli_counts_fp8_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m rocm_parallel plan --weight-dtype fp8_e4m3fn`: FLUX.1-dev on 2 x 12 GB. bf16 weights
    (11.95 GB per GPU at TP=2) cannot fit; fp8 (5.98 GB) can."""
    import json

    from rocm_parallel.backend import cli

    def run(*extra: str) -> dict:
        capsys.readouterr()
        cli.main(["plan", "--devices", "2", "--memory-gb", "12", "--json", *extra])
        return json.loads(capsys.readouterr().out)

    bf16, fp8 = run(), run("--weight-dtype", "fp8_e4m3fn")
    weights = {e["layout"]: e["weights_gb"] for e in fp8["layouts"]}
    assert weights["tp 2"] == pytest.approx(5.975, abs=1e-3)
    assert {e["layout"]: e["weights_gb"] for e in bf16["layouts"]}["tp 2"] == pytest.approx(11.947, abs=1e-3)
    assert bf16["auto"] is None and fp8["auto"]["layout"] == "tp 2"
    cli.main(["plan", "--devices", "2", "--weight-dtype", "fp8_e5m2"])
    assert "bfloat16 (fp8_e5m2 weights), 1024x1024" in capsys.readouterr().out


def test_planner_weight_dtype_follows_the_file(files: dict[str, str]) -> None:
    """What `auto` plans with: 'default' is the file's own fp8 (or the compute dtype), names pass through."""
    from rocm_parallel.backend.checkpoint import planned_weight_dtype

    e4m3fn, e5m2, bf16 = (inspect_checkpoint(files[k]) for k in ("e4m3fn", "e5m2", "bf16"))
    assert [planned_weight_dtype(None, i) for i in (e4m3fn, e5m2, bf16)] == [
        "fp8_e4m3fn",
        "fp8_e5m2",
        "compute",
    ]
    assert planned_weight_dtype("compute", e4m3fn) == "compute"
    assert planned_weight_dtype("float8_e5m2", bf16) == "fp8_e5m2"
