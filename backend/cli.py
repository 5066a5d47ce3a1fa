"""Command line: demo | plan | doctor | bench <name> (bench: from a checkout only) | worker --join (another
host's agent, docs/hosts.md). In ComfyUI's folder:
`python custom_nodes/rocm-parallel doctor`; pip-installed or a checkout: `python -m rocm_parallel doctor`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError
from .dtypes import COMPUTE_DTYPES, FP8_DTYPES, GGUF_BLOCKS
from .family import ModelFamily, families
from .text import cli_command

# The benchmarks are not part of the installed package: they live in the repository's top-level
# benchmarks/ folder, next to backend/ (the repository root is the package), and run from a checkout.
BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
NO_BENCHMARKS = (
    "the benchmarks are not installed with the package; run them from a checkout of the repository: "
    "git clone https://github.com/rocm-parallel/rocm-parallel && cd rocm-parallel && "
    "python -m pip install -e . && python -m rocm_parallel bench <name>"
)
DEFAULT_GPU_GB = 24.0  # `plan`'s GPU when none is named: a 24 GB card (RX 7900 XTX, RTX 4090)
_ROOT_PACKAGE = __package__.rpartition(".")[0] if __package__ else "rocm_parallel"


def _benchmark_names() -> dict[str, str] | None:
    """{name: help} of the benchmarks in BENCHMARKS_DIR, or None when the folder is absent (a wheel)."""
    if not (BENCHMARKS_DIR / "__init__.py").is_file():
        return None
    return importlib.import_module(f"{_ROOT_PACKAGE}.benchmarks").BENCHMARKS


def _demo_module() -> Any:
    """The demo of the first registered family that has one (its `ModelFamily.demo` module)."""
    family = next(f for f in families() if f.demo is not None)
    return importlib.import_module(family.demo, __package__)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser, with the arguments of `command`'s subparser only (None: of every one).

    Each command's arguments come from its own modules (the demo's, every benchmark's), which import torch,
    the API and the test models: `plan` must not pay for them (issue 42: it answers in seconds on 2 cores).
    """
    parser = argparse.ArgumentParser(prog=cli_command(), description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job on a built-in model: split across workers, check, time")
    plan = sub.add_parser("plan", help="per-GPU memory, bytes moved and step time per layout")
    doctor = sub.add_parser("doctor", help="check torch, GPUs, flags and a real worker group; advise")
    bench = sub.add_parser("bench", help="run a benchmark and print its table (from a checkout)")
    worker = sub.add_parser(
        "worker", help="join this host to another host's worker groups: --join ADDRESS:PORT (docs/hosts.md)"
    )
    if command in (None, "demo"):
        _demo_module().add_arguments(demo)
    if command in (None, "plan"):
        _add_plan_arguments(plan)
    if command in (None, "doctor"):
        from . import doctor as doctor_module

        doctor_module.add_arguments(doctor)
    if command in (None, "bench"):
        _add_bench_arguments(bench)
    if command in (None, "worker"):
        from .runtime import agent

        agent.add_arguments(worker)
    return parser


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    benchmarks = _benchmark_names()
    if benchmarks is None:
        bench.add_argument("bench", nargs=argparse.REMAINDER, help="not installed; see the message")
        return
    names = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in benchmarks.items():
        module = importlib.import_module(f"{_ROOT_PACKAGE}.benchmarks.{name}")
        module.add_arguments(names.add_parser(name, help=help_text))


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names (its first word; the top-level parser has no options but --help)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def plan_models() -> dict[str, tuple[ModelFamily, Mapping[str, Any]]]:
    """`plan --model`'s choices: every family's presets, then their older aliases (name -> family, config)."""
    models = {name: (f, config) for f in families() for name, config in f.presets.items()}
    aliases = {alias: (f, f.presets[name]) for f in families() for alias, name in f.aliases.items()}
    return {**models, **aliases}


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    models = plan_models()
    parser.add_argument(
        "--model",
        choices=tuple(models),
        default=None,
        help=f"model (a released config's name; {next(iter(models))})",
    )
    parser.add_argument("--size", default="1024", help="image size in pixels: 1024 or WIDTHxHEIGHT")
    parser.add_argument("--batch", type=int, default=1, help="images per step")
    parser.add_argument(
        "--frames",
        type=int,
        default=1,
        help="a video's frames (Wan: 81 is ComfyUI's template; 1 + a multiple of 4); 1 for an image",
    )
    parser.add_argument(
        "--cfg",
        type=float,
        default=1.0,
        help="cfg scale: at any value but 1 the negative prompt runs too, in the same model call (the "
        "call batch the batch degree splits is twice the images)",
    )
    parser.add_argument(
        "--layout",
        default=None,
        help="price only this layout: degrees such as 'batch 2 x tp 2' or 'tp2xring2' (as load(layout=...) "
        "and the ROCm Parallel Model node take them), or 'tp' / 'context'",
    )
    parser.add_argument(
        "--text-tokens",
        type=int,
        default=None,
        help="text tokens (default: ComfyUI's for the model's family, its `text.tokens`)",
    )
    parser.add_argument(
        "--devices",
        default="2",
        help="a count of GPUs like --memory-gb's (2), or this machine's GPUs: 'all', '0,1', 'cuda:0,cuda:1' "
        "(their memory then comes from the devices)",
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory of one GPU in GB (default 24, or the named GPUs')",
    )
    parser.add_argument(
        "--link-gbps", type=float, default=24.0, help="per-GPU bus bandwidth in GB/s (PCIe 4.0 x16: ~24)"
    )
    parser.add_argument("--latency-us", type=float, default=30.0, help="latency of one collective in µs")
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="hosts the devices are spread over, as many on each (--devices 8 --hosts 2: 2 hosts x 4 GPUs); "
        "TP stays inside a host",
    )
    parser.add_argument(
        "--inter-host-gbit",
        type=float,
        default=10.0,
        help="each host's network in gigabits per second, as NICs are sold (10, 25, 100 GbE); with --hosts",
    )
    parser.add_argument(
        "--inter-host-latency-us",
        type=float,
        default=50.0,
        help="latency of one collective between hosts in µs (TCP sockets: ~50; RDMA: less)",
    )
    parser.add_argument("--tflops", type=float, default=100.0, help="sustained TFLOPS of one GPU")
    parser.add_argument(
        "--dtype", choices=tuple(d.name for d in COMPUTE_DTYPES), default="bfloat16", help="compute dtype"
    )
    parser.add_argument(
        "--weight-dtype",
        choices=("compute", *(d.short for d in FP8_DTYPES), *GGUF_BLOCKS),
        default=None,
        help="how linear weights stay resident: in the compute dtype (the default, or --checkpoint's), fp8 "
        "(1 byte, upcast per layer), or a GGUF file's quantization (Q8_0, Q4_K, ...: its blocks, dequantized "
        "per layer)",
    )
    _add_encoder_arguments(parser)
    from .plan import request as plan_request  # here: only `plan` reads the planner

    plan_request.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--full", action="store_true", help="every column: weights, activations, collectives, bytes sent"
    )


