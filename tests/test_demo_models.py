"""The shipped demo pair (models/demo-target, models/demo-drafter): both load with
from_pretrained, share one vocabulary, and every figure of the model card (models/README.md)
belongs to the committed weights: the reports' sha256 equal the files', the target's held-out
loss and the pair's α are recomputed here from the files, and the card is exactly what
training/card.py renders from the reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.demo import mean_loss
from training.evaluate import held_out_windows, load_model
from training.loop import sha256_file

MODELS = Path(__file__).resolve().parent.parent / "models"
TARGET = MODELS / "demo-target"
DRAFTER = MODELS / "demo-drafter"


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((TARGET / "training_report.json").read_text())


def _sha(directory: Path) -> dict:
    return {f.name: sha256_file(f) for f in sorted(directory.glob("model*.safetensors"))}


def test_target_loads_with_its_tokenizer(report):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET)
    assert model.config.vocab_size == len(tokenizer) == report["config"]["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == report["params"]
    assert tokenizer.eos_token_id in (model.generation_config.eos_token_id,
                                      model.config.eos_token_id)


def test_report_checksum_matches_the_committed_weights(report):
    files = _sha(TARGET)
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


@pytest.fixture(scope="module")
def pair_reports() -> tuple[dict, dict]:
    return (json.loads((DRAFTER / "distill_report.json").read_text()),
            json.loads((MODELS / "demo-eval.json").read_text()))


def test_drafter_loads_and_shares_the_targets_vocabulary():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_tok, d_tok = AutoTokenizer.from_pretrained(TARGET), AutoTokenizer.from_pretrained(DRAFTER)
    assert t_tok.get_vocab() == d_tok.get_vocab()
    draft = AutoModelForCausalLM.from_pretrained(DRAFTER)
    target = AutoModelForCausalLM.from_pretrained(TARGET)
    assert draft.config.vocab_size == target.config.vocab_size == len(t_tok)
    assert sum(p.numel() for p in draft.parameters()) < \
        sum(p.numel() for p in target.parameters()) / 4
    sizes = sum(f.stat().st_size for d in (TARGET, DRAFTER) for f in d.glob("*.safetensors"))
    assert sizes < 150 * 1024 * 1024


def test_every_report_names_the_committed_weights(pair_reports, report):
    distill, ev = pair_reports
    assert distill["sha256"] == _sha(DRAFTER)
    assert ev["draft_sha256"] == _sha(DRAFTER)
    assert ev["target_sha256"] == _sha(TARGET) == report["sha256"]


def test_model_card_is_rendered_from_the_reports():
    from training import card

    assert (MODELS / "README.md").read_text() == card.render(*card.load_reports(MODELS))


def test_alpha_recomputed_from_the_files_matches_the_card(pair_reports):
    """α on the first held-out windows, recomputed from the committed files, agrees with the
    evaluation over all of them; the drafter is far better than chance and than before."""
    from transformers import AutoTokenizer

    from training.evaluate import evaluate_alpha

    distill, ev = pair_reports
    torch.set_num_threads(2)
    windows = held_out_windows(AutoTokenizer.from_pretrained(TARGET), None, ev["eval_seq_len"],
                               ev["eval_windows"])
    with torch.inference_mode():
        got = evaluate_alpha(load_model(str(TARGET)), load_model(str(DRAFTER)), windows)
    assert got["positions"] == ev["positions"]
    assert got["alpha_greedy"] == pytest.approx(ev["alpha_greedy"], abs=0.005)
    assert got["alpha_t1"] == pytest.approx(ev["alpha_t1"], abs=0.005)
    assert got["alpha_greedy"] > distill["alpha_greedy_before"] + 0.2
