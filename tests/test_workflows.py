"""The shared workflows in workflows/ (UI format) and workflows/api/ (API format) against the node specs.

Core node specs are those of every ComfyUI version the pack is checked against (tests/data/comfy_core_nodes*.json,
each a live ComfyUI's /object_info written by tests/tools/dump_core_nodes.py): every workflow is checked
against each; the integration tier (tests/comfy) checks the same files against a live ComfyUI's /object_info.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from fake_comfy import SAMPLERS, FakeComfy
from workflow_check import (
    check_api,
    check_ui,
    core_object_info,
    core_versions,
    overlapping_nodes,
    pack_object_info,
    ui_to_api,
)

import rocm_parallel
from rocm_parallel.nodes import NODE_CLASS_MAPPINGS

WORKFLOWS = Path(rocm_parallel.__file__).parent / "workflows"
NAMES = sorted(p.stem for p in WORKFLOWS.glob("*.json"))
EXPECTED = {
    # name: (sampler, devices, checkpoint, ring x ulysses)
    "flux1_dev_tp4": ("RocmParallelTPSampler", "0,1,2,3", "flux1-dev.safetensors", None),
    # the same, its VAE decode split over the loader's GPUs (ROCm Parallel VAE Decode)
    "flux1_dev_tp4_parallel_vae": ("RocmParallelTPSampler", "0,1,2,3", "flux1-dev.safetensors", None),
    "flux1_dev_ring2": ("RocmParallelRingSampler", "0,1", "flux1-dev.safetensors", (2, 1)),
    "flux1_dev_ring2_ulysses2": ("RocmParallelRingSampler", "0,1,2,3", "flux1-dev.safetensors", (2, 2)),
    "flux1_schnell_tp2": ("RocmParallelTPSampler", "0,1", "flux1-schnell.safetensors", None),
    "flux1_dev_lora_dpmpp2m_beta": ("RocmParallelTPSampler", "0,1,2,3", "flux1-dev.safetensors", None),
    "flux1_dev_ksampler_parallel_model": ("KSampler", "0,1,2,3", "flux1-dev.safetensors", None),
    # the same graph with T5-XXL sharded on the model's 4 GPUs (ROCm Parallel Text Encoder Loader)
    "flux1_dev_text_encoder_parallel_model": ("KSampler", "0,1,2,3", "flux1-dev.safetensors", None),
    "flux1_kontext_dev_ksampler_parallel_model": (
        "KSampler",
        "0,1,2,3",
        "flux1-kontext-dev.safetensors",
        None,
    ),
    # Comfy-Org's FLUX.2 [dev] file, as ComfyUI's own template (image_flux2_text_to_image) loads it.
    "flux2_dev_parallel_model_tp4": (
        "SamplerCustomAdvanced",
        "0,1,2,3",
        "flux2_dev_fp8mixed.safetensors",
        None,
    ),
    # The same template on a composed layout: TP pairs for the weights, Ulysses across them for the tokens.
    "flux2_dev_parallel_model_tp2_ulysses2": (
        "SamplerCustomAdvanced",
        "0,1,2,3",
        "flux2_dev_fp8mixed.safetensors",
        None,
    ),
    # The same template with its CLIPLoader replaced by the ROCm Parallel Text Encoder Loader: Mistral Small 3
    # 24B (Comfy-Org's bf16 file) tensor parallel on the model's 4 GPUs
    "flux2_dev_text_encoder_parallel_model_tp4": (
        "SamplerCustomAdvanced",
        "0,1,2,3",
        "flux2_dev_fp8mixed.safetensors",
        None,
    ),
    # The same template on two GPUs with a GGUF file, kept quantized (the pack's own loader: no
    # ComfyUI-GGUF node in the graph).
    "flux2_dev_gguf_parallel_model_tp2": (
        "SamplerCustomAdvanced",
        "0,1",
        "flux2-dev-Q4_K_M.gguf",
        None,
    ),
    # ComfyUI's Qwen-Image template (image_qwen_image) with cfg 2.5: cond + uncond, one call of 2 that the
    # batch degree splits over two TP pairs; Comfy-Org's fp8 file, as the template loads it.
    "qwen_image_parallel_model_batch2_tp2": (
        "KSampler",
        "0,1,2,3",
        "qwen_image_fp8_e4m3fn.safetensors",
        None,
    ),
    # The same graph with Qwen2.5-VL 7B (Comfy-Org's bf16 file) tensor parallel on the model's 4 GPUs
    "qwen_image_text_encoder_parallel_model_batch2_tp2": (
        "KSampler",
        "0,1,2,3",
        "qwen_image_fp8_e4m3fn.safetensors",
        None,
    ),
    # ComfyUI's Wan 2.1 text-to-video template at 720p x 81 frames on the planner's layout for 4 x 24 GB
    "wan2_1_t2v_14b_parallel_model_batch2_ulysses2": (
        "KSampler",
        "0,1,2,3",
        "wan2.1_t2v_14B_fp8_e4m3fn.safetensors",
        None,
    ),
    # ComfyUI's Wan 2.2 A14B image-to-video template: two loaders (the experts), two KSamplerAdvanced
    "wan2_2_i2v_a14b_parallel_model_batch2_tp2": (
        "KSamplerAdvanced",
        "0,1,2,3",
        "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors",  # the last loader's (the high-noise one's below)
        None,
    ),
}


@pytest.fixture(params=core_versions())
def info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> dict:
    (tmp_path / "models").mkdir()
    FakeComfy(tmp_path / "models").install(monkeypatch)
    return {**core_object_info(request.param), **pack_object_info(NODE_CLASS_MAPPINGS)}


def load(name: str, api: bool = False) -> dict:
    return json.loads((WORKFLOWS / ("api" if api else "") / f"{name}.json").read_text())


def test_every_advertised_workflow_is_there() -> None:
    assert NAMES == sorted(EXPECTED)
    assert sorted(p.stem for p in (WORKFLOWS / "api").glob("*.json")) == sorted(EXPECTED)


def test_comfyui_serves_workflows_as_templates() -> None:
    # ComfyUI serves a pack's templates from the FIRST of these folders that exists (app/custom_node_manager.py
    # adds one static route per folder under the same prefix, and the first one answers 404 for the rest).
    shadowing = [
        d for d in ("example_workflows", "example", "examples", "workflow") if (WORKFLOWS.parent / d).exists()
    ]
    assert shadowing == [], f"{shadowing} would hide workflows/ from ComfyUI's template browser"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ui_workflow_is_valid(info: dict, name: str) -> None:
    assert check_ui(load(name), info) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ui_workflow_nodes_do_not_overlap(name: str) -> None:
    assert overlapping_nodes(load(name)) == []


def test_overlap_check_finds_overlaps() -> None:
    ui = load("flux1_dev_tp4")
    decode = next(n for n in ui["nodes"] if n["type"] == "VAEDecode")
    save = next(n for n in ui["nodes"] if n["type"] == "SaveImage")
    save["pos"] = [decode["pos"][0] + 280, decode["pos"][1]]  # how the shipped files had it
    assert overlapping_nodes(ui) == [f"{decode['id']} VAEDecode overlaps {save['id']} SaveImage"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_api_workflow_is_valid_and_matches_the_ui_one(info: dict, name: str) -> None:
    api = load(name, api=True)
    assert check_api(api, info) == []
    stripped = {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
    assert ui_to_api(load(name), info) == stripped


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_workflow_does_what_its_name_says(name: str) -> None:
    sampler, devices, checkpoint, degrees = EXPECTED[name]
    api = load(name, api=True)
    by_class = {node["class_type"]: node["inputs"] for node in api.values()}
    assert by_class["RocmParallelLoader"]["devices"] == devices
    assert by_class["RocmParallelLoader"]["checkpoint"] == checkpoint
    assert sampler in by_class
    if degrees:
        assert (by_class[sampler]["ring_degree"], by_class[sampler]["ulysses_degree"]) == degrees
    # FLUX.1-dev takes a guidance value; schnell has no guidance input, so no FluxGuidance node.
    assert ("FluxGuidance" in by_class) == ("dev" in name)
    video = name.startswith("wan")
    standard = {"CLIPTextEncode", "VAELoader", "VAEDecode", "SaveAnimatedWEBP" if video else "SaveImage"}
    # FLUX.1: two text encoders (clip_l + t5xxl); FLUX.2: one (Mistral 3 Small) and a 128-channel latent;
    # Qwen-Image: one (Qwen2.5-VL 7B); Wan: one (umt5-xxl)
    if "text_encoder" in name:  # the text encoder on the model's workers, in ComfyUI's loader's place
        standard.add("RocmParallelTextEncoderLoader")
        assert by_class["RocmParallelTextEncoderLoader"]["devices"] == devices
    else:
        standard.add("DualCLIPLoader" if name.startswith("flux1") else "CLIPLoader")
    # text-to-image starts from an empty latent; an edit (Kontext) from the encoded image; image-to-video
    # from WanImageToVideo's latent and a start image
    if "kontext" in name:
        standard.add("VAEEncode")
    elif "i2v" in name:
        standard |= {"WanImageToVideo", "LoadImage"}
    elif video:
        standard.add("EmptyHunyuanLatentVideo")
    else:
        standard.add("EmptyFlux2LatentImage" if name.startswith("flux2") else "EmptySD3LatentImage")
    if name.endswith("_parallel_vae"):  # the decode on the loader's GPUs: the VAE file is the node's own
        standard -= {"VAELoader", "VAEDecode"}
        standard.add("RocmParallelVAEDecode")
        loader = next(k for k, node in api.items() if node["class_type"] == "RocmParallelLoader")
        assert by_class["RocmParallelVAEDecode"]["parallel_flux"] == [loader, 0]
    assert standard <= set(by_class)


def test_lora_workflow_chains_loader_lora_sampler_with_dpmpp_2m_beta() -> None:
    api = load("flux1_dev_lora_dpmpp2m_beta", api=True)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    sampler = api[ids["RocmParallelTPSampler"]]["inputs"]
    assert (sampler["sampler_name"], sampler["scheduler"]) == ("dpmpp_2m", "beta")
    assert sampler["parallel_flux"] == [ids["RocmParallelLoRA"], 0]
    assert api[ids["RocmParallelLoRA"]]["inputs"]["parallel_flux"] == [ids["RocmParallelLoader"], 0]


def test_ksampler_workflow_runs_comfyuis_own_ksampler_on_the_parallel_model() -> None:
    api = load("flux1_dev_ksampler_parallel_model", api=True)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    assert api[ids["KSampler"]]["inputs"]["model"] == [ids["RocmParallelModel"], 0]
    assert api[ids["RocmParallelModel"]]["inputs"]["parallel_flux"] == [ids["RocmParallelLoader"], 0]
    assert api[ids["KSampler"]]["inputs"]["cfg"] == 1.0  # FLUX dev: FluxGuidance, not cfg


def test_kontext_workflow_edits_an_image_with_reference_latents_on_the_parallel_model() -> None:
    """ComfyUI's Kontext graph: LoadImage -> FluxKontextImageScale -> VAEEncode, whose latent is both the
    ReferenceLatent of the prompt and the start latent of ComfyUI's KSampler on the ROCm Parallel Model."""
    api = load("flux1_kontext_dev_ksampler_parallel_model", api=True)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    inputs = {name: api[node_id]["inputs"] for name, node_id in ids.items()}
    assert inputs["KSampler"]["model"] == [ids["RocmParallelModel"], 0]
    assert inputs["KSampler"]["positive"] == [ids["FluxGuidance"], 0]
    assert inputs["FluxGuidance"]["conditioning"] == [ids["ReferenceLatent"], 0]
    assert inputs["ReferenceLatent"]["latent"] == [ids["VAEEncode"], 0]
    assert inputs["KSampler"]["latent_image"] == [ids["VAEEncode"], 0]
    assert inputs["VAEEncode"]["pixels"] == [ids["FluxKontextImageScale"], 0]
    assert inputs["FluxKontextImageScale"]["image"] == [ids["LoadImage"], 0]
    assert (inputs["KSampler"]["cfg"], inputs["FluxGuidance"]["guidance"]) == (1.0, 2.5)


