"""LoRAs on the sharded model: the three key formats parse to the same deltas, every rank's shard equals
the matching slice of a model merged independently here (plain math on the BFL state dict), removing or
changing LoRAs gives back a fresh load's weights bit for bit, and the error messages, exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from model_methods import Inputs
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from worker_jobs import OnRank

from rocm_parallel.backend.api import ParallelFlux
from rocm_parallel.backend.checkpoint import (
    bfl_to_diffusers,
    diffusers_to_bfl,
    inspect_checkpoint,
    load_model,
)
from rocm_parallel.backend.checkpoint.lora import (
    LoraError,
    apply_loras,
    check_loras,
    delta_slice,
    inspect_lora,
)
from rocm_parallel.backend.client import WorkerError, WorkerGroup
from rocm_parallel.backend.config import ConfigError, FluxDims
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.parallel.tensor import apply_tensor_parallel
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.helpers import TEST_CONFIG
from rocm_parallel.testing.models import random_inputs
from rocm_parallel.testing.writers import write_random_lora

CONFIG = TEST_CONFIG  # 8 heads x 16, 2 double + 3 single blocks
FORMATS = ("bfl", "kohya", "peft")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One random checkpoint (fp32 and fp8 copies) and one random LoRA (seed 3) in each format, plus a
    second LoRA (seed 4, alpha absent, a few targets) to stack."""
    folder = tmp_path_factory.mktemp("lora")
    bfl = {k: v.contiguous() for k, v in diffusers_to_bfl(build_flux(CONFIG, seed=5).state_dict()).items()}
    save_file(bfl, str(folder / "flux.safetensors"))
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in bfl.items()}, str(folder / "flux-fp8.safetensors"))
    out = {"checkpoint": str(folder / "flux.safetensors"), "fp8": str(folder / "flux-fp8.safetensors")}
    for fmt in FORMATS:
        out[fmt] = write_random_lora(folder / f"lora-{fmt}.safetensors", CONFIG, fmt, seed=3)
    out["second"] = write_random_lora(
        folder / "lora-second.safetensors",
        CONFIG,
        "bfl",
        seed=4,
        alpha=None,
        targets=["single_blocks.1.linear1", "double_blocks.0.img_attn.qkv", "final_layer.adaLN_modulation.1"],
    )
    return out


def merged_reference(checkpoint: str, loras: list[tuple[str, float]], dtype: torch.dtype) -> dict:
    """The diffusers state dict of `checkpoint` with BFL-format `loras` merged by plain math, written here
    independently of lora.py: W[module] += strength * alpha / rank * up @ down in float32, in BFL layout,
    then converted with convert.py's `bfl_to_diffusers` (which test_convert checks on its own)."""
    bfl = {k: v.float() for k, v in load_file(checkpoint).items()}
    for path, strength in loras:
        lora = load_file(path)
        for key in lora:
            if not key.endswith(".lora_up.weight"):
                continue
            name = key.removesuffix(".lora_up.weight")
            up, down = lora[key].float(), lora[f"{name}.lora_down.weight"].float()
            alpha = lora.get(f"{name}.alpha")
            scale = 1.0 if alpha is None else alpha.item() / down.shape[0]
            module = name.removeprefix("diffusion_model.")
            bfl[f"{module}.weight"] += (strength * scale) * (up @ down)
    return {k: v.to(dtype) for k, v in bfl_to_diffusers(bfl).items()}


def shard(state: dict, degree: int, rank: int) -> dict:
    """`state` as tensor-parallel rank `rank` of `degree` holds it (apply_tensor_parallel's slicing)."""
    model = build_flux(CONFIG, seed=None)
    model.load_state_dict(state)
    if degree == 1:
        return model.state_dict()
    with fake_process_group(degree, rank):
        return apply_tensor_parallel(model).state_dict()


def assert_close(got: dict, want: dict, tol: float, what: str) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= tol, f"{what}: max abs diff {worst:.3g}"


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}"


# --------------------------------------------------------------------------------------------------
# Parsing


