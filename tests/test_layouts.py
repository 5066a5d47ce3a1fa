"""Composed layouts without workers: the syntax the API, the nodes and the CLI share, every refusal's exact
message, the nodes' degree widgets, the call batch ComfyUI makes, and what the planner offers and picks.

Parity of the composed layouts on 4 gloo workers and their collectives per mesh dimension: test_mesh.py.
"""

from __future__ import annotations

import json

import pytest

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import make_layout
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import FLUX_DEV
from rocm_parallel.backend.flux2.model import FLUX2_DEV
from rocm_parallel.backend.plan import PCIE4, Setup, call_batch, candidate_layouts, choose, plan
from rocm_parallel.nodes import inputs
from rocm_parallel.nodes.inputs import LayoutRequest
from rocm_parallel.nodes.runner import call_batch_of, idle_note

DEV = FluxDims.from_diffusers_config(FLUX_DEV)  # 24 heads
DEV2 = FluxDims.from_diffusers_config(FLUX2_DEV)  # 48 heads
SYNTAX = "degrees such as 'batch 2 x tp 2' or 'tp2xring2' (batch, tp, ring, ulysses; each at most once)"

# --- the syntax: one parser for the API, the nodes and the CLI ---------------------------------------


@pytest.mark.parametrize(
    ("text", "layout"),
    [
        ("batch 2 x tp 2", ParallelLayout(batch=2, tp=2)),
        ("batch2xtp2", ParallelLayout(batch=2, tp=2)),
        ("tp=2 x ring=2", ParallelLayout(tp=2, ring=2)),
        ("ulysses4 x tp2", ParallelLayout(tp=2, ulysses=4)),
        (" Ring 2 × Ulysses 2 ", ParallelLayout(ring=2, ulysses=2)),
        ("tp4", ParallelLayout(tp=4)),
        ("single", ParallelLayout()),
    ],
)
def test_layouts_parse_and_print_the_same_way(text: str, layout: ParallelLayout) -> None:
    assert ParallelLayout.parse(text) == layout
    assert ParallelLayout.parse(str(layout)) == layout  # what the panel and the tables print reads back


