"""Qwen-Image on the engine: its checkpoint files, the model call in every layout against one process
(fp32, odd sizes, a text mask, reference latents), its TP facts on the meta device, LoRAs, the headless
sampler against a real ComfyUI's KSampler, and what the engine refuses or guards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rocm_parallel.backend.checkpoint import (
    CheckpointError,
    bfl_to_diffusers,
    inspect_checkpoint,
    load_model,
    save_checkpoint,
)
from rocm_parallel.backend.checkpoint.lora import inspect_lora
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.family import detect_bfl, detect_diffusers, get_family
from rocm_parallel.backend.parallel.comm import CountCollectives
from rocm_parallel.backend.parallel.context import (
    ContextAttention,
    ContextState,
    choose_attention_kernel,
    masked_forward_op,
    math_forward_op,
)
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.backend.qwen_image.forward import qwen_call, qwen_model_fn
from rocm_parallel.backend.qwen_image.model import QWEN_IMAGE, build_qwen_image
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import tiny_qwen_image_config
from rocm_parallel.testing.parallel import apply_tensor_parallel
from rocm_parallel.testing.writers import write_random_lora

TOL = 1e-5
DATA = Path(__file__).parent / "data"
FAMILY = get_family("qwen_image")
CONFIG = tiny_qwen_image_config(heads=4, head_dim=16, blocks=2, text_dim=32)
CONFIG_2511 = tiny_qwen_image_config(heads=4, head_dim=16, blocks=2, text_dim=32, zero_cond_t=True)


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    """Comfy-Org's layout (keys under model.diffusion_model.) of a Qwen-Image and an Edit-2511 model."""
    folder = tmp_path_factory.mktemp("qwen")
    out = {}
    for name, config, seed in (("image", CONFIG, 11), ("edit_2511", CONFIG_2511, 12)):
        model = build_qwen_image(config, seed=seed)
        out[name] = (save_checkpoint(model, folder / f"qwen-{name}.safetensors", prefix=True), model)
    return out


def call_inputs(refs: int = 2, mask: bool = True) -> dict[str, Any]:
    """A CFG-like call as ComfyUI 0.33's QwenImage gets it: two latents of an odd size (5-D), two prompts,
    the second with three padded tokens, reference latents wider than the image."""
    g = torch.Generator().manual_seed(3)
    inputs = {
        "x": torch.randn(2, 16, 1, 9, 7, generator=g),
        "timestep": torch.tensor([0.8, 0.8]),
        "context": torch.randn(2, 11, 32, generator=g),
        "ref_latents": [torch.randn(2, 16, 1, 7 - 2 * i, 11 - 4 * i, generator=g) for i in range(refs)],
    }
    if mask:
        inputs["attention_mask"] = torch.ones(2, 11, dtype=torch.long)
        inputs["attention_mask"][1, 8:] = 0
    return inputs