def test_flux2_workflow_is_comfyuis_flux2_template_on_the_parallel_model() -> None:
    """ComfyUI's FLUX.2 text-to-image template (image_flux2_text_to_image) with its UNETLoader replaced by
    the ROCm Parallel Loader (4 GPUs, the fp8 file kept fp8) -> ROCm Parallel Model (tp): the MODEL goes
    to BasicGuider, and SamplerCustomAdvanced samples with Flux2Scheduler's sigmas for the same size as
    the empty latent."""
    api = load("flux2_dev_parallel_model_tp4", api=True)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    inputs = {name: api[node_id]["inputs"] for name, node_id in ids.items()}
    assert "UNETLoader" not in ids
    assert inputs["RocmParallelLoader"]["weight_dtype"] == "default"
    assert inputs["RocmParallelModel"]["parallel_flux"] == [ids["RocmParallelLoader"], 0]
    assert inputs["RocmParallelModel"]["layout"] == "tp"
    assert inputs["BasicGuider"]["model"] == [ids["RocmParallelModel"], 0]
    assert inputs["BasicGuider"]["conditioning"] == [ids["FluxGuidance"], 0]
    assert inputs["FluxGuidance"]["guidance"] == 4.0
    assert inputs["CLIPLoader"]["type"] == "flux2"
    assert inputs["CLIPLoader"]["clip_name"] == "mistral_3_small_flux2_fp8.safetensors"
    assert inputs["VAELoader"]["vae_name"] == "flux2-vae.safetensors"
    assert inputs["KSamplerSelect"]["sampler_name"] == "euler"
    sampler = inputs["SamplerCustomAdvanced"]
    assert sampler == {
        "noise": [ids["RandomNoise"], 0],
        "guider": [ids["BasicGuider"], 0],
        "sampler": [ids["KSamplerSelect"], 0],
        "sigmas": [ids["Flux2Scheduler"], 0],
        "latent_image": [ids["EmptyFlux2LatentImage"], 0],
    }
    size = (inputs["EmptyFlux2LatentImage"]["width"], inputs["EmptyFlux2LatentImage"]["height"])
    assert (inputs["Flux2Scheduler"]["width"], inputs["Flux2Scheduler"]["height"]) == size
    assert inputs["VAEDecode"]["samples"] == [ids["SamplerCustomAdvanced"], 0]


