"""The rotary cos/sin table (services/rotary.py) against the model's own rotary module.

Real models: the committed demo target and a Llama built here with dynamic RoPE, whose
module recomputes its frequencies from the positions (so it gets no table)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from services import rotary


def _demo():
    return AutoModelForCausalLM.from_pretrained("models/demo-target", dtype=torch.float32).eval()


def test_the_table_gives_the_rotary_modules_cos_and_sin_for_any_positions():
    """Positions in any order, repeated, at the table's start and end, in passes of 1-100
    tokens: the table's rows are the module's cos and signed sin for those positions (one
    float ulp at most: the module computed them in a pass of another length). A table
    indexed off by one, or built from the wrong positions, is off by far more."""
    model = _demo()
    table = rotary.RopeTable(model, model.lm_head.weight)
    assert len(table.table[0]) == model.config.max_position_embeddings == 1024
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 16, 100):
        positions = torch.randint(0, 1024, (2, n), generator=g)
        positions[0, 0], positions[-1, -1] = 0, 1023
        x = torch.zeros(2, n, model.config.hidden_size)
        with torch.inference_mode():
            got = table(x, positions, top=1024)
            cos, sin = model.model.rotary_emb(x, positions)
        torch.testing.assert_close(got[0][:, :, 0], cos, atol=1.2e-7, rtol=0)
        torch.testing.assert_close(got[1][:, :, 0], rotary.signed(sin), atol=1.2e-7, rtol=0)


def test_positions_past_the_table_or_unknown_run_the_module(monkeypatch):
    """A pass whose highest position is unknown (a caller's own position ids) or past the
    table's end runs the rotary module; one within it does not."""
    model = _demo()
    table = rotary.RopeTable(model, model.lm_head.weight)
    calls = []
    module = table.module
    monkeypatch.setattr(table, "module", lambda x, p: calls.append(p.shape) or module(x, p))
    x, positions = torch.zeros(1, 2, model.config.hidden_size), torch.tensor([[5, 6]])
    table(x, positions, top=7)
    assert calls == []
    table(x, positions, top=None)
    table(x, positions + 1020, top=1027)
    assert len(calls) == 2


def test_a_dynamic_rotary_embedding_gets_no_table():
    """Dynamic RoPE rescales its frequencies once a pass's positions pass the trained
    context: the same position's cos differs between passes, so nothing is tabled."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=64,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = LlamaForCausalLM(config).eval()
    assert not rotary.static_rope(model)
    assert rotary.RopeTable(model, model.lm_head.weight).table is None
