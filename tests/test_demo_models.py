"""The shipped demo target (models/demo-target): it loads with from_pretrained with its
tokenizer, and its training report belongs to the committed weights (checksum, and the
held-out loss recomputed from the files). The distilled drafter and the full model card
(training/card.py) follow in the demo-pair work (issue #3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.demo import mean_loss
from training.evaluate import held_out_windows, load_model
from training.loop import sha256_file

TARGET = Path(__file__).resolve().parent.parent / "models" / "demo-target"


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((TARGET / "training_report.json").read_text())


def test_target_loads_with_its_tokenizer(report):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET)
    assert model.config.vocab_size == len(tokenizer) == report["config"]["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == report["params"]
    assert tokenizer.eos_token_id in (model.generation_config.eos_token_id,
                                      model.config.eos_token_id)


def test_report_checksum_matches_the_committed_weights(report):
    files = {f.name: sha256_file(f) for f in sorted(TARGET.glob("model*.safetensors"))}
    assert files and report["sha256"] == files


def test_held_out_loss_recomputed_from_the_files_matches_the_report(report):
    """The held-out windows are a pure function of the fixed stdlib split; the float16 weights
    give the reported loss to within rounding."""
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    windows = held_out_windows(AutoTokenizer.from_pretrained(TARGET), None,
                               report["config"]["seq_len"], report["config"]["eval_windows"])
    loss = mean_loss(load_model(str(TARGET)), windows)
    assert loss == pytest.approx(report["final_held_out_loss"], abs=0.02)
    assert loss < report["initial_held_out_loss"] - 3  # it learned: 9.06 -> ~4.17 nats/token