def test_the_composed_flux2_workflow_is_a_layout_the_planner_prices_for_flux2_dev() -> None:
    """tp 2 x ulysses 2 on the 4 GPUs of the loader: the Model node's layout is read by the pack's parser,
    its degrees multiply to the device count and Ulysses divides the 24 heads each TP rank keeps of FLUX.2
    [dev]'s 48; no batch degree (BasicGuider at cfg 1 makes calls of 1: a batch degree would idle). The
    graph is the tp4 workflow's, node for node, only the layout (and where the image is saved) differs."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.flux.dims import FluxDims
    from rocm_parallel.backend.flux2.model import FLUX2_DEV
    from rocm_parallel.backend.plan import Setup, estimate

    api = load("flux2_dev_parallel_model_tp2_ulysses2", api=True)
    by_class = {node["class_type"]: node["inputs"] for node in api.values()}
    layout = ParallelLayout.parse(by_class["RocmParallelModel"]["layout"])
    assert layout == ParallelLayout(tp=2, ulysses=2)
    devices = len(by_class["RocmParallelLoader"]["devices"].split(","))
    dims = FluxDims.from_diffusers_config(FLUX2_DEV)
    layout.validate(dims, devices=devices)
    setup = Setup(dims, 1024, 1024, text_tokens=512, devices=devices, memory_gb=24, family="flux2",
                  weight_dtype="fp8_e4m3fn")  # fmt: skip
    assert estimate(setup, layout).fits  # 16.2 GB of fp8 weights + activations on 24 GB GPUs
    plain = load("flux2_dev_parallel_model_tp4", api=True)
    for node_id, node in api.items():
        if node["class_type"] not in ("RocmParallelModel", "SaveImage"):
            assert node["inputs"] == plain[node_id]["inputs"], node["class_type"]


def test_the_gguf_flux2_workflow_fits_two_16_gb_gpus_where_fp8_does_not() -> None:
    """FLUX.2 [dev] as a Q4_K GGUF on 'tp' over the loader's two GPUs: the pack's own loader and Model node
    (no ComfyUI-GGUF node), the tp4 graph otherwise, node for node; the planner, pricing the file's Q4_K
    blocks kept quantized, finds tp 2 fits 16 GB GPUs, which the fp8 file does not."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.flux.dims import FluxDims
    from rocm_parallel.backend.flux2.model import FLUX2_DEV
    from rocm_parallel.backend.plan import Setup, estimate

    api = load("flux2_dev_gguf_parallel_model_tp2", api=True)
    by_class = {node["class_type"]: node["inputs"] for node in api.values()}
    assert not [c for c in by_class if "GGUF" in c]
    assert by_class["RocmParallelLoader"]["checkpoint"].endswith(".gguf")
    assert by_class["RocmParallelModel"]["layout"] == "tp"
    devices = len(by_class["RocmParallelLoader"]["devices"].split(","))
    dims = FluxDims.from_diffusers_config(FLUX2_DEV)
    fits = {
        w: estimate(Setup(dims, 1024, 1024, text_tokens=512, devices=devices, memory_gb=16, family="flux2",
                          weight_dtype=w), ParallelLayout(tp=devices)).fits
        for w in ("Q4_K", "fp8_e4m3fn")
    }  # fmt: skip
    assert fits == {"Q4_K": True, "fp8_e4m3fn": False}
    plain = load("flux2_dev_parallel_model_tp4", api=True)
    for node_id, node in api.items():
        if node["class_type"] not in ("RocmParallelLoader", "SaveImage", "CLIPTextEncode"):
            assert node["inputs"] == plain[node_id]["inputs"], node["class_type"]


