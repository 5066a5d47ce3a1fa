"""layout='auto': the planner's choice of layout for an image on a worker group, from measured figures.

`measure_machine(group)` runs `probe.measure_link` on every rank once (link bandwidth and latency, device
TFLOPS and memory); `choose_layout` prices every layout for the image with those figures (backend/plan/)
and returns the planner's `Choice`, whose `.explanation` the nodes show.
"""

from __future__ import annotations

import dataclasses

from ..checkpoint import resolve_dtype
from ..config import ConfigError, ModelDims, ParallelLayout
from ..family import families, get_family
from ..plan import PCIE4, Choice, Link, Setup, choose, estimate
from ..plan.setup import FileWeights
from ..platforms import host_sizes
from ..runtime.client import WorkerGroup
from ..runtime.messages import HostsLinkReport, LinkReport, LinkRequest
from ..text import cli_command


def make_layout(
    kind: str | ParallelLayout,
    devices: int,
    ring: int | None = None,
    ulysses: int | None = None,
    setup: Setup | None = None,
) -> ParallelLayout:
    """The layout a caller names: a ParallelLayout, 'tp', 'context' (with `ring` / `ulysses`), degrees
    such as 'batch 2 x tp 2' (`ParallelLayout.make`), or 'auto': the planner's choice for `setup` (see
    ParallelModel.auto_layout, which also explains it). Degrees that do not apply are refused."""
    if isinstance(kind, ParallelLayout):
        for name, value in (("ring", ring), ("ulysses", ulysses)):
            if value:
                raise ConfigError(
                    f"{name}_degree={value} was given with layout={str(kind)!r}, which names its degrees "
                    f"already; write them all in the layout, e.g. ParallelLayout(tp=2, {name}={value})"
                )
        return kind
    if kind == "auto" and setup is not None:
        if ring or ulysses:
            ParallelLayout.make(kind, devices, ring, ulysses)  # raises: the degrees do not apply to 'auto'
        return choose(setup).layout
    return ParallelLayout.make(kind, devices, ring, ulysses)


def measure_machine(group: WorkerGroup) -> LinkReport:
    """Rank 0's link and speed figures, with the least memory any rank has (the layout must fit it)."""
    reports: list[LinkReport] = group.call_all("measure_link", LinkRequest())
    return dataclasses.replace(reports[0], memory_bytes=min(r.memory_bytes for r in reports))


def choose_layout(
    machine: LinkReport,
    devices: tuple[str, ...],
    dims: ModelDims,
    width: int,
    height: int,
    batch: int,
    *,
    dtype: str | None,
    fixed: dict[str, int],
    weight_dtype: str,
    family: str | None,
    reference_tokens: int,
    frames: int = 1,
    file_weights: FileWeights | None = None,
    hosts_link: HostsLinkReport | None = None,
) -> Choice:
    """The planner's layout for this image on these devices, keeping the `fixed` degrees
    (ParallelModel.auto_layout documents the arguments). Across hosts (`hosts_link`: the group's pre-flight),
    the link inside a host and the network between them as measured there."""
    cpu = devices[0].startswith("cpu")
    link = Link(
        machine.gbps if machine.gbps is not None else 1.0,
        machine.latency_us if machine.latency_us is not None else 0.0,
        measured=machine.gbps is not None,
        name="gloo (CPU)" if cpu else "link",
    )
    sizes, inter_host = host_sizes(devices), None
    if len(sizes) > 1:
        if len(set(sizes)) > 1:
            raise ConfigError(
                f"layout='auto' across hosts needs as many devices on each host (these hold {sizes}); name the "
                "layout, e.g. 'tp 2 x ring 2' (TP inside a host)"
            )
        if hosts_link is not None and hosts_link.within_gbps is not None:
            link = Link(
                hosts_link.within_gbps, hosts_link.within_latency_us or 0.0, measured=True, name=link.name
            )
        if hosts_link is not None and hosts_link.between_gbps is not None:
            # measured with every index's ranks at once: one host's network is their bandwidth together
            inter_host = Link(
                hosts_link.between_gbps * hosts_link.between_groups, hosts_link.between_latency_us or 0.0,
                measured=True, name="between hosts",
            )  # fmt: skip
    compute = str(resolve_dtype(dtype, devices[0])).removeprefix("torch.")
    setup = Setup(
        dims, width, height, batch, dtype=compute, devices=len(devices), memory_gb=machine.memory_bytes / 1e9,
        link=link, tflops=machine.tflops, device_word="CPU worker" if cpu else "GPU", weight_dtype=weight_dtype,
        family=family, text_tokens=(get_family(family) if family else families()[0]).text.tokens,
        reference_tokens=reference_tokens, frames=frames, file_weights=file_weights, hosts=len(sizes),
        inter_host=inter_host,
    )  # fmt: skip
    return choose(setup, fixed)


def gloo_cost(devices: int, gbps: float, latency_us: float) -> str:
    """What gloo costs, priced by the planner: one 1024 px step of the first family's (by name) first released model
    (flux1-dev) at tp `devices` over the link gloo measured here, against the same step over PCIe 4.0 x16
    peer-to-peer (the planner's defaults)."""
    family = min(families(), key=lambda f: f.name)  # by name: registration order depends on imports
    preset, config = next(iter(family.presets.items()))
    dims = family.dims(config)

    def step(link: Link) -> float:
        setup = Setup(
            dims, width=1024, height=1024, batch=1, text_tokens=family.text.tokens, dtype="bfloat16",
            weight_dtype="compute", devices=devices, memory_gb=1e3, link=link, tflops=100.0, family=family.name,
        )  # fmt: skip
        return estimate(setup, ParallelLayout(tp=devices)).step_s

    gloo, pcie = step(Link(gbps, latency_us, measured=True, name="gloo")), step(PCIE4)
    return (
        f"the planner prices one {preset} 1024x1024 step at tp {devices} (100 TFLOPS per GPU) at "
        f"{gloo:.2f} s over gloo as measured here ({gbps:.2f} GB/s, {latency_us:.0f} µs per collective) "
        f"against {pcie:.2f} s over PCIe 4.0 x16 peer-to-peer: context parallelism (ring/Ulysses) moves far "
        f"fewer bytes (`{cli_command('plan')} --devices {devices} --link-gbps {gbps:.2f} "
        f"--latency-us {latency_us:.0f}`)"
    )
