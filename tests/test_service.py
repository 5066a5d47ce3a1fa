"""The forward service: one model call per request on every rank, as ComfyUI's samplers call a model.

Parity is against ComfyUI's own `Flux.forward` (calls recorded by a real ComfyUI during sampling, with
odd latent sizes and a CFG batch, in tests/data/comfy_references.safetensors) and against the same
call in one process, for every layout.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from test_parallel_sampling import LAYOUTS
from test_sampling import flux_model, reference

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.flux.forward import flux_call, pad_to_patch
from rocm_parallel.backend.flux.sampling import diffusers_model_fn
from rocm_parallel.backend.runtime.client import WorkerGroup

TOL = 1e-5


def call_inputs(batch: int = 2, height: int = 7, width: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """A CFG-like call: two latents of an odd size, each with its own prompt."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, 16, height, width, generator=g),
        "timestep": torch.full((batch,), 0.7),
        "context": torch.randn(batch, 8, 32, generator=g),
        "y": torch.randn(batch, 24, generator=g),
        "guidance": torch.full((batch,), 3.5),
    }


def one_process(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return flux_call(
            diffusers_model_fn(flux_model("dev")),
            inputs["x"],
            inputs["timestep"],
            inputs["context"],
            inputs["y"],
            inputs["guidance"],
        )


@pytest.mark.parametrize(
    ("groups", "layout"),
    [(2, lay) for lay in LAYOUTS[2]] + [(4, ParallelLayout(ring=2, ulysses=2))],
    indirect=["groups"],
    ids=str,
)
def test_forward_matches_one_process_in_every_layout(
    groups: WorkerGroup, layout: ParallelLayout, checkpoints: dict[str, str]
) -> None:
    flux = ParallelModel(group=groups)
    flux.load(checkpoints["dev"], layout=layout, dtype="float32")
    inputs = call_inputs()
    out = flux.forward(**inputs)
    assert out.shape == (2, 16, 7, 9) and out.dtype == torch.float32
    assert (out - one_process(inputs)).abs().max().item() <= TOL


def test_padding_is_comfyuis_circular_wrap() -> None:
    x = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(1, 2, 3, 5)
    padded = pad_to_patch(x)
    assert padded.shape == (1, 2, 4, 6)
    assert torch.equal(padded[..., :3, :5], x)
    assert torch.equal(padded[..., 3, :5], x[..., 0, :])  # the extra row is the first one again
    assert torch.equal(padded[..., :3, 5], x[..., :, 0])  # the extra column is the first one again
    even = torch.ones(1, 2, 4, 6)
    assert pad_to_patch(even) is even


def comfy_calls() -> list[dict[str, torch.Tensor]]:
    """The diffusion-model calls a real ComfyUI made (inputs and its own Flux.forward outputs)."""
    ref = reference("model_calls")
    count = len({k.split(".")[0] for k in ref})
    return [{k.split(".", 1)[1]: v for k, v in ref.items() if k.startswith(f"{i}.")} for i in range(count)]


@pytest.mark.parametrize(
    ("groups", "layout"),
    [(2, ParallelLayout(tp=2)), (2, ParallelLayout(ring=2)), (4, ParallelLayout(ring=2, ulysses=2))],
    indirect=["groups"],
    ids=str,
)
def test_forward_equals_comfyuis_own_flux_forward(
    groups: WorkerGroup, layout: ParallelLayout, checkpoints: dict[str, str]
) -> None:
    calls = comfy_calls()
    assert len(calls) >= 2 and any(c["x"].shape[-1] % 2 for c in calls)  # odd sizes are in the record
    flux = ParallelModel(group=groups)
    flux.load(checkpoints["dev"], layout=layout, dtype="float32")
    for call in calls:
        got = flux.forward(call["x"], call["timestep"], call["context"], call["y"], call["guidance"])
        assert (got - call["output"]).abs().max().item() <= 1e-4


def test_conditioning_is_sent_once_and_found_by_content(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    """Each step builds new tensors with the same values (as ComfyUI does): only the first call sends them;
    a different prompt of the same shape is sent and used, never mistaken for the held one."""
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    inputs = call_inputs(seed=1)
    cond_bytes = (inputs["context"].numel() + inputs["y"].numel()) * 4
    for _ in range(3):
        fresh = {k: v.clone() for k, v in inputs.items()}
        out = flux.forward(**fresh)
    assert flux.conditioning_bytes_sent == cond_bytes
    assert (out - one_process(inputs)).abs().max().item() <= TOL
    other = {**inputs, "context": inputs["context"] + 0.5}
    got = flux.forward(**other)
    assert flux.conditioning_bytes_sent == 2 * cond_bytes
    assert (got - one_process(other)).abs().max().item() <= TOL
    assert (got - out).abs().max().item() > 1e-3


def test_a_lookalike_prompt_is_caught_by_the_full_check(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    """Two prompts equal in every sampled word but one: the step is sent under the held key at once, the
    full comparison (made while the ranks compute) fails, and the step is redone with the new prompt.
    Mutation tried: with `Match.verify` always True, the output is the first prompt's."""
    from rocm_parallel.backend.diffusion.forward_client import SAMPLED_WORDS

    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    g = torch.Generator().manual_seed(4)
    tokens = SAMPLED_WORDS * 4 // 32  # float32 words over [1, tokens, 32]: a sampling stride of 2 words
    inputs = {**call_inputs(batch=1, seed=4), "context": torch.randn(1, tokens, 32, generator=g)}
    flux.forward(**inputs)
    lookalike = inputs["context"].clone()
    floats = torch.arange(lookalike.numel())
    # Every odd 8-byte word (floats 2, 3 of each 4) but the last: none of the sampled words changes.
    lookalike.view(-1)[((floats // 2) % 2 == 1) & (floats < lookalike.numel() - 2)] += 1.0
    sent = flux.conditioning_bytes_sent
    got = flux.forward(**{**inputs, "context": lookalike})
    assert flux.conditioning_bytes_sent > sent  # it was sent after all
    assert (got - one_process({**inputs, "context": lookalike})).abs().max().item() <= TOL
    assert (got - one_process(inputs)).abs().max().item() > 1e-4


def test_a_rank_that_lost_the_conditioning_gets_it_again(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    """Mutation tried: without the resend on ConditioningMissing, the second forward fails."""
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    inputs = call_inputs(seed=2)
    flux.forward(**inputs)
    group2.call_all("forget_caches")
    out = flux.forward(**inputs)
    assert (out - one_process(inputs)).abs().max().item() <= TOL


@pytest.mark.slow
def test_forward_after_a_worker_died_restarts_the_group_and_reloads(checkpoints: dict[str, str]) -> None:
    with ParallelModel(["cpu", "cpu"], threads=1) as flux:
        flux.load(checkpoints["dev"], layout=ParallelLayout(ring=2), dtype="float32")
        inputs = call_inputs(seed=3)
        first = flux.forward(**inputs)
        old = flux.group
        os.kill(old.pids[1], signal.SIGKILL)
        while old.alive:
            time.sleep(0.02)
        again = flux.forward(**inputs)
        assert flux.group is not old and flux.resident is not None
        assert torch.equal(again, first)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.zeros(2, 4, 8, 8)}, r"^x has shape \(2, 4, 8, 8\); FLUX.1-dev takes \[batch, 16, height, width\] latents \(encode"),
        ({"context": torch.zeros(2, 8, 64)}, r"^context has shape \(2, 8, 64\); FLUX.1-dev expects \[2, tokens, 32\] \(text features for each latent\): encode the prompt with a FLUX DualCLIPLoader"),
        ({"y": torch.zeros(1, 24)}, r"^y \(pooled_output\) has shape \(1, 24\); FLUX.1-dev expects \[2, 24\] \(CLIP-L pooled\)"),
        ({"guidance": None}, r"^guidance is None; FLUX.1-dev needs one per latent"),
    ],
)  # fmt: skip
def test_bad_calls_fail_before_any_rank_runs(
    group2: WorkerGroup, checkpoints: dict[str, str], change: dict, message: str
) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    before = group2._job
    with pytest.raises(ConfigError, match=message):
        flux.forward(**{**call_inputs(), **change})
    assert group2._job == before


def test_forward_needs_a_loaded_model(group2: WorkerGroup) -> None:
    with pytest.raises(ConfigError, match=r"^no checkpoint is loaded; call load\(checkpoint\) first$"):
        ParallelModel(group=group2).forward(**call_inputs())


def test_reused_tensor_files_are_rewritten_in_place(tmp_path) -> None:
    """The forward service's files keep their names from step to step; a smaller tensor after a larger
    one must not read the larger one's tail."""
    from rocm_parallel.backend.runtime.transport import files_in, pack, unpack

    big, small = torch.randn(2, 16, 64, 64), torch.randn(1, 16, 48, 40)
    first = pack({"x": big, "t": torch.ones(2)}, str(tmp_path), "request", reuse=True)
    second = pack({"x": small, "t": torch.ones(1)}, str(tmp_path), "request", reuse=True)
    assert files_in(first) == files_in(second) == [str(tmp_path / "request-0.bin")]
    assert torch.equal(unpack(second, remove=False)["x"], small)
    assert (tmp_path / "request-0.bin").stat().st_size == small.numel() * 4
    assert (tmp_path / "request-0.bin").stat().st_mode & 0o777 == 0o600
