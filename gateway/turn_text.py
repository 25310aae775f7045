"""A turn's text as its stream shows it, and where the turn ends.

Each round's tokens go through the turn's incremental detokenizer and stop matcher
(gateway/detokenizer.py); the turn ends at an end-of-sequence token (which shows no text), a
stop string, its token budget or the model's context, and then the text still held back is
flushed. A resumed stream replays what its client already has through the same two, so that
its text equals the uninterrupted stream's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.chunks import Finish
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher


class TurnText:
    def __init__(self, tokenizer, before: Sequence[int], stop: Iterable[str],
                 eos_token_ids: Iterable[int]) -> None:
        """``before``: the session's tokens before the turn's first generated one."""
        self._detok = IncrementalDetokenizer(tokenizer, before)
        self._stop = StopMatcher(list(stop))
        self._eos = frozenset(eos_token_ids)

    def accept(self, proposed: Sequence[int], budget: int, room: int
               ) -> tuple[list[int], str, Finish | None]:
        """Keeps a round's ``proposed`` tokens up to an end of sequence, a stop string or
        the turn's remaining ``budget`` of tokens; ``room``: the tokens the context has
        left. Returns (kept, their text, the finish or None)."""
        kept: list[int] = []
        text = ""
        finish = None
        for token in proposed:
            kept.append(token)
            if token in self._eos:
                finish = Finish.EOS
                break
            piece, stopped = self.text_of(token)
            text += piece
            if stopped:
                finish = Finish.STOP
                break
            if len(kept) >= budget:
                finish = Finish.LENGTH
                break
        if finish is None and len(kept) >= room:
            finish = Finish.CONTEXT
        if finish is not None:
            tail, finish = self.final(finish)
            text += tail
        return kept, text, finish

    def text_of(self, token: int) -> tuple[str, bool]:
        """A generated token's text as the stream shows it (EOS shows none): (text, stopped)."""
        if token in self._eos:
            return "", False
        return self._stop.feed(self._detok.push([token]))

    def final(self, finish: Finish) -> tuple[str, Finish]:
        """The text still held back when a turn ends, and the finish (a stop string may
        complete in the detokenizer's last bytes)."""
        if finish is Finish.STOP:
            return "", finish
        tail, stopped = self._stop.feed(self._detok.flush())
        return (tail, Finish.STOP) if stopped else (tail + self._stop.flush(), finish)

    def flush(self) -> str:
        """What the stop matcher holds back, when the turn ends without a final token."""
        return self._stop.flush()

    def replay(self, seen: Sequence[int], unseen: Sequence[int],
               finish: Finish | None) -> tuple[str, Finish | None]:
        """A resumed stream: ``seen`` (what the client has) is fed and not shown, then the
        text of ``unseen``; with the turn's ``finish`` when it had ended, and the tail."""
        for token in seen:
            self.text_of(token)
        text = "".join(self.text_of(token)[0] for token in unseen)
        if finish is not None:
            tail, finish = self.final(finish)
            text += tail
        return text, finish
