"""`training.distill`: distillation really moves the drafter towards the target, resumes
exactly, and saves a drafter that serves as is (shared vocabulary, checksummed weights)."""

from __future__ import annotations

import json

import pytest
import torch

from services.tiny_models import build_tiny_pair
from training import corpus
from training.distill import distill, init_from_target, kd_loss
from training.evaluate import evaluate_alpha, load_model
from training.loop import CHECKPOINT_NAME, sha256_file

# Small but real: the tiny 2-layer target, a 1-layer 32-wide drafter, 64-token windows.
KW = dict(layers=1, hidden=32, seq_len=64, batch_size=8, lr=1e-2, warmup=5, bf16=False,
          init_embeddings=False, held_windows=8, show_progress=False, log=lambda *_: None)
STEPS = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t, _ = build_tiny_pair(tmp_path_factory.mktemp("tiny") / "pair")
    return str(t)


@pytest.fixture(scope="module")
def corpus_files():
    # ~10 small stdlib files: enough text, quick to tokenize.
    files = sorted(corpus.train_files(), key=lambda p: p.stat().st_size)
    return [str(p) for p in files if p.stat().st_size > 4000][:10]


@pytest.fixture(scope="module")
def trained(target, corpus_files, tmp_path_factory):
    base = tmp_path_factory.mktemp("distill")
    before = distill(target, corpus_files, base / "before", steps=0, measure=False, **KW)
    after = distill(target, corpus_files, base / "after", steps=STEPS, measure=True,
                    latency_tokens=4, latency_context=16, **KW)
    return base, before, after


def _held(target, corpus_files):
    from transformers import AutoTokenizer

    from training.distill import _prepare

    _, held, _ = _prepare(AutoTokenizer.from_pretrained(target), corpus_files, 64, 8)
    return held


def test_kl_falls_and_alpha_rises(trained, target, corpus_files):
    base, _, report = trained
    held = _held(target, corpus_files)
    t = load_model(target)
    before = evaluate_alpha(t, load_model(str(base / "before")), held)
    after = evaluate_alpha(t, load_model(str(base / "after")), held)
    # Independent measurement on the same held-out windows.
    assert after["kl"] < 0.8 * before["kl"], (before, after)
    assert after["alpha_greedy"] > before["alpha_greedy"] + 0.05, (before, after)
    assert after["alpha_t1"] > before["alpha_t1"]
    # The report agrees with it.
    assert report["held_out_kl_before"] == pytest.approx(before["kl"], rel=1e-4)
    assert report["held_out_kl_after"] == pytest.approx(after["kl"], rel=1e-4)
    ev = report["evaluation"]
    assert ev["alpha_greedy"] == pytest.approx(after["alpha_greedy"])
    assert 0 < ev["draft_ms_per_token"] and 0 < ev["target_ms_per_token"]


def test_saved_drafter_loads_and_shares_vocabulary(trained, target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, _, report = trained
    d_dir = base / "after"
    model = AutoModelForCausalLM.from_pretrained(str(d_dir))
    tok_d, tok_t = AutoTokenizer.from_pretrained(str(d_dir)), AutoTokenizer.from_pretrained(target)
    assert tok_d.get_vocab() == tok_t.get_vocab()
    assert tok_d("def f(x):").input_ids == tok_t("def f(x):").input_ids
    t_model = AutoModelForCausalLM.from_pretrained(target)
    assert model.get_output_embeddings().weight.shape[0] == \
        t_model.get_output_embeddings().weight.shape[0]
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert model.generation_config.eos_token_id == tok_t.eos_token_id
    # The checksum in the report is the checksum of the saved weights.
    files = sorted(d_dir.glob("model*.safetensors"))
    assert files and report["sha256"] == {f.name: sha256_file(f) for f in files}
    on_disk = json.loads((d_dir / "distill_report.json").read_text())
    assert on_disk["sha256"] == report["sha256"]


def test_resume_continues_identically(target, corpus_files, tmp_path):
    steps = 12
    full = distill(target, corpus_files, tmp_path / "full", steps=steps, measure=False, **KW)
    part = distill(target, corpus_files, tmp_path / "part", steps=steps, stop_after=5,
                   measure=False, **KW)
    assert part["steps_done"] == 5 and not part["finished"]
    ckpt = torch.load(tmp_path / "part" / ".distill" / CHECKPOINT_NAME, weights_only=False)
    assert ckpt["step"] == 5 and ckpt["optimizer"]["state"]  # Adam moments saved
    rest = distill(target, corpus_files, tmp_path / "part", steps=steps, resume=True,
                   measure=False, **KW)
    assert rest["start_step"] == 5 and rest["steps_done"] == steps and rest["finished"]
    assert sorted(rest["train_losses"]) == list(range(6, steps + 1))
    for s in range(1, 6):
        assert part["train_losses"][s] == full["train_losses"][s]
    for s in range(6, steps + 1):
        assert rest["train_losses"][s] == pytest.approx(full["train_losses"][s], rel=1e-6), s
    a = load_model(str(tmp_path / "full")).state_dict()
    b = load_model(str(tmp_path / "part")).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_kd_loss_is_kl():
    p = torch.tensor([[2.0, 0.5, -1.0]])
    assert float(kd_loss(p, p)) == pytest.approx(0.0, abs=1e-7)
    q = torch.tensor([[0.0, 0.0, 0.0]])
    pp = torch.softmax(p, -1)
    expected = float((pp * (pp.log() - torch.log(torch.full((3,), 1 / 3)))).sum())
    assert float(kd_loss(q, p)) == pytest.approx(expected, rel=1e-6)
    # temperature: T² · KL of the softened distributions
    ps, qs = torch.softmax(p / 2, -1), torch.softmax(q / 2, -1)
    assert float(kd_loss(q, p, 2.0)) == pytest.approx(4 * float((ps * (ps / qs).log()).sum()),
                                                      rel=1e-6)


def test_init_from_target_projects_head(target):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from training.distill import draft_config

    t = load_model(target)
    tok = AutoTokenizer.from_pretrained(target)
    same = LlamaForCausalLM(draft_config(t, tok, 1, t.config.hidden_size))
    assert init_from_target(same, t) == "copied"
    assert torch.equal(same.lm_head.weight, t.lm_head.weight)
    narrow = LlamaForCausalLM(draft_config(t, tok, 1, 32))
    assert init_from_target(narrow, t).startswith("svd")
    # The projected head keeps most of the target head's structure: the logits' argmax on the
    # target's own states, projected to rank 32 of 64, agree far above chance.
    w = t.lm_head.weight * t.model.norm.weight
    _, _, vh = torch.linalg.svd(w, full_matrices=False)
    x = torch.randn(256, t.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = (x @ w.T).argmax(-1)
    proj = ((x @ vh[:32].T) @ narrow.lm_head.weight.T).argmax(-1)
    assert (full == proj).float().mean() > 0.15  # chance: 1/512
