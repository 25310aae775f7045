"""The demo-model pipeline: the stdlib corpus split, the tokenizer, a very short target training
run, and the α/latency measurement of `training.evaluate`."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from training import corpus
from training.demo import TargetConfig, build_target, train_tokenizer
from training.evaluate import acceptance_from_logits, evaluate_alpha
from training.evaluate import main as evaluate_main


# ---------------------------------------------------------------- corpus split
def test_split_is_fixed_disjoint_and_documented():
    root = corpus.stdlib_root()
    train, held = corpus.train_files(), corpus.held_out_files()
    assert train == corpus.train_files() and held == corpus.held_out_files()  # deterministic
    assert train == sorted(train, key=lambda p: p.relative_to(root).as_posix())
    assert not set(train) & set(held)
    assert set(train) | set(held) == set(corpus.all_files())
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.09
    # The documented rule, recomputed independently.
    held_set = set(held)
    for p in corpus.all_files():
        rel = p.relative_to(root).as_posix()
        h = int(hashlib.blake2b(rel.encode(), digest_size=8).hexdigest(), 16) % 20 == 0
        assert (p in held_set) == h, rel
    rels = {p.relative_to(root).as_posix() for p in corpus.all_files()}
    assert not any(r.startswith("test/") or "/test/" in r or "/tests/" in r
                   or "idle_test/" in r or "site-packages/" in r
                   or r.split("/")[-1].startswith("_sysconfigdata") for r in rels)
    assert "os.py" in rels and "asyncio/tasks.py" in rels


def test_held_out_text_never_in_training_windows():
    tok = train_tokenizer(corpus.read_texts(corpus.train_files(limit=4)), 400)
    train = corpus.train_files(limit=30)
    stream = corpus.token_stream(tok, train)
    windows = corpus.make_windows(stream, 64)
    expected = np.concatenate([corpus.token_stream(tok, [f]) for f in train])
    assert np.array_equal(stream, expected)  # exactly the train files, in order
    sampler = corpus.WindowSampler(windows, 4, seed=3)
    seen = np.concatenate([sampler.batch(s).numpy().ravel() for s in range(20)])
    again = np.concatenate([corpus.WindowSampler(windows, 4, 3).batch(s).numpy().ravel()
                            for s in range(20)])
    assert np.array_equal(seen, again)  # batches are a function of (seed, step)
    flat = windows.ravel().tobytes()
    for held in corpus.held_out_files(limit=5):
        ids = corpus.token_stream(tok, [held])
        mid = len(ids) // 2
        snippet = ids[mid:mid + 48].astype(np.int32).tobytes()
        assert len(snippet) == 48 * 4 and snippet not in flat, held


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_round_trips_and_prepends_bos(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(corpus.read_texts(corpus.train_files(limit=5)), 600)
    tok.save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 600
    text = "def grüß(x):\n    return '日本語 🐍 — ok'  # naïve\n\ttab"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == tok.convert_tokens_to_ids("<s>")
    assert tok.eos_token == "</s>" and tok.unk_token == "<unk>"
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


# ---------------------------------------------------------------- target training
def test_short_target_run_learns_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = TargetConfig(vocab_size=320, hidden=32, layers=1, heads=2, kv_heads=1,
                       intermediate=64, max_positions=128, seq_len=64, batch_size=4, steps=30,
                       lr=5e-3, warmup=3, eval_every=0, eval_windows=4, ckpt_every=0, seed=1)
    train = corpus.train_files(limit=3)
    held = corpus.held_out_files(limit=1)
    out = tmp_path / "target"
    report = build_target(out, cfg, train_list=train, held_list=held, show_progress=False,
                          log=lambda *_: None)
    assert report["steps_done"] == 30 and report["finished"]
    assert report["final_held_out_loss"] < report["initial_held_out_loss"] - 0.5
    assert report["final_train_loss"] < report["first_train_loss"] - 1.0
    assert report["final_train_loss"] < np.log(320) - 1.0  # well below uniform
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tok) == 320
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.bos_token_id == tok.bos_token_id
    on_disk = json.loads((out / "training_report.json").read_text())
    assert on_disk["sha256"] == report["sha256"] and len(report["sha256"]) == 1


# ---------------------------------------------------------------- evaluation
def test_acceptance_hand_built():
    p = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]))
    q = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.2, 0.5, 0.3]]))
    s = acceptance_from_logits(p, q)
    assert s["n"] == 2
    assert s["greedy"] == 1.0  # position 0 disagrees (0 vs 2), position 1 agrees
    assert s["t1"] == pytest.approx((0.2 + 0.3 + 0.2) + (0.1 + 0.5 + 0.3))
    kl0 = 0.5 * np.log(0.5 / 0.2) + 0.3 * np.log(1) + 0.2 * np.log(0.2 / 0.5)
    kl1 = 0.1 * np.log(0.1 / 0.2) + 0.6 * np.log(0.6 / 0.5) + 0.0
    assert s["kl"] == pytest.approx(kl0 + kl1, rel=1e-5)
    same = acceptance_from_logits(p, p)
    assert same["greedy"] == 2 and same["t1"] == pytest.approx(2.0)


def test_evaluate_draft_equal_to_target_gives_alpha_one(tmp_path, capsys):
    from services.tiny_models import build_tiny_pair

    target, draft = build_tiny_pair(tmp_path / "pair")
    from training.evaluate import load_model

    t = load_model(str(target))
    windows = torch.randint(3, t.config.vocab_size, (3, 32), generator=torch.Generator()
                            .manual_seed(0))
    res = evaluate_alpha(t, load_model(str(target)), windows)
    assert res["alpha_greedy"] == 1.0
    assert res["alpha_t1"] == pytest.approx(1.0, abs=1e-5)
    assert res["kl"] == pytest.approx(0.0, abs=1e-6)
    d = evaluate_alpha(t, load_model(str(draft)), windows)
    assert d["alpha_greedy"] < 1.0 and d["alpha_t1"] < 1.0
    # The command line anyone can run.
    out = tmp_path / "eval.json"
    assert evaluate_main(["--target", str(target), "--draft", str(draft), "--seq-len", "32",
                          "--max-windows", "4", "--latency-tokens", "4",
                          "--latency-context", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "α greedy" in printed and "draft ms / token" in printed
    fig = json.loads(out.read_text())
    assert 0 <= fig["alpha_greedy"] <= 1 and fig["positions"] == 4 * 32
