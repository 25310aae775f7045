"""The speculation cache's planning: which outcomes of a verify to draft the next round for.

A verify of drafts d_1..d_k ends in one of k + 1 accept lengths j, followed by the
verifier's own token t (the correction after a rejection, the bonus after k accepts). The
next round's drafts depend only on (j, t), so a drafter that works while the verifier does
can prepare them for the likely outcomes (SSD / "Saguaro", ICLR 2026; vLLM's draft-server
RFC #42109; PEARL; SpecEdge), and the round after a hit starts with no draft call.

Weights, with a the per-token acceptance rate (Leviathan et al. 2023):
    P(j) = a^j (1 - a) for j < k,   P(k) = a^k
    P(t | j) = r_j(t) / (1 - r_j(d_{j+1}))  for j < k   (a rejected draft is never the correction:
                                                          the residual max(0, p - q) is 0 there)
    P(t | k) = r_k(t)
where r_j is the drafter's own distribution after d_1..d_j: its guess of the target's. Branches
are taken most probable first, up to ``max_branches`` or until they cover ``coverage``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_length_probs(acceptance: float, k: int) -> list[float]:
    """[P(j) for j in 0..k] for a per-token acceptance rate in [0, 1]."""
    a = min(max(acceptance, 0.0), 1.0)
    return [a ** j * (1 - a) for j in range(k)] + [a ** k]


def plan_branches(draft_ids: Sequence[int], guess_probs: torch.Tensor, acceptance: float,
                  max_branches: int, coverage: float = 0.95) -> list[tuple[int, int, float]]:
    """The outcomes to draft for: [(accepted j, token t, probability)], most probable first.

    draft_ids [k]; guess_probs [k+1, V]: the drafter's distribution after d_1..d_j in row j.
    """
    k = len(draft_ids)
    if guess_probs.dim() != 2 or guess_probs.shape[0] != k + 1:
        raise ValueError(f"guess_probs must have shape [k+1={k + 1}, V], "
                         f"got {tuple(guess_probs.shape)}")
    if max_branches < 1:
        raise ValueError(f"max_branches must be >= 1, got {max_branches}")
    p_len = accept_length_probs(acceptance, k)
    probs = guess_probs.to(torch.float32).clone()  # [k+1, V]
    rows = torch.arange(k)
    drafts = torch.tensor(list(draft_ids), dtype=torch.long)  # [k]
    rejected_mass = probs[rows, drafts]  # [k] r_j(d_{j+1})
    probs[rows, drafts] = 0.0  # never the correction after a rejection
    scale = torch.tensor(p_len, dtype=torch.float32)  # [k+1]
    scale[:k] = scale[:k] / (1.0 - rejected_mass).clamp_min(1e-6)
    weighted = probs * scale[:, None]  # [k+1, V] P(j) P(t | j)
    n = min(max_branches, weighted.numel())
    values, flat = torch.topk(weighted.flatten(), n)  # [n]
    vocab = probs.shape[1]
    out, covered = [], 0.0
    for value, index in zip(values.tolist(), flat.tolist(), strict=True):
        if value <= 0.0 or (out and covered >= coverage):
            break
        out.append((index // vocab, index % vocab, value))
        covered += value
    return out
