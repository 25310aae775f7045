"""The gateway's OpenAI-compatible HTTP API (docs/api.md): /v1/completions,
/v1/chat/completions and /v1/models on the gateway's own engine and event loop."""
