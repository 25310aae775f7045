"""services/wide_target.py: the random target shaped like real models that
docs/performance.md measures long contexts on, and the widened copy of a target that keeps
its logits. Built here small (the shape is a parameter), loaded back the way a replica loads
a model, and run by the lean forward against HF; the command's user errors are one line and
exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.lean_llama import lean_forward
from services.wide_target import build_wide_target, widen_target

DEMO_TARGET = "models/demo-target"


def test_the_wide_target_keeps_the_demo_vocabulary_and_takes_the_shape_asked(tmp_path):
    small = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
    out = build_wide_target(Path(DEMO_TARGET), tmp_path / "wide", seed=3, **small)
    config = json.loads((out / "config.json").read_text())
    demo = json.loads((Path(DEMO_TARGET) / "config.json").read_text())
    assert {k: config[k] for k in small} == small
    assert config["vocab_size"] == demo["vocab_size"] and config["dtype"] == "float16"
    tok, demo_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(DEMO_TARGET)
    assert tok("def f(x): return x")["input_ids"] == demo_tok("def f(x): return x")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert sum(p.numel() for p in hf.parameters()) < 10**7
    lean, why = lean_forward(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
                             "auto")
    assert why == ""  # a shape the lean forward (and its kernels) serve
    ids = torch.tensor([tok("def f(x): return x")["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(lean(ids).logits, hf(ids).logits, atol=2e-5, rtol=1e-5)
    again = build_wide_target(Path(DEMO_TARGET), tmp_path / "again", seed=3, **small)
    a = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), hf.parameters(), strict=True))


def test_a_widened_target_is_four_times_as_wide_and_computes_the_source_logits(tmp_path):
    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
    source = build_wide_target(Path(DEMO_TARGET), tmp_path / "source", seed=1, **small)
    out = widen_target(source, tmp_path / "wide", factor=4, extra_layers=1, seed=2)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["num_hidden_layers"]) \
        == (256, 384, 16, 8, 16, 3)
    assert config["dtype"] == "float16" and config["rms_norm_eps"] == 1e-5 / 4
    a = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # the extra layer computes (random q, k, v, gate, up) but writes nothing back
    extra = b.model.layers[2]
    assert extra.self_attn.q_proj.weight.abs().sum() > 0
    assert not extra.self_attn.o_proj.weight.any() and not extra.mlp.down_proj.weight.any()
    ids = torch.randint(0, config["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(0))
    lean, why = lean_forward(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
                             "auto")
    assert why == ""
    with torch.inference_mode():
        expected = a(ids).logits
        assert expected.abs().max() > 0.1  # (logits that say something)
        torch.testing.assert_close(b(ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lean(ids).logits, expected, atol=1e-5, rtol=1e-5)
        greedy = dict(max_new_tokens=24, do_sample=False)
        assert torch.equal(b.generate(ids, **greedy), a.generate(ids, **greedy))


def test_the_commands_user_errors_are_one_line_and_exit_2(tmp_path):
    for args, says in ((["--source", str(tmp_path / "none")], "holds no config.json"),
                       (["--layers", "0"], "--layers must be at least 1, got 0"),
                       (["--widen", "3"], "--widen must be 4 or 16"),
                       (["--widen", "4", "--extra-layers", "-1"], "--extra-layers at least 0"),
                       (["--extra-layers", "2"], "give --widen 4 or 16 too")):
        done = subprocess.run([sys.executable, "-m", "services.wide_target",
                               str(tmp_path / "out"), *args],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2
        assert done.stderr.strip().count("\n") == 0 and says in done.stderr
        assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