def full_deltas(path: str, checkpoint: str) -> dict[str, torch.Tensor]:
    info = inspect_checkpoint(checkpoint)
    lora = inspect_lora(path, info)
    out: dict[str, torch.Tensor] = {}
    with safe_open(path, "pt") as f:
        for module in lora.modules:
            for target in module.targets:
                d = delta_slice(f, module, target, None, 1.0)
                out[target.param] = out[target.param] + d if target.param in out else d
    return out


def test_three_formats_parse_to_the_same_deltas(files: dict[str, str]) -> None:
    deltas = {fmt: full_deltas(files[fmt], files["checkpoint"]) for fmt in FORMATS}
    for fmt in ("kohya", "peft"):
        assert_equal(deltas[fmt], deltas["bfl"], f"{fmt} vs bfl")
    info = inspect_checkpoint(files["checkpoint"])
    assert [inspect_lora(files[f], info).format for f in FORMATS] == ["bfl", "kohya", "diffusers"]
    params = set(deltas["bfl"])
    # fused BFL targets reach every diffusers part; AdaLN, embedders and plain linears are there too
    for name in (
        "transformer_blocks.0.attn.to_q.weight",
        "transformer_blocks.1.attn.add_v_proj.weight",
        "single_transformer_blocks.2.attn.to_k.weight",
        "single_transformer_blocks.2.proj_mlp.weight",
        "single_transformer_blocks.0.proj_out.weight",
        "single_transformer_blocks.0.norm.linear.weight",
        "transformer_blocks.0.norm1_context.linear.weight",
        "norm_out.linear.weight",
        "x_embedder.weight",
    ):
        assert name in params, name
    # every 2-D weight of the model, nothing else (norm scales and biases are not LoRA targets)
    model = build_flux(CONFIG, device="meta")
    assert params == {n for n, p in model.named_parameters() if p.ndim == 2}


