"""The gateway routes, tokenizes and streams; it never runs a model, so it must not need
torch (issue #13: the gateway image is built without it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Every module a gateway process imports to start: the CLI's gateway command imports these.
GATEWAY_MODULES = ("gateway.server", "gateway.http.app", "gateway.http.serve")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_importing_the_gateway_does_not_load_torch():
    """torch is installed in the test environment (so the check can fail); a fresh
    interpreter that imports the gateway's start-up modules still has no torch loaded."""
    out = _run(f"""
        import importlib, importlib.util, sys
        assert importlib.util.find_spec("torch") is not None, "torch should be installed here"
        for name in {GATEWAY_MODULES!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_gateway_serves_its_tokenizer_and_chat_template_without_torch(tiny_pair):
    """With torch made unimportable (as in the gateway image), the gateway modules import,
    and the target's tokenizer loads, tokenizes and renders the default chat template."""
    out = _run(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import gateway.server, gateway.http.app  # noqa: F401
        from gateway.http.chat import render_chat
        from services.model_info import load_tokenizer
        tok = load_tokenizer({tiny_pair[0]!r})
        ids = tok("def f(x):")["input_ids"]
        prompt = render_chat(tok, [{{"role": "user", "content": "hi"}}])
        print(len(ids) > 0, "hi" in prompt)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True True"
