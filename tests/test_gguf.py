"""GGUF diffusion models (ComfyUI-GGUF's files): read with the `gguf` package, split on quantization-block
boundaries, held quantized and dequantized per layer with ComfyUI-GGUF's formulas, LoRAs at call time.

What is checked:
* the torch dequantizers (backend/parallel/ggml.py, ComfyUI-GGUF's formulas) against the `gguf` package's
  numpy ones: equal after float16 rounding where a value is one product d x q (Q8_0, Q4_0, Q5_0: exact
  in float32), within float16 steps where it is more (Q4_1, Q5_1, the K-quants: ComfyUI-GGUF rounds each
  intermediate to float16, numpy computes in float32); the comfy tier compares them with ComfyUI-GGUF's own dequant.py bit for bit;
* headers: family, config, stored types and bytes; refusals by name (NF4 and other foreign quantizations,
  GGML types without a torch dequantizer, text-encoder GGUFs, damaged files, fp8 conversion);
* each rank's shard: its blocks, dequantized, equal the single-process dequantized model sharded, at TP 2
  and 4 for Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and F16; a split inside a block is refused with the degrees that
  work;
* on gloo workers: TP 2, TP 4, ring 2 and tp 2 x ring 2 equal the single-process dequantized model's call;
* LoRAs (every kind, DoRA on both axes, biases) patched at call time equal the same LoRAs on the
  dequantized-at-load model bit for bit, on every rank.
Files are written with the `gguf` package's GGUFWriter and, where it has them, its quantizers
(testing/gguf_files.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rocm_parallel.backend.checkpoint import (
    CheckpointError,
    apply_loras,
    diffusers_to_bfl,
    inspect_checkpoint,
    inspect_lora,
    load_model,
)
from rocm_parallel.backend.diffusion.api import ParallelFlux
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.forward import flux_call
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.flux.sampling import diffusers_model_fn
from rocm_parallel.backend.parallel.ggml import QUANTIZED, dequantize
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.backend.parallel.weights import is_held_quantized, linear_weight, resident_bytes_by_dtype
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.gguf_files import save_gguf, write_gguf
from rocm_parallel.testing.models import tiny_flux_config
from rocm_parallel.testing.parallel import apply_tensor_parallel
from rocm_parallel.testing.writers import LORA_KINDS, write_random_lora

# hidden 1024, MLP 4096: at TP 4 a row-parallel shard is 256 or 1024 values per row, whole K-quant
# super-blocks (256 values), so every type splits at every degree tested.
CONFIG = tiny_flux_config(heads=8, head_dim=128, double_blocks=1, single_blocks=1)
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "F16")
SEED = 7


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("unet")
    model = build_flux(CONFIG, seed=SEED)
    return {q: save_gguf(model, folder / f"tiny-flux-{q}.gguf", q) for q in TYPES}


def _gguf_tensors(path: str, qtype: str) -> list[tuple[np.ndarray, tuple[int, ...], object]]:
    reader = gguf.GGUFReader(path)
    shape = lambda t: tuple(int(v) for v in reversed(t.shape.tolist()))  # noqa: E731
    return [
        (np.array(t.data), shape(t), t.tensor_type) for t in reader.tensors if t.tensor_type.name == qtype
    ]


def test_block_sizes_are_ggmls() -> None:
    for name, (block, size, _) in QUANTIZED.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (block, size), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_matches_the_gguf_packages_numpy(tmp_path: Path, qtype: str) -> None:
    """Mutation tried: Q4_K's nibbles taken high-first (max error 1.0 against values of 0.15)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 512, generator=g) * 0.05
    path = write_gguf({"w.weight": weight}, tmp_path / f"{qtype}.gguf", qtype)
    ((data, shape, kind),) = _gguf_tensors(path, qtype)
    ours = dequantize(torch.from_numpy(data), qtype, shape)
    ref = torch.from_numpy(gguf.quants.dequantize(data, kind)).reshape(shape)
    assert ours.dtype == torch.float16 and ours.shape == (48, 512)
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):  # d * q alone: one rounding either way
        assert torch.equal(ours, ref.half())
    else:
        step = (ours.float() - ref).abs().max().item() / ref.abs().max().item()
        assert step <= 2e-3, step  # a few float16 steps of the block's largest value
    assert (ref - weight).abs().max().item() <= 0.35 * weight.abs().max().item()  # a real quantization


