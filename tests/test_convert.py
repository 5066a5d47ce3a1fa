"""BFL <-> diffusers key mapping: exact round trip, the released FLUX.1 key set, configs from shapes."""

from __future__ import annotations

import pytest
import torch

from rocm_parallel.backend.checkpoint import COMFY_PREFIX, CheckpointError, bfl_to_diffusers, diffusers_to_bfl
from rocm_parallel.backend.flux.family import FLUX1
from rocm_parallel.backend.flux.keys import config_from_bfl
from rocm_parallel.backend.flux.model import FLUX_DEV, FLUX_SCHNELL, build_flux
from rocm_parallel.testing.models import tiny_flux_config


def _tiny(guidance: bool = True) -> dict:
    return tiny_flux_config(heads=4, head_dim=16, double_blocks=2, single_blocks=3, guidance=guidance)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_round_trip_is_bit_exact(guidance: bool) -> None:
    original = build_flux(_tiny(guidance), seed=3).state_dict()
    back = bfl_to_diffusers(diffusers_to_bfl(original))
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_fused_layout_is_bfl() -> None:
    """The BFL side as the BFL code stacks it: qkv, [q|k|v|mlp], final AdaLN as (shift, scale)."""
    d = build_flux(_tiny(), seed=5).state_dict()
    b = diffusers_to_bfl(d)
    h = 64
    qkv = b["double_blocks.1.txt_attn.qkv.weight"]
    assert torch.equal(qkv, torch.cat([d[f"transformer_blocks.1.attn.add_{x}_proj.weight"] for x in "qkv"]))
    linear1 = b["single_blocks.2.linear1.bias"]
    assert linear1.shape == (3 * h + 4 * h,)
    assert torch.equal(linear1[2 * h : 3 * h], d["single_transformer_blocks.2.attn.to_v.bias"])
    assert torch.equal(linear1[3 * h :], d["single_transformer_blocks.2.proj_mlp.bias"])
    shift, scale = b["final_layer.adaLN_modulation.1.weight"].chunk(2)
    diffusers_scale, diffusers_shift = d["norm_out.linear.weight"].chunk(2)
    assert torch.equal(shift, diffusers_shift) and torch.equal(scale, diffusers_scale)
    assert torch.equal(
        b["double_blocks.0.img_attn.norm.key_norm.scale"], d["transformer_blocks.0.attn.norm_k.weight"]
    )


def _released_flux_keys(guidance: bool, double: int = 19, single: int = 38) -> dict[str, tuple[int, ...]]:
    """FLUX.1-dev/schnell's BFL keys and shapes, written out from the BFL model definition (flux/model.py,
    flux/modules/layers.py) and the keys diffusers' convert_flux_transformer_checkpoint_to_diffusers pops."""
    h, mlp = 3072, 12288
    keys: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out: int, inp: int) -> None:
        keys[f"{name}.weight"], keys[f"{name}.bias"] = (out, inp), (out,)

    linear("img_in", h, 64)
    linear("txt_in", h, 4096)
    for emb, inp in [("time_in", 256), ("vector_in", 768)] + ([("guidance_in", 256)] if guidance else []):
        linear(f"{emb}.in_layer", h, inp)
        linear(f"{emb}.out_layer", h, h)
    for i in range(double):
        for s in ("img", "txt"):
            p = f"double_blocks.{i}.{s}"
            linear(f"{p}_mod.lin", 6 * h, h)
            linear(f"{p}_attn.qkv", 3 * h, h)
            linear(f"{p}_attn.proj", h, h)
            keys[f"{p}_attn.norm.query_norm.scale"] = keys[f"{p}_attn.norm.key_norm.scale"] = (128,)
            linear(f"{p}_mlp.0", mlp, h)
            linear(f"{p}_mlp.2", h, mlp)
    for i in range(single):
        p = f"single_blocks.{i}"
        linear(f"{p}.linear1", 3 * h + mlp, h)
        linear(f"{p}.linear2", h, h + mlp)
        linear(f"{p}.modulation.lin", 3 * h, h)
        keys[f"{p}.norm.query_norm.scale"] = keys[f"{p}.norm.key_norm.scale"] = (128,)
    linear("final_layer.linear", 64, h)
    linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return keys


@pytest.mark.parametrize("config", [FLUX_DEV, FLUX_SCHNELL], ids=["dev", "schnell"])
def test_released_flux_key_set(config: dict) -> None:
    expected = _released_flux_keys(config["guidance_embeds"])
    assert len(expected) == (780 if config["guidance_embeds"] else 776)
    assert FLUX1.bfl_shapes(config) == expected


def test_diffusers_own_converter_agrees_on_the_released_shape() -> None:
    """diffusers' converter (width 3072 hard-coded) maps our BFL dict back onto the model's keys/shapes."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    model = build_flux(FLUX_DEV, device="meta")
    bfl = {COMFY_PREFIX + k: v for k, v in diffusers_to_bfl(model.state_dict()).items()}
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert {k: tuple(v.shape) for k, v in theirs.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize(
    "config", [FLUX_DEV, FLUX_SCHNELL, _tiny(True), _tiny(False)], ids=["dev", "schnell", "tiny", "tiny-s"]
)
def test_config_from_shapes(config: dict) -> None:
    shapes = FLUX1.bfl_shapes(config)
    assert config_from_bfl(shapes) == config
    assert config_from_bfl({COMFY_PREFIX + k: v for k, v in shapes.items()}) == config


def test_full_comfy_checkpoint_keeps_only_the_transformer() -> None:
    d = build_flux(_tiny(), seed=1).state_dict()
    bfl = {COMFY_PREFIX + k: v for k, v in diffusers_to_bfl(d).items()}
    bfl["first_stage_model.decoder.conv_in.weight"] = torch.zeros(3)
    back = bfl_to_diffusers(bfl)
    assert all(torch.equal(back[k], v) for k, v in d.items())


def test_missing_block_is_named() -> None:
    shapes = FLUX1.bfl_shapes(_tiny())
    shapes = {k: v for k, v in shapes.items() if not k.startswith("single_blocks.1.")}
    with pytest.raises(
        CheckpointError, match=r"^'single_blocks.\*' blocks \[1\] are missing; the checkpoint is incomplete$"
    ):
        config_from_bfl(shapes)
