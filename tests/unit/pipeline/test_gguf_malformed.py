"""Malformed GGUF sources fail once, as a permanent ModelLoadError naming the file (issue 46.12)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pipeline.errors import PipelineError
from pipeline.models.loading import ModelLoadError, gguf_architecture


def tiny_gguf_bytes(tmp_path) -> bytes:
    from gguf import GGUFWriter

    path = tmp_path / "valid.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


# Header layout: magic (4), version (u32), tensor count (u64), KV count (u64), then the first KV:
# key length (u64, at 24), key "general.architecture" (20 bytes), value type (u32, at 52), string length (u64, at 56).
MALFORMED = {
    "truncated_header": lambda data: data[:10],
    "truncated_body": lambda data: data[: len(data) // 2],
    "absurd_tensor_count": lambda data: patched(data, 8, "<Q", 2**62),
    "absurd_kv_count": lambda data: patched(data, 16, "<Q", 2**62),
    "huge_key_length": lambda data: patched(data, 24, "<Q", 2**60),
    "huge_value_length": lambda data: patched(data, 56, "<Q", 2**60),
    "unknown_value_type": lambda data: patched(data, 52, "<I", 77),
}


def test_the_unpatched_file_reads(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(tiny_gguf_bytes(tmp_path))
    assert gguf_architecture(path) == "LlamaForCausalLM"


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_gguf_is_a_permanent_error_naming_the_file(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(MALFORMED[name](tiny_gguf_bytes(tmp_path)))
    with pytest.raises(ModelLoadError, match=f"{name}.gguf is not a readable GGUF file") as caught:
        gguf_architecture(path)
    # PipelineError is what workers/runner.py treats as permanent (never retried).
    assert isinstance(caught.value, PipelineError)
