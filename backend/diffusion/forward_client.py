"""The caller's side of the forward service: one model call on every rank (serve.py is the workers' side).

`ForwardClient.call` is what `ParallelModel.forward` runs for each model call: a prompt's inputs (the
family's held inputs) go under a key the ranks hold (sent along when they do not, after a check that it holds no NaN or inf) and the
latent through a reused tensor file. No clock limits a call: a hung rank is found by what the ranks
report (liveness.py), and a slow forward (a bigger image, a first call that compiles kernels) takes the
time it needs. `ForwardClient.sample` is `ParallelModel.sample`'s Euler loop (sampling.py `euler`)
with `call` as the model: one sampling path, in the caller.

The client finds a key by content (tensor equality), because ComfyUI builds new tensors with the same
values for each step. Both sides keep the same least-recently-used set of keys
(`messages.ConditioningSlots`: they see the same sequence of uses), and a rank that lacks a key says so
and gets the tensors again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..runtime.client import JobCancelled, JobTimeout, ProgressCallback, WorkerError, WorkerGroup
from ..runtime.watch import CANCELLED
from .call import CallSpec, check_held_values
from .messages import DEFAULT_SLOT, Conditioning, ConditioningSlots, ForwardReply, ForwardRequest
from .sampling import Inputs, SamplingPlan, euler

_keys = itertools.count(1)


@dataclass
class ConditioningSender:
    """The client's side: which prompts' inputs the ranks hold, found by content.

    Comparing a prompt bit for bit (8 MB for 512 T5 tokens in float32, 31 MB for FLUX.2 [dev]) costs about as
    much as the rest of a step's messaging, so it is taken off the step's path: `key_for` picks the held
    entry whose shape, dtype and a strided sample of words match (microseconds), the step is sent under that
    key at once, and the full comparison (`Match.verify`) runs while the ranks compute. In the rare case it
    fails, the caller discards that step's output and sends the step again with the conditioning.
    """

    spec: CallSpec
    slots: ConditioningSlots = field(default_factory=ConditioningSlots)
    sent_bytes: int = 0  # conditioning bytes sent to the ranks so far (the benchmark and tests read it)

    def key_for(self, held: Inputs) -> Match:
        """The held entry these prompt inputs (the family's held inputs, by name) probably are (to verify),
        or a new key to send them under."""
        given = tuple(t.detach().cpu().contiguous() for t in _entry(self.spec, held))
        for key, entry in reversed(self.slots.entries.items()):  # the latest first: the usual hit
            if len(entry) == len(given) and all(_similar(h, t) for h, t in zip(entry, given, strict=True)):
                self.slots.get(key)
                return Match(key, held=True, expected=entry, given=given)
        return self.add(held)

    def add(self, held: Inputs) -> Match:
        """A new key for these prompt inputs; the ranks get the tensors with the next call. The copy kept
        here is what later steps' freshly built tensors are compared with. Checked for NaN and inf here,
        once per prompt: a held key equals what was checked when it was sent."""
        check_held_values(self.spec, held)
        key = next(_keys)
        entry = _entry(self.spec, held)
        self.slots.put(key, tuple(t.detach().cpu().clone() for t in entry))
        self.sent_bytes += sum(_nbytes(t) for t in entry[1:])
        return Match(key, held=False)

    def forget(self, key: int) -> None:
        self.slots.forget(key)


@dataclass
class Match:
    """`key_for`'s answer: the key, whether the ranks hold it, and what to compare to be sure."""

    key: int
    held: bool
    expected: tuple[torch.Tensor, ...] = ()
    given: tuple[torch.Tensor, ...] = ()

    def verify(self) -> bool:
        """Bit-for-bit equality of the held entry and the given tensors (True for a new key)."""
        return all(torch.equal(_words(a), _words(b)) for a, b in zip(self.expected, self.given, strict=True))


def _entry(spec: CallSpec, held: Inputs) -> tuple[torch.Tensor, ...]:
    """A prompt's held inputs as a flat tuple of tensors, led by their structure (per input, in the spec's
    order: -1 for None, -2 for one tensor, n for a sequence of n), so that two prompts match only when the
    same inputs are present (a masked and an unmasked prompt never do)."""
    structure, tensors = [], []
    for item in spec.held():
        value = held.get(item.name)
        if value is None:
            structure.append(-1)
        elif torch.is_tensor(value):
            structure.append(-2)
            tensors.append(value)
        else:
            structure.append(len(value))
            tensors.extend(value)
    return (torch.tensor(structure, dtype=torch.int64), *tensors)


SAMPLED_WORDS = 1024  # words `_similar` compares: enough to tell prompts apart, cheap at any size


def _similar(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and a strided sample of the bits: the cheap test before `Match.verify`."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    wa, wb = _words(a), _words(b)
    stride = max(1, wa.numel() // SAMPLED_WORDS)
    return torch.equal(wa[::stride], wb[::stride]) and torch.equal(wa[-1:], wb[-1:])


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of a contiguous tensor as 8-byte words (several times faster to compare than floats, and
    NaN equals itself, which a cache wants), or bytes when the size is not a multiple of 8."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat.view(torch.int64) if flat.numel() % 8 == 0 else flat


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ForwardClient:
    """What the caller keeps for the forward service of one resident model: the conditioning the ranks
    hold and the latest forward's time."""

    def __init__(self, spec: CallSpec, slot: str = DEFAULT_SLOT) -> None:
        self.spec, self.slot = spec, slot
        self.sender = ConditioningSender(spec)
        self.last_seconds = 0.0  # the ranks' own time for the latest call (the slowest rank)
        self.compiles: list[str] = []  # rank 0's line for each call that compiled the blocks (compile.py)

    def call(
        self,
        group: WorkerGroup,
        x: torch.Tensor,
        timestep: torch.Tensor,
        inputs: Inputs,
        timeout: float | None = None,
        label: str | None = None,
        check_output: bool = True,
    ) -> torch.Tensor:
        """One `model_call` job on `group` with the call's checked `inputs` (the family's names); rank 0's
        output. The key's full check runs while the ranks compute; a lookalike prompt that fails it has its
        output discarded and the step sent again with its own conditioning. `label` names the call in
        `WorkerGroup.activity`. `check_output`: an output holding NaN or inf is an error naming the call's
        sigma (`euler` checks its own steps)."""
        held = {i.name: inputs.get(i.name) for i in self.spec.held()}
        per_call = {i.name: inputs.get(i.name) for i in self.spec.per_call()}
        match = self.sender.key_for(held)
        checked: list[bool] = []
        for attempt in range(3):
            cond = None if match.held else Conditioning(held)
            request = ForwardRequest(x, timestep, match.key, per_call, cond, self.slot)
            try:
                replies: list[ForwardReply] = group.call_all(
                    "model_call", request, timeout=timeout, reuse_files=True, label=label or "model call",
                    while_waiting=lambda m=match: checked.append(m.verify()),
                )  # fmt: skip
            except WorkerError as exc:
                self.sender.forget(match.key)  # whatever happened, no rank is assumed to hold it
                # A rank without the key (a restarted worker, an eviction out of step) gets the tensors
                # once more; anything else ends the call.
                if exc.remote_type != "ConditioningMissing" or attempt or not group.alive:
                    raise
                match = self.sender.add(held)
                continue
            if checked.pop():
                reply = replies[0]  # rank 0 holds the output
                # the call waited for the slowest rank: ranks start and end their forward apart (up to
                # ~0.1 s at TP 2 on two shared cores), and rank 0's time alone hid that in the "reply"
                self.last_seconds = max(r.seconds for r in replies)
                if reply.compiled:  # the first call, or a new size: say so (the call took longer)
                    self.compiles.append(reply.compiled)
                    logging.getLogger("rocm_parallel.compile").info(reply.compiled)
                if check_output and not reply.finite:
                    sigmas = ", ".join(f"{float(t):g}" for t in timestep.flatten()[:4])
                    raise FloatingPointError(
                        f"the model call at sigma {sigmas} produced NaN or inf values from finite inputs; "
                        "the model's output overflowed: try dtype='bfloat16' or 'float32' instead of float16"
                    )
                return reply.out
            match = self.sender.add(held)
        raise AssertionError("unreachable: a new key always verifies")

    def sample(
        self,
        group: WorkerGroup,
        plan: SamplingPlan,
        checked: Callable[[Tensor, Tensor, Inputs], Inputs],
        progress: ProgressCallback | None,
        timeout: float | None,
        model_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`sampling.euler` over this service: every step one `call` on `group`, its inputs from
        `checked(x, sigma, inputs)`; `timeout` bounds the whole loop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        steps, cancels = itertools.count(1), group.cancels

        def step(x: Tensor, sigma: Tensor, inputs: Inputs) -> Tensor:
            left = None if deadline is None else deadline - time.monotonic()
            label = f"step {next(steps)} of {plan.steps}"
            if group.cancels != cancels:  # WorkerGroup.cancel() ends the whole loop, not one call
                raise JobCancelled(f"'sample' was cancelled (WorkerGroup.cancel) before {label}")
            try:
                if left is not None and left <= 0:
                    raise JobTimeout("no time left for the next step")
                return self.call(
                    group, x, sigma, checked(x, sigma, inputs), timeout=left, label=label, check_output=False
                )
            except JobTimeout as exc:
                if not group.alive:  # a rank did not stop when cancelled: its own message says so
                    raise
                raise JobTimeout(
                    f"'sample' ran past its time limit of {timeout:g} s and was cancelled"
                ) from exc
            except WorkerError as exc:  # the call itself stopped at the cancel
                if exc.remote_type == CANCELLED and group.cancels != cancels:
                    raise JobCancelled(f"'sample' was cancelled (WorkerGroup.cancel) during {label}") from exc
                raise

        return euler(step, plan, progress, model_dtype)