def test_comfyui_key_variants(files: dict[str, str], tmp_path: Path) -> None:
    """ComfyUI's `linear1_qkv` partial key and lora_A/lora_B factors with alpha under `diffusion_model.`
    (AI-toolkit) mean what ComfyUI makes of them; text-encoder keys are skipped."""
    lora = load_file(files["bfl"])
    renamed = {}
    for key, value in lora.items():
        key = key.replace(".lora_up.weight", ".lora_B.weight").replace(".lora_down.weight", ".lora_A.weight")
        if ".single_blocks.1.linear1." in key and not key.endswith("alpha"):
            value = value[: 3 * 128] if key.endswith("lora_B.weight") else value  # q|k|v rows only
        renamed[key.replace(".single_blocks.1.linear1.", ".single_blocks.1.linear1_qkv.")] = value
    renamed["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
    save_file(renamed, str(tmp_path / "variants.safetensors"))
    info = inspect_checkpoint(files["checkpoint"])
    assert inspect_lora(tmp_path / "variants.safetensors", info).skipped == (
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
    )
    got = full_deltas(str(tmp_path / "variants.safetensors"), files["checkpoint"])
    want = full_deltas(files["bfl"], files["checkpoint"])
    assert set(want) - set(got) == {"single_transformer_blocks.1.proj_mlp.weight"}
    assert_equal(got, {k: want[k] for k in got}, "variants vs bfl")


# --------------------------------------------------------------------------------------------------
# Applying on one process: every rank of TP=2 (fake group), fp32 and fp8 -> bf16


def load_rank(checkpoint: str, degree: int, rank: int, dtype: str) -> nn.Module:
    if degree == 1:
        return load_model(checkpoint, dtype=dtype)
    with fake_process_group(degree, rank):
        return load_model(checkpoint, dtype=dtype, tp=degree)


@pytest.mark.parametrize(
    ("stored", "dtype", "tol"), [("checkpoint", "float32", 1e-5), ("fp8", "bfloat16", 2**-7)]
)
def test_each_tp_rank_matches_the_merged_model_and_restores_exactly(
    files: dict[str, str], stored: str, dtype: str, tol: float
) -> None:
    """Mutations tried: (1) `apply_loras` adding the deltas to the current weight instead of a re-read
    from the checkpoint: the s1 -> s2 == fresh s2 check fails (56 tensors differ on rank 0), and so
    would the restore; (2) `delta_slice` taking one contiguous column range for the single blocks'
    packed `proj_out` (attention | mlp) shard: the merged-model check fails on rank 0 (diff 0.04)."""
    info = inspect_checkpoint(files[stored])
    first, second = inspect_lora(files["kohya"], info), inspect_lora(files["second"], info)
    torch_dtype = getattr(torch, dtype)
    stack = [(files["bfl"], 0.7), (files["second"], -1.5)]
    want = [shard(merged_reference(files[stored], stack, torch_dtype), 2, rank) for rank in range(2)]
    for rank in range(2):
        with fake_process_group(2, rank):
            model = load_model(info, dtype=dtype, tp=2)
            original = {k: v.clone() for k, v in model.state_dict().items()}
            patched = apply_loras(model, info, [(first, 0.7), (second, -1.5)], rank=rank, degree=2)
            # bf16: the reference rounds once from float32 too; tolerance is one bf16 step at |w| ~ 0.2
            assert_close(model.state_dict(), want[rank], tol, f"rank {rank}")
            changed = apply_loras(model, info, [(first, 0.3)], restore=patched, rank=rank, degree=2)
            fresh = load_model(info, dtype=dtype, tp=2)
            apply_loras(fresh, info, [(first, 0.3)], rank=rank, degree=2)
            assert_equal(model.state_dict(), fresh.state_dict(), f"rank {rank}: s1 -> s2 vs fresh s2")
            apply_loras(model, info, [], restore=changed, rank=rank, degree=2)
            assert_equal(model.state_dict(), original, f"rank {rank}: removed vs fresh load")


# --------------------------------------------------------------------------------------------------
# Real workers through the API: TP=2 and ring=2


def test_workers_apply_change_and_remove_loras(files: dict[str, str], group2: WorkerGroup) -> None:
    """`ParallelFlux.load(loras=...)` on a gloo group, in both layouts: each rank's weights equal the
    slice of the independently merged model (and so does the forward), changing the strength equals a
    fresh load at that strength, and `loras=()` gives back the fresh load, all bit for bit."""
    flux = ParallelFlux(group=group2)
    ck = files["checkpoint"]
    merged = merged_reference(ck, [(files["bfl"], 0.7)], torch.float32)
    reference = build_flux(CONFIG, seed=None)
    reference.load_state_dict(merged)
    inputs = random_inputs(FluxDims.from_diffusers_config(CONFIG)).as_kwargs()
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]

    def states() -> list[dict]:
        return [r.state for r in group2.call_all("resident_state")]

    try:
        for layout, degree in (("tp", 2), ("context", 1)):
            flux.unload()
            flux.load(ck, layout=layout, dtype="float32")
            fresh = states()
            reports = flux.load(ck, layout=layout, dtype="float32", loras=[(files["peft"], 0.7)])
            assert [r.reused for r in reports] == [True, True]
            assert [r.lora_tensors for r in reports] == [56, 56]
            assert flux.resident.loras == ((files["peft"], 0.7),)
            for rank, state in enumerate(states()):
                assert_close(state, shard(merged, degree, rank % degree), 1e-5, f"{layout} rank {rank}")
            out = group2.call("forward", Inputs(inputs)).output
            assert (out - expected).abs().max().item() <= 1e-5, layout
            flux.load(ck, layout=layout, dtype="float32", loras=[(files["peft"], 0.2)])
            changed = states()
            assert flux.load(ck, layout=layout, dtype="float32", loras=[])[0].lora_tensors == 56
            assert_equal_ranks(states(), fresh, f"{layout}: removed vs fresh load")
            flux.unload()
            flux.load(ck, layout=layout, dtype="float32", loras=[(files["peft"], 0.2)])
            assert_equal_ranks(changed, states(), f"{layout}: 0.7 -> 0.2 vs fresh 0.2")
    finally:
        flux.unload()