def test_a_layout_prints_its_degrees_in_mesh_order() -> None:
    assert str(ParallelLayout(ulysses=4, tp=2)) == "tp 2 x ulysses 4"
    assert ParallelLayout(batch=2, tp=2).describe() == "batch 2 x tp 2"  # the panel's text
    assert str(ParallelLayout(batch=2, tp=2, ring=2, ulysses=2)) == "batch 2 x tp 2 x ring 2 x ulysses 2"
    assert ParallelLayout(batch=2, ring=2).world_size == 4 and ParallelLayout(ring=2, ulysses=2).cp == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp2xfoo3", f"layout='tp2xfoo3' is not a layout: 'foo3' is not a degree; use tp, context, auto or {SYNTAX}"),
        ("tp 2 x tp 2", f"layout='tp 2 x tp 2' names tp twice; name each degree once ({SYNTAX})"),
        ("batch0xtp4", "batch_degree=0 must be a positive integer; use 1 to turn it off"),
        ("2 x 2", f"layout='2 x 2' is not a layout: '2' is not a degree; use tp, context, auto or {SYNTAX}"),
    ],
)  # fmt: skip
def test_bad_layout_text_is_refused_naming_the_part(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelLayout.parse(text)
    assert str(err.value) == message


# --- refusals: the dimension that does not divide, and the degrees that would -------------------------


@pytest.mark.parametrize(
    ("layout", "devices", "dims", "message"),
    [
        (
            ParallelLayout(batch=2, tp=4), 4, DEV,
            "the layout batch 2 x tp 4 needs 8 devices (batch x tp x ring x ulysses) but 4 were given; make "
            "the product 4 (e.g. tp 4 or batch 2 x tp 2)",
        ),
        (
            ParallelLayout(tp=4, ulysses=4), 16, DEV,
            "ulysses_degree=4 does not divide the 6 attention heads a rank holds under tp_degree=4 (24 / 4); "
            "use ulysses_degree 2, 3 or 6; or tp_degree 1, 2, 3 or 6 with ulysses_degree=4; or ring_degree "
            "instead (ring splits no heads)",
        ),
        (
            ParallelLayout(tp=8, ulysses=2), 16, DEV,
            "ulysses_degree=2 does not divide the 3 attention heads a rank holds under tp_degree=8 (24 / 8); "
            "use ulysses_degree 3; or tp_degree 1, 2, 3, 4, 6 or 12 with ulysses_degree=2; or ring_degree "
            "instead (ring splits no heads)",
        ),
        (ParallelLayout(batch=2, tp=5), 10, DEV, "tp_degree=5 does not divide 24 attention heads; use 2, 3, 4, 6, 8, 12 or 24"),
        (ParallelLayout(ulysses=5), 5, DEV, "ulysses_degree=5 does not divide 24 attention heads; use 2, 3, 4, 6, 8, 12 or 24"),
    ],
)  # fmt: skip
def test_layout_refusals(layout: ParallelLayout, devices: int, dims: FluxDims, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        layout.validate(dims, devices=devices)
    assert str(err.value) == message


def test_ulysses_under_tp_is_checked_against_the_heads_a_rank_holds() -> None:
    """tp 2 x ulysses 4 on FLUX.2 [dev]'s 48 heads: 24 per rank, 6 each after Ulysses; and Ulysses 4
    x TP 2, cache-dit's fastest FLUX.2 layout on 8 GPUs, is valid."""
    ParallelLayout(tp=2, ulysses=4).validate(DEV2, devices=8)
    ParallelLayout(tp=8, ulysses=3).validate(DEV, devices=24)  # 3 heads per rank, 1 after Ulysses


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            {"kind": "tp", "ring": 2},
            "ring_degree=2 does not apply to layout='tp': tp takes every device the batch degree leaves; "
            "for tensor x context parallelism name every degree, e.g. layout='tp 2 x ring 2'",
        ),
        (
            {"kind": "batch2xtp2", "ulysses": 2},
            "ulysses_degree=2 does not apply to layout='batch2xtp2': layout='batch2xtp2' names its degrees "
            "already; write them all there, e.g. 'batch 2 x tp 2'",
        ),
        (
            {"kind": "context", "ring": 3, "ulysses": 0, "batch": 2},
            "ring_degree=3 does not divide the 2 devices batch 2 leaves of 4, so the other degree cannot fill "
            "the rest; use one of 1, 2",
        ),
        (
            {"kind": "tp", "batch": 3},
            "batch_degree=3 does not divide the 4 devices, so tp cannot take the rest; use batch_degree 1, 2 "
            "or 4",
        ),
    ],
)
def test_contradictory_or_indivisible_degrees_are_refused(call: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelLayout.make(devices=4, **call)
    assert str(err.value) == message


def test_the_api_refuses_degrees_beside_a_layout_that_names_them() -> None:
    """`load(layout=..., ring=...)`: the same make_layout as `sample`; ring never silently dropped."""
    assert make_layout("batch 2 x tp 2", 4) == ParallelLayout(batch=2, tp=2)
    assert make_layout("context", 4, ring=2) == ParallelLayout(ring=2, ulysses=2)
    with pytest.raises(ConfigError, match=r"^ring_degree=2 does not apply to layout='tp': "):
        make_layout("tp", 4, ring=2)
    with pytest.raises(ConfigError) as err:
        make_layout(ParallelLayout(tp=4), 4, ulysses=2)
    assert str(err.value) == (
        "ulysses_degree=2 was given with layout='tp 4', which names its degrees already; write them all in "
        "the layout, e.g. ParallelLayout(tp=2, ulysses=2)"
    )
    with pytest.raises(ConfigError, match=r"^ulysses_degree=2 does not apply to layout='auto': auto chooses"):
        make_layout("auto", 4, ulysses=2)


# --- the nodes: one layout field on the Model node, degree widgets on the samplers --------------------


@pytest.mark.parametrize(
    ("text", "ring", "ulysses", "request_"),
    [
        ("tp", 0, 0, LayoutRequest(ParallelLayout(tp=4))),
        ("batch 2 x tp 2", 0, 0, LayoutRequest(ParallelLayout(batch=2, tp=2))),
        ("tp2xulysses2", 0, 0, LayoutRequest(ParallelLayout(tp=2, ulysses=2))),
        ("auto", 0, 0, LayoutRequest(None)),
        ("context", 2, 0, LayoutRequest(ParallelLayout(ring=2, ulysses=2), context_only=True)),
        ("context", 0, 0, LayoutRequest(None, context_only=True)),
    ],
)
def test_the_model_nodes_layout_field(text: str, ring: int, ulysses: int, request_: LayoutRequest) -> None:
    assert inputs.model_layout(text, ring, ulysses, 4) == request_


def test_the_model_node_refuses_degree_widgets_its_layout_does_not_use() -> None:
    with pytest.raises(ConfigError) as err:
        inputs.model_layout("batch 2 x tp 2", 2, 0, 4)
    assert str(err.value) == (
        "ring_degree=2 applies to layout 'context' only, but layout is 'batch 2 x tp 2'; set it to 0, or "
        "write the degree into the layout (e.g. 'tp 2 x ring 2')"
    )
    with pytest.raises(
        ConfigError, match=r"^ulysses_degree=2 applies to layout 'context' only, but layout is 'tp'"
    ):
        inputs.model_layout("tp", 0, 2, 4)
    with pytest.raises(ConfigError, match=r"^layout=' ' is empty; use tp, context, auto or degrees"):
        inputs.model_layout(" ", 0, 0, 4)


def test_the_samplers_degrees_compose_with_their_own_dimension() -> None:
    assert inputs.tp_layout(4) == ParallelLayout(tp=4)
    assert inputs.tp_layout(4, batch=2) == ParallelLayout(batch=2, tp=2)
    assert inputs.tp_layout(8, ulysses=4) == ParallelLayout(tp=2, ulysses=4)
    assert inputs.context_layout(0, 0, 4, batch=2) is None  # auto, keeping batch 2 (LayoutRequest.fixed)
    assert inputs.context_layout(2, 0, 8, batch=2) == ParallelLayout(batch=2, ring=2, ulysses=2)
    assert inputs.context_layout(0, 0, 4, tp=2) is None
    assert inputs.context_layout(2, 1, 4, tp=2) == ParallelLayout(tp=2, ring=2)
    with pytest.raises(ConfigError) as err:
        inputs.tp_layout(4, batch=2, ring=4)
    assert str(err.value) == (
        "batch_degree=2 x ring_degree=4 = 8 does not divide the 4 devices, so tp cannot take the rest; use "
        "degrees whose product divides 4 (1, 2 or 4)"
    )
    with pytest.raises(
        ConfigError, match=r"^batch_degree=3 does not divide the 4 devices, so ring x ulysses"
    ):
        inputs.context_layout(0, 0, 4, batch=3)
    ring_auto = LayoutRequest(None, context_only=True, batch=2, tp=1)
    assert ring_auto.fixed() == {"batch": 2, "tp": 1}
    assert ring_auto.describe() == "auto (context parallel) with batch 2"
    assert LayoutRequest(None).fixed() == {}


# --- the call batch: what the batch degree splits ------------------------------------------------------


@pytest.mark.parametrize(
    ("latents", "cfg", "lengths", "pad", "expected"),
    [
        (1, 1.0, {"positive": 256, "negative": 256}, 0, 1),  # cfg 1: ComfyUI skips the negative
        (1, 2.5, {"positive": 256, "negative": 256}, 0, 2),  # cond + uncond in one call
        (2, 2.5, {"positive": 256, "negative": 256}, 0, 4),
        (1, 2.5, {"positive": 300, "negative": 256}, 0, 1),  # FLUX.1 T5 300 vs 256 tokens: two calls
        (1, 2.5, {"positive": 40, "negative": 7}, 512, 2),  # FLUX.2 pads both to 512: one call
        (1, 2.5, {"positive": 256, "negative": None}, 0, 1),  # no negative entries
        (1, 2.5, {"positive": 256}, 0, 1),  # BasicGuider: positive only
    ],
)
def test_call_batch_of_a_comfyui_run(
    latents: int, cfg: float, lengths: dict, pad: int, expected: int
) -> None:
    assert call_batch_of(latents, cfg, lengths, pad) == expected


def test_the_panel_says_when_batch_groups_idle() -> None:
    assert idle_note(ParallelLayout(batch=2, tp=2), 2) is None
    assert idle_note(ParallelLayout(tp=4), 1) is None
    assert idle_note(ParallelLayout(batch=2, tp=2), 1) == (
        "note: batch 2 x tp 2 with 1 entry per model call leaves 1 of 2 batch groups idle (batch_size, or "
        "cfg > 1 with a negative prompt, fills them)"
    )


# --- the planner: every composition, priced per dimension; never idle groups ---------------------------


def test_candidates_are_every_composition_the_engine_accepts() -> None:
    found = candidate_layouts(DEV, 4)
    assert [str(lay) for lay in found] == [
        "tp 4", "tp 2 x ring 2", "tp 2 x ulysses 2", "ring 4", "ring 2 x ulysses 2", "ulysses 4",
        "batch 2 x tp 2", "batch 2 x ring 2", "batch 2 x ulysses 2", "batch 4",
    ]  # fmt: skip
    assert candidate_layouts(DEV, 4, batch=1) == found[:6]  # a call of 1: no batch degree
    assert len(candidate_layouts(DEV, 8)) == 20  # every ordered factorisation of 2^3 into 4 degrees
    assert candidate_layouts(DEV, 5) == [ParallelLayout(ring=5), ParallelLayout(batch=5)]


def test_the_planner_never_picks_a_batch_degree_the_calls_cannot_fill() -> None:
    """4 x 24 GB, FLUX.1-dev: at cfg 1 (call batch 1) no batch layout is even priced; at cfg 2.5 (cond and
    uncond in one call) batch 2 x tp 2 wins: each TP pair reduces half the activations TP 4 would."""
    alone = Setup(DEV, 1024, 1024, batch=call_batch(1, 1.0), devices=4, memory_gb=24, link=PCIE4)
    assert all(e.layout.batch == 1 for e in plan(alone))
    assert choose(alone).layout.batch == 1
    paired = Setup(DEV, 1024, 1024, batch=call_batch(1, 2.5), devices=4, memory_gb=24, link=PCIE4)
    choice = choose(paired)
    assert choice.layout == ParallelLayout(batch=2, tp=2)
    assert choice.explanation.startswith("auto: batch 2 x tp 2 — fits 12.2 of 24 GB per GPU; predicted ")
    by_name = {e.name: e for e in choice.estimates}
    assert by_name["batch 2 x tp 2"].local_batch == 1 and by_name["tp 4"].local_batch == 2
    # batch 4 would leave groups idle: never priced for calls of 2, priced (and said) only when fixed
    assert "batch 4" not in by_name
    forced = choose(Setup(DEV, 1024, 1024, batch=1, devices=4, memory_gb=48, link=PCIE4), {"batch": 2})
    assert forced.layout.batch == 2 and forced.explanation.endswith("; 1 batch group(s) idle per call")


def test_plan_json_reports_the_degrees(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m rocm_parallel plan --json`: each layout's degrees, its collectives per mesh dimension,
    the auto choice's degrees; `--layout` prices one layout in the nodes' syntax."""
    from rocm_parallel.backend import cli

    assert cli.main(["plan", "--devices", "4", "--cfg", "2.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["call_batch"] == 2
    chosen = out["auto"]
    assert (chosen["layout"], chosen["batch"], chosen["tp"], chosen["ring"], chosen["ulysses"]) == (
        "batch 2 x tp 2", 2, 2, 1, 1,
    )  # fmt: skip
    row = next(e for e in out["layouts"] if e["layout"] == "tp 2 x ring 2")
    assert (row["batch"], row["tp"], row["ring"], row["ulysses"], row["devices"]) == (1, 2, 2, 1, 4)
    assert set(row["per_dimension"]) == {"tp", "ring", "cp"}
    assert row["per_dimension"]["tp"]["count"] == 76 + 1
    assert {c["dim"] for c in row["collectives"]} == {"tp", "ring", "cp"}
    assert cli.main(["plan", "--devices", "4", "--layout", "tp2xulysses2", "--json"]) == 0
    (only,) = json.loads(capsys.readouterr().out)["layouts"]
    assert (only["layout"], only["tp"], only["ulysses"]) == ("tp 2 x ulysses 2", 2, 2)
    assert cli.main(["plan", "--devices", "4", "--layout", "tp2xulysses4"]) == 2
    assert "error: the layout tp 2 x ulysses 4 needs 8 devices" in capsys.readouterr().err


@pytest.mark.parametrize(("batch", "degree"), [(3, 2), (1, 2), (4, 4), (6, 4), (2, 1)])
def test_batch_shares_are_tensor_splits(batch: int, degree: int) -> None:
    """Each group of the batch dimension takes tensor_split's share: 3 over 2 is 2 + 1, 1 over 2 is 1 + 0
    (the second group idles)."""
    import torch

    from rocm_parallel.backend.parallel.mesh import batch_sizes

    assert batch_sizes(batch, degree) == [len(p) for p in torch.arange(batch).tensor_split(degree)]


def test_a_load_whose_layout_misses_the_device_count_is_refused_before_the_file_is_read(tmp_path) -> None:
    """The layout against the device count needs no checkpoint: refused before its header is read (which
    imports diffusers: 12-31 s on a busy 2-core machine). The file does not exist, so reading it first
    would answer with a file error instead."""
    from rocm_parallel.backend.diffusion.api import ParallelModel

    flux = ParallelModel("cpu x4")
    with pytest.raises(ConfigError) as err:
        flux.check_load(str(tmp_path / "absent.safetensors"), layout="tp 2 x ring 3")
    assert str(err.value) == (
        "the layout tp 2 x ring 3 needs 6 devices (batch x tp x ring x ulysses) but 4 were given; make the "
        "product 4 (e.g. tp 2 x ring 2)"
    )
    assert not flux.started
