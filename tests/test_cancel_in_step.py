"""Cancel inside one model call (backend/runtime/cancel_points.py): every rank leaves at the same block, the group
stays, and the next result is exact; the caller's interrupt check is polled while the ranks compute
(watch.interrupt_check, what the ROCm Parallel Model passes ComfyUI's Cancel through)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
import torch
from test_service import call_inputs

from rocm_parallel.backend.checkpoint import save_checkpoint
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.backend.runtime.watch import interrupt_check
from rocm_parallel.testing.models import tiny_flux_config

BLOCKS = 16  # 2 double + 14 single: a large call's blocks take a fraction of a second each


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = build_flux(tiny_flux_config(double_blocks=2, single_blocks=BLOCKS - 2), seed=0)
    return str(save_checkpoint(model, tmp_path_factory.mktemp("deep") / "deep-flux.safetensors"))


def _after(seconds: float) -> tuple[Callable[[], None], list[float]]:
    """An interrupt check that raises from `seconds` on (ComfyUI's after a Cancel), and when it first did."""
    deadline, fired = time.monotonic() + seconds, []

    def check() -> None:
        if time.monotonic() >= deadline:
            fired.append(fired[0] if fired else time.monotonic())
            raise InterruptedError("user pressed Cancel")

    return check, fired


def _cancelled(flux: ParallelModel, inputs: dict, took: float) -> tuple[float, list[int]]:
    """Cancel one call part-way in (40 % of `took`, the same call's time before): how long the call took to
    stop once the check raised, and the block each rank stopped before (from its reply).

    On a starved CPU one call can take a fraction of the one timed before it, so the cancel may come after
    the ranks passed their last check (every rank answers ok): then it is tried again earlier in the call
    (25 %, 15 %). Without the cancel points no try stops a rank, so the test still fails for that."""
    replies = {}
    for fraction in (0.4, 0.25, 0.15):
        check, fired = _after(fraction * took)
        try:
            with interrupt_check(check):
                flux.forward(**inputs)
        except InterruptedError:
            stopped = time.monotonic() - fired[0]
        else:
            continue  # the call ended before the check ever raised
        replies = flux.group.last_replies
        if all(r.ok for r in replies.values()):
            continue  # raised after the ranks had finished: too late in this call to cancel it
        for reply in replies.values():
            assert reply.error_type == "JobCancelled", reply.error
        return stopped, [int(re.search(r"before block (\d+)$", r.error).group(1)) for r in replies.values()]
    raise AssertionError(f"no cancel stopped a rank inside the call: {replies}")


@pytest.mark.torch_api
@pytest.mark.parametrize("compile", ["off", "aot_eager"])
def test_a_cancel_stops_inside_a_model_call_at_the_same_block_on_every_rank(
    deep_checkpoint: str, group2: WorkerGroup, compile: str
) -> None:
    """A call of a few seconds, cancelled 40% in: both ranks stop before the same block, well before the
    call's end, within 2 s of the interrupt; the group keeps its model and the next call is exact (with
    regional compilation too: the check is excluded from the compiled blocks). Mutation tried: without
    the hooks (`cancellable` returning `model_fn`) the call ran to its end and both ranks answered ok."""
    flux = ParallelModel(group=group2)
    flux.load(deep_checkpoint, layout="tp", dtype="float32", compile=compile)
    big = call_inputs(batch=1, height=96, width=96)
    flux.forward(**big)  # compiles the blocks for this size (aot_eager), warms up
    started = time.monotonic()
    full = flux.forward(**big)
    took = time.monotonic() - started
    stopped, blocks = _cancelled(flux, big, took)
    assert len(set(blocks)) == 1 and 1 < blocks[0] <= BLOCKS, blocks
    assert stopped < 2.0, (stopped, took)
    assert group2.alive
    assert torch.equal(flux.forward(**big), full)


def test_a_cancel_inside_a_call_under_a_batch_degree_stops_every_group(
    deep_checkpoint: str, group4: WorkerGroup
) -> None:
    """batch 2 x tp 2: each batch group runs the whole model on its entry; the four ranks meet at every
    check and stop before the same block. A call with one entry leaves a batch group idle: it is not
    armed and ends at the call's end (the group stays usable)."""
    flux = ParallelModel(group=group4)
    flux.load(deep_checkpoint, layout="batch 2 x tp 2", dtype="float32")
    big, small = call_inputs(batch=2, height=96, width=96), call_inputs(batch=2, height=8, width=8)
    expected = flux.forward(**small)
    started = time.monotonic()
    flux.forward(**big)
    took = time.monotonic() - started
    stopped, blocks = _cancelled(flux, big, took)
    assert len(blocks) == 4 and len(set(blocks)) == 1 and blocks[0] <= BLOCKS, blocks
    assert stopped < 2.0, (stopped, took)
    one = call_inputs(batch=1, height=96, width=96)
    with pytest.raises(InterruptedError), interrupt_check(_after(0.0)[0]):
        flux.forward(
            **one
        )  # the check raises at the first look: the ranks finish the call, then it is raised
    assert all(r.ok for r in group4.last_replies.values())
    assert group4.alive and torch.equal(flux.forward(**small), expected)


class _Context:
    """What the checks read of a WorkerContext: the device and whether a cancel is pending."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.pending = False

    def cancel_requested(self) -> bool:
        return self.pending


@pytest.mark.torch_api
@pytest.mark.parametrize(("lag", "every", "stops_before"), [(0, 1, 4), (2, 1, 6), (0, 3, 4), (2, 3, 10)])
def test_the_checks_stop_at_an_agreed_block(lag: int, every: int, stops_before: int) -> None:
    """A cancel pending from block 4 on: with no lag (a CPU: the all-reduce is synchronous) the first check
    that sees it stops; a GPU's lag of 2 acts two checks later, on the flag of that check (never on a
    value a peer may not have yet); checks every 3 blocks fall on blocks 1, 4, 7, 10. The GPU path (pinned
    copies, events) runs here with CPU tensors."""
    from rocm_parallel.backend.runtime.cancel_points import _Checks
    from rocm_parallel.backend.runtime.worker import JobCancelled

    ctx = _Context()
    checks = _Checks(ctx, None, every, lag, [])
    with pytest.raises(JobCancelled, match=rf"^cancelled inside a model call, before block {stops_before}$"):
        for block in range(1, 20):
            ctx.pending = block >= 4
            checks.before_block()


@pytest.mark.torch_api
def test_the_lagged_checks_read_only_this_calls_flags_when_slots_are_reused() -> None:
    """A model keeps its host slots from call to call (`_Points.slots`: pinned allocations are slow), so a
    cancelled call leaves them holding its raised flags. The next call must not act on them: with a GPU's lag
    of 2 a call without a cancel runs every block, and a call cancelled from block 4 on stops before block 6,
    exactly as with fresh slots (the test above).

    Mutation tried: with the `self.checks <= self.lag` guard removed from `_Checks._lagged` (check k reading
    slot k - lag before this call wrote it) every case above still passed with fresh slots, and here the
    second call stopped before block 1 on the first call's flag: this test failed."""
    from rocm_parallel.backend.runtime.cancel_points import _Checks
    from rocm_parallel.backend.runtime.worker import JobCancelled

    ctx = _Context()
    slots: list = []  # one model's slots, shared by its calls as `cancellable` shares `_Points.slots`

    def call(cancel_from: int | None, blocks: int = 20) -> int | None:
        checks = _Checks(ctx, None, 1, 2, slots)
        try:
            for block in range(1, blocks + 1):
                ctx.pending = cancel_from is not None and block >= cancel_from
                checks.before_block()
        except JobCancelled as stop:
            return int(str(stop).rsplit(" ", 1)[1])
        return None

    for _ in range(2):
        assert call(cancel_from=1) == 3  # cancelled at once: every slot now holds a raised flag
        assert len(slots) == 3
        assert call(cancel_from=None) is None  # runs every block
        assert call(cancel_from=1, blocks=2) is None  # two checks: the lag has not passed yet
        assert call(cancel_from=4) == 6