def test_failed_lora_apply_leaves_no_rank_half_patched(files: dict[str, str], group2: WorkerGroup) -> None:
    """Rank 1 runs out of memory at its 3rd patched tensor while rank 0 applies all of them: the load
    fails with rank 1's message and no rank keeps a model (each rank drops its half-patched one, the
    API unloads the rest); the next load with the LoRA works. Mutation tried: without the unload in
    `ParallelFlux._load_resident`'s except clause, rank 0 kept the patched model ([key, None]). The
    worker's own drop of a half-patched model is belt and braces behind it: removing it alone passes."""
    flux = ParallelFlux(group=group2)
    ck = files["checkpoint"]
    try:
        flux.load(ck, layout="tp", dtype="float32")
        group2.call("arm_load_failure", OnRank(rank=1, at_step=3))
        with pytest.raises(WorkerError, match=r"^rank 1 \(cpu\): out of memory"):
            flux.load(ck, layout="tp", dtype="float32", loras=[(files["bfl"], 1.0)])
        assert group2.alive and flux.resident is None
        assert [r.loaded for r in flux.status()] == [None, None]
        reports = flux.load(ck, layout="tp", dtype="float32", loras=[(files["bfl"], 1.0)])
        assert [r.lora_tensors for r in reports] == [56, 56]
    finally:
        flux.unload()


def assert_equal_ranks(got: list[dict], want: list[dict], what: str) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_equal(g, w, f"{what}, rank {rank}")


# --------------------------------------------------------------------------------------------------
# Errors: raised in the caller's process (check_load), before any worker starts; exact text.


def _error(files: dict[str, str], loras: list) -> str:
    with pytest.raises(LoraError) as err:
        ParallelFlux(["cpu", "cpu"]).check_load(files["checkpoint"], loras=loras)
    assert isinstance(err.value, ConfigError)
    return str(err.value)


def test_missing_and_not_safetensors(files: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "style.safetensors").write_bytes(b"")
    assert _error(files, [(tmp_path / "styl.safetensors", 1.0)]) == (
        f"LoRA '{tmp_path}/styl.safetensors' does not exist; '{tmp_path}' has: style.safetensors. "
        "Pick one of those, or put the LoRA into that folder"
    )
    torch.save({"a": torch.zeros(2)}, tmp_path / "style.safetensors")
    size = (tmp_path / "style.safetensors").stat().st_size
    assert _error(files, [(tmp_path / "style.safetensors", 1.0)]).startswith(
        f"LoRA '{tmp_path}/style.safetensors' is not a safetensors file (its header length field says "
    )
    (tmp_path / "style.safetensors").write_bytes(b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}")
    assert _error(files, [(tmp_path / "style.safetensors", 1.0)]) == (
        f"LoRA '{tmp_path}/style.safetensors' is truncated or corrupt: its 18 bytes do not start with a "
        "safetensors header. Download or copy it again"
    )
    assert size > 0


def test_no_flux_keys(files: dict[str, str], tmp_path: Path) -> None:
    sdxl = tmp_path / "sdxl.safetensors"
    keys = ["lora_unet_down_blocks_0_attentions_0_proj_in", "lora_unet_mid_block_attentions_0_proj_out"]
    save_file({f"{k}.lora_down.weight": torch.zeros(4, 8) for k in keys}, str(sdxl))
    assert _error(files, [(sdxl, 1.0)]) == (
        f"'{sdxl}' has no FLUX LoRA keys (looked for 'diffusion_model.*', 'lora_unet_*', 'transformer.*' "
        "with lora_up/lora_down or lora_A/lora_B factors); it may be a LoRA for another model (first keys: "
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight, "
        "lora_unet_mid_block_attentions_0_proj_out.lora_down.weight)"
    )
    te = tmp_path / "te.safetensors"
    save_file({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8)}, str(te))
    assert _error(files, [(te, 1.0)]) == (
        f"LoRA '{te}' has only text-encoder keys (1, e.g. "
        "'lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight'), which ROCm Parallel does not "
        "apply: it patches the FLUX transformer only. Apply this LoRA to the CLIP/T5 model with ComfyUI's "
        "LoraLoader"
    )