def _add_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    from .plan.graph import ENCODER_DTYPES, stored_encoders

    parser.add_argument(
        "--encoder",
        choices=("auto", "none", *stored_encoders()),
        default="auto",
        help="the text encoder the ROCm Parallel Text Encoder Loader puts on the same GPUs (auto: the model's "
        "own, the one its ComfyUI template loads; none: no whole-graph table)",
    )
    parser.add_argument(
        "--encoder-dtype",
        choices=tuple(ENCODER_DTYPES),
        default=None,
        help="how the encoder's weights are held (default: bf16 beside bf16 weights, else fp8)",
    )


def _run_plan(args: argparse.Namespace) -> int:
    from .config import ParallelLayout
    from .plan import Link, Setup, call_batch, choose, estimate, format_table, plan
    from .plan import request as plan_request
    from .plan.gguf import gguf_hint
    from .plan.graph import format_graph, graph_answer
    from .plan.setup import network
    from .platforms import planned_gpus

    try:
        family, config, file_note = plan_request.resolve_model(args, plan_models())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text_tokens = family.text.tokens  # what ComfyUI pads a short prompt to: 256 FLUX.1, 512 FLUX.2
    width, _, height = args.size.partition("x")
    args.devices, memory_gb = planned_gpus(args.devices)
    if args.memory_gb is None:
        args.memory_gb = memory_gb or DEFAULT_GPU_GB
    try:
        setup = Setup(
            family.dims(config),
            width=int(width), height=int(height or width), batch=call_batch(args.batch, args.cfg),
            text_tokens=text_tokens if args.text_tokens is None else args.text_tokens, dtype=args.dtype,
            weight_dtype=args.weight_dtype, devices=args.devices, memory_gb=args.memory_gb,
            link=Link(args.link_gbps, args.latency_us, name="link"), tflops=args.tflops, family=family.name,
            file_weights=args.file_weights, frames=args.frames, hosts=args.hosts,
            inter_host=network(args.inter_host_gbit, args.inter_host_latency_us),
        )  # fmt: skip
        setup = plan_request.with_references(setup, args, family)
        if args.layout is None:
            estimates = plan(setup)
        else:
            estimates = [estimate(setup, ParallelLayout.make(args.layout, args.devices))]
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.layout is not None:  # one layout priced: no choice to make
        choice, problem = None, None if estimates[0].fits else f"{estimates[0].name} does not fit"
    else:
        try:
            choice, problem = choose(setup), None
        except ConfigError as exc:
            choice, problem = None, str(exc)
    hint = gguf_hint(setup) if problem is not None else None  # neither bf16 nor fp8 fits: name a GGUF
    graph = _graph_plan(args, estimates)
    # one answer per screen: the whole graph's when it differs from the model's own (plan/graph.py)
    answer, refused = graph_answer(graph, args.memory_gb, setup.device_word) if graph else ("", False)
    if refused:
        problem = answer.removeprefix("auto: ")
    answer_layout = graph.layout if graph is not None and graph.fastest and not refused else None
    if not answer:
        answer = choice.explanation if choice is not None else f"auto: {problem}"
        answer_layout = str(choice.layout) if choice is not None else None
    if args.json:
        print(json.dumps({
            "setup": {k: v for k, v in vars(args).items() if k not in ("command", "json", "full", "file_weights")},
            "layouts": [e.as_dict() for e in estimates],
            "call_batch": setup.batch,
            "tokens": {"image": setup.latent_tokens, "references": setup.reference_tokens, "sequence": setup.tokens},
            "auto": None if choice is None else {
                "layout": str(choice.layout), **choice.layout.degrees, "explanation": choice.explanation
            },
            "error": problem,
            "answer": {"layout": answer_layout, "text": answer},
            "gguf": hint,
            "encoder": None if graph is None else graph.as_dict(),
        }, indent=2))  # fmt: skip
    else:
        if file_note is not None:
            print(file_note)
        print(format_table(setup, estimates, full=args.full))
        if graph is not None:
            print()
            print(format_graph(graph, full=args.full))
        if args.layout is None or problem is not None:
            print()
            print(answer)
        if hint is not None:
            print(hint)
    return 0 if problem is None else 1


