"""Tensor-parallel benchmark (being written)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> str:
    raise SystemExit("bench tp: not written yet")