def test_targets_and_shapes_this_checkpoint_lacks(files: dict[str, str], tmp_path: Path) -> None:
    lora = load_file(files["kohya"])
    path = tmp_path / "bad.safetensors"
    save_file(
        {**lora, "lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight": torch.zeros(384, 4)}, str(path)
    )
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight' targets "
        "'lora_unet_double_blocks_7_img_attn_qkv', which this checkpoint (2 double + 3 single blocks, "
        "hidden 128) does not have; the LoRA was made for a different FLUX model"
    )
    wide = {**lora, "lora_unet_img_in.lora_down.weight": torch.zeros(4, 80)}
    save_file(wide, str(path))
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_img_in.lora_down.weight' has shape [4, 80] but this checkpoint's "
        "'lora_unet_img_in' needs [4, 64]; the LoRA was made for a different FLUX model"
    )
    save_file({**lora, "lora_unet_img_in.dora_scale": torch.ones(128, 1)}, str(path))
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_img_in.dora_scale' is a DoRA patch; ROCm Parallel applies plain LoRA "
        "factors (lora_up/lora_down or lora_A/lora_B, optional alpha) only. Use a plain LoRA file"
    )
    del lora["lora_unet_txt_in.lora_down.weight"]
    save_file(lora, str(path))
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_txt_in.lora_up.weight' has no matching down factor for "
        "'lora_unet_txt_in'; the file is incomplete. Download it again"
    )


def test_strength_must_be_finite(files: dict[str, str]) -> None:
    for bad in (math.nan, math.inf, "1.0"):
        assert _error(files, [(files["bfl"], bad)]) == (
            f"LoRA '{files['bfl']}': strength {bad!r} is not a finite number; use e.g. 1.0 "
            "(0 disables it, negative values invert it)"
        )
    info = inspect_checkpoint(files["checkpoint"])
    assert check_loras([(Path(files["bfl"]), 1)], info) == ((files["bfl"], 1.0),)


@pytest.mark.parametrize("layout", ["tp", "context"])
def test_matches_comfyuis_own_lora_loader(
    group2: WorkerGroup, checkpoints: dict[str, str], tmp_path: Path, layout: str
) -> None:
    """The `lora_bfl` reference: ComfyUI 0.3.64's LoraLoaderModelOnly applied this same random LoRA file
    (rebuilt here from the recorded seed) and sampled with euler / simple; the pack applies it on its
    shards and samples with its own loop, in TP and ring."""
    from test_sampling import ALL_CASES, MODELS, positive, reference

    from rocm_parallel.testing.models import tiny_flux_config

    case, ref = ALL_CASES["lora_bfl"], reference("lora_bfl")
    spec = case["lora"]
    config = tiny_flux_config(**MODELS["dev"]["config"])
    lora = write_random_lora(
        tmp_path / "lora.safetensors", config, spec["format"], rank=spec["rank"], seed=spec["seed"]
    )
    flux = ParallelFlux(group=group2)
    flux.load(checkpoints["dev"], layout=layout, dtype="float32", loras=[(lora, spec["strength"])])
    out = flux.sample(
        positive(ref["cond"], ref["pooled"], case["guidance"]), {"samples": ref["latent"]},
        seed=case["seed"], steps=case["steps"],
    )["samples"]  # fmt: skip
    assert (out - ref["output"]).abs().max().item() <= 1e-4
    plain = flux.sample(
        positive(ref["cond"], ref["pooled"], case["guidance"]), {"samples": ref["latent"]},
        seed=case["seed"], steps=case["steps"],
    )["samples"]  # fmt: skip
    assert torch.equal(plain, out)  # the LoRA stays applied between jobs
    flux.load(checkpoints["dev"], layout=layout, dtype="float32")  # removed: the LoRA made a difference
    without = flux.sample(
        positive(ref["cond"], ref["pooled"], case["guidance"]), {"samples": ref["latent"]},
        seed=case["seed"], steps=case["steps"],
    )["samples"]  # fmt: skip
    assert (without - ref["output"]).abs().max().item() > 1e-2