def _graph_plan(args: argparse.Namespace, estimates: list[Any]) -> Any:
    """The text encoder beside the model's fitting layouts (or the one --layout priced), or None: no encoder
    asked for or known for the model, or no layout that fits."""
    from .plan.graph import encoder_dtype, model_encoders, place_beside_layouts

    family = plan_models()[args.model][0]
    encoder = (
        model_encoders().get(family.aliases.get(args.model, args.model))
        if args.encoder == "auto"
        else args.encoder
    )
    if encoder in (None, "none"):
        return None
    fitting = [e for e in estimates if e.fits]  # fastest first (plan's order); --layout: that one
    if not fitting:
        return None
    dtype = args.encoder_dtype or encoder_dtype(args.weight_dtype)
    return place_beside_layouts(encoder, dtype, args.devices, args.memory_gb, fitting)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(_command(argv)).parse_args(argv)
    try:
        return _run(args)
    except ConfigError as exc:  # a wrong input: one line, never a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "doctor":
        from . import doctor

        return doctor.run(args)
    if args.command == "demo":
        return _demo_module().run(args)
    if args.command == "worker":
        from .runtime import agent

        return agent.run(args)
    if _benchmark_names() is None:
        print(f"error: {NO_BENCHMARKS}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{_ROOT_PACKAGE}.benchmarks.{args.bench}")
    module.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
