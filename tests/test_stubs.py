"""The committed gRPC stubs are exactly what the .proto files generate, and the
public API has the shape and field names the design promises."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

import specmesh.v1
from specmesh import protogen
from specmesh.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2

COMMITTED = Path(specmesh.v1.__file__).resolve().parent


def _committed_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in COMMITTED.iterdir()
            if p.is_file() and p.suffix in (".py", ".pyi")}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("stubs")
    written = protogen.generate(out)
    gen_dir = out / "specmesh" / "v1"
    assert written, "protogen wrote nothing"
    assert all(p.parent == gen_dir for p in written)
    return {p.name: p.read_bytes() for p in gen_dir.iterdir() if p.is_file()}


def test_generation_covers_every_proto(generated):
    protos = {p.stem for p in protogen.proto_files()}
    assert protos == {"common", "drafter", "gateway", "verifier"}
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert stem + suffix in generated, stem + suffix


def test_committed_stub_set_equals_generated_set(generated):
    committed = _committed_files()
    missing = sorted(set(generated) - set(committed))
    extra = sorted(set(committed) - set(generated))
    assert not missing, f"generated stubs not committed: {missing} (run `make proto`)"
    assert not extra, f"committed files protoc does not produce: {extra}"


def test_committed_stubs_byte_equal_generated(generated):
    committed = _committed_files()
    stale = sorted(name for name, data in generated.items() if committed.get(name) != data)
    assert not stale, f"committed stubs differ from the .proto files: {stale} (run `make proto`)"


def _service(module, name):
    return module.DESCRIPTOR.services_by_name[name]


def test_gateway_methods_and_streaming_shape():
    svc = _service(gateway_pb2, "Gateway")
    assert svc.full_name == "specmesh.v1.Gateway"
    shape = {m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming,
                      m.server_streaming) for m in svc.methods}
    assert shape == {
        "Generate": ("specmesh.v1.GenerateRequest", "specmesh.v1.GenerateResponse", False, False),
        "GenerateStream": ("specmesh.v1.GenerateRequest", "specmesh.v1.GenerateChunk", False, True),
        "CloseSession": ("specmesh.v1.CloseSessionRequest", "specmesh.v1.CloseSessionResponse",
                         False, False),
    }


def test_internal_services_methods():
    for module, name, calls, stream in (
            (drafter_pb2, "Drafter", ("Draft", "Speculate", "DraftBatch"), "DraftStream"),
            (verifier_pb2, "Verifier", ("Verify", "VerifyBatch"), "VerifyStream")):
        svc = _service(module, name)
        assert svc.full_name == f"specmesh.v1.{name}"
        methods = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
        assert methods == {**{call: (False, False) for call in calls}, stream: (True, True),
                           "Release": (False, False), "GetModelInfo": (False, False),
                           "GetStats": (False, False)}
        assert svc.methods_by_name["GetModelInfo"].output_type is common_pb2.ModelInfo.DESCRIPTOR
        # a step's batch carries the stream's own requests and answers each with its response
        batch = svc.methods_by_name[calls[-1]]
        assert batch.input_type.fields_by_name["calls"].message_type is \
            svc.methods_by_name[stream].input_type
        assert batch.output_type.fields_by_name["outcomes"].message_type is \
            svc.methods_by_name[stream].output_type


def _fields(message) -> dict[str, FieldDescriptor]:
    return dict(message.DESCRIPTOR.fields_by_name)


def _is_repeated(f: FieldDescriptor) -> bool:
    return f.label == FieldDescriptor.LABEL_REPEATED if hasattr(f, "label") else f.is_repeated


def test_generate_request_fields():
    f = _fields(gateway_pb2.GenerateRequest)
    assert {"prompt", "prompt_token_ids", "sampling", "speculation", "session_id"} <= set(f)
    assert f["prompt"].type == FieldDescriptor.TYPE_STRING
    assert f["prompt_token_ids"].type == FieldDescriptor.TYPE_INT32
    assert _is_repeated(f["prompt_token_ids"])
    assert f["session_id"].type == FieldDescriptor.TYPE_STRING
    assert f["sampling"].message_type is gateway_pb2.SamplingParams.DESCRIPTOR
    assert f["speculation"].message_type is gateway_pb2.SpeculationParams.DESCRIPTOR

    s = _fields(gateway_pb2.SamplingParams)
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed"} <= set(s)
    assert s["temperature"].type == FieldDescriptor.TYPE_FLOAT
    assert s["top_p"].type == FieldDescriptor.TYPE_FLOAT
    assert s["top_k"].type == FieldDescriptor.TYPE_INT32
    assert s["max_new_tokens"].type == FieldDescriptor.TYPE_INT32
    assert s["stop"].type == FieldDescriptor.TYPE_STRING and _is_repeated(s["stop"])
    assert s["seed"].type == FieldDescriptor.TYPE_UINT64
    # Unset must be distinguishable from 0 for the scalars with non-zero defaults.
    for name in ("temperature", "top_p", "top_k", "max_new_tokens", "seed"):
        assert s[name].has_presence, name

    sp = _fields(gateway_pb2.SpeculationParams)
    assert {"num_draft_tokens", "disable"} <= set(sp)
    assert sp["num_draft_tokens"].type == FieldDescriptor.TYPE_INT32
    assert sp["disable"].type == FieldDescriptor.TYPE_BOOL


@pytest.mark.parametrize("message", [gateway_pb2.GenerateResponse, gateway_pb2.GenerateChunk])
def test_generate_response_and_chunk_fields(message):
    f = _fields(message)
    assert {"text", "token_ids", "finish_reason", "session_id", "usage"} <= set(f)
    assert f["text"].type == FieldDescriptor.TYPE_STRING
    assert f["token_ids"].type == FieldDescriptor.TYPE_INT32 and _is_repeated(f["token_ids"])
    assert f["finish_reason"].enum_type is gateway_pb2.FinishReason.DESCRIPTOR
    assert f["session_id"].type == FieldDescriptor.TYPE_STRING
    assert f["usage"].message_type is gateway_pb2.Usage.DESCRIPTOR


def test_usage_fields():
    f = _fields(gateway_pb2.Usage)
    names = {"prompt_tokens", "completion_tokens", "rounds", "draft_tokens",
             "accepted_draft_tokens"}
    assert names <= set(f)
    for name in names:
        assert f[name].type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64,
                                FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64), name


def test_finish_reasons():
    values = {v.name: v.number for v in gateway_pb2.FinishReason.DESCRIPTOR.values}
    assert values["FINISH_REASON_UNSPECIFIED"] == 0
    assert {"FINISH_REASON_LENGTH", "FINISH_REASON_EOS", "FINISH_REASON_STOP",
            "FINISH_REASON_CONTEXT"} <= set(values)
    assert len(set(values.values())) == len(values)


def test_field_numbers_are_unique_per_message():
    for module in (common_pb2, drafter_pb2, gateway_pb2, verifier_pb2):
        for msg in module.DESCRIPTOR.message_types_by_name.values():
            numbers = [f.number for f in msg.fields]
            assert len(numbers) == len(set(numbers)), msg.full_name
