"""The text encoders on the workers: ComfyUI's arithmetic against transformers' models, tensor parallelism
against one process, and every refusal before a rank runs.

The files are small random models written by transformers' own classes (testing/encoder_files.py). The
one-process reference is transformers' model on the same weights in float32 (ComfyUI's text encoders compute
in float32); the workers' encoders at TP 2 and TP 4 (token embeddings split by vocabulary, or replicated) must
equal the pack's one-process encoder within 1e-5 and transformers within 1e-4. The real-ComfyUI tier
(tests/comfy/test_comfy_encoders.py) checks the same encoders under ComfyUI's own CLIP against ComfyUI's.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.encoders.api import ParallelEncoder
from rocm_parallel.backend.encoders.files import check_clip_type, inspect_encoder
from rocm_parallel.backend.encoders.kind import get_encoder_kind
from rocm_parallel.backend.encoders.load import load_encoder
from rocm_parallel.backend.encoders.messages import EncoderLoadRequest
from rocm_parallel.backend.parallel.splits import vocab_range
from rocm_parallel.backend.plan.encoder import encoder_bytes, place_encoder
from rocm_parallel.backend.resident.group import ResidentGroup
from rocm_parallel.testing.encoder_files import KINDS, PACK_KINDS, VOCAB, reference, write_encoder

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("text_encoders")
    out = {kind: write_encoder(kind, folder) for kind in KINDS}
    out["t5-bf16"] = write_encoder("t5", folder, torch.bfloat16)
    out["t5-fp8"] = write_encoder("t5", folder, torch.float8_e4m3fn)
    return out


def _ids(batch: int = 2, tokens: int = 9, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def one_process(path: Path, ids: torch.Tensor, **options: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pack's encoder in this process (no tensor parallelism)."""
    info = inspect_encoder(path)
    model = load_encoder(EncoderLoadRequest(info.path, info, ParallelLayout()), torch.device("cpu"))
    with torch.inference_mode():
        x = model.embed(ids.clamp(min=0))
        mask = options.pop("attention_mask", None)
        return model(x, mask, options.get("intermediate_output"), options.get("final", True), None)


@pytest.mark.parametrize("kind", KINDS)
def test_the_encoder_computes_what_transformers_does(files: dict[str, Path], kind: str) -> None:
    ids = _ids()
    out, _ = one_process(files[kind], ids)
    expected = reference(kind, files[kind], ids)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert (out - expected).abs().max() < TOLERANCE
    assert inspect_encoder(files[kind]).kind == PACK_KINDS[kind]


