"""The one module that touches ComfyUI's text encoder internals: the ROCm Parallel Text Encoder as a ComfyUI
CLIP.

The CLIP is ComfyUI's own (`comfy.sd.load_text_encoder_state_dicts`, the function its CLIPLoader and
DualCLIPLoader call, with the loader's `type`): ComfyUI detects the files, picks its tokenizer and prompt
templates, its layer selection (FLUX.2's three intermediate layers, Qwen-Image's template cut), its padding,
weights and pooled output, and its text nodes (CLIPTextEncode, CLIPTextEncodeFlux, TextEncodeQwenImageEdit,
...) run on it unchanged. It is built on the meta device (`model_options["initial_device"]`), so no weight of
the sharded encoder exists in ComfyUI's process; then exactly two attributes of ComfyUI's transformer change:

* its stack (T5's `encoder`, the language models' `model`) becomes `StackProxy`, whose forward sends the
  prompt's token ids, ComfyUI's attention mask and position ids and its layer selection to the workers
  (backend/encoders/api.py) and returns what ComfyUI's stack would: (hidden states, intermediate output);
* its token embedding becomes `TokenMarker`: ComfyUI's `process_tokens` looks the tokens up through it and
  concatenates the rows with the embeddings it makes itself (a textual inversion, Qwen2.5-VL's image tokens),
  so each looked-up row carries its token id (channel 0) and a marker in every other channel; the proxy reads
  the ids back and sends the other rows' values as they are. The workers look the ids up in their own
  (vocabulary-split) table.

What ComfyUI keeps in its own process (FLUX.1's CLIP-L, Qwen2.5-VL's vision tower) is filled from the file
with ComfyUI's own `CLIP.load_sd`, as its loader would. Each parameter of the sharded part is held on the
workers in the dtype ComfyUI's own CLIP gives it (read from the meta model), so the numbers are ComfyUI's.

Imported lazily, only inside ComfyUI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..backend.config import ConfigError

if TYPE_CHECKING:
    from ..backend.encoders.api import ParallelEncoder
    from ..backend.encoders.files import EncoderInfo
    from ..backend.encoders.kind import EncoderKind
    from ..backend.resident.group import ResidentGroup

# Every channel of a looked-up token's row but the first (which holds the id): float32's most negative
# finite value, which no embedding holds and which ComfyUI's nan_to_num (T5 with fp8 weights) leaves alone.
MARKER = torch.finfo(torch.float32).min

_REQUIRED = (
    ("comfy.sd", "load_text_encoder_state_dicts"),
    ("comfy.sd", "CLIPType"),
    ("comfy.sd", "CLIP.load_sd"),
)


class TokenMarker(torch.nn.Module):
    """ComfyUI's token embedding, as far as ComfyUI sees it: `forward(ids, out_dtype=None)` returns one row
    per id, [.., width] float32, the id in channel 0 and MARKER in the others (module docstring)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.width, self.num_embeddings, self.embedding_dim = width, vocab, width
        # ComfyUI reads the embedding's device (`get_input_embeddings().weight.device`) when it has no
        # execution device: an empty tensor that its model management moves like any other
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, input_ids: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = torch.full(
            (*input_ids.shape, self.width), MARKER, dtype=torch.float32, device=input_ids.device
        )
        rows[..., 0] = input_ids.to(torch.float32)  # exact: token ids are far below 2**24
        return rows


