"""LoRAs on the sharded model, as ComfyUI computes them: every adapter kind (LoRA, LoHa, LoKr in its three
layouts, each with DoRA on either axis; .diff and .diff_b) in every key format ComfyUI maps (BFL, kohya,
diffusers/PEFT, LyCORIS), on FLUX.1 and FLUX.2, on every tensor-parallel rank and on real TP 2 / ring 2
workers, equals a model merged here by ComfyUI's own formulas (written below from comfy/lora.py,
comfy/weight_adapter/*.py and comfy/utils.py `flux_to_diffusers` of ComfyUI 0.3.75 and 0.33, whose LoRA math
is the same); removing or changing LoRAs gives back a fresh load's weights bit for bit; what is refused is
refused before any worker starts, with exact messages."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from model_methods import Inputs
from safetensors.torch import load_file, save_file
from torch import nn
from worker_jobs import OnRank

from rocm_parallel.backend.checkpoint import (
    bfl_to_diffusers,
    diffusers_to_bfl,
    inspect_checkpoint,
    load_model,
)
from rocm_parallel.backend.checkpoint.lora import LoraError, apply_loras, check_loras, inspect_lora
from rocm_parallel.backend.checkpoint.lora.values import scan_values
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.family import get_family
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.helpers import TEST_CONFIG
from rocm_parallel.testing.models import random_inputs, tiny_flux2_config
from rocm_parallel.testing.parallel import apply_tensor_parallel
from rocm_parallel.testing.writers import LORA_KINDS, write_random_lora

CONFIGS = {
    "flux1": TEST_CONFIG,  # 8 heads x 16, 2 double + 3 single blocks
    "flux2": tiny_flux2_config(heads=4, head_dim=16, double_blocks=2, single_blocks=2),
}
FACTORED = tuple(k for k in LORA_KINDS if k != "diff")  # the kinds DoRA applies to
FORMATS = ("bfl", "kohya", "peft")
MAX_DIFFS: dict[str, float] = {}  # printed at the end of the module (pytest -s): the report's figures


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random checkpoints (FLUX.1 fp32 and fp8, FLUX.2 fp32) and plain LoRAs: seed 3 in each format, and a
    second one (seed 4, alpha absent, a few targets) to stack."""
    folder = tmp_path_factory.mktemp("lora")
    out = {}
    for family, config in CONFIGS.items():
        model = get_family(family).build(config, seed=5)
        bfl = {k: v.contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()}
        out[family] = str(folder / f"{family}.safetensors")
        save_file(bfl, out[family])
        if family == "flux1":
            out["fp8"] = str(folder / "flux1-fp8.safetensors")
            save_file({k: v.to(torch.float8_e4m3fn) for k, v in bfl.items()}, out["fp8"])
    out["checkpoint"] = out["flux1"]
    for fmt in FORMATS:
        out[fmt] = write_random_lora(folder / f"lora-{fmt}.safetensors", TEST_CONFIG, fmt, seed=3)
    out["second"] = write_random_lora(
        folder / "lora-second.safetensors",
        TEST_CONFIG,
        "bfl",
        seed=4,
        alpha=None,
        targets=["single_blocks.1.linear1", "double_blocks.0.img_attn.qkv", "final_layer.adaLN_modulation.1"],
    )
    out["mixed"] = write_random_lora(  # every kind, both DoRA axes, and bias differences, cycled
        folder / "lora-mixed.safetensors",
        TEST_CONFIG,
        "kohya",
        kind=LORA_KINDS,
        dora=(None, "output", "input", "output", "input"),
        bias=True,
        seed=6,
    )
    out["mixed2"] = write_random_lora(
        folder / "lora-mixed2.safetensors",
        CONFIGS["flux2"],
        "bfl",
        kind=LORA_KINDS,
        dora=("input", None, "output", "input", "output"),
        seed=7,
        family="flux2",
    )
    return out


# --------------------------------------------------------------------------------------------------
# ComfyUI's LoRA, written here from its source, independently of backend/checkpoint/lora/