def test_qwen_workflow_is_comfyuis_qwen_image_template_on_a_batch_split() -> None:
    """ComfyUI's Qwen-Image template (image_qwen_image, comfyui_workflow_templates 0.7.23) with its UNETLoader
    replaced by the ROCm Parallel Loader (4 GPUs, Comfy-Org's fp8 file kept fp8) -> ROCm Parallel Model ->
    the template's ModelSamplingAuraFlow 3.1 -> KSampler (20 steps, euler/simple, cfg 2.5 with the negative
    prompt) at 1328x1328. cfg 2.5 makes every model call a batch of 2 (cond + uncond): 'batch 2 x tp 2'
    gives each TP pair one of them, no pair idles, and the planner finds it fits 24 GB GPUs."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.plan import Setup, estimate
    from rocm_parallel.backend.qwen_image.model import QWEN_IMAGE

    api = load("qwen_image_parallel_model_batch2_tp2", api=True)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    inputs = {name: api[node_id]["inputs"] for name, node_id in ids.items()}
    assert "UNETLoader" not in ids and "FluxGuidance" not in ids
    assert inputs["RocmParallelLoader"]["weight_dtype"] == "default"
    assert inputs["RocmParallelModel"]["parallel_flux"] == [ids["RocmParallelLoader"], 0]
    assert inputs["ModelSamplingAuraFlow"] == {"shift": 3.1, "model": [ids["RocmParallelModel"], 0]}
    assert inputs["CLIPLoader"]["type"] == "qwen_image"
    assert inputs["CLIPLoader"]["clip_name"] == "qwen_2.5_vl_7b_fp8_scaled.safetensors"
    assert inputs["VAELoader"]["vae_name"] == "qwen_image_vae.safetensors"
    sampler = inputs["KSampler"]
    assert sampler["model"] == [ids["ModelSamplingAuraFlow"], 0]
    assert sampler["latent_image"] == [ids["EmptySD3LatentImage"], 0]
    assert {sampler["positive"][0], sampler["negative"][0]} == {
        k for k, v in api.items() if v["class_type"] == "CLIPTextEncode"
    }
    assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"], sampler["scheduler"]) == (
        20,
        2.5,
        "euler",
        "simple",
    )
    latent = inputs["EmptySD3LatentImage"]
    assert (latent["width"], latent["height"], latent["batch_size"]) == (1328, 1328, 1)
    assert inputs["VAEDecode"]["samples"] == [ids["KSampler"], 0]

    family = get_family("qwen_image")
    layout = ParallelLayout.parse(inputs["RocmParallelModel"]["layout"])
    assert layout == ParallelLayout(batch=2, tp=2)
    devices = len(inputs["RocmParallelLoader"]["devices"].split(","))
    dims = family.dims(QWEN_IMAGE)
    layout.validate(dims, devices=devices)
    call_batch = latent["batch_size"] * (2 if sampler["cfg"] != 1 else 1)
    setup = Setup(dims, 1328, 1328, batch=call_batch, text_tokens=family.text.tokens, devices=devices,
                  memory_gb=24, family="qwen_image", weight_dtype="fp8_e4m3fn")  # fmt: skip
    cost = estimate(setup, layout)
    assert cost.fits and cost.idle_groups == 0 and cost.local_batch == 1  # 10.2 GB of fp8 weights per GPU


@pytest.mark.parametrize(
    ("name", "plain", "clip_name", "model", "placed"),
    [
        # bf16 Mistral at TP 4: 11.45 GB per GPU beside 8.2 GB of fp8 model; on 24 GB GPUs only between phases
        ("flux2_dev_text_encoder_parallel_model_tp4", "flux2_dev_parallel_model_tp4",
         "mistral_3_small_flux2_bf16.safetensors", "flux2-dev", {24: "host", 32: "resident"}),
        ("qwen_image_text_encoder_parallel_model_batch2_tp2", "qwen_image_parallel_model_batch2_tp2",
         "qwen_2.5_vl_7b.safetensors", "qwen-image", {16: "comfyui", 24: "resident"}),
    ],
)  # fmt: skip
def test_text_encoder_workflows_are_the_plain_ones_with_the_encoder_on_the_workers(
    name: str, plain: str, clip_name: str, model: str, placed: dict[int, str]
) -> None:
    """The FLUX.2 [dev] and Qwen-Image workflows with ComfyUI's CLIPLoader replaced by the ROCm Parallel Text
    Encoder Loader (its bf16 file: the pack holds no scaled-fp8 encoder; same type; the model loader's devices),
    whose CLIP feeds the same nodes; every other node's inputs are the plain workflow's. The planner, pricing
    the encoder's shard beside the Model node's layout and ComfyUI on GPU 0, keeps it resident on the larger
    GPUs named and says where it goes on the smaller ones."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.plan import Setup, call_batch, estimate
    from rocm_parallel.backend.plan.graph import model_encoders, plan_graph

    api, base = load(name, api=True), load(plain, api=True)
    assert sorted(api) == sorted(base)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    assert (
        "CLIPLoader" not in ids and base[ids["RocmParallelTextEncoderLoader"]]["class_type"] == "CLIPLoader"
    )
    clip_type = base[ids["RocmParallelTextEncoderLoader"]]["inputs"]["type"]
    by_class = {node["class_type"]: node["inputs"] for node in api.values()}
    devices = by_class["RocmParallelLoader"]["devices"]
    assert by_class["RocmParallelTextEncoderLoader"] == {
        "clip_name1": clip_name, "clip_name2": "none", "type": clip_type, "devices": devices,
        "placement": "auto",  # parked in host memory when sampling needs the room: the planner's "host"
    }  # fmt: skip
    for node_id, node in api.items():
        if node["class_type"] not in ("RocmParallelTextEncoderLoader", "SaveImage"):
            assert node["inputs"] == base[node_id]["inputs"], node["class_type"]

    family = next(f for f in (get_family("flux2"), get_family("qwen_image")) if model in f.presets)
    latent = by_class.get("EmptyFlux2LatentImage") or by_class["EmptySD3LatentImage"]
    cfg = by_class["KSampler"]["cfg"] if "KSampler" in by_class else 1.0  # BasicGuider: no negative prompt
    count = len(devices.split(","))
    layout = ParallelLayout.make(by_class["RocmParallelModel"]["layout"], count)
    for memory, choice in placed.items():
        setup = Setup(family.dims(family.presets[model]), latent["width"], latent["height"],
                      batch=call_batch(latent["batch_size"], cfg), text_tokens=family.text.tokens, devices=count,
                      memory_gb=memory, family=family.name, weight_dtype="fp8_e4m3fn")  # fmt: skip
        cost = estimate(setup, layout)
        assert cost.fits
        graph = plan_graph(model_encoders()[model], "bf16", count, cost.weights, cost.activations, memory)
        assert graph.placement.choice == choice, (memory, graph.placement.explanation())


def test_wan_t2v_workflow_is_comfyuis_template_on_the_planners_layout() -> None:
    """ComfyUI's Wan 2.1 text-to-video template (text_to_video_wan: ModelSamplingSD3 8, KSampler 30 steps
    uni_pc / simple at cfg 6 with its negative prompt) with the 14B file (Comfy-Org's fp8) on the ROCm Parallel
    Model at 1280x720 x 81 frames: the layout is the planner's first choice for 4 x 24 GB GPUs, and it fits."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.plan import Setup, plan
    from rocm_parallel.backend.wan.model import WAN21_T2V_14B

    api = load("wan2_1_t2v_14b_parallel_model_batch2_ulysses2", api=True)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    inputs = {name: api[node_id]["inputs"] for name, node_id in ids.items()}
    assert "UNETLoader" not in ids
    assert inputs["RocmParallelModel"]["parallel_flux"] == [ids["RocmParallelLoader"], 0]
    assert inputs["ModelSamplingSD3"] == {"shift": 8.0, "model": [ids["RocmParallelModel"], 0]}
    assert (inputs["CLIPLoader"]["type"], inputs["VAELoader"]["vae_name"]) == (
        "wan",
        "wan_2.1_vae.safetensors",
    )
    sampler = inputs["KSampler"]
    assert sampler["model"] == [ids["ModelSamplingSD3"], 0]
    assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"], sampler["scheduler"]) == (
        30,
        6,
        "uni_pc",
        "simple",
    )
    latent = inputs["EmptyHunyuanLatentVideo"]
    assert (latent["width"], latent["height"], latent["length"], latent["batch_size"]) == (1280, 720, 81, 1)
    assert sampler["latent_image"] == [ids["EmptyHunyuanLatentVideo"], 0]
    assert inputs["SaveAnimatedWEBP"]["images"] == [ids["VAEDecode"], 0]

    family = get_family("wan")
    layout = ParallelLayout.parse(inputs["RocmParallelModel"]["layout"])
    devices = len(inputs["RocmParallelLoader"]["devices"].split(","))
    setup = Setup(family.dims(WAN21_T2V_14B), 1280, 720, batch=2, frames=81, text_tokens=family.text.tokens,
                  devices=devices, memory_gb=24, family="wan", weight_dtype="fp8_e4m3fn")  # fmt: skip
    best = plan(setup)[0]
    assert best.layout == layout == ParallelLayout(batch=2, ulysses=2) and best.fits


def test_wan_a14b_workflow_keeps_both_experts_on_the_same_gpus() -> None:
    """ComfyUI's Wan 2.2 A14B image-to-video template (video_wan2_2_14B_i2v with its default, no 4-step LoRA:
    WanImageToVideo 640x640 x 81, ModelSamplingSD3 5 on each expert, KSamplerAdvanced 20 steps at cfg 3.5 split
    at step 10) with two ROCm Parallel Loaders on the same GPUs: two slots of one worker group, both experts'
    weights and the activations fit 24 GB GPUs in its layout, so neither is unloaded for the other."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.plan import Setup, estimate
    from rocm_parallel.backend.wan.model import WAN22_I2V_A14B

    api = load("wan2_2_i2v_a14b_parallel_model_batch2_tp2", api=True)
    of = lambda kind: sorted((k for k, v in api.items() if v["class_type"] == kind), key=int)  # noqa: E731
    (high_loader, low_loader), (high_model, low_model) = of("RocmParallelLoader"), of("RocmParallelModel")
    (first, second), (cond,) = of("KSamplerAdvanced"), of("WanImageToVideo")
    loaders = [api[k]["inputs"] for k in (high_loader, low_loader)]
    assert [x["checkpoint"] for x in loaders] == [
        "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors",
        "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors",
    ]
    assert loaders[0]["devices"] == loaders[1]["devices"] == "0,1,2,3"
    assert api[high_model]["inputs"]["parallel_flux"] == [high_loader, 0]
    assert api[low_model]["inputs"]["parallel_flux"] == [low_loader, 0]
    a, b = api[first]["inputs"], api[second]["inputs"]
    for sampler, model in ((a, high_model), (b, low_model)):
        (shift_id,) = [
            k
            for k, v in api.items()
            if v["class_type"] == "ModelSamplingSD3" and v["inputs"]["model"] == [model, 0]
        ]
        assert sampler["model"] == [shift_id, 0] and api[shift_id]["inputs"]["shift"] == 5.0
        assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"]) == (20, 3.5, "euler")
        assert (sampler["positive"], sampler["negative"]) == ([cond, 0], [cond, 1])
    assert (a["add_noise"], a["start_at_step"], a["end_at_step"], a["return_with_leftover_noise"]) == (
        "enable",
        0,
        10,
        "enable",
    )
    assert (b["add_noise"], b["start_at_step"], b["end_at_step"], b["return_with_leftover_noise"]) == (
        "disable",
        10,
        10000,
        "disable",
    )
    assert (a["latent_image"], b["latent_image"]) == ([cond, 2], [first, 0])
    video = api[cond]["inputs"]
    assert (video["width"], video["height"], video["length"]) == (640, 640, 81)

    family = get_family("wan")
    layout = ParallelLayout.parse(api[high_model]["inputs"]["layout"])
    assert layout == ParallelLayout.parse(api[low_model]["inputs"]["layout"]) == ParallelLayout(batch=2, tp=2)
    setup = Setup(family.dims(WAN22_I2V_A14B), 640, 640, batch=2, frames=81, text_tokens=family.text.tokens,
                  devices=4, memory_gb=24, family="wan", weight_dtype="fp8_e4m3fn")  # fmt: skip
    cost = estimate(setup, layout)
    assert 2 * cost.weights + cost.activations <= cost.usable  # both experts resident, plus one's activations


