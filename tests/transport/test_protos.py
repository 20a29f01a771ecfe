"""The committed generated modules match the .proto files, and hand-made chunk frames are valid protobuf."""

import ast
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from grpc_tools import protoc

from elasticdl_strategy.transport import frames
from elasticdl_strategy.transport.protos import coordinator_pb2, peer_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "elasticdl_strategy" / "transport" / "protos"


def _generate(tmp_path, name):
    # In a subprocess: protoc inside a process that has imported TensorFlow crashes
    # (both bring their own copy of libprotobuf).
    proto = f"elasticdl_strategy/transport/protos/{name}.proto"
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"-I{include}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", proto],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, f"protoc failed on {proto}: {result.stderr}"
    return tmp_path / "elasticdl_strategy" / "transport" / "protos"


def _descriptor_bytes(path):
    # Read the serialized FileDescriptorProto without importing into the default pool twice.
    text = path.read_text()
    start = text.index("AddSerializedFile(") + len("AddSerializedFile(")
    return ast.literal_eval(text[start : text.index(")\n", start)])  # a bytes literal written by protoc


@pytest.mark.parametrize("name, module", [("peer", peer_pb2), ("coordinator", coordinator_pb2)])
def test_committed_stubs_match_proto(tmp_path, name, module):
    out = _generate(tmp_path, name)
    fresh = _descriptor_bytes(out / f"{name}_pb2.py")
    assert fresh == module.DESCRIPTOR.serialized_pb, (
        f"{name}_pb2.py is stale: regenerate it (see elasticdl_strategy/transport/protos/__init__.py)"
    )
    committed_grpc = (PROTO_DIR / f"{name}_pb2_grpc.py").read_text()
    fresh_grpc = (out / f"{name}_pb2_grpc.py").read_text()
    strip = lambda t: "\n".join(line for line in t.splitlines() if not line.startswith("GRPC_GENERATED_VERSION"))  # noqa: E731
    assert strip(fresh_grpc) == strip(committed_grpc), f"{name}_pb2_grpc.py is stale: regenerate it"
    stub = f"{name}_pb2.pyi"  # what the type check reads
    assert (out / stub).read_text() == (PROTO_DIR / stub).read_text(), f"{stub} is stale: regenerate it"


def test_chunk_frame_is_a_valid_frame_and_parses_without_copy():
    data = np.arange(1000, dtype=np.float32)
    frame = frames.encode_chunk(memoryview(data.view(np.uint8)))
    parsed = peer_pb2.Frame.FromString(frame)
    assert parsed.WhichOneof("kind") == "chunk"
    assert parsed.chunk == data.tobytes()
    view = frames.chunk_payload(frame)
    assert view.obj is frame  # a view into the received bytes, no copy
    np.testing.assert_array_equal(np.frombuffer(view, np.float32), data)


def test_control_frames_round_trip():
    header = peer_pb2.MessageHeader(channel=1, tag=3, sequence=9, nbytes=12, dtype="float32", shape=[3])
    assert frames.decode_control(frames.encode_header(header)).header == header
    assert frames.decode_control(frames.encode_goodbye(peer_pb2.Goodbye(reason="bye"))).WhichOneof("kind") == "goodbye"
    with pytest.raises(ValueError):
        frames.chunk_payload(frames.encode_header(header))


@pytest.mark.parametrize("inline", [0, 1, 100, 127, 128, 200, 300, 16383, 16384, 70000])
def test_a_header_frame_is_the_bytes_protobuf_gives_the_frame_whatever_the_headers_length(inline):
    for extra in range(0, 4):  # the header's length crosses each varint width at one of these
        header = peer_pb2.MessageHeader(channel=2, nbytes=inline, inline_data=b"x" * max(0, inline - extra))
        assert frames.encode_header(header) == peer_pb2.Frame(header=header).SerializeToString()


def test_a_whole_message_frame_splits_into_its_aligned_payload_and_header():
    payload = np.arange(1000, dtype=np.float64)
    header = peer_pb2.MessageHeader(channel=1, tag=3, sequence=9, nbytes=payload.nbytes, dtype="float64", shape=[1000])
    frame = frames.encode_whole_message(memoryview(payload).cast("B"), header)
    view, parsed = frames.split_whole_message(frame)
    np.testing.assert_array_equal(np.frombuffer(view, np.float64), payload)
    assert parsed == header and view.obj is frame  # a view into the received frame, not a copy
    assert frames.CHUNK_PREFIX_SIZE % 8 == 0
    assert frames.split_whole_message(frames.encode_chunk(b"abc")) is None  # a plain chunk
    with pytest.raises(ValueError):
        frames.split_whole_message(frame[: frames.CHUNK_PREFIX_SIZE + 10])
    with pytest.raises(ValueError):
        frames.split_whole_message(frames.encode_header(header))