def decode_rows(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(ids [B, S] with -1 where a row is ComfyUI's own embedding, their flat positions, their values)."""
    tokens = (hidden[..., 1:] == MARKER).all(-1)
    ids = torch.where(tokens, hidden[..., 0].round().long(), torch.full_like(tokens, -1, dtype=torch.long))
    if bool(tokens.all()):
        return ids, None, None
    flat = hidden.reshape(-1, hidden.shape[-1])
    at = (~tokens).flatten().nonzero().flatten()
    return ids, at, flat[at].to(torch.float32)


class StackProxy(torch.nn.Module):
    """ComfyUI's transformer stack (T5Stack, Llama2_) whose forward runs on the workers; no parameters, so
    ComfyUI's memory management finds nothing to move. Arguments only text generation or other models pass
    (a KV cache, DeepStack features) are refused by name, never ignored."""

    def __init__(self, encoder: ParallelEncoder, embedding: TokenMarker, before: Callable[[], None]) -> None:
        super().__init__()
        self.encoder, self.before = encoder, before
        self.embed_tokens = embedding  # a language model's `model.embed_tokens` (T5's is `shared`)

    def forward(
        self,
        x: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        num_tokens: Any = None,
        intermediate_output: Any = None,
        final_layer_norm_intermediate: bool = True,
        dtype: Any = None,
        position_ids: torch.Tensor | None = None,
        embeds_info: Any = None,
        **others: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        given = sorted(
            k for k, v in others.items() if v is not None and not (isinstance(v, list | tuple) and not v)
        )
        if given:
            raise ConfigError(
                f"the ROCm Parallel text encoder encodes prompts only; ComfyUI passed {', '.join(given)} "
                "(text generation): use ComfyUI's own CLIPLoader for that node"
            )
        hidden = embeds if embeds is not None else x
        assert hidden is not None
        if not hidden.is_floating_point():  # token ids themselves
            ids, at, rows = hidden.long(), None, None
        else:
            ids, at, rows = decode_rows(hidden)
        self.before()
        got = self.encoder.encode(
            ids.cpu(),
            external_at=at.cpu() if at is not None else None,
            external=rows.cpu() if rows is not None else None,
            attention_mask=attention_mask.cpu() if attention_mask is not None else None,
            position_ids=position_ids.cpu() if position_ids is not None else None,
            intermediate_output=intermediate_output,
            final_layer_norm_intermediate=final_layer_norm_intermediate,
        )
        device = hidden.device
        return got.out.to(device), got.intermediate.to(device) if got.intermediate is not None else None


# --------------------------------------------------------------------------------------------------
# Building ComfyUI's CLIP


def _state_dict(path: str, real: Callable[[str, Any], bool]) -> dict[str, torch.Tensor]:
    """The file's tensors as ComfyUI's detection reads them: meta tensors of their shapes and dtypes, the
    real values where `real(key, slice)` says so (ComfyUI reads a tokenizer stored in the file)."""
    from safetensors import safe_open

    out = {}
    with safe_open(path, "pt") as f:
        for key in f.keys():
            s = f.get_slice(key)
            if real(key, s):
                out[key] = f.get_tensor(key)
            else:
                dtype = _torch_dtype(s.get_dtype())
                out[key] = torch.empty(tuple(s.get_shape()), dtype=dtype, device="meta")
    return out


def _torch_dtype(name: str) -> torch.dtype:
    from ..backend.dtypes import stored_dtype

    found = stored_dtype(name)
    if found is None:
        raise ConfigError(f"a tensor is stored as {name}, which the pack cannot read")
    return found.torch


def _is_data(key: str, s: Any) -> bool:
    """Tensors that are data rather than weights (a tokenizer's bytes): ComfyUI reads their values."""
    return s.get_dtype() in ("U8", "I8", "I32", "I64", "BOOL")


def _is_real(key: str, s: Any) -> bool:
    """What ComfyUI's detection reads the values of: data, and the scales of a scaled fp8 file (one number a
    layer: `convert_old_quants` drops a `scale_input` of 1.0)."""
    from ..backend.checkpoint.quant import QUANT_SUFFIXES, SCALE_INPUT, SCALE_WEIGHT, SCALED_FP8_MARKER

    return (
        _is_data(key, s)
        or key == SCALED_FP8_MARKER
        or key.endswith((SCALE_WEIGHT, SCALE_INPUT, *QUANT_SUFFIXES))
    )


def build_clip(
    group: ResidentGroup,
    paths: Sequence[str],
    clip_type: str,
    *,
    embedding: str = "vocab",
    slot: str | None = None,
    placement: str = "auto",
    before: Callable[[], None] = lambda: None,
    embedding_directory: Any = None,
    comfy_options: dict[str, Any] | None = None,
) -> Any:
    """ComfyUI's own CLIP for `paths` and `clip_type` with its sharded encoder on `group` (module docstring).
    `comfy_options`: more of ComfyUI's `model_options` (e.g. a companion's `model_config` for a small
    test file). `placement`: where the shard waits between prompts (backend/resident/parking.py). Every file is checked first (backend/encoders/files.py); nothing runs on a rank here."""
    import comfy.sd

    from ..backend.encoders.api import ParallelEncoder
    from ..backend.encoders.files import check_clip_type
    from ..backend.encoders.messages import ENCODER_SLOT

    _require()
    info, companions = _split_files(paths, clip_type)
    check_clip_type(info, clip_type)
    kind = info.encoder
    options: dict[str, Any] = {**(comfy_options or {}), "initial_device": torch.device("meta")}
    for name in kind.names_in_comfy():  # the file's own config (a small test file's too)
        options[f"{name}_model_config"] = _comfy_config(info.config)
    # the lists ComfyUI's detection converts in place (a companion in OpenAI's CLIP layout, say): kept
    data = [
        _as_comfy_reads(info.path, _state_dict(info.path, _is_real)),
        *(_companion(p) for p in companions),
    ]
    # as ComfyUI's CLIPLoader reads its `type` (check_clip_type has refused the types the pack does not run):
    # 0.3.75 lists 'flux2' with no CLIPType for it and detects FLUX.2 [dev]'s Mistral by the file alone
    clip_type_enum = getattr(comfy.sd.CLIPType, clip_type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION)
    clip = comfy.sd.load_text_encoder_state_dicts(
        data, embedding_directory=embedding_directory, clip_type=clip_type_enum, model_options=options
    )
    held = _sharded_transformers(clip, kind)
    for owner, transformer in held:
        dtypes = _comfy_dtypes(transformer, kind, info)
        name = slot or ENCODER_SLOT
        encoder = ParallelEncoder(
            group, info, dtypes=dtypes, embedding=embedding, slot=name, placement=placement
        )
        dims = encoder.dims
        marker = TokenMarker(dims.width, dims.vocab)
        _set_path(transformer, kind.stack, StackProxy(encoder, marker, before))
        _set_path(transformer, kind.embedding, marker)
        owner.parallel_encoder = encoder  # the loader node preloads through it
    _materialize_rest(clip, info, kind, data[1:])
    return clip


def _companion(path: str) -> dict[str, torch.Tensor]:
    """A file that stays in ComfyUI, read as ComfyUI's CLIPLoader reads it."""
    import comfy.utils

    return _as_comfy_reads(path, comfy.utils.load_torch_file(path, safe_load=True))


def _as_comfy_reads(path: str, sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` as ComfyUI's `load_clip` hands a file's state dict on: newer ComfyUI (0.33) converts the legacy
    scaled fp8 form and a header's `_quantization_metadata` to `weight_scale` + `comfy_quant` tensors
    (`convert_old_quants`, a version shim). 0.3.75 passes that metadata on for the language models only and
    then fails on it (`te() got an unexpected keyword argument`): it is not passed there; the workers read
    the scales from the file themselves (backend/encoders/files.py)."""
    import comfy.utils

    from ..backend.checkpoint.headers import read_header

    convert = getattr(comfy.utils, "convert_old_quants", None)
    if convert is None:
        return sd
    _, metadata = read_header(_existing(path))
    sd, _ = convert(sd, model_prefix="", metadata=dict(metadata))
    return sd


def _comfy_config(config: dict[str, Any]) -> dict[str, Any]:
    """The shape fields of the file's config as ComfyUI's config overrides take them (its own defaults stay
    for the rest; the check of ComfyUI's meta model against the workers' compares every shape)."""
    shaped = (
        "d_model",
        "d_kv",
        "num_heads",
        "d_ff",
        "num_layers",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    return {k: v for k, v in config.items() if k in shaped}


def _split_files(paths: Sequence[str], clip_type: str) -> tuple[EncoderInfo, list[str]]:
    """The one file the pack shards and the files that stay in ComfyUI (a kind's companions)."""
    from ..backend.checkpoint.files import CheckpointError
    from ..backend.checkpoint.headers import read_header
    from ..backend.encoders.files import inspect_encoder
    from ..backend.encoders.kind import detect_encoder, kinds_for_clip_type

    encoders, others = [], []
    for path in paths:
        header, _ = read_header(_existing(path))
        (encoders if detect_encoder(set(header)) is not None else others).append(path)
    if not encoders:
        wanted = ", ".join(k.title for k in kinds_for_clip_type(clip_type)) or "a text encoder the pack runs"
        inspect_encoder(paths[0])  # says what the first file is
        raise CheckpointError(f"none of {', '.join(map(os.path.basename, paths))} is {wanted}")
    if len(encoders) > 1:
        raise CheckpointError(
            f"{' and '.join(map(os.path.basename, encoders))} are both text encoders the pack shards; a loader "
            "takes one (and, where the encoder has one, its companion that stays in ComfyUI as the other file)"
        )
    info = inspect_encoder(encoders[0])
    kind = info.encoder
    for path in others:
        header, _ = read_header(_existing(path))
        if not any(matches(set(header)) for matches in kind.companions.values()):
            companions = " or ".join(kind.companions) or "no second file"
            raise CheckpointError(
                f"'{os.path.basename(path)}' is not what {kind.title} is loaded with: it takes {companions}"
            )
    if kind.companions and not others:
        needed = " or ".join(kind.companions)
        raise CheckpointError(
            f"{kind.title} is loaded with {needed} (ComfyUI's DualCLIPLoader): give the {needed} file as the "
            "second file"
        )
    return info, others


def _existing(path: str) -> Any:
    from pathlib import Path

    from ..backend.checkpoint.files import missing_checkpoint

    p = Path(path)
    if not p.is_file():
        raise missing_checkpoint(p)
    return p


def _sharded_transformers(clip: Any, kind: EncoderKind) -> list[tuple[Any, Any]]:
    """(ComfyUI's SDClipModel, its transformer) for every transformer of `kind` in the CLIP."""
    found = [
        (m, m.transformer)
        for m in clip.cond_stage_model.modules()
        if type(getattr(m, "transformer", None)).__name__ in kind.comfy_classes
    ]
    if not found:
        classes = sorted(
            {
                type(getattr(m, "transformer", None)).__name__
                for m in clip.cond_stage_model.modules()
                if hasattr(m, "transformer")
            }
        )
        raise ConfigError(
            f"ComfyUI built {', '.join(classes) or 'no text model'} for this file and type, not {kind.title} "
            f"({' or '.join(kind.comfy_classes)}): the file is not the {kind.title} ComfyUI expects for this type"
        )
    return found


def _comfy_dtypes(transformer: Any, kind: EncoderKind, info: EncoderInfo) -> dict[str, str]:
    """The dtype ComfyUI holds each parameter of the sharded part in, by the workers' names; its shapes
    must be the workers' (a ComfyUI whose model differs fails here, not with noise)."""
    params = dict(transformer.named_parameters())
    wanted = dict(kind.build(info.config, device="meta").named_parameters())
    out = {}
    for name, param in wanted.items():
        held = params.get(kind.prefix + name)
        if held is None or tuple(held.shape) != tuple(param.shape):
            got = "missing" if held is None else list(held.shape)
            raise RuntimeError(
                f"ComfyUI's {type(transformer).__name__} has '{kind.prefix}{name}' {got} where the pack's "
                f"{kind.title} has {list(param.shape)}: this ComfyUI's text encoder differs from the one the pack "
                "was checked against"
            )
        out[name] = str(held.dtype).removeprefix("torch.")
    return out


def _set_path(root: Any, path: str, module: torch.nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)


def _materialize_rest(
    clip: Any, info: EncoderInfo, kind: EncoderKind, companions: list[dict[str, Any]]
) -> None:
    """What stays in ComfyUI (a companion file's model, Qwen2.5-VL's vision tower): its meta tensors become
    real and ComfyUI's own `CLIP.load_sd` fills them from the files, as its loader does."""
    model = clip.cond_stage_model
    device = clip.patcher.offload_device
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(
                    module,
                    name,
                    torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=False),
                )
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_meta:
                module.register_buffer(name, torch.empty_like(buffer, device=device))
    sharded = {kind.prefix + n for n in info.tensors}
    sharded |= {s.key for s in info.scales.values()} | _scale_companions(sharded)
    from safetensors import safe_open

    rest = {}
    with safe_open(info.path, "pt") as f:
        for key in f.keys():
            if key not in sharded and not _is_data(key, f.get_slice(key)):
                rest[key] = f.get_tensor(key)
    if rest:
        clip.load_sd(rest)
    for sd in companions:
        clip.load_sd(sd)


def _scale_companions(keys: set[str]) -> set[str]:
    """The scaled fp8 marker and the input scales / quantization tags of the layers whose weights are `keys`:
    the workers' part of the file, not ComfyUI's."""
    from ..backend.checkpoint.quant import COMFY_QUANT, INPUT_SCALE, SCALE_INPUT, SCALED_FP8_MARKER

    layers = {k.removesuffix(".weight") for k in keys if k.endswith(".weight")}
    return {SCALED_FP8_MARKER} | {
        f"{layer}{s}" for layer in layers for s in (SCALE_INPUT, INPUT_SCALE, COMFY_QUANT)
    }


def _require() -> None:
    from .comfy_model import comfyui_version, missing_internals

    missing = missing_internals(_REQUIRED)
    if missing:
        raise RuntimeError(
            f"ROCm Parallel Text Encoder Loader: ComfyUI {comfyui_version()} lacks {', '.join(missing)}; update ComfyUI"
        )
