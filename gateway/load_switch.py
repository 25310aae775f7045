"""Whether a loaded gateway's requests draft at all, decided for all of them together.

With several requests in flight their rounds share the replicas' passes (step batching):
a request that stops drafting still waits for passes that carry the others' drafts, so
its own round times do not show what not drafting would cost, and a choice made per
request keeps drafting after drafting stopped paying. Measured on the demo pair behind an
800-token shared context at 8 streams (drafter acceptance 0.16): a request's round took
about 52 ms with drafts and about 52 ms without while the others drafted (the gateway's
cycle averages), against 31 ms in the target-only run beside it (253.8 tokens/s over 8
streams); the per-request choice kept drafting, at 0.71x of target-only.

What decides is the throughput of all the requests together in each mode. The switch runs
the gateway's requests of one drafter kind at one load level in epochs of one mode (at
least ``epoch_s`` and ``min_rounds`` rounds), and measures each epoch's tokens per
request-second: the tokens of the rounds that began in it over those rounds' cycle times.
A round that began in the previous mode does not count, nor does a round without drafts that
was cut to one token because its step also verified drafts (or fed a prompt): after a
drafting epoch the first plain rounds run beside the others' last drafted ones, and on the
demo pair at 8 streams about one round in five of the first plain epoch was cut, which put
that epoch at 0.85 of what the plain epochs after it measured, and drafting, 0.85 of plain in
its steady epochs, kept winning. How the better mode is kept and the other explored again,
and that a tie goes to not drafting: services/epoch_switch.py, the mechanism this shares with
a verifier's choice of threads.
A load level seen for the first time starts from the nearest level's rates, mode and pace
of exploring; the first level of all from what lone requests measured (draft_length.py), so
that a gateway whose drafts did not pay for one request does not begin its first loaded
epochs drafting (such a switch is ``patient``).
"""

from __future__ import annotations

from services.epoch_switch import EpochSwitch


class LoadSwitch(EpochSwitch):
    """``on``: the requests draft (services/epoch_switch.py has the mechanism)."""