def one_process(model: torch.nn.Module, inputs: dict[str, Any], ref_method: str = "index") -> torch.Tensor:
    mask = inputs.get("attention_mask")
    with torch.no_grad():
        return qwen_call(
            qwen_model_fn(model), inputs["x"], inputs["timestep"], inputs["context"],
            None if mask is None else mask.bool(), inputs["ref_latents"], ref_method,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Checkpoints


def test_comfy_files_and_diffusers_state_dicts_are_qwen_image(qwen_files, tmp_path: Path) -> None:
    path, model = qwen_files["image"]
    info = inspect_checkpoint(path)
    assert (info.family, info.format, info.prefix, info.variant) == (
        "qwen_image",
        "bfl",
        "model.diffusion_model.",
        "image",
    )
    assert info.config == {**CONFIG, "axes_dims_rope": (4, 6, 6)}
    assert info.model_name == "Qwen-Image (4 heads, 2 blocks)"
    assert info.dims.blocks == 2 and not hasattr(info.dims, "pooled_dim")  # no pooled text vector
    bare = save_file(
        {k.removeprefix("model.diffusion_model."): v for k, v in load_file(path).items()},
        str(tmp_path / "bare.safetensors"),
    )
    assert bare is None and inspect_checkpoint(tmp_path / "bare.safetensors").config == info.config
    keys = set(model.state_dict())
    assert detect_bfl(keys) is FAMILY and detect_diffusers(keys) is FAMILY  # no FLUX family claims them
    # ComfyUI 0.33's Lens (a SwiGLU `img_mlp.w1`) and other txt_norm models are not Qwen-Image's layout
    lens = {k.replace("img_mlp.net.0.proj", "img_mlp.w1") for k in keys}
    assert detect_bfl(lens) is None
    loaded = load_model(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_edit_2511_is_read_from_comfyuis_marker_and_from_a_diffusers_folder(
    qwen_files, tmp_path: Path
) -> None:
    path, model = qwen_files["edit_2511"]
    with safe_open(path, "pt") as f:  # ComfyUI's QwenImage has the same empty buffer (0.33)
        assert f.get_tensor("model.diffusion_model.__index_timestep_zero__").numel() == 0
    info = inspect_checkpoint(path)
    assert (info.variant, info.config["zero_cond_t"], info.model_name) == (
        "edit-2511",
        True,
        "Qwen-Image-Edit-2511 (4 heads, 2 blocks)",
    )
    assert FAMILY.default_ref_method(info.config) == "index_timestep_zero"
    assert FAMILY.default_ref_method(CONFIG) == "index"
    # diffusers' own folder (Qwen/Qwen-Image-Edit-2511): zero_cond_t in config.json, no marker
    from diffusers import QwenImageTransformer2DModel

    plain = QwenImageTransformer2DModel(**CONFIG_2511)
    plain.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith("__")}, strict=False
    )
    plain.save_pretrained(tmp_path / "transformer")
    folder = inspect_checkpoint(tmp_path)
    assert (folder.format, folder.variant, folder.config["zero_cond_t"]) == ("diffusers", "edit-2511", True)
    inputs = call_inputs(refs=1, mask=False)
    assert torch.equal(
        one_process(load_model(tmp_path), inputs, "index_timestep_zero"),
        one_process(model, inputs, "index_timestep_zero"),
    )


def test_qwen_image_layered_is_refused_by_name(qwen_files, tmp_path: Path) -> None:
    path, _ = qwen_files["image"]
    state = load_file(path)
    state["model.diffusion_model.time_text_embed.addition_t_embedding.weight"] = torch.zeros(2, 64)
    save_file(state, str(tmp_path / "layered.safetensors"))
    with pytest.raises(CheckpointError) as err:
        inspect_checkpoint(tmp_path / "layered.safetensors")
    assert "this is Qwen-Image-Layered (it has 'time_text_embed.addition_t_embedding')" in str(err.value)