def _random_blocks(qtype: str, rows: int, values: int, seed: int) -> np.ndarray:
    """`rows` rows of `values` values of `qtype` as random blocks: every quant, sub-scale and sign bit drawn
    at random (the `gguf` package quantizes none of Q2_K, Q3_K, IQ4_NL, IQ4_XS, so no encoder of ours decides
    which bits occur), the float16 scale fields (SCALE_BYTES) set to random finite values of either sign."""
    from rocm_parallel.backend.parallel.ggml import SCALE_BYTES

    rng = np.random.default_rng(seed)
    block, size, _ = QUANTIZED[qtype]
    blocks = rng.integers(0, 256, (rows * values // block, size), dtype=np.uint8)
    start, stop = SCALE_BYTES[qtype]
    scales = (rng.standard_normal((blocks.shape[0], (stop - start) // 2)) * 0.05).astype(np.float16)
    blocks[:, start:stop] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _accepted_types() -> list[str]:
    from rocm_parallel.backend.checkpoint.gguf_header import supported_types

    return supported_types().split(", ")


@pytest.mark.parametrize("qtype", _accepted_types())
def test_every_type_the_loader_accepts_reads_as_the_gguf_package_dequantizes(
    tmp_path: Path, qtype: str
) -> None:
    """Each GGML type the loader accepts, stored in a file, read back by the loader (`read_gguf`, whole and in
    column pieces as a row-parallel shard reads it) against the `gguf` package's own numpy dequantizer of the
    same bytes: exact for the plain types, within a few float16 steps of each block's largest value for the
    quantized ones (ComfyUI-GGUF's formulas round intermediates to float16, numpy keeps float32). The bytes are
    random (`_random_blocks`), so a formula that is wrong for some bit patterns is seen: a finiteness check
    is not enough (a sign flip in Q2_K's minimum passes one).

    Mutations tried, each failing this test for its type alone (errors in units of a block's largest value;
    unbroken: at most 1.0e-3): Q2_K's `- dmin * m` as `+ dmin * m` (2.2) and its minima read from the scales'
    low nibble (1.0); Q3_K's high bit not subtracting 4 (1.0) and its scale offset 32 as 31 (0.040); IQ4_NL's
    nibbles taken high first (1.9) and its sign flipped (2.0); IQ4_XS's scale offset 32 as 31 (0.053)."""
    from rocm_parallel.backend.checkpoint.gguf import read_gguf, read_gguf_header

    rows, values = 4, 1024  # four super-blocks (256) or 32 blocks (32) per row
    if qtype in QUANTIZED:
        data = _random_blocks(qtype, rows, values, seed=len(qtype) * 31 + sum(map(ord, qtype)))
    else:
        rng = np.random.default_rng(5)
        data = rng.standard_normal((rows, values)).astype(np.float32)
        data = data.astype(np.float16) if qtype == "F16" else data
        data = (data.view(np.uint32) >> 16).astype(np.uint16) if qtype == "BF16" else data
    writer = gguf.GGUFWriter(path=None, arch="flux")
    writer.add_tensor("w.weight", data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    path = tmp_path / f"{qtype}.gguf"
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ((data_read, shape, kind),) = _gguf_tensors(str(path), qtype)
    assert shape == (rows, values)
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(data_read, kind), dtype=np.float32)).reshape(
        shape
    )
    stored = read_gguf_header(path)[0]["w.weight"]
    block = QUANTIZED[qtype][0] if qtype in QUANTIZED else 1
    whole = read_gguf(stored, ((0, rows),), None, torch.float32, torch.device("cpu"))
    pieces = read_gguf(
        stored, ((1, 3),), ((block, 2 * block), (values - block, values)), torch.float32, torch.device("cpu")
    )
    expected_pieces = torch.cat([ref[1:3, block : 2 * block], ref[1:3, values - block :]], dim=1)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    if qtype not in QUANTIZED:
        assert torch.equal(whole, ref) and torch.equal(pieces, expected_pieces)
        return
    per_block = ref.reshape(-1, block).abs().amax(dim=1, keepdim=True)
    error = ((whole - ref).reshape(-1, block).abs() / per_block).max().item()
    assert error <= 2e-3, error  # four float16 steps of each block's largest value
    assert (pieces - expected_pieces).abs().max().item() <= 2e-3 * ref.abs().max().item()


def test_inspect_reads_family_config_and_types(files: dict[str, str], tmp_path: Path) -> None:
    info = inspect_checkpoint(files["Q4_K"])
    assert (info.family, info.format, info.quantization) == ("flux1", "bfl", "gguf")
    assert info.config == {**CONFIG, "axes_dims_rope": tuple(CONFIG["axes_dims_rope"])}
    assert info.stored_dtypes == ("Q4_K", "float16", "float32")
    data = sum(t.n_bytes for t in gguf.GGUFReader(files["Q4_K"]).tensors)
    assert info.stored_bytes == data
    prefixed = save_gguf(build_flux(CONFIG, seed=SEED), tmp_path / "prefixed.gguf", "Q8_0", prefix=True)
    assert inspect_checkpoint(prefixed).prefix == "model.diffusion_model."


def test_quantized_weights_stay_blocks_and_compute_like_dequantized_at_load(files: dict[str, str]) -> None:
    from rocm_parallel.testing.models import random_inputs

    inputs = random_inputs(FluxDims.from_diffusers_config(CONFIG)).as_kwargs()
    for qtype in ("Q8_0", "Q4_K"):
        quantized = load_model(files[qtype])
        dense = load_model(files[qtype], weight_dtype="compute")
        held = [m for m in quantized.modules() if is_held_quantized(m)]
        assert held and all(m.weight.dtype == torch.uint8 for m in held)
        by_dtype = resident_bytes_by_dtype(quantized)  # the status report's split
        assert sorted(by_dtype) == sorted({qtype, "float32"}) and sum(by_dtype.values()) == parameter_bytes(
            quantized
        )
        assert by_dtype[qtype] == sum(m.weight.numel() for m in held)
        assert parameter_bytes(quantized) < 0.3 * parameter_bytes(dense)
        with torch.no_grad():
            a = quantized(**inputs, return_dict=False)[0]
            b = dense(**inputs, return_dict=False)[0]
        assert torch.equal(a, b), qtype


def _dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A loaded model's state as values: held blocks dequantized as a call would."""
    out = dict(model.state_dict())
    for name, module in model.named_modules():
        if is_held_quantized(module):
            out[f"{name}.weight"] = linear_weight(module, torch.float32)
    return out


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("degree", [2, 4])
def test_each_rank_holds_its_blocks_of_the_dequantized_model(
    files: dict[str, str], qtype: str, degree: int
) -> None:
    """Mutation tried: row-parallel byte ranges starting at the value offset instead of its block's byte
    offset (fails at TP 2)."""
    full = load_model(files[qtype], weight_dtype="compute")
    for rank in range(degree):
        with fake_process_group(degree, rank):
            want = apply_tensor_parallel(load_model(files[qtype], weight_dtype="compute")).state_dict()
            got = _dequantized(load_model(files[qtype], tp=degree))
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), (qtype, degree, rank, key)
    del full


def test_a_split_inside_a_block_is_refused_with_the_degrees_that_work(tmp_path: Path) -> None:
    config = tiny_flux_config(heads=6, head_dim=128, double_blocks=1, single_blocks=1)  # hidden 768
    path = save_gguf(build_flux(config, seed=1), tmp_path / "q4k.gguf", "Q4_K")
    with fake_process_group(2, 0), pytest.raises(CheckpointError) as err:
        load_model(path, tp=2)
    assert str(err.value) == (
        f"'{path}': tp_degree=2 would split the rows of tensor 'single_blocks.0.linear2.weight' (Q4_K, "
        "blocks of 256 values, 3840 values per row) at value 384, inside a quantization block; each rank "
        "must hold whole blocks. Use tp 3, or a file with smaller blocks (Q8_0, Q4_0: 32 values)"
    )
    with fake_process_group(3, 2):
        load_model(path, tp=3)  # 256 values per rank: whole super-blocks


def test_the_api_refuses_the_split_before_any_worker_runs(tmp_path: Path) -> None:
    config = tiny_flux_config(heads=6, head_dim=128, double_blocks=1, single_blocks=1)
    path = save_gguf(build_flux(config, seed=1), tmp_path / "q4k.gguf", "Q4_K")
    flux = ParallelFlux(["cpu", "cpu"])
    with pytest.raises(CheckpointError, match="tp_degree=2 would split the rows"):
        flux.check_load(path, layout="tp")
    assert not flux.started


def test_nf4_and_other_foreign_quantizations_are_named(tmp_path: Path) -> None:
    bfl = diffusers_to_bfl(build_flux(tiny_flux_config(), seed=1).state_dict())
    weight = "double_blocks.0.img_attn.qkv.weight"
    nf4 = {
        **bfl,
        f"{weight}.absmax": torch.ones(4),
        f"{weight}.quant_state.bitsandbytes__nf4": torch.zeros(8),
    }
    path = tmp_path / "flux1-dev-bnb-nf4.safetensors"
    save_file({k: v.contiguous() for k, v in nf4.items()}, str(path))
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(path)
    assert str(err.value) == (
        f"'{path}' is a bitsandbytes NF4 (4-bit) file (tensor '{weight}.quant_state.bitsandbytes__nf4'); this "
        "loader does not read that quantization. Use a GGUF file of the same model (Q4_K or Q4_0 is about "
        "NF4's size, Q8_0 about fp8's; this loader reads it from models/diffusion_models or models/unet and "
        "splits it across the GPUs), or an fp8, bf16 or fp16 .safetensors file"
    )
    svd = {**bfl, "double_blocks.0.img_attn.qkv.wscales": torch.ones(4)}
    save_file({k: v.contiguous() for k, v in svd.items()}, str(tmp_path / "svdq.safetensors"))
    with pytest.raises(CheckpointError, match="is a Nunchaku SVDQuant"):
        inspect_checkpoint(tmp_path / "svdq.safetensors")


def test_gguf_refusals(files: dict[str, str], tmp_path: Path) -> None:
    # a GGML type ComfyUI-GGUF has no torch dequantizer for
    writer = gguf.GGUFWriter(path=None, arch="flux")
    writer.add_tensor(
        "img_in.weight", np.zeros((4, 66), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS
    )
    odd = tmp_path / "iq2.gguf"
    writer.write_header_to_file(path=str(odd))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(odd)
    assert str(err.value).startswith(f"'{odd}': tensor 'img_in.weight' is stored as IQ2_XXS; the pack reads")
    # a text encoder
    t5 = tmp_path / "t5-v1_1-xxl-encoder-Q8_0.gguf"
    write_gguf({"enc.blk.0.attn_q.weight": torch.zeros(64, 64)}, t5, "Q8_0", arch="t5encoder")
    with pytest.raises(CheckpointError, match="is a GGUF text encoder \\(architecture 't5encoder'\\)"):
        inspect_checkpoint(t5)
    # truncated
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(files["Q8_0"]).read_bytes()[:100_000])
    with pytest.raises(CheckpointError, match=f"'{cut}' is truncated or corrupt"):
        inspect_checkpoint(cut)
    # fp8 conversion
    with pytest.raises(CheckpointError, match="is a quantized GGUF file \\(Q8_0, float16, float32\\)"):
        load_model(files["Q8_0"], weight_dtype="fp8_e4m3fn")


def _one_process(path: str, call: dict) -> torch.Tensor:
    model = load_model(path, weight_dtype="compute")
    with torch.no_grad():
        return flux_call(
            diffusers_model_fn(model),
            call["x"],
            call["timestep"],
            call["context"],
            call["y"],
            call["guidance"],
        )


def _call() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(2, 16, 6, 10, generator=g),
        "timestep": torch.tensor([0.4, 0.8]),
        "context": torch.randn(2, 5, 32, generator=g),
        "y": torch.randn(2, 24, generator=g),
        "guidance": torch.tensor([3.5, 2.0]),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("groups", "layouts"), [(2, ("tp 2", "ring 2")), (4, ("tp 4", "tp 2 x ring 2"))],
                         indirect=["groups"], ids=["2", "4"])  # fmt: skip
def test_workers_equal_the_dequantized_model(
    files: dict[str, str], groups: WorkerGroup, layouts: tuple[str, ...]
) -> None:
    call = _call()
    flux = ParallelFlux(group=groups)
    worst = {}
    for qtype in TYPES:
        want = _one_process(files[qtype], call)
        for layout in layouts:
            flux.load(files[qtype], layout=layout, dtype="float32")
            out = flux.forward(call["x"], call["timestep"], call["context"], call["y"], call["guidance"])
            worst[(qtype, layout)] = (out - want).abs().max().item()
    flux.unload()
    print(f"max |diff| per (type, layout): {worst}")
    assert max(worst.values()) <= 1e-5, worst


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_loras_at_call_time_equal_loras_on_the_dequantized_weights(
    files: dict[str, str], tmp_path: Path, degree: int
) -> None:
    """Every kind, DoRA on both axes and bias differences, on every rank. Mutation tried: linear_weight
    skipping the call-time patch (fails)."""
    info = inspect_checkpoint(files["Q4_K"])
    path = write_random_lora(
        tmp_path / "lora.safetensors",
        CONFIG,
        "kohya",
        kind=LORA_KINDS,
        dora=(None, "output", "input"),
        bias=True,
    )
    lora = inspect_lora(path, info)
    for rank in range(degree):
        with fake_process_group(degree, rank):
            dense = load_model(info, weight_dtype="compute", tp=degree)
            quantized = load_model(info, tp=degree)
            for model in (dense, quantized):
                apply_loras(model, info, [(lora, 0.8)], rank=rank, degree=degree)
        got, want = _dequantized(quantized), dense.state_dict()
        assert sum(getattr(m, "weight_patch", None) is not None for m in quantized.modules()) >= 20
        for key, value in want.items():
            assert torch.equal(got[key], value), (degree, rank, key)
        # removing the LoRA gives the file's weights back
        apply_loras(quantized, info, [], restore=lora.params, rank=rank, degree=degree)
        assert all(
            getattr(m, "weight_patch", None) is None for m in quantized.modules() if is_held_quantized(m)
        )


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_the_planner_prices_what_each_rank_holds(files: dict[str, str], degree: int) -> None:
    """The planner's bytes per rank (the file's type's bytes per value) against what load_model holds."""
    from rocm_parallel.backend.checkpoint import planned_weight_dtype
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.plan import Setup, weight_bytes

    info = inspect_checkpoint(files["Q4_K"])
    assert planned_weight_dtype(None, info) == "Q4_K"
    assert planned_weight_dtype("compute", info) == "compute"
    linear = Setup(info.dims, weight_dtype="Q4_K").linear_bytes
    planned = weight_bytes(info.dims, ParallelLayout(tp=degree), 4, linear_bytes=linear)
    with fake_process_group(degree, degree - 1):
        held = parameter_bytes(load_model(files["Q4_K"], tp=degree))
    # the planner prices every 2-D weight at Q4_K; the file keeps the 2-D tensors whose rows are no whole
    # super-blocks (the three narrow embedders) in F16, held whole in the compute dtype (float32 here)
    plain = [
        t for t in gguf.GGUFReader(files["Q4_K"]).tensors if len(t.shape) == 2 and t.tensor_type.name == "F16"
    ]
    assert len(plain) == 3
    assert held - planned == round(sum(int(t.n_elements) for t in plain) * (4 - linear))


def test_plan_names_the_least_quantized_gguf_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    from rocm_parallel.backend.cli import main
    from rocm_parallel.backend.plan import Setup, plan
    from rocm_parallel.backend.plan.gguf import LADDER

    argv = [
        "plan",
        "--model",
        "flux2-dev",
        "--devices",
        "2",
        "--memory-gb",
        "16",
        "--weight-dtype",
        "fp8_e4m3fn",
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("gguf: "))
    assert line.startswith("gguf: a Q6_K GGUF file of this model fits (tp 2: ") and "; Q8_0 does not." in line
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.flux2.model import FLUX2_DEV

    dims = get_family("flux2").dims(FLUX2_DEV)
    fits = {
        q: any(
            e.fits
            for e in plan(
                Setup(dims, devices=2, memory_gb=16, weight_dtype=q, family="flux2", text_tokens=512)
            )
        )
        for q in LADDER[:2]
    }
    assert fits == {"Q8_0": False, "Q6_K": True}


@pytest.mark.parametrize("qtype", sorted(QUANTIZED))
def test_the_nan_check_reads_each_formats_scales(qtype: str) -> None:
    """SCALE_BYTES must point at the scales the formula multiplies by: an inf written there makes the
    dequantized block non-finite, and block_scales (what the loader checks) sees it."""
    from rocm_parallel.backend.parallel.ggml import SCALE_BYTES, block_scales

    block, size, _ = QUANTIZED[qtype]
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (2, size), generator=g, dtype=torch.uint8)
    start, stop = SCALE_BYTES[qtype]
    data[:, start:stop] = torch.tensor([0x00, 0x3C] * ((stop - start) // 2), dtype=torch.uint8)  # 1.0
    assert torch.isfinite(dequantize(data, qtype, (2, block))).all()
    data[0, start : start + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # float16 inf
    values = dequantize(data, qtype, (2, block))
    assert not torch.isfinite(values[0]).all() and torch.isfinite(values[1]).all()
    assert not torch.isfinite(block_scales(data, qtype)).all()


def test_a_nan_in_a_quantized_tensor_is_refused_at_load(tmp_path: Path) -> None:
    bfl = diffusers_to_bfl(build_flux(CONFIG, seed=SEED).state_dict())
    bfl["double_blocks.0.img_mlp.2.weight"][5, 7] = float("nan")
    path = write_gguf(bfl, tmp_path / "nan.gguf", "Q8_0")
    with pytest.raises(
        CheckpointError, match=re.escape("tensor 'double_blocks.0.img_mlp.2.weight' holds NaN values")
    ):
        load_model(path)


@pytest.mark.parametrize("family", ["flux2", "qwen_image"])
def test_flux2_and_qwen_image_files_load_by_family_and_shard_on_blocks(tmp_path: Path, family: str) -> None:
    """FLUX.2 and Qwen-Image GGUF files (ComfyUI's key names, arch 'flux' / 'qwen_image'): the family and
    config come from the names and shapes, and each TP 2 / TP 4 rank's blocks are the dequantized model's
    shard."""
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.testing.models import tiny_flux2_config, tiny_qwen_image_config

    config = (
        tiny_flux2_config(heads=8, head_dim=128, double_blocks=1, single_blocks=1)
        if family == "flux2"
        else tiny_qwen_image_config(heads=8, head_dim=128, blocks=1)
    )
    fam = get_family(family)
    path = save_gguf(fam.build(config, seed=2), tmp_path / f"{family}-Q4_K.gguf", "Q4_K")
    info = inspect_checkpoint(path)
    assert (info.family, info.quantization) == (family, "gguf") and "Q4_K" in info.stored_dtypes
    assert {k: v for k, v in info.config.items() if k in config} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in info.config
    }
    for degree in (2, 4):
        for rank in (0, degree - 1):
            with fake_process_group(degree, rank):
                want = apply_tensor_parallel(load_model(path, weight_dtype="compute")).state_dict()
                got = _dequantized(load_model(path, tp=degree))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], v) for k, v in want.items()), (family, degree, rank)
