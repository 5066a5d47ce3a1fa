"""A tensor file is read back whole however many reads it takes: one read() moves at most ~2 GiB, and a
4 GiB latent used to arrive half-read ('holds 2147479552 bytes; expected 4294967296')."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rocm_parallel.backend.runtime import transport


def test_a_tensor_file_is_read_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "READ_CHUNK", 1000)  # stands in for the kernel's ~2 GiB per read
    tensor = torch.randn(300, 700)  # 840000 bytes: 840 reads
    path = tmp_path / "t.bin"
    path.write_bytes(tensor.numpy().tobytes())
    ref = {transport._REF: str(path), "dtype": "float32", "shape": [300, 700]}
    assert torch.equal(transport._read_tensor(ref), tensor)
    path.write_bytes(tensor.numpy().tobytes()[:-4])
    with pytest.raises(OSError, match=r"holds 839996 bytes; expected 840000$"):
        transport._read_tensor(ref)