def test_a_plain_fp8_file_stays_fp8_resident_and_computes_as_upcast(qwen_files, tmp_path: Path) -> None:
    """Comfy-Org's qwen_image_fp8_e4m3fn.safetensors: every linear weight float8_e4m3fn without a scale, the
    rest bf16. 'default' keeps the fp8 weights on the device (1 byte each), upcast layer by layer, which
    computes exactly what upcasting at load does."""
    path, _ = qwen_files["image"]
    state = {
        k: v.to(torch.float8_e4m3fn if v.ndim == 2 else torch.bfloat16) for k, v in load_file(path).items()
    }
    save_file(state, str(tmp_path / "fp8.safetensors"))
    info = inspect_checkpoint(tmp_path / "fp8.safetensors")
    assert info.stored_dtypes == ("bfloat16", "float8_e4m3fn")
    kept = load_model(info, dtype="float32")
    upcast = load_model(info, dtype="float32", weight_dtype="compute")
    fp8 = [n for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert len(fp8) == sum(p.ndim == 2 for p in upcast.parameters())
    assert parameter_bytes(kept) < 0.3 * parameter_bytes(upcast)
    inputs = call_inputs()
    assert torch.equal(one_process(kept, inputs), one_process(upcast, inputs))


# --------------------------------------------------------------------------------------------------
# Every layout against one process


@pytest.mark.parametrize(
    ("groups", "layout"),
    [(2, ParallelLayout(tp=2)), (2, ParallelLayout(ring=2)), (2, ParallelLayout(ulysses=2)),
     (2, ParallelLayout(batch=2)), (4, ParallelLayout(tp=4)), (4, ParallelLayout(ring=2, ulysses=2))],
    indirect=["groups"],
    ids=str,
)  # fmt: skip
def test_qwen_image_forward_matches_one_process_in_every_layout(
    groups: WorkerGroup, layout, qwen_files
) -> None:
    """ComfyUI's QwenImage call through `ParallelModel.forward`: 5-D odd latents, a text mask on one prompt
    of a CFG batch (as key validity under ring / Ulysses; split with the batch under a batch degree),
    references by three methods; Edit-2511's default (index_timestep_zero: the references modulated at
    t = 0) in one layout per world size. Mutation tried: `serve.forward` passing the whole text mask to
    each batch group (not `take(mask)`) failed batch 2."""
    flux = ParallelModel(group=groups)
    try:
        path, model = qwen_files["image"]
        flux.load(path, layout=layout, dtype="float32")
        inputs = call_inputs()
        for method in ("index", "offset"):
            out = flux.forward(**inputs, ref_method=method)
            assert out.shape == (2, 16, 1, 9, 7) and out.dtype == torch.float32
            assert (out - one_process(model, inputs, method)).abs().max().item() <= TOL, method
        text_only = call_inputs(refs=0)
        out = flux.forward(**{**text_only, "x": text_only["x"][:, :, 0]})  # a 4-D latent comes back 4-D
        assert (out - one_process(model, text_only)[:, :, 0]).abs().max().item() <= TOL
        if layout.tp == 1 and layout.ring == 2:
            path, model = qwen_files["edit_2511"]
            flux.load(path, layout=layout, dtype="float32")
            out = flux.forward(**inputs)  # the file's default placement
            assert (out - one_process(model, inputs, "index_timestep_zero")).abs().max().item() <= TOL
            # the method reached the ranks: plain "index" modulates the references at t, not 0
            assert (out - one_process(model, inputs, "index")).abs().max().item() > 1e-3
    finally:
        flux.unload()


@pytest.mark.parametrize("layout", [ParallelLayout(ring=2), ParallelLayout(ulysses=2)], ids=str)
def test_a_text_mask_on_sizes_that_need_no_padding_still_masks(
    group2: WorkerGroup, qwen_files, layout
) -> None:
    """Even sizes (16 image and 12 text tokens over 2 ranks: nothing padded) with a prompt whose last four
    tokens are padding: the key-validity channel must still carry the mask. Mutation tried: deciding the
    channel from the sequence padding alone (`state.masked = state.padding is not None`) dropped the mask
    here (every other test uses odd sizes, where the padding turns it on anyway)."""
    g = torch.Generator().manual_seed(5)
    inputs = {
        "x": torch.randn(2, 16, 1, 8, 8, generator=g),
        "timestep": torch.tensor([0.8, 0.8]),
        "context": torch.randn(2, 12, 32, generator=g),
        "ref_latents": [],
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
    }
    inputs["attention_mask"][1, 8:] = 0
    path, model = qwen_files["image"]
    flux = ParallelModel(group=group2)
    try:
        flux.load(path, layout=layout, dtype="float32")
        out = flux.forward(**inputs)
        assert (out - one_process(model, inputs)).abs().max().item() <= TOL
    finally:
        flux.unload()


def test_the_text_mask_reaches_every_layout(group2: WorkerGroup, qwen_files) -> None:
    """Mutation check of the test above: without its mask the padded prompt's output differs far beyond the
    tolerance, so a layout that dropped the mask would fail there."""
    _, model = qwen_files["image"]
    inputs = call_inputs(refs=0)
    unmasked = one_process(model, {**inputs, "attention_mask": None})
    assert (unmasked[1] - one_process(model, inputs)[1]).abs().max().item() > 1e-2
    assert torch.equal(unmasked[0], one_process(model, inputs)[0])  # the unpadded prompt is unaffected


def test_qwen_image_refusals_before_any_rank_runs(group2: WorkerGroup, qwen_files, monkeypatch) -> None:
    flux = ParallelModel(group=group2)
    try:
        flux.load(qwen_files["image"][0], layout=ParallelLayout(tp=2), dtype="float32")
        for method in ("call", "call_all"):
            monkeypatch.setattr(group2, method, lambda *a, **k: pytest.fail("a rank was called"))
        inputs = call_inputs()
        with pytest.raises(ConfigError) as err:
            flux.forward(**{**inputs, "x": torch.randn(2, 16, 3, 9, 7)})  # three frames: a video latent
        assert str(err.value) == (
            "x has shape (2, 16, 3, 9, 7); Qwen-Image (4 heads, 2 blocks) takes [batch, 16, 1, height, width] "
            "(or [batch, 16, height, width]) latents (encode with the Qwen-Image VAE (qwen_image_vae.safetensors), "
            "or use EmptySD3LatentImage)"
        )
        with pytest.raises(
            ConfigError,
            match=r"attention_mask has shape \(2, 9\); Qwen-Image \(4 heads, 2 blocks\) takes \[2, 11\]",
        ):
            flux.forward(**{**inputs, "attention_mask": torch.ones(2, 9)})
        with pytest.raises(
            ConfigError, match=r"attention_mask must hold 1 \(a real token\) or 0 \(padding\) per token"
        ):
            flux.forward(**{**inputs, "attention_mask": torch.full((2, 11), 2)})
        with pytest.raises(ConfigError) as err:  # 'uxo/uno' is the node's choice; the conditioning says 'uxo'
            flux.forward(**inputs, ref_method="uno")
        assert str(err.value) == (
            "ref_latents_method='uno' is not a reference placement ComfyUI's models run (index, "
            "index_timestep_zero, negative_index, offset, uxo); it came with the conditioning (the Edit Model "
            "Reference Method (FluxKontextMultiReferenceLatentMethod) node, or a custom node that sets it): set "
            "that node to one of index, offset, uxo/uno, negative_index, index_timestep_zero for Qwen-Image "
            "(4 heads, 2 blocks)"
        )
    finally:
        monkeypatch.undo()
        flux.unload()


def test_text_key_mask_reads_comfyuis_mask_forms() -> None:
    """Integer 1/0 (the text encoder's), ComfyUI's additive 0/-max; an all-real mask is no mask."""
    from rocm_parallel.backend.diffusion.checks import text_key_mask

    info = type("Info", (), {"model_family": FAMILY, "model_name": "Qwen-Image"})()
    context = torch.zeros(2, 4, 32)
    ints = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    want = torch.tensor([[True, True, True, False], [True, True, True, True]])
    assert torch.equal(text_key_mask(ints, context, info), want)
    additive = (ints - 1).float() * torch.finfo(torch.float32).max
    assert torch.equal(text_key_mask(additive, context, info), want)
    assert text_key_mask(torch.ones(2, 4, dtype=torch.long), context, info) is None
    with pytest.raises(ConfigError, match="additive values other than 0 and large negatives"):
        text_key_mask(torch.full((2, 4), -3.0), context, info)
    # a family whose call takes no mask refuses one by name, before any check of its values
    from rocm_parallel.backend.diffusion.call import bind

    with pytest.raises(ConfigError) as err:
        bind(get_family("flux1").call_spec, (), {"attention_mask": ints}, "FLUX.1-dev")
    assert str(err.value) == (
        "attention_mask is not an input of FLUX.1-dev's model call; it takes context, y, guidance, ref_latents, "
        "ref_latents_method"
    )


# --------------------------------------------------------------------------------------------------
# Context parallelism's key validity (the mechanism the text mask rides on)


def test_key_validity_may_differ_per_batch_entry() -> None:
    """The kernel drops each entry's own invalid keys: equal to attention with each entry's mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(3))
    valid = torch.tensor([[1, 1, 1, 1, 0, 1], [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    flag = valid.float()[:, :, None, None].expand(2, 6, 2, 1)
    zeros = torch.zeros(2, 6, 2, 1)
    op = masked_forward_op(math_forward_op)
    out, lse = op(None, torch.cat([q, zeros], -1), torch.cat([k, flag], -1), torch.cat([v, zeros], -1), None,
                  return_lse=True)  # fmt: skip
    want, want_lse = math_forward_op(None, q, k, v, valid[:, None, None, :], return_lse=True)
    assert (out[..., :-1] - want).abs().max().item() <= 1e-6
    assert (lse - want_lse).abs().max().item() <= 1e-6


def test_a_mask_the_padding_hook_did_not_plan_is_refused() -> None:
    """Mutation guard: a mask reaching context-parallel attention in a forward whose hook did not decide the
    validity channel (what diffusers' own ring would apply to the wrong keys) fails instead of computing."""
    state = ContextState(ParallelLayout(ring=2), choose_attention_kernel(torch.device("cpu"), torch.float32))
    q = torch.zeros(2, 5, 2, 8)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3] = False
    with pytest.raises(RuntimeError, match=r"did not plan validity for \(ContextState.masked\)"):
        ContextAttention(state)(q, q, q, mask, parallel_config=object())


# --------------------------------------------------------------------------------------------------
# TP facts on the meta device


@pytest.mark.torch_api
def test_one_all_gather_per_forward_also_under_zero_cond_t() -> None:
    """Two all-reduces per block (both streams fused) and one all-gather for the 2 x blocks + 1 modulation
    linears, also when Edit-2511's doubled temb feeds txt_mod and norm_out their halves."""
    with fake_process_group(2, rank=1):
        model = apply_tensor_parallel(build_qwen_image(CONFIG_2511, seed=0))
        for method in ("index", "index_timestep_zero"):
            with CountCollectives() as counter:
                one_process(model, call_inputs(refs=1), method)
            assert dict(counter.log.counts) == {"all_reduce": 2 * 2, "all_gather": 1}, method


def test_each_rank_s_attention_counts_its_own_heads() -> None:
    """diffusers' shared Attention (no `head_dim`) keeps heads and inner_dim for the local shard: diffusers
    0.37's Qwen processor unflattens by `attn.heads` (with the global count its q norm met 8 of 16 channels
    at TP 2, a real ComfyUI 0.3.75 failure with that diffusers), newer ones by `inner_dim // heads`."""
    model = build_qwen_image(CONFIG_2511, seed=0)
    heads = model.transformer_blocks[0].attn.heads
    head_dim = model.transformer_blocks[0].attn.inner_dim // heads
    with fake_process_group(2, rank=1):
        apply_tensor_parallel(model)
    for block in model.transformer_blocks:
        attn = block.attn
        assert (attn.heads, attn.inner_dim) == (heads // 2, heads // 2 * head_dim)
        assert attn.to_q.out_features == attn.inner_dim == attn.add_q_proj.out_features


@pytest.mark.torch_api
@pytest.mark.parametrize("degree", [2, 4, 8])
def test_released_bytes_per_rank_on_meta(degree: int) -> None:
    """Qwen-Image in bf16: everything but the embedders, the per-head q/k norms and the row-parallel biases is
    split `degree` ways (the modulation included); the planner holds the engine's figure exactly."""
    from rocm_parallel.backend.plan import weight_bytes

    d, blocks, text = 3072, 60, 3584
    full = parameter_bytes(build_qwen_image(QWEN_IMAGE, device="meta", dtype=torch.bfloat16))
    assert full == 2 * 20_430_401_088
    with fake_process_group(degree):
        held = parameter_bytes(
            apply_tensor_parallel(build_qwen_image(QWEN_IMAGE, device="meta", dtype=torch.bfloat16))
        )
    replicated = (
        64 * d + d + text * d + d + text + 256 * d + d + d * d + d + d * 64 + 64
    )  # embedders, proj_out
    replicated += blocks * (4 * 128 + 4 * d)  # q/k norms; the biases of to_out, to_add_out, both MLPs' net.2
    assert held == (full - 2 * replicated) // degree + 2 * replicated
    dims = FAMILY.dims(QWEN_IMAGE)
    assert weight_bytes(dims, ParallelLayout(tp=degree), 2, family="qwen_image") == held


def test_planner_work_of_qwen_image() -> None:
    """Per-token work from the meta model against the architecture worked by hand: per block and stream
    Q, K, V, out (4 d^2) and a GELU MLP d -> 4d -> d; 2 x 6d modulation per block + 2d final."""
    from rocm_parallel.backend.plan import model_facts

    d, blocks = 3072, 60
    facts = model_facts("qwen_image", FAMILY.dims(QWEN_IMAGE))
    assert facts.image_macs == 64 * d + d * 64 + blocks * 12 * d * d
    assert facts.text_macs == 3584 * d + blocks * 12 * d * d
    assert facts.joint_macs == 0
    assert (facts.attentions, facts.tp_all_reduces, facts.modulation_width) == (
        60,
        120,
        blocks * 12 * d + 2 * d,
    )


# --------------------------------------------------------------------------------------------------
# LoRAs


def test_comfyuis_qwen_lora_formats_patch_the_same_parameters(qwen_files, tmp_path: Path) -> None:
    """comfy/lora.py maps QwenImage LoRAs as bare module names, diffusion_model., transformer. (PEFT),
    lora_unet_ (kohya) and lycoris_; all five patch the same parameters with the same delta."""
    info = inspect_checkpoint(qwen_files["image"][0])
    made = {
        f: write_random_lora(tmp_path / f"{f}.safetensors", CONFIG, f, seed=5, family="qwen_image")
        for f in ("bare", "bfl", "peft", "kohya")
    }
    kohya = load_file(made["kohya"])
    save_file(
        {k.replace("lora_unet_", "lycoris_"): v for k, v in kohya.items()},
        str(tmp_path / "lycoris.safetensors"),
    )
    made["lycoris"] = str(tmp_path / "lycoris.safetensors")
    read = {f: inspect_lora(p, info) for f, p in made.items()}
    params = {f: r.params for f, r in read.items()}
    assert len({frozenset(p) for p in params.values()}) == 1
    assert (
        "transformer_blocks.0.img_mod.1.weight" in params["bare"]
        and "norm_out.linear.weight" in params["bare"]
    )
    assert read["bare"].format == "bfl" and read["peft"].format == "diffusers"


def test_a_lora_on_tp_equals_its_merge_by_hand(group2: WorkerGroup, qwen_files, tmp_path: Path) -> None:
    """A bare-format LoRA (Qwen-Image-Lightning's) on TP 2, the modulation's Gathered shards included, equals
    the model whose weights were merged by plain math (W += strength x alpha / rank x up @ down)."""
    path, _ = qwen_files["image"]
    lora = write_random_lora(
        tmp_path / "bare.safetensors", CONFIG, "bare", seed=9, family="qwen_image", relative=0.5
    )
    state = {k.removeprefix("model.diffusion_model."): v.float() for k, v in load_file(path).items()}
    factors = load_file(lora)
    for key in [k for k in factors if k.endswith(".lora_up.weight")]:
        name = key.removesuffix(".lora_up.weight")
        up, down = factors[key], factors[f"{name}.lora_down.weight"]
        state[f"{name}.weight"] += 0.8 * factors[f"{name}.alpha"].item() / down.shape[0] * (up @ down)
    merged = build_qwen_image(CONFIG, device="meta")
    merged.load_state_dict(bfl_to_diffusers(state, "qwen_image"), assign=True)
    merged.pos_embed = build_qwen_image(CONFIG, device="meta").pos_embed
    flux = ParallelModel(group=group2)
    try:
        flux.load(path, layout=ParallelLayout(tp=2), dtype="float32", loras=[(lora, 0.8)])
        out = flux.forward(**call_inputs())
        assert (out - one_process(merged.eval(), call_inputs())).abs().max().item() <= TOL
    finally:
        flux.unload()


# --------------------------------------------------------------------------------------------------
# The headless sampler against ComfyUI's own KSampler


def _references(version: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with safe_open(str(DATA / f"qwen_references_{version}.safetensors"), "pt") as f:
        return json.loads(f.metadata()["cases"]), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("name", ["qwen_t2i_cfg1", "qwen_img2img_cfg1"])
def test_sample_equals_comfyuis_ksampler_on_the_template_schedule(
    group2: WorkerGroup, tmp_path: Path, name: str
) -> None:
    """`ParallelModel.sample` (ModelSamplingAuraFlow 3.1, KSampler euler/simple, cfg 1; the Wan 2.1 latent
    format's per-channel process_in / out) on ring 2 against what ComfyUI 0.33.0 and 0.3.75 sampled with their
    own QwenImage (tests/tools/make_qwen_references.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "tools"))
    from make_qwen_references import MODELS

    flux = ParallelModel(group=group2)
    try:
        for version in ("0.33.0", "0.3.75"):
            cases, tensors = _references(version)
            case = cases[name]
            spec = MODELS[case["model"]]
            config = tiny_qwen_image_config(**spec["config"])
            path = save_checkpoint(
                build_qwen_image(config, seed=spec["seed"]), tmp_path / "m.safetensors", prefix=True
            )
            flux.load(path, layout=ParallelLayout(ring=2), dtype="float32")
            latent = tensors.get(
                f"{name}.latent", torch.zeros(1, 16, case["height"] // 8, case["width"] // 8)
            )
            out = flux.sample([[tensors[f"{name}.cond"], {"pooled_output": None}]], {"samples": latent},
                              seed=case["seed"], steps=case["steps"], denoise=case.get("denoise", 1.0))["samples"]  # fmt: skip
            want = tensors[f"{name}.output"]
            assert out.shape == want.shape == (1, 16, 1, case["height"] // 8, case["width"] // 8)
            assert (out - want).abs().max().item() <= 1e-4, version
    finally:
        flux.unload()


def test_sample_passes_a_padded_prompts_text_mask_as_comfyui(group2: WorkerGroup, tmp_path: Path) -> None:
    """`ParallelModel.sample` with CLIPTextEncode's `attention_mask` (a prompt with three padded tokens) on ring
    2 against ComfyUI 0.33.0's KSampler, whose QwenImage hands the mask to the model (0.3.75 drops it in
    extra_conds, so only 0.33.0 recorded the case: tests/tools/make_qwen_references.py). Mutation check:
    the same call without the mask lands far outside the tolerance, so a sampler that dropped it would fail."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "tools"))
    from make_qwen_references import MODELS

    name = "qwen_t2i_mask_cfg1"
    cases, tensors = _references("0.33.0")
    case, spec = cases[name], MODELS[cases[name]["model"]]
    path = save_checkpoint(
        build_qwen_image(tiny_qwen_image_config(**spec["config"]), seed=spec["seed"]),
        tmp_path / "m.safetensors",
        prefix=True,
    )
    cond, mask = tensors[f"{name}.cond"], tensors[f"{name}.mask"]
    assert mask.tolist() == [[1] * 6 + [0] * 3]  # the recorded prompt: 9 tokens, the last 3 padding
    latent = {"samples": torch.zeros(1, 16, case["height"] // 8, case["width"] // 8)}  # EmptySD3LatentImage
    flux = ParallelModel(group=group2)
    try:
        flux.load(path, layout=ParallelLayout(ring=2), dtype="float32")

        def sample(extras: dict[str, Any]) -> torch.Tensor:
            positive = [[cond, {"pooled_output": None, **extras}]]
            return flux.sample(positive, latent, seed=case["seed"], steps=case["steps"])["samples"]

        want = tensors[f"{name}.output"]
        out = sample({"attention_mask": mask})
        assert out.shape == want.shape == (1, 16, 1, case["height"] // 8, case["width"] // 8)
        assert (out - want).abs().max().item() <= 1e-4
        assert (sample({}) - want).abs().max().item() > 1e-2
    finally:
        flux.unload()
