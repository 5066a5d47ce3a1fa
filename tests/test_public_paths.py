"""What the panel and the status route show of a path: its file name, whatever the folders hold.

Every message that names a checkpoint or a LoRA (the caller's checks, a rank's load) is made twice, once
for a file in folders whose names hold quotes, a newline, a tab, a backslash, spaces and other scripts,
once for the same file name in a plain folder: the public text must be the same, name the file and show
nothing of the folders. Before, a folder `o'brien` showed as "...'PRIVo'missing.safetensors' does not
exist; 'PRIVo." and `say "hi"` leaked whole.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sampling import flux_model

from rocm_parallel.backend.checkpoint import diffusers_to_bfl
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion.api import ParallelFlux
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.nodes.registry import Registry, public_error

# Every folder component holds every kind of character a name may: quotes of both kinds, a newline, a
# tab, a backslash, spaces, other scripts; "PRIV" marks what must never be shown.
FOLDERS = ('PRIV1 o\'brien "say hi"\n☃', "PRIV2 ünï\tcødé \\ 'x'", "PRIV3 日本 語\n\"'")
NAME = 'my "flux" ü\'s\nmodel.safetensors'  # the file name is shown, whatever it holds
LORA = "a 'lora' ü\n.safetensors"


@pytest.fixture(scope="module")
def model_state() -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in diffusers_to_bfl(flux_model("dev").state_dict()).items()}


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory, model_state: dict) -> str:
    path = tmp_path_factory.mktemp("plain") / "base.safetensors"
    save_file(model_state, str(path))
    return str(path)


def _folder(root: Path, weird: bool) -> Path:
    folder = root.joinpath(*FOLDERS) if weird else root / "plain"
    folder.mkdir(parents=True)
    (folder / "other.safetensors").write_bytes(b"")
    (folder / f"PRIV sub {FOLDERS[0]}").mkdir()  # a listing names this folder's entries: dropped whole
    (folder / f"PRIV {FOLDERS[1]}.safetensors").write_bytes(b"")
    return folder


# ---- how each message kind is made: (folder, state) -> (checkpoint path, loras) for check_load ----------


def _missing(folder: Path, state: dict) -> tuple[Path, list]:
    return folder / NAME, []


def _missing_folder(folder: Path, state: dict) -> tuple[Path, list]:
    return folder / "PRIV gone 'x'\n" / NAME, []


def _no_config(folder: Path, state: dict) -> tuple[Path, list]:
    (folder / NAME).mkdir()
    (folder / NAME / "PRIV notes 'n'.txt").write_text("")
    return folder / NAME, []


def _other_class(folder: Path, state: dict) -> tuple[Path, list]:
    (folder / NAME).mkdir()
    (folder / NAME / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    return folder / NAME, []


def _missing_shard(folder: Path, state: dict) -> tuple[Path, list]:
    (folder / NAME).mkdir()
    (folder / NAME / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    index = {"weight_map": {"x": "shard-1.safetensors"}}
    (folder / NAME / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return folder / NAME, []


def _gguf(folder: Path, state: dict) -> tuple[Path, list]:
    (folder / NAME).write_bytes(b"GGUF" + bytes(60))
    return folder / NAME, []


def _pickle(folder: Path, state: dict) -> tuple[Path, list]:
    torch.save({"a": torch.zeros(2)}, folder / NAME)
    return folder / NAME, []


def _truncated(folder: Path, state: dict) -> tuple[Path, list]:
    save_file({"weight": torch.ones(64, 64)}, str(folder / NAME))
    data = (folder / NAME).read_bytes()
    (folder / NAME).write_bytes(data[: len(data) // 2])
    return folder / NAME, []


def _not_flux(folder: Path, state: dict) -> tuple[Path, list]:
    save_file({"weight": torch.ones(4, 4)}, str(folder / NAME))
    return folder / NAME, []


def _incomplete(folder: Path, state: dict) -> tuple[Path, list]:
    save_file({k: v for k, v in state.items() if k != "img_in.weight"}, str(folder / NAME))
    return folder / NAME, []


def _wrong_shape(folder: Path, state: dict) -> tuple[Path, list]:
    save_file({**state, "img_in.bias": torch.zeros(7)}, str(folder / NAME))
    return folder / NAME, []


def _stored_as_int(folder: Path, state: dict) -> tuple[Path, list]:
    save_file({**state, "img_in.weight": state["img_in.weight"].to(torch.int32)}, str(folder / NAME))
    return folder / NAME, []


def _fifo(folder: Path, state: dict) -> tuple[Path, list]:
    os.mkfifo(folder / NAME)
    return folder / NAME, []


def _device(folder: Path, state: dict) -> tuple[Path, list]:
    (folder / NAME).symlink_to("/dev/zero")
    return folder / NAME, []


def _lora_file(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / LORA))
    return folder / LORA


def _checkpoint_beside(folder: Path, state: dict) -> Path:
    save_file(state, str(folder / NAME))
    return folder / NAME


def _lora_missing(folder: Path, state: dict) -> tuple[Path, list]:
    return _checkpoint_beside(folder, state), [(folder / LORA, 1.0)]


def _lora_missing_folder(folder: Path, state: dict) -> tuple[Path, list]:
    return _checkpoint_beside(folder, state), [(folder / "PRIV gone\n'" / LORA, 1.0)]


def _lora_folder(folder: Path, state: dict) -> tuple[Path, list]:
    (folder / LORA).mkdir()
    return _checkpoint_beside(folder, state), [(folder / LORA, 1.0)]


def _lora_pickle(folder: Path, state: dict) -> tuple[Path, list]:
    torch.save({"a": torch.zeros(2)}, folder / LORA)
    return _checkpoint_beside(folder, state), [(folder / LORA, 1.0)]


def _lora_fifo(folder: Path, state: dict) -> tuple[Path, list]:
    os.mkfifo(folder / LORA)
    return _checkpoint_beside(folder, state), [(folder / LORA, 1.0)]


def _lora_no_flux_keys(folder: Path, state: dict) -> tuple[Path, list]:
    lora = _lora_file(folder, {"lora_unet_down_blocks_0_proj_in.lora_down.weight": torch.zeros(4, 8)})
    return _checkpoint_beside(folder, state), [(lora, 1.0)]


def _img_in_lora(
    folder: Path, state: dict, up: torch.Tensor, down: torch.Tensor, strength: float = 1.0
) -> tuple[Path, list]:
    """A LoRA of `img_in` (the tiny model's [64, 64] input layer) beside a good checkpoint."""
    key = "diffusion_model.img_in"
    lora = _lora_file(folder, {f"{key}.lora_up.weight": up, f"{key}.lora_down.weight": down})
    return _checkpoint_beside(folder, state), [(lora, strength)]


def _lora_wrong_shape(folder: Path, state: dict) -> tuple[Path, list]:
    return _img_in_lora(folder, state, torch.zeros(64, 2), torch.zeros(2, 80))


def _lora_nan(folder: Path, state: dict) -> tuple[Path, list]:
    up = torch.full((64, 2), 0.5)
    up[3, 1] = math.nan
    return _img_in_lora(folder, state, up, torch.full((2, 64), 0.25))


def _lora_strength(folder: Path, state: dict) -> tuple[Path, list]:
    return _img_in_lora(folder, state, torch.zeros(64, 2), torch.zeros(2, 64), strength=1e30)


KINDS: dict[str, Callable[[Path, dict], tuple[Path, list]]] = {
    "missing": _missing, "missing folder": _missing_folder, "folder without config": _no_config,
    "diffusers config of another class": _other_class, "missing shard": _missing_shard, "gguf": _gguf,
    "pickle": _pickle, "truncated": _truncated, "not flux": _not_flux, "incomplete": _incomplete,
    "wrong shape": _wrong_shape, "stored as int": _stored_as_int, "fifo": _fifo, "device": _device,
    "lora missing": _lora_missing, "lora missing folder": _lora_missing_folder, "lora folder": _lora_folder,
    "lora pickle": _lora_pickle, "lora fifo": _lora_fifo, "lora no flux keys": _lora_no_flux_keys,
    "lora wrong shape": _lora_wrong_shape, "lora nan": _lora_nan, "lora strength": _lora_strength,
}  # fmt: skip
# The file a kind's message is about (the public text must name it).
NAMED = {kind: repr(LORA if kind.startswith("lora") else NAME) for kind in KINDS}
NAMED["diffusers config of another class"] = "'config.json'"
NAMED["missing shard"] = "'diffusion_pytorch_model.safetensors.index.json'"


def _refusal(root: Path, kind: str, state: dict, weird: bool) -> ConfigError:
    checkpoint, loras = KINDS[kind](_folder(root, weird), state)
    with pytest.raises(ConfigError) as err:
        ParallelFlux(["cpu", "cpu"]).check_load(str(checkpoint), loras=loras)
    return err.value


@pytest.mark.timeout(60)  # a FIFO opened for reading blocked forever before
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_refusal_shows_the_file_name_and_nothing_of_its_folders(
    kind: str, tmp_path: Path, model_state: dict
) -> None:
    weird = _refusal(tmp_path / "w", kind, model_state, weird=True)
    plain = _refusal(tmp_path / "p", kind, model_state, weird=False)
    shown, expected = public_error(weird), public_error(plain)
    assert "PRIV" not in shown, shown
    assert shown == expected
    assert NAMED[kind] in shown, shown
    # the same text through the panel's snapshot (what the status route answers)
    registry = Registry(factory=lambda devices: None)
    with pytest.raises(ConfigError), registry.refusals():
        raise weird
    assert registry.snapshot()["error"] == shown


def test_a_ranks_refusal_at_load_shows_the_file_name_only(
    group2: WorkerGroup, tmp_path: Path, plain_checkpoint: str
) -> None:
    """A NaN weight found by the ranks while loading: their message names the file, through a WorkerError."""
    state = load_file(plain_checkpoint)
    state["img_in.bias"] = state["img_in.bias"].clone()
    state["img_in.bias"][1] = math.nan
    shown = []
    for weird in (True, False):
        path = _folder(tmp_path / str(weird), weird) / NAME
        save_file(state, str(path))
        with pytest.raises(Exception) as err:
            ParallelFlux(group=group2).load(str(path), layout="tp", dtype="float32")
        shown.append(public_error(err.value))
    assert "PRIV" not in shown[0], shown[0]
    first = re.compile(r"^WorkerError: rank [01] ")  # whichever rank refused first
    shown = [first.sub("WorkerError: rank N ", s) for s in shown]
    assert shown[0] == shown[1]
    assert shown[0] == (
        f"WorkerError: rank N (cpu): CheckpointError: {NAME!r}: tensor 'img_in.bias' holds NaN values; the "
        "file is damaged (an interrupted download or copy, a failing disk) or was saved from a broken model: "
        "download or copy it again"
    )


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        # an OS error names the path as Python writes a string (repr); a raw Windows path in quotes
        (
            f"[Errno 13] Permission denied: {str(Path('/x', *FOLDERS, NAME))!r}",
            f"[Errno 13] Permission denied: {NAME!r}",
        ),
        ("LoRA 'D:\\My LoRAs\\a b.safetensors' is bad", "LoRA 'a b.safetensors' is bad"),
        # a separator between spaces is prose, not a path
        ("a pickle (torch.save / .ckpt / .bin)", "a pickle (torch.save / .ckpt / .bin)"),
        # prose apostrophes open no quote; a quoted value without a separator is kept
        ("rank 0's layout 'tp 2' and the file '/a/PRIV b/c.safetensors'", "rank 0's layout 'tp 2' and the file 'c.safetensors'"),
        # a listing is dropped whole, whatever its entries hold
        (
            f"checkpoint {'/m/PRIV/x.safetensors'!r} does not exist; {'/m/PRIV'!r} has: a.safetensors, "
            f"{'PRIV b. C'!r}, {'PRIV sub'!r}/ and 3 more. Pick one of those",
            "checkpoint 'x.safetensors' does not exist. Pick one of those",
        ),
    ],
)  # fmt: skip
def test_public_text_of_other_spellings(message: str, shown: str) -> None:
    assert public_error(RuntimeError(message)) == f"RuntimeError: {shown}"
