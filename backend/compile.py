"""Regional compilation: torch.compile the repeated transformer blocks on each worker, not the whole model.

The same idea as diffusers' `ModelMixin.compile_repeated_blocks`: every block class the model names in
`_repeated_blocks` (FLUX.1's double and single blocks, FLUX.2's, Qwen-Image's one block) is compiled with
`nn.Module.compile`. All blocks of a class share one code object, so dynamo traces each class once and the
other blocks reuse its graph: compile time is that of two blocks, not of the whole model. Written here
rather than calling diffusers' method because the workers need three things it does not do: a count of the
graphs compiled (the no-recompilation guarantee is tested with it), a line naming the size that made a
recompile, and one validated option shared by the caller and the workers.

What is inside the compiled region:

* **Tensor parallelism**: the row-parallel linears' `dist.all_reduce` (parallel/tensor.py) is traced by
  dynamo into a functional collective (`_c10d_functional.all_reduce` + `wait_tensor`): no graph break.
* **Context parallelism** (ring attention, Ulysses, both): diffusers' templated attention uses functional
  collectives (all-gather of K/V for the ring, all-to-all for Ulysses), but our attention dispatch around
  it (parallel/context.py `ContextAttention`: the per-device kernel choice, the LSE guard's probes, the
  key-validity channel) is Python that inspects tensors and carries state between calls. It is excluded
  from the region on purpose (`torch.compiler.disable` on the dispatch, `exclude_from_region`): each
  attention call is then one deliberate break between two compiled pieces of its block (projections +
  norms before, MLP + modulation after), a fixed number per block class, counted by the tests, never a
  storm. The attention kernel itself gains nothing from inductor on a GPU (it is a flash kernel already).
* The sequence split / gather hooks (diffusers' `_cp_plan`) sit on the top-level model, outside the region.

Shapes: the first call compiles for its sizes (static); a call with another size (image, text length or
batch) recompiles once with the changed dimensions dynamic (dynamo's automatic dynamic shapes), and later
sizes reuse that graph. Timesteps, sigmas and guidance are tensors, so steps never recompile; cond and
uncond have the same shapes (or are one batch). `CompileLog` counts the graphs; `serve.py` says when a call
compiled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ConfigError

log = logging.getLogger("rocm_parallel.compile")

# 'off': eager (the default until a GPU measurement shows a gain); 'inductor': torch.compile's default
# backend, the one that makes kernels; 'aot_eager': traces and runs the same graphs eagerly (no code
# generated: checks that the region compiles, cheap enough for tests).
COMPILE_MODES = ("off", "inductor", "aot_eager")


def compile_mode(value: str | None) -> str:
    """The canonical compile mode ('off' for None, False); ConfigError naming the input, value and choices."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "inductor"
    if not isinstance(value, str) or value.strip().lower() not in COMPILE_MODES:
        raise ConfigError(
            f"compile={value!r} is not a compile mode; use one of {', '.join(COMPILE_MODES)} "
            "('inductor' compiles the repeated transformer blocks on every worker at the first call, "
            "'off' runs eager)"
        )
    return value.strip().lower()


@dataclass
class CompileLog:
    """Graphs compiled in this process since the model was compiled, and the last call that compiled."""

    graphs: int = 0
    backend_seconds: float = 0.0  # in the backend (inductor's code generation); dynamo's tracing not counted
    events: list[str] = field(default_factory=list)  # one line per call that compiled


LOG = CompileLog()


def _counting_backend(mode: str) -> Callable[..., Any]:
    """`mode`'s backend, counting each graph it is given (one per block class and size; more means breaks)."""
    inner = torch._dynamo.lookup_backend(mode)  # public in torch/_dynamo/__init__.py in 2.13 and 2.15

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        started = time.perf_counter()
        compiled = inner(gm, example_inputs)
        LOG.graphs += 1
        LOG.backend_seconds += time.perf_counter() - started
        return compiled

    return backend


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The class names diffusers marks as the model's repeated blocks (none: empty)."""
    return tuple(getattr(model, "_repeated_blocks", None) or ())


def repeated_block_classes(model: nn.Module) -> tuple[str, ...]:
    """The class names diffusers marks as the model's repeated blocks; ConfigError when there are none."""
    names = repeated_blocks(model)
    if not names:
        raise ConfigError(
            f"compile: {type(model).__name__} names no repeated blocks (_repeated_blocks); load it with "
            "compile='off'"
        )
    return names


def exclude_from_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` always runs eagerly, also when called from a compiled block (see the module docstring)."""
    return torch.compiler.disable(fn, recursive=True)


def compile_repeated_blocks(model: nn.Module, mode: str) -> int:
    """Compile every repeated block of `model` with `mode` ('off': nothing); returns the blocks marked.

    Clears dynamo's caches first (a previous model's graphs and its dynamic-shape decisions must not
    carry over) and resets `LOG`. Compilation itself happens at the first call.
    """
    mode = compile_mode(mode)
    torch.compiler.reset()
    LOG.graphs, LOG.backend_seconds, LOG.events = 0, 0.0, []
    if mode == "off":
        return 0
    if mode == "inductor":
        # One compile thread: no pool of compile subprocesses next to the worker (it would outlive a killed
        # worker, and the workers already take the cores).
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    # A size seen second makes the dimensions that changed dynamic (one recompile, then any size reuses
    # it). torch's default, set here so that the guarantee does not rest on a default.
    torch._dynamo.config.automatic_dynamic_shapes = True
    names = set(repeated_block_classes(model))
    backend = _counting_backend(mode)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def is_compiled(model: nn.Module) -> bool:
    """Whether `compile_repeated_blocks` compiled blocks of `model`."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _shapes(tensors: Sequence[torch.Tensor | None]) -> str:
    return ", ".join("x".join(map(str, t.shape)) for t in tensors if t is not None)


@contextmanager
def note_compiles(rank: int, inputs: Sequence[torch.Tensor | None]) -> Iterator[list[str]]:
    """Around one model call: when it compiled graphs, log (and yield in the list) one line naming the input
    sizes that made it, the graphs and the time, e.g. 'compiled 2 graphs for x 1x16x32x32, ...: 3.1 s'."""
    said: list[str] = []
    before, started = LOG.graphs, time.perf_counter()
    yield said
    if LOG.graphs > before:
        first = not LOG.events
        what = "compiled" if first else "recompiled (new input size)"
        line = (
            f"rank {rank}: {what} the repeated blocks, {LOG.graphs - before} graphs, for inputs "
            f"{_shapes(inputs)}: this call took {time.perf_counter() - started:.1f} s"
        )
        LOG.events.append(line)
        said.append(line)
        log.warning(line)