def test_checker_finds_broken_workflows(info: dict) -> None:
    """The checks above can fail: each kind of damage is reported."""
    ui = load("flux1_dev_tp4")
    sampler = next(n for n in ui["nodes"] if n["type"] == "RocmParallelTPSampler")
    broken = copy.deepcopy(ui)
    node = next(n for n in broken["nodes"] if n["id"] == sampler["id"])
    node["inputs"][1]["type"] = "LATENT"  # positive typed wrong
    node["widgets_values"][4] = "dpmpp_3m_turbo"  # a sampler ComfyUI does not offer
    broken["links"] = [link for link in broken["links"] if link[3] != sampler["id"] or link[4] != 2]
    assert check_ui(broken, info) == [
        f"node {sampler['id']} RocmParallelTPSampler.positive is typed LATENT, the node takes CONDITIONING",
        f"node {sampler['id']} RocmParallelTPSampler.latent_image: link "
        f"{node['inputs'][2]['link']} is not in the links table",
        f"node {sampler['id']} RocmParallelTPSampler: required input 'latent_image' is not connected",
        f"node {sampler['id']} RocmParallelTPSampler.sampler_name='dpmpp_3m_turbo': not one of {SAMPLERS}",
    ]
    api = load("flux1_dev_ring2", api=True)
    ring_id = next(k for k, v in api.items() if v["class_type"] == "RocmParallelRingSampler")
    api[ring_id]["inputs"]["positive"] = ["4", 0]  # the empty latent, not a CONDITIONING
    api[ring_id]["inputs"]["ring_degree"] = -1
    del api[ring_id]["inputs"]["seed"]
    api["99"] = {"class_type": "KSamplerTurbo", "inputs": {}}
    assert check_api(api, info) == [
        f"node {ring_id} RocmParallelRingSampler.positive takes CONDITIONING, linked to LATENT",
        f"node {ring_id} RocmParallelRingSampler: required input 'seed' missing",
        f"node {ring_id} RocmParallelRingSampler.ring_degree=-1: outside [0, 64]",
        "node type 'KSamplerTurbo' is neither a pack node nor a known core node",
    ]
    composed = load("flux2_dev_parallel_model_tp2_ulysses2", api=True)
    model_id = next(k for k, v in composed.items() if v["class_type"] == "RocmParallelModel")
    composed[model_id]["inputs"]["layout"] = "tp 2 x ulyses 2"
    assert check_api(composed, info) == [
        f"node {model_id} RocmParallelModel.layout='tp 2 x ulyses 2': layout='tp 2 x ulyses 2' is not a "
        "layout: 'ulyses 2' is not a degree; use tp, context, auto or degrees such as 'batch 2 x tp 2' or "
        "'tp2xring2' (batch, tp, ring, ulysses; each at most once)"
    ]
