"""A Responses request's input items (``/v1/responses``) as the chat messages the engine
reads, and as they are stored (each with an id): messages of text and images, function calls
and their outputs, reasoning items. An item a chat completion cannot carry is refused by name."""

from __future__ import annotations

import secrets
from typing import Any

from inference.gateway.errors import invalid_request

MESSAGE_ROLES = ("user", "system", "developer", "assistant")


def new_id(prefix: str) -> str:
    """An id nobody can guess (192 random bits), as OpenAI's look: ``resp_…``, ``msg_…``."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _text_of(value: Any, where: str) -> str:
    """A function call's output, or a part list of text, as one string."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if t)
    raise invalid_request(f"'{where}' must be a string or a list of text parts.", param=where)


def _content(
    content: Any, role: str, where: str
) -> tuple[list[dict[str, Any]], str | list[dict[str, Any]]]:
    """(the item's parts as stored, the chat message's content) of one message's content."""
    output = role == "assistant"
    text_kind = "output_text" if output else "input_text"
    if isinstance(content, str):
        content = [{"type": text_kind, "text": content}]
    if not isinstance(content, list) or not content:
        raise invalid_request(
            f"'{where}.content' must be a string or a non-empty list of content parts.",
            param=f"{where}.content",
        )
    parts: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise invalid_request(f"'{at}.text' must be a string.", param=f"{at}.text")
            if output:
                parts.append(
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                )
            else:
                parts.append({"type": "input_text", "text": text})
            chat.append({"type": "text", "text": text})
        elif kind == "input_image" and not output:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise invalid_request(
                    "Images must be given by image_url (a data: URL or an allowed https URL); "
                    "file_id is not supported.",
                    param=f"{at}.image_url",
                    code="unsupported_content",
                )
            parts.append(
                {"type": "input_image", "image_url": url, "detail": part.get("detail") or "auto"}
            )
            chat.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise invalid_request(
                f"Content parts of type {kind!r} are not supported here: send text"
                f"{'' if output else ' or input_image'}.",
                param=f"{at}.type",
                code="unsupported_content",
            )
    if all(p["type"] == "text" for p in chat):
        return parts, "".join(p["text"] for p in chat)
    return parts, chat


def input_items(given: str | list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the input items as stored, each with an id; the chat messages they make)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"'{where}' must be an object (an input item).", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise invalid_request(
                    f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}.",
                    param=f"{where}.role",
                )
            parts, content = _content(item.get("content"), role, where)
            items.append(
                {
                    "id": new_id("msg"),
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": parts,
                }
            )
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(
                arguments, str
            ):
                raise invalid_request(
                    f"'{where}' (a function_call) needs call_id, name and arguments as strings.",
                    param=where,
                )
            items.append(
                {
                    "id": new_id("fc"),
                    "type": "function_call",
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                    "status": "completed",
                }
            )
            tool_call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(tool_call)  # the calls of one turn, together
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid_request(
                    f"'{where}.call_id' must name the function call it answers.",
                    param=f"{where}.call_id",
                )
            output = _text_of(item.get("output"), f"{where}.output")
            items.append(
                {
                    "id": new_id("fco"),
                    "type": "function_call_output",
                    "call_id": call_id,
                    "output": output,
                    "status": "completed",
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            # The model's earlier reasoning is not read again (as chat templates do).
            # A new id, whatever it came with: the listing pages by id.
            items.append({**item, "id": new_id("rs")})
        else:
            raise invalid_request(
                f"Input items of type {kind!r} are not supported: send messages, "
                "function_call and function_call_output items (item_reference: use "
                "previous_response_id).",
                param=f"{where}.type",
                code="unsupported_content",
            )
    return items, messages
