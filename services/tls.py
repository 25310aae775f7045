"""gRPC credentials from a TlsConfig: TLS for clients of the gateway, mTLS between tiers."""

from __future__ import annotations

import grpc

from services.config import TlsConfig


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(tls: TlsConfig, require_client_cert: bool) -> grpc.ServerCredentials:
    """The server's certificate chain; with ``require_client_cert`` only clients presenting a
    certificate signed by ``tls.ca`` complete the handshake."""
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))],
        root_certificates=_read(tls.ca) if tls.ca else None,
        require_client_auth=require_client_cert and tls.mutual)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Trusts ``tls.ca`` (the system roots when empty) and presents ``cert``/``key`` as the
    client certificate when given."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca) if tls.ca else None,
        private_key=_read(tls.key) if tls.key else None,
        certificate_chain=_read(tls.cert) if tls.cert else None)
