"""Several models resident on one worker group, each in its own slot (a ComfyUI graph with two loaders, Wan 2.2's
two experts, a text encoder beside a diffusion model), and the pieces a new family needs from the engine:
context attention that stays local where diffusers passes no parallel config, a TP split for norms across
heads, and modules a model class keeps in float32."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_flux2_service import CONFIG as FLUX2_CONFIG
from test_flux2_service import call_inputs as flux2_inputs
from test_flux2_service import flux2_file  # noqa: F401  (a fixture)
from test_flux2_service import one_process as flux2_one_process
from test_service import call_inputs as flux_inputs
from test_service import one_process as flux_one_process

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.parallel.context import (
    AttentionKernel,
    ContextAttention,
    ContextState,
    cpu_flash_forward_op,
    math_forward_op,
)
from rocm_parallel.backend.runtime.client import WorkerGroup

TOL = 1e-5


def _counting_loads(group: WorkerGroup) -> tuple[list[str], mock._patch]:
    """Patch the group so every `load` request it sends is recorded (its slot)."""
    loads: list[str] = []
    real = group.call_all

    def call_all(method: str, request: object = None, **kwargs: object) -> object:
        if method == "load":
            loads.append(request.slot)  # type: ignore[attr-defined]
        return real(method, request, **kwargs)

    return loads, mock.patch.object(group, "call_all", side_effect=call_all)


def test_two_models_stay_resident_and_alternate_without_a_load(
    group2: WorkerGroup,
    checkpoints: dict[str, str],
    flux2_file: tuple[str, torch.nn.Module],  # noqa: F811
) -> None:
    """A FLUX.1 and a FLUX.2 checkpoint on one group in two slots (and two layouts): 20 alternating calls,
    no load after the first two, each output its own model's one-process forward."""
    path2, model2 = flux2_file
    group = ParallelModel(group=group2)
    group.unload()  # whatever earlier tests left resident on the session's ranks
    loads, patch = _counting_loads(group2)
    with patch:
        group.load(checkpoints["dev"], layout="tp", dtype="float32", slot="first")
        group.load(path2, layout=ParallelLayout(ring=2), dtype="float32", slot="second")
        one = flux_inputs()
        two = {k: v for k, v in flux2_inputs().items() if k != "ref_latents"}
        want_one, want_two = flux_one_process(one), flux2_one_process(model2, {**two, "ref_latents": []})
        for i in range(20):
            if i % 2 == 0:
                out = group.forward(**one, slot="first")
                assert (out - want_one).abs().max().item() <= TOL, i
            else:
                out = group.forward(**two, slot="second")
                assert (out - want_two).abs().max().item() <= TOL, i
    assert loads == ["first", "second"]
    assert list(group.residents) == ["first", "second"]  # least recently used first
    status = group.status()
    assert [m.slot for m in status[0].models] == ["first", "second"]
    assert status[0].parameter_bytes == sum(m.parameter_bytes for m in status[0].models)
    # one slot unloaded, the other keeps serving without a load
    group.unload(slot="first")
    with pytest.raises(ConfigError, match=r"no checkpoint is loaded in slot 'first'; loaded: 'second'"):
        group.forward(**one, slot="first")
    loads.clear()
    with patch:
        out = group.forward(**two, slot="second")
    assert loads == [] and (out - want_two).abs().max().item() <= TOL
    group.unload()
    assert group.status()[0].models == ()


