"""Service configuration: built once (by the CLI), validated, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

# How replicas run a model: the lean forward with 16-bit copies of exactly 16-bit CPU weights
# and the others prepacked where supported, with every weight prepacked, with PyTorch's
# matmuls, or transformers' own forward (services/lean_llama.py, services/linear_layers.py).
FORWARD_MODES = ("auto", "packed", "lean", "hf")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def parse_addresses(value: str | None) -> tuple[str, ...]:
    """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'); checks each names a host and a port."""
    if not value:
        return ()
    out = []
    for part in value.split(","):
        addr = part.strip()
        if not addr:
            continue
        host, sep, port = addr.rpartition(":")
        _require(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
                 f"address {addr!r} must look like HOST:PORT")
        out.append(addr)
    return tuple(out)


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for logs and error messages)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class TlsConfig:
    """PEM files. A server with ``cert``/``key`` serves TLS; with ``ca`` too, a drafter or
    verifier requires client certificates signed by it (mTLS), and a gateway dials its
    drafters and verifiers over TLS, trusting ``ca`` and presenting ``cert``/``key``."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.cert) == bool(self.key),
                 "--tls-cert and --tls-key go together: give both or neither")
        _require(not self.ca or bool(self.cert),
                 "--tls-ca needs --tls-cert and --tls-key (mTLS: every tier proves who it is)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca)):
            if path:
                try:
                    with open(path, "rb") as f:
                        head = f.read(4096)
                except OSError as exc:
                    raise ValueError(f"{flag} {path!r} cannot be read: {exc.strerror}") from exc
                _require(b"-----BEGIN " in head, f"{flag} {path!r} is not a PEM file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def mutual(self) -> bool:
        return bool(self.ca)


@dataclass(frozen=True)
class ServerConfig:
    """What every gRPC server of the mesh shares."""

    port: int
    host: str = "0.0.0.0"
    max_message_mb: int = 16
    grace_s: float = 5.0
    tls: TlsConfig = TlsConfig()
    health_port: int = 0  # plaintext grpc.health.v1 only (probes cannot speak TLS); 0 = off
    parent_pid: int = 0  # stop once this process is no longer the parent (services/server.py)

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}")
        _require(0 <= self.health_port < 65536,
                 f"health port must be in 0..65535, got {self.health_port}")
        _require(not self.health_port or self.health_port != self.port,
                 "the health port must differ from the service port")
        _require(self.parent_pid >= 0, f"parent pid must be >= 0, got {self.parent_pid}")
        _require(self.max_message_mb >= 1, "max message size must be at least 1 MB")
        _require(self.grace_s >= 0, "grace period must be >= 0 seconds")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def grpc_options(self) -> list[tuple[str, int]]:
        size = self.max_message_mb * 1024 * 1024
        # so_reuseport off: a second server on a taken port must fail, not share its traffic.
        return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0)]


@dataclass(frozen=True)
class ModelServiceConfig:
    """A drafter or a verifier: one model, per-session KV caches."""

    server: ServerConfig
    model: str
    device: str = "auto"
    dtype: str = "float32"
    max_sessions: int = 256
    max_draft_tokens: int = 16
    threads: int = 0
    max_queue: int = 64
    max_batch: int = 32  # calls of different sessions run in one forward pass
    kind: str = "model"  # drafters: "model" or "ngram" (prompt lookup, no weights loaded)
    kv_budget_mb: int = 0  # KV cache memory budget; 0 = bounded by max_sessions only
    redis_url: str = ""  # register in this Redis (gateways with --discovery redis find it)
    advertise: str = ""  # address gateways should dial; "" = host:port (hostname for 0.0.0.0)
    forward: str = "auto"  # "auto": the lean forward (on a CPU, 16-bit copies of exactly
    #   16-bit weights, the others prepacked) where supported; "packed": all prepacked;
    #   "lean": neither; "hf": transformers'
    prefix_cache_mb: int = 256  # KV blocks of committed prefixes shared across sessions; 0 = off
    prefix_block: int = 16  # tokens per prefix-cache block
    prefill_chunk: int = 256  # a longer prompt is fed this many tokens per pass; 0 = at once
    prefill_threads: int = 0  # torch threads for a pass that feeds a prompt; 0 = threads
    plain_threads: int = 0  # a verifier's passes without drafts: tried on this many; 0 = off
    stall_s: float = 120.0  # a pass running longer: health NOT_SERVING until it ends; 0 = off
    local_drafter: str = ""  # a verifier's own draft model for its plain rounds; "" = none
    local_draft_tokens: int = 3  # ... tokens it drafts a pass
    local_draft_sessions: int = 1  # ... only in steps of at most this many sessions

    def __post_init__(self) -> None:
        _require(bool(self.model), "a model (hub name or local path) is required")
        _require(self.stall_s >= 0, f"stall time must be >= 0 s (0 = off), got {self.stall_s}")
        _require(self.forward in FORWARD_MODES,
                 f"forward must be one of {', '.join(FORWARD_MODES)}, got {self.forward!r}")
        _require(self.device in ("auto", "cpu") or self.device.startswith("cuda"),
                 f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        _require(self.dtype in ("float32", "float16", "bfloat16"),
                 f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        _require(self.max_sessions >= 1, "max sessions must be >= 1")
        _require(1 <= self.max_draft_tokens <= 64, "max draft tokens must be in 1..64")
        _require(1 <= self.max_batch <= 256, f"max batch must be in 1..256, got {self.max_batch}")
        _require(self.prefix_cache_mb >= 0,
                 f"prefix cache size must be >= 0 MB, got {self.prefix_cache_mb}")
        _require(self.prefill_chunk >= 0,
                 f"prefill chunk must be >= 0 tokens (0 = off), got {self.prefill_chunk}")
        _require(self.prefill_threads >= 0,
                 f"prefill threads must be >= 0 (0 = --threads), got {self.prefill_threads}")
        _require(self.plain_threads >= 0,
                 f"plain threads must be >= 0 (0 = --threads), got {self.plain_threads}")
        _require(1 <= self.prefix_block <= 1024,
                 f"prefix block size must be in 1..1024 tokens, got {self.prefix_block}")
        _require(1 <= self.local_draft_tokens <= self.max_draft_tokens,
                 f"local draft tokens must be in 1..{self.max_draft_tokens} (--max-draft-tokens),"
                 f" got {self.local_draft_tokens}")
        _require(self.local_draft_sessions >= 1,
                 f"local draft sessions must be >= 1, got {self.local_draft_sessions}")


@dataclass(frozen=True)
class ApiKey:
    """One client credential of the gateway: only the SHA-256 of the key is stored."""

    name: str
    sha256: str
    rate_per_s: float = 0.0  # requests per second, refilled continuously; 0 = unlimited
    burst: int = 0  # bucket size; 0 = ceil(rate_per_s)

    def __post_init__(self) -> None:
        _require(bool(self.name) and len(self.name) <= 64 and self.name.isprintable(),
                 f"API key name must be 1..64 printable characters, got {self.name!r}")
        _require(len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256),
                 f"API key {self.name!r}: sha256 must be 64 lowercase hex digits")
        _require(self.rate_per_s >= 0, f"API key {self.name!r}: rate_per_s must be >= 0")
        _require(self.burst >= 0, f"API key {self.name!r}: burst must be >= 0")


def load_api_keys(path: str) -> tuple[ApiKey, ...]:
    """Reads ``{"keys": [{"name", "sha256", "rate_per_s"?, "burst"?}, ...]}`` (JSON)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--api-keys {path!r} cannot be read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--api-keys {path!r} is not valid JSON: {exc}") from exc
    entries = data.get("keys") if isinstance(data, dict) else None
    _require(isinstance(entries, list) and len(entries) > 0,
             f"--api-keys {path!r} must hold {{\"keys\": [...]}} with at least one key")
    keys = []
    for i, entry in enumerate(entries):
        _require(isinstance(entry, dict), f"--api-keys {path!r}: keys[{i}] must be an object")
        unknown = set(entry) - {"name", "sha256", "rate_per_s", "burst"}
        _require(not unknown, f"--api-keys {path!r}: keys[{i}] has unknown fields {sorted(unknown)}")
        try:
            keys.append(ApiKey(name=str(entry.get("name", "")), sha256=str(entry.get("sha256", "")),
                               rate_per_s=float(entry.get("rate_per_s", 0)),
                               burst=int(entry.get("burst", 0))))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--api-keys {path!r}: keys[{i}]: {exc}") from exc
    names = [k.name for k in keys]
    _require(len(set(names)) == len(names), f"--api-keys {path!r}: key names must be unique")
    _require(len({k.sha256 for k in keys}) == len(keys), f"--api-keys {path!r}: duplicate key")
    return tuple(keys)


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    redis_url: str
    model: str = ""  # tokenizer source; "" = the model the verifiers report
    drafters: tuple[str, ...] = ()
    verifiers: tuple[str, ...] = ()
    num_draft_tokens: int = 3  # 0 = adaptive, up to max_adaptive_k
    spec_fallback: bool = True  # the gateway's fixed k drops to 0 while drafts do not pay
    max_adaptive_k: int = 8
    max_support: int = 32
    default_max_new_tokens: int = 128
    max_new_tokens_cap: int = 4096
    max_stop_strings: int = 16
    session_ttl_s: int = 3600
    lease_s: float = 5.0
    store_outage_s: float = 30.0  # a kept session's final commit waits this long for Redis
    rpc_timeout_s: float = 30.0
    max_inflight: int = 64
    replica_retry_s: float = 2.0
    default_drafter_kind: str = "model"
    pipeline: bool = True  # speculation cache: draft round r+1 while round r is being verified
    lead_round: bool = True  # a new session's first round: verifier alone, drafter beside it
    spec_fanout: int = 16  # most branches of the speculation cache per round
    spec_max_requests: int = 1  # trees only while the gateway runs at most this many requests
    tree_switch: bool = True  # measure whether lone requests' trees pay (off: always draft them)
    step_batching: bool = True  # Draft/Verify calls made meanwhile go as one RPC per step
    plain_tokens: int = 8  # a round without drafts asks the verifier for up to this many tokens
    decode_ahead: bool = True  # the verifier starts a plain round's next one once it answers
    prefix_affinity: int = 4  # a new session goes to the replica caching most of its prompt
    #                           while it runs at most this many more requests than the least
    #                           busy one (-1: routing by load alone)
    discovery: str = "static"  # or "kubernetes": follow the EndpointSlices of two Services
    namespace: str = "default"
    drafter_service: str = ""
    verifier_service: str = ""
    drafter_port: int = 50061
    verifier_port: int = 50071
    api_keys: tuple[ApiKey, ...] = ()  # empty: no authentication (say so in the logs)
    http_port: int = 0  # the OpenAI-compatible HTTP API (docs/api.md); 0 = off

    def __post_init__(self) -> None:
        _require(self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                 f"redis URL must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        _require(self.discovery in ("static", "kubernetes", "redis"),
                 f"discovery must be static, kubernetes or redis, got {self.discovery!r}")
        if self.discovery == "static":
            _require(len(self.verifiers) >= 1, "at least one verifier address is required "
                                               "(--verifiers HOST:PORT,...)")
        elif self.discovery == "kubernetes":
            _require(bool(self.verifier_service), "kubernetes discovery needs --verifier-service")
        _require(0 <= self.num_draft_tokens <= 64, "num draft tokens must be in 0..64")
        _require(1 <= self.max_adaptive_k <= 64, "max adaptive k must be in 1..64")
        _require(1 <= self.max_support <= 256, "max support must be in 1..256")
        _require(1 <= self.spec_fanout <= 64, "speculation fan-out must be in 1..64")
        _require(self.spec_max_requests >= 1, "speculation max requests must be >= 1")
        _require(1 <= self.plain_tokens <= 64, "plain tokens must be in 1..64")
        _require(self.prefix_affinity >= -1, "prefix affinity must be >= -1 (-1 = off)")
        _require(1 <= self.default_max_new_tokens <= self.max_new_tokens_cap,
                 "default max new tokens must be in 1..max_new_tokens_cap")
        _require(self.session_ttl_s >= 1, "session TTL must be >= 1 s")
        _require(self.lease_s > 0, "session lease must be > 0 s")
        _require(self.store_outage_s > 0, "store outage wait must be > 0 s")
        _require(self.rpc_timeout_s > 0, "RPC timeout must be > 0 s")
        _require(self.max_inflight >= 1, "max in-flight requests must be >= 1")
        _require(self.default_drafter_kind in ("model", "ngram"),
                 "default drafter kind must be model or ngram")
        _require(0 <= self.http_port < 65536,
                 f"HTTP port must be in 0..65535 (0 = off), got {self.http_port}")
        _require(not self.http_port or self.http_port not in (self.server.port,
                                                              self.server.health_port),
                 f"the HTTP port {self.http_port} must differ from the gRPC and health ports")
