"""What `plan` is asked to price besides a released model at bf16: the user's own file and reference images.

* `--checkpoint PATH`: the file's family, released model and weight dtype (bf16, fp8, ComfyUI's scaled
  fp8, a GGUF quantization type), read from its header without torch (checkpoint.py);
* `--references N` (`--reference-size`): reference latents (ReferenceLatent: Qwen-Image-Edit's input
  image, FLUX.1 Kontext's, FLUX.2's references), which every step carries after the image's own tokens, so
  they are split, attended and held like image tokens (Setup.reference_tokens). None unless asked: an
  Edit model's graph has at least one (ComfyUI's TextEncodeQwenImageEdit / ReferenceLatent), and the fit
  tables price Qwen-Image-Edit with `--references 1`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import ConfigError
from ..dtypes import GGUF_BLOCKS
from ..family import ModelFamily
from .setup import Setup

Models = Mapping[str, tuple[ModelFamily, Mapping[str, Any]]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`plan`'s --checkpoint, --references and --reference-size."""
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="price this file instead of --model: its model and weight dtype (bf16, fp8, a GGUF type) from "
        "its header (a .safetensors or .gguf file, or a diffusers folder)",
    )
    parser.add_argument(
        "--references",
        type=int,
        default=0,
        help="reference images each call carries (ReferenceLatent: an Edit model's input image): their tokens "
        "ride along in every step",
    )
    parser.add_argument(
        "--reference-size",
        default=None,
        help="size of each reference image: WIDTHxHEIGHT (default: --size; an Edit model's text encode node "
        "scales its input to about 1024x1024)",
    )


def resolve_model(
    args: argparse.Namespace, models: Models
) -> tuple[ModelFamily, Mapping[str, Any], str | None]:
    """(family, config, a line naming the file or None) of what `args` price; sets `args.model`,
    `args.weight_dtype` (the file's when not given) and `args.file_weights` (the file's linear weights tensor by
    tensor: plan.setup.FileWeights; None without a file)."""
    note = None
    args.file_weights = None
    if args.checkpoint is None:
        args.model = args.model or next(iter(models))
        family, config = models[args.model]
    else:
        if args.model is not None:
            raise ConfigError(
                f"--model {args.model} and --checkpoint {args.checkpoint}: the file says which model it is; "
                "give one of them"
            )
        from .checkpoint import CheckpointError, inspect_for_plan, unreleased_dims

        found = inspect_for_plan(args.checkpoint)
        asked = args.weight_dtype
        args.weight_dtype = _file_weight_dtype(args, found.weight_dtype)
        if found.preset is None:
            raise CheckpointError(unreleased_dims(found))
        family, config, args.model = found.family, found.config, found.preset
        # every linear weight as the file stores it (or as the loader converts them all), tensor by tensor
        args.file_weights = found.file_weights("default" if asked is None else args.weight_dtype)
        mixed = asked is None and len({held for _, held in args.file_weights.held}) > 1
        priced = "tensor by tensor" if mixed else f"as {_dtype_text(args.weight_dtype)}"
        note = (
            f"checkpoint {found.path}: {found.name} ({args.model}), linear weights stored as "
            f"{found.stored_text()}, priced {priced}"
        )
    if args.weight_dtype is None:
        args.weight_dtype = "compute"
    return family, config, note


def _dtype_text(weight_dtype: str) -> str:
    return "the compute dtype" if weight_dtype == "compute" else weight_dtype


def _file_weight_dtype(args: argparse.Namespace, file_dtype: str) -> str:
    """The file's weight dtype, or the one asked for when the loader can hold the file so: a GGUF file stays
    in its own blocks or is dequantized to the compute dtype, never requantized (checkpoint/info.py
    `check_weight_dtype`)."""
    asked = args.weight_dtype
    if asked is None or asked == file_dtype:
        return file_dtype
    if file_dtype in GGUF_BLOCKS and asked != "compute":
        raise ConfigError(
            f"--weight-dtype {asked} but --checkpoint {args.checkpoint} is a {file_dtype} GGUF file: its blocks "
            "are not converted. Leave --weight-dtype out (priced quantized, as the loader keeps it) or use "
            "'compute' (dequantized at load)"
        )
    return asked


def with_references(setup: Setup, args: argparse.Namespace, family: ModelFamily) -> Setup:
    """`setup` with `args.references` reference latents of `args.reference_size` (default: the image's)."""
    count = args.references
    if not isinstance(count, int) or count < 0:
        raise ConfigError(f"--references {count}: give 0 or more reference images")
    if count == 0:
        return setup
    if family.references is None:
        raise ConfigError(
            f"--references {count}: {family.title} takes no reference images; leave --references out"
        )
    width, height = setup.width, setup.height
    if args.reference_size is not None:
        w, _, h = args.reference_size.partition("x")
        try:
            width, height = int(w), int(h or w)
        except ValueError:
            raise ConfigError(
                f"--reference-size {args.reference_size!r} is not a size; use e.g. 1024 or 1024x768"
            ) from None
    one = dataclasses.replace(setup, width=width, height=height)  # checks the size like --size
    return dataclasses.replace(setup, reference_tokens=count * one.latent_tokens)


__all__ = ["add_arguments", "resolve_model", "with_references"]
