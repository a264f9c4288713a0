"""``/v1/responses``: create (streamed or whole), retrieve, delete, list input items.

A response runs as a chat completion (translated by ``responses_in`` and ``responses_out``)
through the same ``Lifecycle`` as ``/v1/chat/completions``: the ledger's record says
``responses``. A stored response (``store``, the default) is written to PostgreSQL once its
answer is complete and before the client is told so (its last stream event, or the whole
answer), so a follow-up with ``previous_response_id`` finds it on any web process. The
call's engine slot and limits are released before that write. A write that fails (the
database away, a text PostgreSQL cannot keep) does not cost the client its answer: it gets
it, with ``store: false``, and the stream an ``error`` event before its last. Stored
responses are the tenant's alone: every read and delete is by tenant and id, and another
tenant's id is a 404 like one that never was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

import orjson
from django.conf import settings
from django.db import DatabaseError

from conversations.models import StoredResponse
from conversations.selectors import stored_response_get
from conversations.services import stored_response_create, stored_response_delete
from inference.gateway import responses_in, responses_out
from inference.gateway.call import MidStreamError
from inference.gateway.db import run_conversations_db
from inference.gateway.errors import ApiError, invalid_request
from inference.gateway.headless import embedder
from inference.gateway.items import new_id
from inference.gateway.lifecycle import Lifecycle
from inference.gateway.v1 import JSON, SSE_HEADERS, YIELD_EVERY, GatewayHttpConsumer

log = logging.getLogger(__name__)


STORE_FAILED = (
    "The response could not be stored (store is now false): it cannot be retrieved or "
    "continued with previous_response_id."
)


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"No response found with id '{response_id}'.", code="not_found", param="response_id"
    )


def _sse(events: list[dict[str, Any]]) -> bytes:
    dumps = orjson.dumps
    return b"".join(
        [b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n" for e in events]
    )


async def _history(tenant_id: int, response_id: str) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues: its stored chat messages."""

    def read() -> list[dict[str, Any]] | None:
        try:
            stored = stored_response_get(tenant_id=tenant_id, response_id=response_id)
        except StoredResponse.DoesNotExist:
            return None
        conversation: list[dict[str, Any]] = stored.conversation
        return conversation

    found = await run_conversations_db(read)
    if found is None:
        raise invalid_request(
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return found


class ResponsesConsumer(GatewayHttpConsumer):
    """``POST /v1/responses``."""

    endpoint = "responses"

    async def handle_request(self, body: bytes) -> None:
        key = self.checked_key
        request = responses_in.read_request(body)
        previous = request.get("previous_response_id")
        history = await _history(key.tenant_id, previous) if previous else []
        translated = responses_in.translate(
            request, history, max_bytes=settings.INFERPLANE_MAX_BODY_BYTES
        )
        response = responses_out.skeleton(
            request, response_id=new_id("resp"), created_at=int(time.time())
        )
        try:
            life = await Lifecycle.begin(
                key=key,
                raw_body=orjson.dumps(translated.chat),
                endpoint="chat.completions",
                surface="responses",
                rid=self.rid,
                embed=embedder(key),
            )
        except ApiError as error:
            raise responses_in.renamed(error) from None
        self.ran = True
        if request.get("stream"):
            await self.stream(life, request, translated, response)
        else:
            await self.whole(life, request, translated, response)

    async def whole(
        self,
        life: Lifecycle,
        request: dict[str, Any],
        translated: responses_in.Translated,
        response: dict[str, Any],
    ) -> None:
        async with life:
            try:
                await life.start()
                answer = await life.whole()
            except ApiError as error:
                await self.send_error(responses_in.renamed(error), life.call.headers)
                return
        output, finish_reason = responses_out.output_of_answer(answer)
        responses_out.finished(
            response, output=output, finish_reason=finish_reason, chat_usage=life.call.usage()
        )
        await self._store(request, translated, response)
        await self.send_response(200, orjson.dumps(response), headers=[JSON, *life.call.headers])

    async def stream(
        self,
        life: Lifecycle,
        request: dict[str, Any],
        translated: responses_in.Translated,
        response: dict[str, Any],
    ) -> None:
        events = responses_out.EventStream(response)
        error: str | None = None
        async with life:
            try:
                await life.start()
            except ApiError as refused:
                await self.send_error(responses_in.renamed(refused), life.call.headers)
                return
            await self.send_headers(status=200, headers=[*SSE_HEADERS, *life.call.headers])
            self.failure_event = lambda error: _sse(
                [events.event("error", code=error.code, message=error.message, param=None)]
            )
            send = self.base_send
            await self.send_body(_sse(events.begin()), more_body=True)
            written = 0
            try:
                async for batch in life:
                    out: list[dict[str, Any]] = []
                    for chunk in batch:
                        out.extend(events.feed(chunk))
                    if out:
                        await send(
                            {"type": "http.response.body", "body": _sse(out), "more_body": True}
                        )
                    # As chat's stream: a client that left is noticed within a few batches.
                    written += 1
                    if not written % YIELD_EVERY:
                        await asyncio.sleep(0)
            except MidStreamError as exc:
                error = str(exc)
        # The engine's slot and the limits are free; the answer is complete: keep it, then
        # say so (a client that continues from it at once finds it).
        ending, response = events.close(chat_usage=life.call.usage(), error=error)
        stored = await self._store(request, translated, response)
        problem = None
        if not stored and request.get("store") is not False:
            problem = ("storage_failed", STORE_FAILED)
        await self.send_body(_sse([*ending, *events.terminal(response, problem=problem)]))

    async def _store(
        self, request: dict[str, Any], translated: responses_in.Translated, response: dict[str, Any]
    ) -> bool:
        """Keep the response (when asked): whether it was kept. A write that fails leaves the
        answer as it is but for ``store``, now false: it cannot be continued or retrieved."""
        if not response["store"]:
            return False
        key = self.checked_key
        try:
            await run_conversations_db(
                stored_response_create,
                response_id=response["id"],
                tenant_id=key.tenant_id,
                api_key_id=key.key_id,
                request_id=self.rid,
                model=request["model"],
                body=response,
                input_items=translated.input_items,
                conversation=[
                    *translated.conversation,
                    *responses_out.assistant_turn(response["output"]),
                ],
                created_at=datetime.fromtimestamp(response["created_at"], UTC),
            )
        except DatabaseError:
            log.exception("could not store response %s", response["id"])
            response["store"] = False
            return False
        return True


class ResponseConsumer(GatewayHttpConsumer):
    """``GET`` and ``DELETE /v1/responses/{id}``: the tenant's own, else 404."""

    methods: tuple[str, ...] = ("GET", "DELETE")
    endpoint = "responses"

    def max_body(self) -> int:
        return 0

    async def handle_request(self, body: bytes) -> None:
        tenant_id = self.checked_key.tenant_id
        response_id = self.scope["url_route"]["kwargs"]["response_id"]
        if self.scope["method"] == "DELETE":
            if not await run_conversations_db(
                stored_response_delete, tenant_id=tenant_id, response_id=response_id
            ):
                raise _not_found(response_id)
            answer: dict[str, Any] = {"id": response_id, "object": "response", "deleted": True}
        else:
            answer = (await _stored(tenant_id, response_id)).body
        await self.send_response(200, orjson.dumps(answer), headers=[JSON])


async def _stored(tenant_id: int, response_id: str) -> StoredResponse:
    def read() -> StoredResponse | None:
        try:
            return stored_response_get(tenant_id=tenant_id, response_id=response_id)
        except StoredResponse.DoesNotExist:
            return None

    stored = await run_conversations_db(read)
    if stored is None:
        raise _not_found(response_id)
    return stored


class ResponseInputItemsConsumer(ResponseConsumer):
    """``GET /v1/responses/{id}/input_items``: the items the response was given, newest
    first unless ``order=asc``, ``limit`` (1 to 100, 20) at a time after the item ``after``."""

    methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        query = parse_qs(self.scope.get("query_string", b"").decode(errors="replace"))
        limit_text = (query.get("limit") or ["20"])[0]
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise invalid_request("limit must be an integer from 1 to 100.", param="limit")
        order = (query.get("order") or ["desc"])[0]
        if order not in ("asc", "desc"):
            raise invalid_request("order must be asc or desc.", param="order")
        response_id = self.scope["url_route"]["kwargs"]["response_id"]
        stored = await _stored(self.checked_key.tenant_id, response_id)
        listed: list[dict[str, Any]] = list(stored.input_items)
        if order == "desc":
            listed.reverse()
        after = (query.get("after") or [None])[0]
        if after is not None:
            ids = [item.get("id") for item in listed]
            if after not in ids:
                raise invalid_request(f"No input item with id '{after}'.", param="after")
            listed = listed[ids.index(after) + 1 :]
        page = listed[: int(limit_text)]
        answer = {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(listed) > len(page),
        }
        await self.send_response(200, orjson.dumps(answer), headers=[JSON])
