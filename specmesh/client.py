"""A small client of the public specmesh.v1.Gateway API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from specmesh.v1 import gateway_pb2, gateway_pb2_grpc


def build_request(prompt: str = "", *, prompt_token_ids: list[int] | None = None,
                  max_new_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop: list[str] | None = None,
                  num_draft_tokens: int = 0, disable_speculation: bool = False,
                  drafter: str = "",
                  session_id: str = "", keep_session: bool = False,
                  resume_from: int = 0) -> gateway_pb2.GenerateRequest:
    sampling = gateway_pb2.SamplingParams(stop=stop or [])
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    return gateway_pb2.GenerateRequest(
        prompt=prompt, prompt_token_ids=prompt_token_ids or [], sampling=sampling,
        speculation=gateway_pb2.SpeculationParams(num_draft_tokens=num_draft_tokens,
                                                  disable=disable_speculation, drafter=drafter),
        session_id=session_id, keep_session=keep_session, resume_from=resume_from)


class GatewayClient:
    """``tls_ca``: verify the gateway's certificate with this CA (PEM file); ``tls``: TLS with
    the system's roots; ``api_key``: sent as ``authorization: Bearer <key>`` on every call."""

    def __init__(self, address: str, *, tls_ca: str = "", tls: bool = False,
                 api_key: str = "") -> None:
        if tls_ca or tls:
            roots = Path(tls_ca).read_bytes() if tls_ca else None
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots))
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()

    def generate(self, request: gateway_pb2.GenerateRequest,
                 timeout: float | None = None) -> gateway_pb2.GenerateResponse:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def stream(self, request: gateway_pb2.GenerateRequest,
               timeout: float | None = None) -> Iterator[gateway_pb2.GenerateChunk]:
        return self.stub.GenerateStream(request, timeout=timeout, metadata=self.metadata)

    def close_session(self, session_id: str) -> int:
        reply = self.stub.CloseSession(gateway_pb2.CloseSessionRequest(session_id=session_id),
                                       metadata=self.metadata)
        return reply.committed_tokens


def finish_name(value: int) -> str:
    return gateway_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
