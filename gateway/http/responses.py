"""Engine chunks -> OpenAI response bodies and stream chunks (completions and chat)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from gateway.chunks import Chunk, Finish, Usage

# EOS and a stop string end the text as OpenAI's "stop"; max_tokens and a full context
# window as "length".
FINISH = {Finish.EOS: "stop", Finish.STOP: "stop", Finish.LENGTH: "length",
          Finish.CONTEXT: "length", None: None}


def usage_body(u: Usage) -> dict:
    """OpenAI's usage, plus the speculation figures (extension)."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "speculation": {"rounds": u.rounds, "draft_tokens": u.draft_tokens,
                            "accepted_draft_tokens": u.accepted_draft_tokens}}


class Formatter:
    """Builds one request's bodies; ``chat`` picks the chat.completion shapes; ``choices``:
    how many the request runs (gateway/http/choices.py)."""

    def __init__(self, tokenizer, model: str, chat: bool, logprobs: int, choices: int = 1) -> None:
        self.tokenizer, self.model, self.chat, self.logprobs = tokenizer, model, chat, logprobs
        self.choices = choices
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # each choice's text so far (completions)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def logprobs_body(self, chunk: Chunk, index: int = 0):
        """The logprobs of choice ``index``'s next chunk in the endpoint's shape (None when
        not asked)."""
        if self.logprobs < 0:
            return None
        if self.chat:
            return {"content": [{
                "token": self._token(t.token_id), "logprob": t.logprob,
                "bytes": list(self._token(t.token_id).encode()),
                "top_logprobs": [{"token": self._token(i), "logprob": lp,
                                  "bytes": list(self._token(i).encode())}
                                 for i, lp in zip(t.top_ids, t.top_logprobs, strict=True)],
            } for t in chunk.logprobs]}
        tokens = [self._token(t.token_id) for t in chunk.logprobs]
        offsets, offset = [], self.text_offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self.text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in chunk.logprobs],
                "top_logprobs": [{self._token(i): lp for i, lp in
                                  zip(t.top_ids, t.top_logprobs, strict=True)}
                                 for t in chunk.logprobs],
                "text_offset": offsets}

    def _envelope(self, obj: str, choices: list, usage, chunk: Chunk) -> dict:
        """The body around ``choices``; its session is ``chunk``'s, or "" where the request
        runs several choices (each has a session of its own, and none is kept)."""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage,
                "session_id": chunk.session_id if self.choices == 1 else ""}

    def whole(self, wholes: Sequence[Chunk], usage: Usage) -> dict:
        """The non-streamed body: each choice's chunks collected into one (gateway/chunks.py
        ``collect``), in order, and the request's usage."""
        choices = []
        for index, whole in enumerate(wholes):
            choice = {"index": index, "logprobs": self.logprobs_body(whole, index),
                      "finish_reason": FINISH[whole.finish]}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": whole.text}
            else:
                choice["text"] = whole.text
            choices.append(choice)
        return self._envelope("chat.completion" if self.chat else "text_completion", choices,
                              usage_body(usage), wholes[0])

    def stream_chunk(self, chunk: Chunk, include_usage: bool, first: bool = False,
                     index: int = 0) -> dict:
        """One streamed chunk of choice ``index``: the round's text delta (a chat choice's
        first also carries the assistant role), and on its last the finish reason."""
        choice = {"index": index, "logprobs": self.logprobs_body(chunk, index),
                  "finish_reason": FINISH[chunk.finish]}
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if chunk.text or first:
                delta["content"] = chunk.text
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion",
                              [choice], None, chunk)
        if not include_usage:
            del body["usage"]
        return body

    def usage_chunk(self, usage: Usage, last: Chunk) -> dict:
        """stream_options.include_usage: the extra last chunk, no choices, the request's usage
        (``last``: the first choice's last chunk)."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage_body(usage), last)
