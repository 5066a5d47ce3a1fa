"""`plan`'s whole-graph table: the text encoder beside the diffusion model on the same GPUs. The encoders'
stored bytes (backend/plan/encoders.json) equal the meta model's, every released model names an encoder of
its own graph type, `plan` prices the placement exactly as `place_encoder` does on the meta model's bytes,
and the table's path imports no torch."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from rocm_parallel.backend import cli
from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.encoders.kind import get_encoder_kind
from rocm_parallel.backend.family import families
from rocm_parallel.backend.plan import Setup, call_batch, estimate
from rocm_parallel.backend.plan.encoder import COMFYUI_GPU0, encoder_bytes, place_encoder
from rocm_parallel.backend.plan.graph import ENCODERS_FILE, model_encoders, stored_encoders

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from make_encoder_facts import encoders_facts, render
from test_docs_fit import _gpus, _table
from test_plan_facts import fresh_python

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9
# ComfyUI's CLIPLoader type of each family's graph (what the Text Encoder Loader's `type` is set to)
CLIP_TYPES = {"flux1": "flux", "flux2": "flux2", "qwen_image": "qwen_image"}


def plan_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["plan", *argv, "--json"])
    return json.loads(out.getvalue())


def test_encoders_file_equals_the_meta_models_bytes() -> None:
    # data derived from code: a change to an encoder's model, TP plan or presets must rewrite it
    # (python tests/tools/make_encoder_facts.py), or plan would price the old encoder
    assert json.loads(ENCODERS_FILE.read_text()) == json.loads(render(encoders_facts()))


def test_every_released_model_names_an_encoder_of_its_graph() -> None:
    for family in families():
        if family.name not in CLIP_TYPES:  # Wan: its UMT5 is not one of the pack's encoders
            assert not set(family.presets) & set(model_encoders())
            continue
        for preset in family.presets:
            record = stored_encoders()[model_encoders()[preset]]
            kind = get_encoder_kind(record["kind"])
            assert CLIP_TYPES[family.name] in kind.clip_types, f"{preset}: {kind.title}"


@pytest.mark.parametrize(
    ("model", "devices", "memory", "weights"),
    [
        ("flux2-dev", 4, 32, "fp8_e4m3fn"),
        ("qwen-image-edit-2511", 2, 32, "compute"),
        ("flux1-dev", 2, 24, "compute"),
    ],
)
def test_plan_places_the_encoder_as_the_meta_model_prices_it(
    model: str, devices: int, memory: int, weights: str
) -> None:
    answer = plan_json(
        "--model", model, "--devices", str(devices), "--memory-gb", str(memory), "--weight-dtype", weights
    )
    layout = next(e for e in answer["layouts"] if e["layout"] == answer["encoder"]["layout"])
    kind = get_encoder_kind(stored_encoders()[model_encoders()[model]]["kind"])
    held, table = ("bfloat16", None) if weights == "compute" else ("float8_e4m3fn", "bfloat16")
    shard = encoder_bytes(kind, kind.presets[model_encoders()[model]], devices, "vocab", held, table)
    expected = place_encoder(
        shard, round(layout["weights_gb"] * GB), round(layout["activations_gb"] * GB), memory * GB
    )
    got = answer["encoder"]
    assert got["tp"] == devices
    assert got["encoder_gb"] == pytest.approx(shard / GB, abs=1e-9)
    assert got["choice"] == expected.choice
    assert got["gpu0_peak_gb"] == pytest.approx(expected.gpu0_peak / GB, abs=1e-6)


def test_the_plan_prints_the_whole_graph_after_the_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    args = "plan --model flux2-dev --devices 4 --memory-gb 32 --weight-dtype fp8_e4m3fn".split()
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("Whole graph on the GPUs (text encoder + model + activations + ComfyUI on GPU 0):")
    assert lines[at + 2] == "| text encoder | encoder per GPU (GB) | GPU 0 at peak (GB) | choice |"
    assert lines[at + 4].startswith("| Mistral Small 3 24B (mistral3-24b, fp8) | 5.89 | ")
    assert lines[at + 4].endswith(" | resident |")
    assert lines[at + 5].startswith(
        "text encoder resident: encoder and model fit together (per GPU: encoder 5.89 GB"
    )
    assert cli.main([*args, "--full", "--encoder-dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("Whole graph on the GPUs (text encoder + model + activations + ComfyUI on GPU 0):")
    assert lines[at + 2].startswith("| text encoder | tp | encoder per GPU (GB) | whole (GB) | model (GB) |")
    assert lines[at + 4].startswith("| Mistral Small 3 24B (mistral3-24b, bf16) | 4 | 11.45 | 45.80 | ")
    assert cli.main([*args, "--encoder", "none"]) == 0
    assert "Whole graph" not in capsys.readouterr().out


def test_the_graph_takes_the_fastest_layout_that_keeps_the_encoder_resident(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 x 24 GB, FLUX.2 [dev] fp8: auto's fastest layout for the model alone (tp 2 x ring 2, 16.2 GB of
    # weights) leaves no room for Mistral's 5.89 GB shard; tp 4 (8.2 GB) does, a little slower per step
    argv = ("--model", "flux2-dev", "--devices", "4", "--memory-gb", "24", "--weight-dtype", "fp8_e4m3fn")
    answer = plan_json(*argv)
    got = answer["encoder"]
    assert (got["layout"], got["model_alone_layout"], got["choice"]) == (
        "tp 4",
        answer["auto"]["layout"],
        "resident",
    )
    fitting = [e for e in answer["layouts"] if e["fits"]]
    chosen = next(i for i, e in enumerate(fitting) if e["layout"] == "tp 4")
    assert chosen > 0
    shard = got["encoder_gb"] * GB
    for e in fitting[:chosen]:  # every faster layout: no room for the encoder beside it
        faster = place_encoder(
            round(shard), round(e["weights_gb"] * GB), round(e["activations_gb"] * GB), 24 * GB
        )
        assert faster.choice == "comfyui", e["layout"]
    assert cli.main(["plan", *argv]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"auto for the whole graph: tp 4 — {got['step_s']:.2f} s/step with the text encoder resident beside it; "
        f"set layout 'tp 4' on the ROCm Parallel Model (its 'auto' plans the model alone and takes "
        f"{answer['auto']['layout']}, {fitting[0]['step_s']:.2f} s/step, beside which the text encoder would be "
        "left to ComfyUI's own CLIPLoader)"
    )
    assert answer["answer"]["layout"] == "tp 4"


def _screen(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    rc = cli.main(["plan", *argv])
    return rc, capsys.readouterr().out.splitlines()


def test_one_screen_gives_one_answer(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's own command (FLUX.1-dev, cfg 2.5, 4 x 16 GB) printed "auto: batch 2 x tp 2" and "set layout
    'tp 4'"; Qwen-Image at 1328 px on 2 x 24 GB printed "tp 2 fits", then "GPU 0 ... may run out", and picked
    it. Each screen now ends in its one answer, and no other line recommends a layout."""
    rc, lines = _screen(capsys, "--devices", "4", "--memory-gb", "16", "--size", "1024", "--cfg", "2.5")
    answers = [line for line in lines if line.startswith("auto")]
    assert rc == 0 and answers == [lines[-1]]
    assert lines[-1].startswith("auto for the whole graph: tp 4 — ")
    assert [line for line in lines if "set layout" in line] == [lines[-1]]
    assert "takes batch 2 x tp 2" in lines[-1]  # what the node's own auto does, said as that
    rc, lines = _screen(capsys, "--model", "qwen-image", "--size", "1328", "--devices", "2", "--memory-gb", "24", "--cfg", "2.5")  # fmt: skip
    answers = [line for line in lines if line.startswith("auto")]
    assert rc == 1 and answers == [lines[-1]]
    assert lines[-1].startswith(
        "auto: no layout fits the whole graph on these GPUs: tp 2 fits the model alone (21.36 GB per GPU), but "
        "GPU 0 also holds ComfyUI's own process (1.50 GB): 22.86 GB at peak of 21.60 GB usable (24 GB); use fp8 "
        "weights"
    ), lines[-1]
    answer = plan_json("--model", "qwen-image", "--size", "1328", "--devices", "2", "--memory-gb", "24", "--cfg", "2.5")  # fmt: skip
    assert answer["answer"]["layout"] is None and answer["error"] == lines[-1].removeprefix("auto: ")


