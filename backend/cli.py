"""Command line: `python -m rocm_parallel demo | bench <name>`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .bench import BENCHMARKS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rocm_parallel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job on a built-in FLUX: split across workers, check, time")
    from . import demo as demo_module

    demo_module.add_arguments(demo)
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    names = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHMARKS.items():
        module = importlib.import_module(f"{__package__}.bench.{name}")
        module.add_arguments(names.add_parser(name, help=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.run(args)
    module = importlib.import_module(f"{__package__}.bench.{args.bench}")
    module.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
