"""Chat messages -> the target's prompt: validated messages rendered with the tokenizer's
chat template (``apply_chat_template``), or DEFAULT_CHAT_TEMPLATE for a model without one
(the demo pair), so that chat works on every model out of the box."""

from __future__ import annotations

from gateway.http.errors import bad_request

# For models whose tokenizer has no chat template: one "Role: content" line per message
# and "Assistant:" to prompt the reply. Plain text, no special tokens, so any causal LM
# can continue it. docs/api.md shows it.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 1024


def _content(value, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict):
                raise bad_request(f"{where}[{j}] must be an object {{\"type\": \"text\", "
                                  "\"text\": ...}", f"{where}[{j}]")
            if part.get("type") != "text":
                raise bad_request(f"{where}[{j}].type must be \"text\" (this model takes text "
                                  f"only), got {part.get('type')!r}", f"{where}[{j}].type")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            texts.append(text)
        return "".join(texts)
    raise bad_request(f"{where} must be a string or a list of text parts, got "
                      f"{type(value).__name__}", where)


def validate_messages(messages) -> list[dict[str, str]]:
    """[{"role", "content"}] with roles and content shapes checked; errors name the field.
    ``developer`` is read as ``system`` (OpenAI's newer name for it)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {\"role\", \"content\"} "
                          "objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"messages has {len(messages)} entries; the limit is {MAX_MESSAGES}",
                          "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"
                              + (" (tools are not supported)" if role in ("tool", "function")
                                 else ""), f"{where}.role")
        if message.get("tool_calls") or message.get("function_call"):
            raise bad_request(f"{where}: tool calls are not supported", f"{where}.tool_calls")
        if "content" not in message or message["content"] is None:
            raise bad_request(f"{where}.content is required", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(message["content"], f"{where}.content")})
    return out


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict[str, str]], continuing: bool = False) -> str:
    """The prompt text of ``messages`` with the reply's generation prompt. ``continuing``:
    the messages are a new turn of a session that holds the earlier ones (the text is
    appended to it), so a template's leading BOS text is dropped."""
    template = None if has_template(tokenizer) else DEFAULT_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template may reject a conversation (jinja raise)
        raise bad_request(f"messages: the model's chat template rejected them: {exc}",
                          "messages") from exc
    bos = getattr(tokenizer, "bos_token", None)
    if continuing:
        if bos and text.startswith(bos):
            text = text[len(bos):]
        if template is not None:
            text = "\n" + text  # the earlier reply ended without a newline
    return text