def test_an_encoder_that_does_not_split_over_the_gpus_is_left_to_comfyui() -> None:
    answer = plan_json(
        "--model", "flux2-dev", "--devices", "3", "--memory-gb", "32", "--weight-dtype", "fp8_e4m3fn"
    )
    got = answer["encoder"]
    assert (got["choice"], got["tp"], got["encoder_gb"]) == ("comfyui", 1, got["whole_gb"])
    assert got["reason"] == (
        "Mistral Small 3 24B cannot be split over 3 GPUs (its heads, key/value heads and MLP split over 2, 4 or "
        "8): ComfyUI's own CLIPLoader runs it"
    )


def test_gpu_0_at_peak_is_what_each_placement_holds_at_once() -> None:
    device = 24 * GB  # usable: 21.6 GB, of which ComfyUI's own 1.5 GB
    resident = place_encoder(encoder=6 * GB, model=6 * GB, activations=2 * GB, device=device)
    assert (resident.choice, resident.gpu0_peak) == ("resident", COMFYUI_GPU0 + 14 * GB)
    host = place_encoder(encoder=8 * GB, model=8 * GB, activations=5 * GB, device=device)
    assert (host.choice, host.gpu0_peak) == ("host", COMFYUI_GPU0 + 16 * GB)  # encoding: model + encoder
    # the model and its activations alone fill GPU 0 beside ComfyUI: nothing more goes there
    full = place_encoder(encoder=1 * GB, model=17 * GB, activations=3.5 * GB, device=device)
    assert full.choice == "comfyui"
    assert "alone fill GPU 0 past its usable memory" in full.reason
    assert full.gpu0_peak == COMFYUI_GPU0 + 20.5 * GB