def test_a_new_model_evicts_the_least_recently_used_when_both_do_not_fit(
    group2: WorkerGroup,
    checkpoints: dict[str, str],
    flux2_file: tuple[str, torch.nn.Module],  # noqa: F811
) -> None:
    """When the weights of every resident model and the new one would not fit together, the least recently
    used slot is unloaded first, and said so."""
    path2, _ = flux2_file
    group = ParallelModel(group=group2)
    group.unload()
    group.load(checkpoints["dev"], layout="tp", dtype="float32", slot="first")
    group.load(checkpoints["schnell"], layout="tp", dtype="float32", slot="other")
    group.forward(**flux_inputs(), slot="first")  # "other" is now the least recently used
    with mock.patch.object(type(group), "_weight_limit", return_value=1.0):  # nothing fits beside the new one
        group.load(path2, layout="tp", dtype="float32", slot="new")
    assert list(group.residents) == ["new"]
    assert [m.slot for m in group.status()[0].models] == ["new"]
    assert len(group.evicted) == 2 and "to make room for flux2-tiny.safetensors" in group.evicted[-1]
    group.unload()


def test_a_slot_must_be_named() -> None:
    group = ParallelModel(["cpu", "cpu"])
    with pytest.raises(ConfigError, match=r"^slot='' must be a non-empty name$"):
        group.check_load("unused.safetensors", slot="")
    with pytest.raises(ConfigError, match=r"^wrong is not a load option; use layout, ring"):
        group.check_load("unused.safetensors", wrong=1)


# --------------------------------------------------------------------------------------------------
# Context attention without a parallel config


@pytest.mark.parametrize("kernel", [cpu_flash_forward_op, math_forward_op], ids=["cpu_flash", "math"])
def test_context_attention_without_a_parallel_config_is_plain_attention(kernel: object) -> None:
    """diffusers passes no parallel config where attention stays local (Wan's cross-attention from this rank's
    tokens to the whole text): the rank's own attention, with the device's kernel."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=g)  # [B, S_local, H, D]
    k, v = torch.randn(2, 7, 4, 8, generator=g), torch.randn(2, 7, 4, 8, generator=g)
    state = ContextState(ParallelLayout(ring=2), AttentionKernel("k", kernel, lambda *a: None))
    out = ContextAttention(state)(q, k, v, parallel_config=None)
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    assert (out - want.transpose(1, 2)).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------------------------------
# fp32-kept modules (diffusers' _keep_in_fp32_modules)


def test_modules_the_class_keeps_in_float32_stay_float32(checkpoints: dict[str, str]) -> None:
    """A model class that keeps modules in float32 (Wan: its time embedder and modulation tables) loads them
    in float32 whatever the compute dtype, the rest in that dtype."""
    from diffusers import FluxTransformer2DModel

    from rocm_parallel.backend.checkpoint import load_model

    with mock.patch.object(FluxTransformer2DModel, "_keep_in_fp32_modules", ["time_text_embed"]):
        model = load_model(checkpoints["dev"], dtype="bfloat16")
    kept = {n: p.dtype for n, p in model.named_parameters() if n.startswith("time_text_embed.")}
    rest = {p.dtype for n, p in model.named_parameters() if not n.startswith("time_text_embed.")}
    assert kept and set(kept.values()) == {torch.float32} and rest == {torch.bfloat16}
    plain = load_model(checkpoints["dev"], dtype="bfloat16")
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}  # FLUX keeps none itself


__all__ = ["FLUX2_CONFIG"]


# --------------------------------------------------------------------------------------------------
# A TP split for an RMS norm across all heads (Wan's norm_q / norm_k)


def test_a_norm_across_heads_under_tp_equals_the_whole_norm(group2: WorkerGroup) -> None:
    """Each rank holds its heads' slice of the norm; the sum of squares is all-reduced: the whole model's
    output, one extra small all-reduce. Normalising each slice by its own statistics is measurably wrong."""
    from norm_methods import NormCheck

    split = group2.call_all("norm_across_heads", NormCheck(split_norm=True))
    assert all(r.max_diff <= 1e-5 for r in split), [r.max_diff for r in split]
    assert {r.all_reduces for r in split} == {2}  # the norm's statistics and to_out's row-parallel sum
    per_rank = group2.call_all("norm_across_heads", NormCheck(split_norm=False))
    assert all(r.max_diff > 1e-3 for r in per_rank), [r.max_diff for r in per_rank]