def test_t5_with_a_padding_mask_computes_what_transformers_does(files: dict[str, Path]) -> None:
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    out, _ = one_process(files["t5"], ids, attention_mask=mask)
    expected = reference("t5", files["t5"], ids, mask)
    assert (out - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_equals_one_process(
    request: pytest.FixtureRequest, files: dict[str, Path], kind: str, world: int
) -> None:
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt (ComfyUI's Mistral pads left), its keys masked
    options = {
        "intermediate_output": [0, 2] if kind != "t5" else 1,
        "final_layer_norm_intermediate": kind == "t5",
    }
    expected, expected_mid = one_process(
        files[kind],
        ids,
        attention_mask=mask,
        intermediate_output=options["intermediate_output"],
        final=options["final_layer_norm_intermediate"],
    )
    for embedding in ("vocab", "replicated"):
        encoder = ParallelEncoder(group, files[kind], embedding=embedding, slot=f"te {kind}")
        got = encoder.encode(ids, attention_mask=mask, **options)
        assert (got.out - expected).abs().max() < 1e-5, embedding
        assert got.intermediate is not None and expected_mid is not None
        assert (got.intermediate - expected_mid).abs().max() < 1e-5, embedding
    group.unload(f"te {kind}")


UNEVEN_VOCAB = 1001  # divided by neither 2 nor 4: 501 + 500 rows, 251 + 251 + 251 + 248


def test_vocabulary_blocks_cover_every_row_once_at_any_size() -> None:
    """Each rank's rows [start, stop) tile the table in rank order, whatever the size and degree (8 GPUs
    and fewer), the last rank's block the short one."""
    for degree in range(1, 9):
        for size in [*range(degree, 80), 1001, 32128, 131072, 151936]:
            ranges = [vocab_range(size, rank, degree) for rank in range(degree)]
            assert ranges[0][0] == 0 and ranges[-1][1] == size, (size, degree)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), (size, degree, ranges)
            block = -(-size // degree)
            assert all(stop - start == block for start, stop in ranges[:-1] if stop < size), (size, degree)


@pytest.mark.parametrize("world", [2, 4])
def test_a_vocabulary_the_degree_does_not_divide_reads_every_boundary_id(
    request: pytest.FixtureRequest, tmp_path: Path, world: int
) -> None:
    """Token embeddings split by vocabulary over 2 and 4 ranks when the table's 1001 rows divide by neither:
    the ids at every rank's first and last row (and 0 and 1000) read the one-process encoder's rows, within
    1e-5. Every other test's table (1000 rows) divides evenly, where a wrong block size still looks right.

    Mutations tried: `vocab_range` with blocks of size // degree (the last id held by no rank: its row came
    back zero), and the lookup's `local >= rows` as `local > rows` (a rank's first id past its block looked
    up on the rank before: an index error on the workers); each failed this test at both degrees."""
    path = write_encoder("t5", tmp_path, vocab=UNEVEN_VOCAB)
    edges = {0, UNEVEN_VOCAB - 1}
    for rank in range(world):
        start, stop = vocab_range(UNEVEN_VOCAB, rank, world)
        edges |= {start, start + 1, stop - 1}
    ids = torch.tensor([sorted(edges)])
    expected, _ = one_process(path, ids)
    group = ResidentGroup(group=request.getfixturevalue(f"group{world}"))
    encoder = ParallelEncoder(group, path, embedding="vocab", slot="te uneven vocab")
    try:
        got = encoder.encode(ids)
    finally:
        group.unload("te uneven vocab")
    assert (got.out - expected).abs().max() < 1e-5
    assert (expected - reference("t5", path, ids)).abs().max() < TOLERANCE


def test_embeddings_made_outside_take_their_positions(
    request: pytest.FixtureRequest, files: dict[str, Path]
) -> None:
    """ComfyUI's own embeddings (a textual inversion, an image's tokens) replace the rows marked -1."""
    group = ResidentGroup(group=request.getfixturevalue("group2"))
    ids = _ids(1, 7)
    info = inspect_encoder(files["qwen25"])
    model = load_encoder(EncoderLoadRequest(info.path, info, ParallelLayout()), torch.device("cpu"))
    rows = torch.randn(2, 48, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        x = model.embed(ids)
        x[0, 3:5] = rows
        expected, _ = model(x)
    marked = ids.clone()
    marked[0, 3:5] = -1
    encoder = ParallelEncoder(group, files["qwen25"], slot="te external")
    got = encoder.encode(marked, external_at=torch.tensor([3, 4]), external=rows)
    assert (got.out - expected).abs().max() < 1e-5
    group.unload("te external")


@pytest.mark.parametrize("variant", ["t5-bf16", "t5-fp8"])
def test_low_precision_files_stay_in_their_dtype(
    request: pytest.FixtureRequest, files: dict[str, Path], variant: str
) -> None:
    """bf16 and fp8 weights stay 2 and 1 bytes on every rank (the planner's count is what the ranks report)
    and compute in float32 like ComfyUI: the same numbers as transformers on the upcast weights."""
    group = ResidentGroup(group=request.getfixturevalue("group2"))
    encoder = ParallelEncoder(group, files[variant], slot="te low")
    ids = _ids()
    got = encoder.encode(ids)
    assert (got.out - reference("t5", files[variant], ids)).abs().max() < TOLERANCE
    held = next(m for m in group.status()[0].models if m.slot == "te low")
    assert held.parameter_bytes == encoder.request.weight_bytes
    linear = "float8_e4m3fn" if variant == "t5-fp8" else "bfloat16"
    assert held.parameter_bytes_by_dtype[linear] > held.parameter_bytes_by_dtype.get("float32", 0)
    group.unload("te low")


# --------------------------------------------------------------------------------------------------
# Refusals: before any rank runs


def test_a_diffusion_model_is_refused_naming_what_it_is(tmp_path: Path, checkpoints: dict[str, str]) -> None:
    with pytest.raises(
        ConfigError, match=r"is a FLUX.1 .*diffusion model \(load it with the ROCm Parallel Loader"
    ):
        inspect_encoder(checkpoints["dev"])


def test_an_encoder_for_another_family_is_refused(files: dict[str, Path]) -> None:
    info = inspect_encoder(files["qwen25"])
    with pytest.raises(
        ConfigError, match=r"is Qwen2.5-VL 7B, the text encoder of Qwen-Image .*type 'flux2' takes"
    ):
        check_clip_type(info, "flux2")
    check_clip_type(info, "qwen_image")


@pytest.mark.parametrize(
    ("kinds", "clip_type", "message"),
    [
        # T5-XXL takes CLIP-L beside it, but the problem is the type, not a missing second file
        (("t5",), "qwen_image", r"'tiny-t5-float32\.safetensors' is T5-XXL, the text encoder of FLUX\.1 .*; type 'qwen_image' takes Qwen2\.5-VL 7B"),
        # Qwen2.5-VL takes no second file, but the problem is the type, not the CLIP-L beside it
        (("qwen25", "clip_l"), "flux", r"is Qwen2\.5-VL 7B, the text encoder of Qwen-Image .*; type 'flux' takes T5-XXL"),
    ],
)  # fmt: skip
def test_a_file_of_another_kind_for_the_type_is_named_as_that_not_as_a_second_file_problem(
    files: dict[str, Path], tmp_path: Path, kinds: tuple[str, ...], clip_type: str, message: str
) -> None:
    """docs/nodes.md's promise for the Text Encoder Loader, through the node's own file check
    (nodes/comfy_clip.py `_split_files`, which runs before anything of ComfyUI is built)."""
    from safetensors.torch import save_file

    from rocm_parallel.nodes.comfy_clip import _split_files

    clip_l = tmp_path / "clip_l.safetensors"  # CLIP-L as ComfyUI's DualCLIPLoader reads it (its keys)
    save_file({"text_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(4, 2)}, str(clip_l))
    paths = [str(clip_l if kind == "clip_l" else files[kind]) for kind in kinds]
    with pytest.raises(ConfigError, match=message):
        _split_files(paths, clip_type)


def test_a_tokenizer_and_file_that_do_not_belong_together_are_refused(
    request: pytest.FixtureRequest, files: dict[str, Path]
) -> None:
    group = ResidentGroup(group=request.getfixturevalue("group2"))
    encoder = ParallelEncoder(group, files["t5"])
    with pytest.raises(ConfigError, match=rf"token id {VOCAB + 5} is outside T5-XXL's vocabulary of {VOCAB}"):
        encoder.check(torch.tensor([[1, 2, VOCAB + 5]]))


def test_a_prompt_too_long_for_the_encoder_is_refused(
    request: pytest.FixtureRequest, files: dict[str, Path]
) -> None:
    group = ResidentGroup(group=request.getfixturevalue("group2"))
    encoder = ParallelEncoder(group, files["mistral3"])
    with pytest.raises(
        ConfigError, match=r"the prompt is 8193 tokens long; Mistral Small 3 24B takes at most 8192"
    ):
        encoder.check(torch.zeros(1, 8193, dtype=torch.long))


@pytest.mark.parametrize("kind", ["t5", "qwen25"])
def test_a_prompt_no_device_can_hold_is_refused_before_any_rank_runs(
    request: pytest.FixtureRequest, files: dict[str, Path], kind: str
) -> None:
    """A 100,000-token prompt once reached the ranks and one failed allocating 40 GB (a language model's
    causal mask alone is 100,000^2 x 4 bytes): refused in the caller, naming the longest prompt that fits
    these workers, with no rank asked; a prompt of that length is encoded."""
    group = ResidentGroup(group=request.getfixturevalue("group2"))
    encoder = ParallelEncoder(group, files[kind], slot="te long")
    encoder.encode(_ids(1, 5))  # resident: the ranks have reported their memory
    calls: list[str] = []
    real = group.call_resident
    group.call_resident = lambda *a, **k: calls.append(a[1]) or real(*a, **k)  # type: ignore[method-assign]
    try:
        with pytest.raises(ConfigError) as refused:
            encoder.encode(torch.zeros(1, 100_000, dtype=torch.long))
        assert calls == []
        message = str(refused.value)
        assert re.match(
            rf"encoding a prompt of 100000 tokens \(batch 1\) with {re.escape(encoder.kind.title)} needs about "
            r"\d+\.\d GB per CPU worker, but .* GB of host memory are available .*: the limit is \d+\.\d GB per "
            r"CPU worker\. What fits: prompts of at most \d+ tokens \(batch 1\); shorten the prompt; or more devices$",
            message,
        ), message
        fits = int(re.search(r"at most (\d+) tokens", message).group(1))
        assert 1000 < fits < 100_000
        assert encoder.activation_bytes(1, 100_000) >= 4 * 100_000**2  # the 40 GB mask at least
    finally:
        del group.call_resident
    group.unload("te long")


def test_a_split_that_does_not_divide_the_heads_is_refused(files: dict[str, Path]) -> None:
    info = inspect_encoder(files["mistral3"])
    with pytest.raises(ConfigError, match=r"3 does not divide its 8 attention heads; .* must be 2 or 4"):
        info.encoder.validate_tp(3, info.config)


# --------------------------------------------------------------------------------------------------
# The planner: bytes per rank of the released encoders (meta device), and where an encoder lives


def test_the_planner_counts_t5_xxl_and_mistral3_bytes_per_rank() -> None:
    """encoder_bytes against the parameter counts written out by hand: linear weights and token tables split
    over the ranks in the held dtype, norms whole in float32 (T5's relative position table, an embedding,
    whole in the held dtype)."""
    t5 = get_encoder_kind("t5xxl")
    d, ff, vocab, layers = 4096, 10240, 32128, 24
    split = vocab * d + layers * (4 * d * d + 3 * d * ff)
    for degree in (1, 2, 4):
        for held, size in (("bfloat16", 2), ("float8_e4m3fn", 1)):
            expected = split // degree * size + 32 * 64 * size + (2 * layers + 1) * d * 4
            assert encoder_bytes(t5, t5.presets["t5-xxl"], degree, "vocab", held) == expected
    # replicated embeddings: every rank holds the whole table
    assert (
        encoder_bytes(t5, t5.presets["t5-xxl"], 2, "replicated")
        - encoder_bytes(t5, t5.presets["t5-xxl"], 2, "vocab")
        == vocab * d // 2 * 2
    )
    mistral = get_encoder_kind("mistral3_24b")
    d, q, kv, mlp, vocab, layers = 5120, 32 * 128, 8 * 128, 32768, 131072, 40
    split = vocab * d + layers * (2 * d * q + 2 * d * kv + 3 * d * mlp)
    norms = (2 * layers + 1) * d * 4
    assert encoder_bytes(mistral, mistral.presets["mistral3-24b"], 1) == split * 2 + norms  # 45.8 GB: no card
    assert (
        encoder_bytes(mistral, mistral.presets["mistral3-24b"], 4, held="float8_e4m3fn") == split // 4 + norms
    )


def test_the_planner_places_the_encoder_by_what_fits_gpu_0() -> None:
    gb = 10**9  # usable on GPU 0: 24 GB x 0.9 - 1.5 GB for ComfyUI = 20.1 GB
    resident = place_encoder(encoder=6 * gb, model=6 * gb, activations=2 * gb, device=24 * gb)
    assert resident.choice == "resident"
    # fits beside the model's weights but not with the sampling activations too: parked in host memory
    host = place_encoder(encoder=8 * gb, model=8 * gb, activations=5 * gb, device=24 * gb)
    assert host.choice == "host"
    left = place_encoder(encoder=14 * gb, model=8 * gb, activations=2 * gb, device=24 * gb)
    assert left.choice == "comfyui"
    assert "per GPU: encoder 14.00 GB, model 8.00 GB" in left.explanation()