def test_the_whole_graph_plan_imports_no_torch() -> None:
    # `plan` answers in seconds on 2 cores (issue 42): the encoders' bytes come from the file, not a torch model
    code = (
        "import sys\n"
        "from rocm_parallel.backend.plan.graph import plan_graph\n"
        "g = plan_graph('mistral3-24b', 'fp8', 4, 8e9, 0.5e9, 24)\n"
        "print(g.placement.choice, g.placement.encoder, 'torch' in sys.modules)\n"
    )
    assert fresh_python(code).split() == ["resident", "5894656000", "False"]


# BENCHMARKS.md's whole-graph table: each row is `plan --json` with the row's model, GPUs and weights
GRAPH_MODELS = {
    "FLUX.2 [dev]": ("flux2-dev", ["--cfg", "1"]),
    "Qwen-Image-Edit": ("qwen-image-edit-2511", ["--cfg", "2.5", "--references", "1"]),
}
WEIGHTS = {"bf16": "compute", "fp8": "fp8_e4m3fn"}


def graph_row(name: str, gpus: str, weights: str) -> list[str]:
    """The table's row as `plan` answers it: model layout (per GPU), encoder per GPU, GPU 0 at peak, choice."""
    devices, memory = _gpus(gpus)
    model, extra = GRAPH_MODELS[name]
    answer = plan_json(
        "--model", model, "--devices", str(devices), "--memory-gb", str(memory), "--weight-dtype", WEIGHTS[weights],
        *extra,
    )  # fmt: skip
    if answer["auto"] is None:
        return [name, gpus, weights, "no", "-", "-", "-"]
    layout = answer["encoder"]["layout"]
    per_gpu = next(e["per_gpu_gb"] for e in answer["layouts"] if e["layout"] == layout)
    e = answer["encoder"]
    encoder = f"{e['encoder_gb']:.2f} ({e['dtype']}, tp {e['tp']})"
    return [name, gpus, weights, f"{layout}, {per_gpu:.1f}", encoder, f"{e['gpu0_peak_gb']:.1f}", e["choice"]]


@pytest.mark.parametrize("row", _table(ROOT / "BENCHMARKS.md", "graph-plan"), ids=" ".join)
def test_each_row_of_the_whole_graph_table_is_what_plan_answers(row: list[str]) -> None:
    assert graph_row(*row[:3]) == row


def test_the_whole_graph_table_covers_both_models_on_each_machine() -> None:
    rows = {tuple(row[:3]) for row in _table(ROOT / "BENCHMARKS.md", "graph-plan")}
    gpus = ("2 × 16 GB", "4 × 16 GB", "2 × 32 GB")
    assert rows == {(m, g, w) for m in GRAPH_MODELS for g in gpus for w in WEIGHTS}


def test_plan_prices_reference_images_as_tokens_of_the_outputs_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    family = next(f for f in families() if f.name == "qwen_image")
    setup = Setup(
        family.dims(family.presets["qwen-image-edit-2511"]), batch=call_batch(1, 2.5),
        text_tokens=family.text.tokens, devices=2, memory_gb=32, family="qwen_image", reference_tokens=4096,
    )  # fmt: skip  # one 1024 x 1024 reference: 64 x 64 tokens of 16 x 16 pixels
    expected = estimate(setup, ParallelLayout.make("tp 2", 2))
    args = ("--model", "qwen-image-edit-2511", "--devices", "2", "--memory-gb", "32", "--cfg", "2.5")
    answer = plan_json(*args, "--references", "1", "--layout", "tp 2")
    assert answer["layouts"][0]["activations_gb"] == pytest.approx(expected.activations / GB, rel=1e-12)
    without = plan_json(*args, "--layout", "tp 2")["layouts"][0]["activations_gb"]
    assert without < answer["layouts"][0]["activations_gb"]
    assert cli.main(["plan", *args, "--references", "-1"]) == 2
    assert capsys.readouterr().err == "error: --references -1: give 0 or more reference images\n"