def _flux_to_diffusers(double: int, single: int, hidden: int) -> dict[str, tuple[str, Any, bool]]:
    """comfy/utils.py `flux_to_diffusers`, FLUX.1's linear weights: diffusers module -> (BFL weight, (start,
    length) ComfyUI narrows it to or None, whether ComfyUI swaps the delta's halves)."""
    out: dict[str, tuple[str, Any, bool]] = {}
    for i in range(double):
        src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for j, n in enumerate("qkv"):
            out[f"{src}.attn.to_{n}"] = (f"{dst}.img_attn.qkv.weight", (j * hidden, hidden), False)
            out[f"{src}.attn.add_{n}_proj"] = (f"{dst}.txt_attn.qkv.weight", (j * hidden, hidden), False)
        for a, b in {
            "attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
            "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
            "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
        }.items():  # fmt: skip
            out[f"{src}.{a}"] = (f"{dst}.{b}.weight", None, False)
    for i in range(single):
        src, dst = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for j, n in enumerate("qkv"):
            out[f"{src}.attn.to_{n}"] = (f"{dst}.linear1.weight", (j * hidden, hidden), False)
        out[f"{src}.proj_mlp"] = (f"{dst}.linear1.weight", (3 * hidden, 4 * hidden), False)
        out[f"{src}.norm.linear"] = (f"{dst}.modulation.lin.weight", None, False)
        out[f"{src}.proj_out"] = (f"{dst}.linear2.weight", None, False)
    for a, b in {
        "proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    }.items():  # fmt: skip
        out[a] = (f"{b}.weight", None, False)
    out["norm_out.linear"] = ("final_layer.adaLN_modulation.1.weight", None, True)
    return out


def comfy_key_map(bfl: dict[str, torch.Tensor], family: str) -> dict[str, tuple[str, Any, bool]]:
    """comfy/lora.py `model_lora_keys_unet` for a FLUX model: LoRA module key -> (BFL weight, narrow, swap)."""
    out: dict[str, tuple[str, Any, bool]] = {}
    dims = get_family(family).dims(CONFIGS[family])
    for key, tensor in bfl.items():
        if key.endswith(".weight") and tensor.ndim == 2:
            module = key.removesuffix(".weight")
            out["lora_unet_" + module.replace(".", "_")] = (key, None, False)
            out[f"diffusion_model.{module}"] = (key, None, False)
            if module.endswith(".linear1"):
                out[f"diffusion_model.{module}_qkv"] = (key, (0, 3 * dims.hidden), False)
    if family == "flux1":  # FLUX.2's diffusers names are not what ComfyUI maps: its files use BFL keys
        for module, target in _flux_to_diffusers(dims.double_blocks, dims.single_blocks, dims.hidden).items():
            for key in (f"transformer.{module}", "lycoris_" + module.replace(".", "_"),
                        "lora_transformer_" + module.replace(".", "_")):  # fmt: skip
                out[key] = target
    return out


LORA_SPELLINGS = [  # LoRAAdapter.load, in its order
    (".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
    (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"), (".lora_B", ".lora_A"),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    (".lora_B.default.weight", ".lora_A.default.weight"),
]  # fmt: skip


def swap_scale_shift(t: torch.Tensor) -> torch.Tensor:
    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def weight_decompose(dora_scale, weight, lora_diff, alpha, strength, function) -> None:
    """comfy/weight_adapter/base.py weight_decompose, in place on `weight` (float32)."""
    lora_diff *= alpha
    weight_calc = weight + function(lora_diff)
    if dora_scale.shape[0] == weight_calc.shape[0]:
        weight_norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
    else:
        weight_norm = (
            weight_calc.transpose(0, 1).reshape(weight_calc.shape[1], -1).norm(dim=1, keepdim=True)
            .reshape(weight_calc.shape[1], 1).transpose(0, 1)
        )  # fmt: skip
    weight_norm = weight_norm + torch.finfo(weight.dtype).eps
    weight_calc *= dora_scale.float() / weight_norm
    if strength != 1.0:
        weight_calc -= weight
        weight += strength * weight_calc
    else:
        weight[:] = weight_calc


def comfy_adapter(lora: dict[str, torch.Tensor], x: str) -> tuple[torch.Tensor, float] | None:
    """(lora_diff, alpha factor) of ComfyUI's LoRA / LoHa / LoKr adapter at module key `x`, or None."""
    f = {k: v.float() for k, v in lora.items() if k.startswith(x + ".") or k.startswith(x + "_lora.")}
    alpha = lora[f"{x}.alpha"].item() if f"{x}.alpha" in lora else None
    if f"{x}.hada_w1_a" in f:
        w1b = f[f"{x}.hada_w1_b"]
        diff = (f[f"{x}.hada_w1_a"] @ w1b) * (f[f"{x}.hada_w2_a"] @ f[f"{x}.hada_w2_b"])
        return diff, alpha / w1b.shape[0] if alpha is not None else 1.0
    if any(f"{x}.lokr_{n}" in f for n in ("w1", "w2", "w1_a", "w2_a")):
        dim = None
        w1 = f.get(f"{x}.lokr_w1")
        if w1 is None:
            dim = f[f"{x}.lokr_w1_b"].shape[0]
            w1 = f[f"{x}.lokr_w1_a"] @ f[f"{x}.lokr_w1_b"]
        w2 = f.get(f"{x}.lokr_w2")
        if w2 is None:
            dim = f[f"{x}.lokr_w2_b"].shape[0]
            w2 = f[f"{x}.lokr_w2_a"] @ f[f"{x}.lokr_w2_b"]
        return torch.kron(w1, w2), alpha / dim if alpha is not None and dim is not None else 1.0
    for up, down in LORA_SPELLINGS:
        if x + up in f:
            mat2 = f[x + down]
            return f[x + up] @ mat2, alpha / mat2.shape[0] if alpha is not None else 1.0
    return None


def comfy_merge(checkpoint: str, loras: list[tuple[str, float]], family: str) -> dict[str, torch.Tensor]:
    """The diffusers state dict of `checkpoint` with `loras` applied as ComfyUI's LoraLoaderModelOnly does:
    each module key patches its (narrowed) BFL tensor in float32, LoRA after LoRA; then bfl_to_diffusers
    (test_convert checks it on its own)."""
    bfl = {k: v.float() for k, v in load_file(checkpoint).items()}
    key_map = comfy_key_map(bfl, family)
    for path, strength in loras:
        lora = load_file(path)
        for x, (key, narrow, swap) in key_map.items():
            function = swap_scale_shift if swap else (lambda t: t)
            weight = bfl[key] if narrow is None else bfl[key].narrow(0, *narrow)
            adapter = comfy_adapter(lora, x)
            if adapter is not None:
                lora_diff, alpha = adapter
                lora_diff = lora_diff.reshape(weight.shape)
                if f"{x}.dora_scale" in lora:
                    weight_decompose(lora[f"{x}.dora_scale"], weight, lora_diff, alpha, strength, function)
                else:
                    weight += function((strength * alpha) * lora_diff)
            if f"{x}.diff" in lora:
                weight += function(strength * lora[f"{x}.diff"].float())
            bias = key.removesuffix(".weight") + ".bias"
            if f"{x}.diff_b" in lora and narrow is None and not swap:  # ComfyUI drops it on tuple targets
                bfl[bias] += strength * lora[f"{x}.diff_b"].float()
    return bfl_to_diffusers(bfl, family)


# --------------------------------------------------------------------------------------------------
# Helpers


def shard(state: dict, family: str, degree: int, rank: int) -> dict:
    """`state` as tensor-parallel rank `rank` of `degree` holds it (apply_tensor_parallel's slicing)."""
    model = get_family(family).build(CONFIGS[family], seed=None)
    model.load_state_dict(state)
    if degree == 1:
        return model.state_dict()
    with fake_process_group(degree, rank):
        return apply_tensor_parallel(model).state_dict()


def load_rank(checkpoint: Any, degree: int, rank: int, dtype: str = "float32") -> nn.Module:
    if degree == 1:
        return load_model(checkpoint, dtype=dtype)
    with fake_process_group(degree, rank):
        return load_model(checkpoint, dtype=dtype, tp=degree)


def max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def assert_close(got: dict, want: dict, tol: float, what: str) -> float:
    worst = max_diff(got, want)
    assert worst <= tol, f"{what}: max abs diff {worst:.3g}"
    MAX_DIFFS[what.split(" rank")[0]] = max(MAX_DIFFS.get(what.split(" rank")[0], 0.0), worst)
    return worst


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.fixture(scope="module", autouse=True)
def report_max_diffs() -> Any:
    yield
    for what, worst in sorted(MAX_DIFFS.items()):
        print(f"max |diff| vs ComfyUI's formulas: {what}: {worst:.3g}")


# --------------------------------------------------------------------------------------------------
# Every kind x key format x family, on one process (degree 1) and each rank of TP 2 (fake group)

CASES = [
    *[("flux1", "bfl", kind, dora, False, 0.8) for kind in FACTORED for dora in (None, "output", "input")],
    ("flux1", "bfl", "diff", None, True, 0.8),
    ("flux1", "bfl", "lora", "input", False, 1.0),  # strength 1: ComfyUI's `weight[:] = weight_calc` branch
    ("flux1", "kohya", LORA_KINDS, (None, "output", "input", "input", "output"), True, -0.6),
    *[("flux1", "peft", LORA_KINDS, dora, True, 0.8) for dora in (None, "output", "input")],
    *[("flux1", "lycoris", LORA_KINDS, dora, True, 0.8) for dora in ("output", "input")],
    *[("flux2", "bfl", kind, ("input", None, "output"), False, 0.8) for kind in LORA_KINDS],
    ("flux2", "kohya", LORA_KINDS, (None, "output", "input", "output", "input"), False, 1.0),
]


def _case_id(case: tuple) -> str:
    family, fmt, kind, dora, bias, strength = case
    kind = "mixed" if isinstance(kind, tuple) else kind
    dora = "cycled" if isinstance(dora, tuple) else dora or "no-dora"
    return f"{family}-{fmt}-{kind}-{dora}{'-bias' if bias else ''}-s{strength}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_kind_and_format_on_each_rank_equals_comfyuis_merge(
    files: dict[str, str], tmp_path: Path, case: tuple
) -> None:
    """Mutations tried: LoKr's outer factor indexed by `r % w1.rows` instead of `r // w2.rows` (all 12 LoKr
    cases fail, e.g. diff 0.10); DoRA's column norm taken over the shard's rows only (the 8 input-axis
    cases fail, diff 0.10-0.46); the output-axis norm of weight + delta instead of the weight before it (the
    7 output-axis cases fail); the diffusers norm_out's dora_scale read in delta order instead of ComfyUI's
    weight order (the peft and lycoris output-axis cases fail, diff 0.046)."""
    family, fmt, kind, dora, bias, strength = case
    path = write_random_lora(
        tmp_path / "lora.safetensors", CONFIGS[family], fmt, kind=kind, dora=dora, bias=bias, seed=11,
        family=family,
    )  # fmt: skip
    info = inspect_checkpoint(files[family])
    lora = inspect_lora(path, info)
    want = comfy_merge(files[family], [(path, strength)], family)
    fresh = bfl_to_diffusers(load_file(files[family]), family)
    assert max_diff(want, fresh) > 1e-3  # the reference applied it
    if fmt in ("bfl", "kohya") and not bias:  # every linear of the model is patched
        assert lora.params == {n for n, t in fresh.items() if t.ndim == 2}
    if bias:
        assert "diff_b" in lora.kinds and any(p.endswith(".bias") for p in lora.params)
    for degree, rank in ((1, 0), (2, 0), (2, 1)):
        model = load_rank(info, degree, rank)
        apply_loras(model, info, [(lora, strength)], rank=rank, degree=degree)
        assert_close(
            model.state_dict(),
            shard(want, family, degree, rank),
            1e-5,
            f"{_case_id(case)} rank {rank}/{degree}",
        )


def test_formats_give_the_same_weights_and_comfyuis_partial_keys(
    files: dict[str, str], tmp_path: Path
) -> None:
    """The plain LoRA drawn once per BFL module gives the same weights in the BFL, kohya and PEFT keys;
    ComfyUI's `linear1_qkv` key patches only linear1's q|k|v rows (FLUX.1: to_q/to_k/to_v; FLUX.2: the first
    3 x hidden rows of the fused to_qkv_mlp_proj); text-encoder keys are skipped."""
    info = inspect_checkpoint(files["checkpoint"])
    states = {}
    for fmt in FORMATS:
        model = load_model(info, dtype="float32")
        apply_loras(model, info, [(inspect_lora(files[fmt], info), 1.0)])
        states[fmt] = model.state_dict()
    assert_equal(states["kohya"], states["bfl"], "kohya vs bfl")
    assert_equal(states["peft"], states["bfl"], "peft vs bfl")
    assert [inspect_lora(files[f], info).format for f in FORMATS] == ["bfl", "kohya", "diffusers"]
    for family, block in (("flux1", "single_blocks.1."), ("flux2", "single_blocks.0.")):
        source = load_file(write_random_lora(tmp_path / f"{family}.safetensors", CONFIGS[family], "bfl", seed=3,
                                             targets=[block + "linear1"], kind="loha", family=family))  # fmt: skip
        hidden = get_family(family).dims(CONFIGS[family]).hidden
        renamed = {k.replace(".linear1.", ".linear1_qkv."): v[: 3 * hidden] if "hada_w" in k and k.endswith("_a") else v
                   for k, v in source.items()}  # fmt: skip
        renamed["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(4, 8)
        path = str(tmp_path / f"{family}-qkv.safetensors")
        save_file(renamed, path)
        checkpoint = inspect_checkpoint(files[family])
        lora = inspect_lora(path, checkpoint)
        assert lora.skipped == ("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",)
        want = comfy_merge(files[family], [(path, 0.9)], family)
        for degree, rank in ((1, 0), (2, 1)):
            model = load_rank(checkpoint, degree, rank)
            apply_loras(model, checkpoint, [(lora, 0.9)], rank=rank, degree=degree)
            assert_close(model.state_dict(), shard(want, family, degree, rank), 1e-5, f"{family} linear1_qkv")
        fresh = bfl_to_diffusers(load_file(files[family]), family)
        changed = {k for k in want if not torch.equal(want[k], fresh[k])}
        if family == "flux1":
            assert changed == {f"single_transformer_blocks.1.attn.to_{n}.weight" for n in "qkv"}
        else:
            (name,) = changed
            assert torch.equal(want[name][3 * hidden :], fresh[name][3 * hidden :])


# --------------------------------------------------------------------------------------------------
# A stack with DoRA after plain LoRAs, on each TP rank: fp32 and fp8 -> bf16; change and remove exactly


@pytest.mark.parametrize(
    ("stored", "dtype", "tol"), [("checkpoint", "float32", 1e-5), ("fp8", "bfloat16", 2**-7)]
)
def test_each_tp_rank_matches_the_merged_stack_and_restores_exactly(
    files: dict[str, str], stored: str, dtype: str, tol: float
) -> None:
    """A plain LoRA, the mixed file (every kind, DoRA on both axes, bias differences) and a LoRA without
    alpha, stacked: DoRA's norms read the weight with the earlier LoRAs on it, as ComfyUI's do.

    Mutations tried: (1) patching the resident weight instead of a re-read from the checkpoint: both cases
    fail (the s1 -> s2 == fresh s2 and restore checks); (2) the packed `proj_out` (attention | mlp) shard's
    columns read as one contiguous range: both cases fail (diff 0.066); (3) DoRA's rebuilt weight skipping
    the earlier patches (`_full` without its loop): the float32 case fails (diff 0.0023).
    """
    info = inspect_checkpoint(files[stored])
    stack = [(files["kohya"], 0.7), (files["mixed"], 0.6), (files["second"], -1.5)]
    parsed = [(inspect_lora(path, info), strength) for path, strength in stack]
    want = comfy_merge(files[stored], stack, "flux1")
    torch_dtype = getattr(torch, dtype)
    shards = [{k: v.to(torch_dtype) for k, v in shard(want, "flux1", 2, rank).items()} for rank in range(2)]
    for rank, expected in enumerate(shards):
        with fake_process_group(2, rank):
            model = load_model(info, dtype=dtype, tp=2)
            original = {k: v.clone() for k, v in model.state_dict().items()}
            patched = apply_loras(model, info, parsed, rank=rank, degree=2)
            # bf16: the reference rounds once from float32 too; tolerance is one bf16 step at |w| ~ 0.2
            assert_close(model.state_dict(), expected, tol, f"stack {dtype} rank {rank}")
            changed = apply_loras(model, info, parsed[1:2], restore=patched, rank=rank, degree=2)
            fresh = load_model(info, dtype=dtype, tp=2)
            apply_loras(fresh, info, parsed[1:2], rank=rank, degree=2)
            assert_equal(model.state_dict(), fresh.state_dict(), f"rank {rank}: s1 -> s2 vs fresh s2")
            apply_loras(model, info, [], restore=changed, rank=rank, degree=2)
            assert_equal(model.state_dict(), original, f"rank {rank}: removed vs fresh load")


# --------------------------------------------------------------------------------------------------
# Real workers through the API: TP=2 and ring=2, FLUX.1 and FLUX.2


def assert_equal_ranks(got: list[dict], want: list[dict], what: str) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_equal(g, w, f"{what}, rank {rank}")


@pytest.mark.parametrize(
    ("family", "name", "tensors"), [("flux1", "peft", 56), ("flux1", "mixed", 112), ("flux2", "mixed2", 39)]
)
def test_workers_apply_change_and_remove_loras(
    files: dict[str, str], group2: WorkerGroup, family: str, name: str, tensors: int
) -> None:
    """`ParallelModel.load(loras=...)` on a gloo group, in both layouts: each rank's weights equal the
    slice of the model merged by ComfyUI's formulas (and so does the forward), changing the strength
    equals a fresh load at that strength, and `loras=()` gives back the fresh load, all bit for bit."""
    flux = ParallelModel(group=group2)
    ck, lora = files[family], files[name]
    merged = comfy_merge(ck, [(lora, 0.7)], family)
    reference = get_family(family).build(CONFIGS[family], seed=None)
    reference.load_state_dict(merged)
    dims = get_family(family).dims(CONFIGS[family])
    inputs = random_inputs(dims, family=family).as_kwargs()
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]

    def states() -> list[dict]:
        return [r.state for r in group2.call_all("resident_state")]

    try:
        for layout, degree in (("tp", 2), ("context", 1)):
            flux.unload()
            flux.load(ck, layout=layout, dtype="float32")
            fresh = states()
            reports = flux.load(ck, layout=layout, dtype="float32", loras=[(lora, 0.7)])
            assert [r.reused for r in reports] == [True, True]
            assert [r.lora_tensors for r in reports] == [tensors, tensors]
            assert flux.resident.loras == ((lora, 0.7),)
            for rank, state in enumerate(states()):
                assert_close(
                    state,
                    shard(merged, family, degree, rank % degree),
                    1e-5,
                    f"workers {family} {name} {layout} rank {rank}",
                )
            out = group2.call("forward", Inputs(inputs)).output
            assert (out - expected).abs().max().item() <= 1e-5, layout
            flux.load(ck, layout=layout, dtype="float32", loras=[(lora, 0.2)])
            changed = states()
            assert flux.load(ck, layout=layout, dtype="float32", loras=[])[0].lora_tensors == tensors
            assert_equal_ranks(states(), fresh, f"{layout}: removed vs fresh load")
            flux.unload()
            flux.load(ck, layout=layout, dtype="float32", loras=[(lora, 0.2)])
            assert_equal_ranks(changed, states(), f"{layout}: 0.7 -> 0.2 vs fresh 0.2")
    finally:
        flux.unload()


def test_failed_lora_apply_leaves_no_rank_half_patched(files: dict[str, str], group2: WorkerGroup) -> None:
    """Rank 1 runs out of memory at its 3rd patched tensor while rank 0 applies all of them: the load
    fails with rank 1's message and no rank keeps a model (each rank drops its half-patched one, the
    API unloads the rest); the next load with the LoRA works. Mutation tried: without the unload in
    `ParallelModel._load_resident`'s except clause, rank 0 kept the patched model ([key, None]). The
    worker's own drop of a half-patched model is belt and braces behind it: removing it alone passes."""
    flux = ParallelModel(group=group2)
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
    flux = ParallelModel(group=group2)
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


# --------------------------------------------------------------------------------------------------
# Errors: raised in the caller's process (check_load), before any worker starts; exact text.


def _error(files: dict[str, str], loras: list, family: str = "flux1") -> str:
    flux = ParallelModel(["cpu", "cpu"])
    with pytest.raises(LoraError) as err:
        flux.check_load(files[family], loras=loras)
    assert isinstance(err.value, ConfigError)
    assert not flux.started  # no worker was started
    return str(err.value)


def _lora(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


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


NO_FLUX_KEYS = (
    "has no FLUX LoRA keys (looked for 'diffusion_model.*', 'lora_unet_*', 'transformer.*', 'lycoris_*' with "
    "LoRA, LoHa, LoKr or .diff tensors); "
)


def test_no_flux_keys(files: dict[str, str], tmp_path: Path) -> None:
    """A LoRA for another model, or a checkpoint picked as a LoRA, is named as what it is."""
    keys = ["lora_unet_down_blocks_0_attentions_0_proj_in", "lora_unet_mid_block_attentions_0_proj_out"]
    sd15 = _lora(tmp_path / "sd15.safetensors", {f"{k}.lora_down.weight": torch.zeros(4, 8) for k in keys})
    assert _error(files, [(sd15, 1.0)]) == (
        f"'{sd15}' {NO_FLUX_KEYS}it is a LoRA for a Stable Diffusion 1.5 / 2.x UNet (its keys name down_blocks, "
        "mid_block, up_blocks) (first keys: lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight, "
        "lora_unet_mid_block_attentions_0_proj_out.lora_down.weight)"
    )
    sdxl_keys = [
        "lora_unet_input_blocks_4_1_proj_in.lora_down.weight",
        "lora_te2_text_model_x.lora_up.weight",
    ]
    sdxl = _lora(tmp_path / "sdxl.safetensors", {k: torch.zeros(4, 8) for k in sdxl_keys})
    assert _error(files, [(sdxl, 1.0)]) == (
        f"'{sdxl}' {NO_FLUX_KEYS}it is an SDXL LoRA (its keys name SDXL's UNet blocks or its second text "
        "encoder) (first keys: lora_te2_text_model_x.lora_up.weight, "
        "lora_unet_input_blocks_4_1_proj_in.lora_down.weight)"
    )
    model = _lora(tmp_path / "model.safetensors", {"double_blocks.0.img_attn.qkv.weight": torch.zeros(4, 8)})
    assert _error(files, [(model, 1.0)]) == (
        f"'{model}' {NO_FLUX_KEYS}it is a model checkpoint (plain weights, no LoRA tensors), not a LoRA (first "
        "keys: double_blocks.0.img_attn.qkv.weight)"
    )
    odd = _lora(tmp_path / "odd.safetensors", {"something.lora_down.weight": torch.zeros(4, 8)})
    assert _error(files, [(odd, 1.0)]).endswith(
        "it may be a LoRA for another model (first keys: something.lora_down.weight)"
    )
    te = _lora(
        tmp_path / "te.safetensors",
        {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8)},
    )
    assert _error(files, [(te, 1.0)]) == (
        f"LoRA '{te}' has only text-encoder keys (1, e.g. "
        "'lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight'), which ROCm Parallel does not "
        "apply: it patches the FLUX transformer only. Apply this LoRA to the CLIP/T5 model with ComfyUI's "
        "LoraLoader"
    )


def test_targets_and_shapes_this_checkpoint_lacks(files: dict[str, str], tmp_path: Path) -> None:
    lora = load_file(files["kohya"])
    path = tmp_path / "bad.safetensors"
    _lora(path, {**lora, "lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight": torch.zeros(384, 4)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight' targets "
        "'lora_unet_double_blocks_7_img_attn_qkv', which this checkpoint (FLUX.1-dev, hidden 128) "
        "does not have; the LoRA was made for a different model"
    )
    _lora(path, {**lora, "lora_unet_img_in.lora_down.weight": torch.zeros(4, 80)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_img_in.lora_down.weight' has shape [4, 80] but this checkpoint's "
        "'lora_unet_img_in' needs [4, 64]; the LoRA was made for a different model"
    )
    del lora["lora_unet_txt_in.lora_down.weight"]
    _lora(path, lora)
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': 'lora_unet_txt_in.lora_up.weight' has no matching '.lora_down.weight' for "
        "'lora_unet_txt_in'; the file is incomplete. Download it again"
    )


def test_new_kinds_shapes_and_combinations(files: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    key = "diffusion_model.double_blocks.0.img_attn.qkv"  # [384, 128]
    lokr = {
        f"{key}.lokr_w1": torch.ones(16, 8),
        f"{key}.lokr_w2_a": torch.ones(24, 2),
        f"{key}.lokr_w2_b": torch.ones(2, 32),
    }
    _lora(path, lokr)
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.lokr_w1' (16 x 8) and '{key}.lokr_w2_a' (24 x 32) make a 384 x 256 Kronecker "
        f"product but this checkpoint's '{key}' needs [384, 128]; the LoRA was made for a different model"
    )
    _lora(
        path,
        {
            f"{key}.lokr_w1": torch.ones(16, 8),
            f"{key}.lokr_w1_a": torch.ones(16, 2),
            f"{key}.lokr_w2": torch.ones(24, 16),
        },
    )
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}' has both '{key}.lokr_w1' and '{key}.lokr_w1_a'; a LoKr factor is stored "
        "whole or as two parts, not both. The file is malformed"
    )
    _lora(path, {f"{key}.lokr_w1": torch.ones(16, 8), f"{key}.lokr_w2_a": torch.ones(24, 2)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.lokr_w2_a' has no matching '.lokr_w2_b' for '{key}'; the file is incomplete. "
        "Download it again"
    )
    loha = {
        f"{key}.hada_w1_a": torch.ones(384, 2),
        f"{key}.hada_w1_b": torch.ones(2, 128),
        f"{key}.hada_w2_a": torch.ones(384, 2),
    }
    _lora(path, loha)
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.hada_w1_a' has no matching '.hada_w2_b' for '{key}'; the file is incomplete. "
        "Download it again"
    )
    plain = {f"{key}.lora_up.weight": torch.ones(384, 2), f"{key}.lora_down.weight": torch.ones(2, 128)}
    _lora(path, {**plain, f"{key}.dora_scale": torch.ones(384)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.dora_scale' has shape [384] but this checkpoint's '{key}' needs [384, 1] or "
        "[1, 128] (DoRA's magnitude per output row or per input column); the LoRA was made for a different model"
    )
    _lora(path, {**plain, f"{key}.diff": torch.ones(384, 128)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}' has both LoRA and full weight difference (.diff) tensors; ComfyUI would apply "
        "only the last it recognises and ignore the rest. The file is malformed"
    )
    _lora(path, {**plain, f"{key}.lora_B.weight": torch.ones(384, 2)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.lora_B.weight' and '{key}.lora_up.weight' are the same tensor of '{key}' in "
        "two spellings; ComfyUI would use one and ignore the other. The file is malformed"
    )
    _lora(path, {**plain, f"{key}.alpha": torch.ones(2)})
    assert (
        _error(files, [(path, 1.0)]) == f"LoRA '{path}': '{key}.alpha' holds 2 values; an alpha is one number"
    )
    _lora(path, {f"{key}.diff": torch.ones(384, 128), f"{key}.dora_scale": torch.ones(384, 1)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.dora_scale' is a DoRA scale beside a full weight difference (.diff), which "
        "ComfyUI applies without it; the file is malformed"
    )
    _lora(path, {f"{key}.dora_scale": torch.ones(384, 1)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.dora_scale' has no LoRA, LoHa, LoKr or .diff tensors beside it for '{key}'; "
        "the file is incomplete. Download it again"
    )
    _lora(path, {f"{key}.diff": torch.ones(384, 64)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{key}.diff' has shape [384, 64] but this checkpoint's '{key}' needs [384, 128]; "
        "the LoRA was made for a different model"
    )
    part = "transformer.transformer_blocks.0.attn.to_q"
    _lora(path, {f"{part}.diff_b": torch.ones(128)})
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}': '{part}.diff_b' is a bias difference on '{part}', a part of a fused BFL tensor, for "
        "which ComfyUI maps no bias and drops the patch. Key the bias by its BFL module "
        "('diffusion_model.<module>.diff_b') instead"
    )
    flux2 = "diffusion_model.double_blocks.0.img_attn.proj"
    _lora(path, {f"{flux2}.diff_b": torch.ones(64)})
    assert _error(files, [(path, 1.0)], "flux2") == (
        f"LoRA '{path}': '{flux2}.diff_b' is a bias difference, but this checkpoint's '{flux2}' has no bias; "
        "the LoRA was made for a different model"
    )


def test_what_comfyui_applies_and_the_pack_refuses_by_name(files: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "refused.safetensors"
    key = "lora_unet_double_blocks_0_img_attn_qkv"
    applied = (
        "ROCm Parallel applies LoRA, LoHa and LoKr factors (optional alpha and DoRA dora_scale) and "
        ".diff/.diff_b differences only"
    )
    for suffix, name, short in (
        (".oft_blocks", "OFT/BOFT", "OFT/BOFT"),
        (".rescale", "OFT/BOFT", "OFT/BOFT"),
        (".a1.weight", "GLoRA", "GLoRA"),
        (".set_weight", "weight replacement (set_weight)", "weight replacement"),
        (".reshape_weight", "reshaping (FLUX control LoRA)", "reshaping"),
        (".w_norm", "norm difference (w_norm)", "norm difference"),
        (".b_norm", "norm difference (b_norm)", "norm difference"),
    ):
        _lora(path, {key + suffix: torch.ones(2, 2)})
        assert _error(files, [(path, 1.0)]) == (
            f"LoRA '{path}': '{key}{suffix}' is a {name} patch; {applied}. Use a file without {short} patches"
        )
    for suffix, name in (
        (".lora_mid.weight", "LoCon Tucker (lora_mid)"),
        (".hada_t1", "LoHa Tucker (hada_t1)"),
        (".lokr_t2", "LoKr Tucker (lokr_t2)"),
    ):
        lora = load_file(files["kohya"])
        _lora(path, {**lora, key + suffix: torch.ones(4, 4)})
        assert _error(files, [(path, 1.0)]) == (
            f"LoRA '{path}': '{key}{suffix}' is a {name} factor, which only convolutions have: FLUX's "
            "transformer has linear layers only (ComfyUI fails on it too). The LoRA was made for another model"
        )
    _lora(
        path,
        {"img_in.lora_A.weight": torch.ones(4, 128), "single_blocks.0.norm.key_norm.scale": torch.ones(16)},
    )
    assert _error(files, [(path, 1.0)]) == (
        f"LoRA '{path}' is a FLUX control LoRA (Canny/Depth: 'img_in.lora_A.weight' widens the image input, "
        f"'single_blocks.0.norm.key_norm.scale' replaces norm scales); {applied}. Use the matching FLUX "
        "control checkpoint (flux1-canny-dev, flux1-depth-dev) instead"
    )


def test_non_finite_values_and_overflowing_strengths(files: dict[str, str], tmp_path: Path) -> None:
    """NaN / inf anywhere a LoRA applies (factors, dora_scale, diffs, alpha) and a strength whose change
    could overflow are refused before any worker starts. Mutation tried: `check_loras` without its value
    scan accepts the NaN factor (this test fails)."""
    key = "diffusion_model.img_in"  # [128, 64]
    up, down = torch.full((128, 2), 0.5), torch.full((2, 64), 0.25)
    path = tmp_path / "bad.safetensors"
    for role, tensors, where in (
        ("lora_up.weight", {"lora_up.weight": up.clone().index_put_((torch.tensor(3), torch.tensor(1)), torch.tensor(math.nan)), "lora_down.weight": down}, "nan at [3, 1] (1 of 256"),
        ("dora_scale", {"lora_up.weight": up, "lora_down.weight": down, "dora_scale": torch.full((128, 1), math.inf)}, "inf at [0, 0] (128 of 128"),
        ("diff", {"diff": torch.full((128, 64), -math.inf)}, "-inf at [0, 0] (8192 of 8192"),
    ):  # fmt: skip
        _lora(path, {f"{key}.{k}": v for k, v in tensors.items()})
        assert _error(files, [(path, 0.5)]) == (
            f"LoRA '{path}': '{key}.{role}' holds {where} values are not finite); applied, it would make the "
            "model's output NaN. The file is corrupt or was saved from a diverged training run: use another file"
        )
    _lora(
        path,
        {
            f"{key}.lora_up.weight": up,
            f"{key}.lora_down.weight": down,
            f"{key}.alpha": torch.tensor(math.nan),
        },
    )
    assert _error(files, [(path, 1.0)]) == f"LoRA '{path}': '{key}.alpha' is nan, not a finite number"
    _lora(
        path,
        {f"{key}.lora_up.weight": up, f"{key}.lora_down.weight": down, f"{key}.alpha": torch.tensor(2.0)},
    )
    assert _error(files, [(path, 1e30)]) == (  # beyond ComfyUI's LoraLoader range: refused before any scan
        f"LoRA '{path}': strength 1e+30 is beyond +-100 (ComfyUI's LoraLoader range; far beyond it the "
        "patched weights overflow to inf); use e.g. 1.0"
    )
    _lora(
        path,
        {f"{key}.lora_up.weight": up, f"{key}.lora_down.weight": down, f"{key}.alpha": torch.tensor(1e38)},
    )
    assert _error(files, [(path, 1.0)]).startswith(
        f"LoRA '{path}' at strength 1: '{key}' can change a weight by up to 1.25e+37"
    )
    info = inspect_checkpoint(files["checkpoint"])
    assert check_loras([(Path(path), 0)], info) == ((str(path), 0.0),)  # strength 0: not applied, not scanned
    for bad in (math.nan, math.inf, "1.0"):
        assert _error(files, [(files["bfl"], bad)]) == (
            f"LoRA '{files['bfl']}': strength {bad!r} is not a finite number; use e.g. 1.0 "
            "(0 disables it, negative values invert it)"
        )
    assert check_loras([(Path(files["bfl"]), 1)], info) == ((files["bfl"], 1.0),)
    assert scan_values(inspect_lora(files["bfl"], info)) is scan_values(inspect_lora(files["bfl"], info))


def test_a_patch_that_still_overflows_on_a_rank_is_named(files: dict[str, str], tmp_path: Path) -> None:
    """The rank's own check behind the caller's: a file whose values changed after it was checked (here:
    applied without check_loras) fails on the rank naming the file and the tensor, not as a NaN output."""
    key = "diffusion_model.img_in"
    path = _lora(tmp_path / "huge.safetensors", {f"{key}.diff": torch.full((128, 64), 3e38)})
    info = inspect_checkpoint(files["checkpoint"])
    model = load_model(info, dtype="float32")
    with pytest.raises(LoraError) as err:
        apply_loras(model, info, [(inspect_lora(path, info), 2.0)])
    assert str(err.value) == (
        f"the LoRAs ['{path}'] make 'x_embedder.weight' hold inf or NaN in float32 on rank 0; lower their "
        "strengths, or check that the files did not change since they were checked"
    )
