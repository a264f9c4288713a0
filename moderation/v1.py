"""``POST /v1/moderations`` in OpenAI's shape, through the tenant's cascade.

The input is a string, a list of strings, or a list of content parts (text only: this
deployment's checks read text). ``model`` may name a guard model the tenant may call (its
scores are then the guard's), or OpenAI's own names (``omni-moderation-latest``,
``text-moderation-latest``), which mean the tenant's policy; without a policy, the default
one (the embedded classifier, every category at 0.8). Limited and metered as a request: the
key's request rate and concurrency apply, and the ledger gets one record with the guard
model's tokens, as its engines counted them (none for the rules or the embedded classifier),
counted toward the key's token and spend budgets at the guard model's price.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract import UsageRecord
from inference.gateway import limits, metering, metrics
from inference.gateway.catalog import catalog_view
from inference.gateway.errors import ApiError, invalid_request, model_not_found
from inference.gateway.lua import Batch
from inference.gateway.v1 import JSON, GatewayHttpConsumer
from moderation.cascade import Cascade, GuardUse
from moderation.categories import CATEGORIES
from moderation.guard import MODEL_NAME
from moderation.policy import CategoryRule, PolicySpec
from moderation.policy_view import policy_view
from moderation.records import guard_cost, moderation_checked
from moderation.services import DEFAULT_THRESHOLD
from tenants.priority import band

MAX_INPUTS = 32
GUARD_SECONDS = 10.0  # what /v1/moderations gives a guard model it names
MAX_INPUT_CHARS = 32_000
OPENAI_MODELS = frozenset(
    {"omni-moderation-latest", "omni-moderation-2024-09-26", "text-moderation-latest",
     "text-moderation-stable", MODEL_NAME}
)  # fmt: skip


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_INPUT_CHARS)]


class _ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: dict[str, Any]


Text = Annotated[str, Field(max_length=MAX_INPUT_CHARS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[_TextPart | _ImagePart], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    model: Annotated[str, Field(min_length=1, max_length=300)] | None = None


def _default_spec() -> PolicySpec:
    return PolicySpec(
        categories={c: CategoryRule(threshold=DEFAULT_THRESHOLD, action="flag") for c in CATEGORIES}
    )


_DEFAULT: dict[str, Cascade] = {}


def parse(body: bytes) -> tuple[list[str], str | None]:
    try:
        request = _Request.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("list[", "str")))
        if first["type"] == "json_invalid":
            raise invalid_request("We could not parse the JSON body of your request.") from None
        raise invalid_request(
            f"Invalid value for {where or 'the body'}: {first['msg']}. 'input' is a string, "
            "a list of strings, or a list of text parts.",
            param=where.split(".")[0] or None,
        ) from None
    given = request.input
    if isinstance(given, str):
        return [given], request.model
    texts: list[str] = []
    for item in given:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, _TextPart):
            texts.append(item.text)
        else:
            raise invalid_request(
                "Image inputs are not supported by this deployment's moderation; send text.",
                param="input",
            )
    return texts, request.model


class ModerationsConsumer(GatewayHttpConsumer):
    endpoint = "moderations"

    async def handle_request(self, body: bytes) -> None:
        started, t0 = datetime.now(UTC), time.perf_counter()
        key = self.checked_key
        texts, model = parse(body)
        cascade = await policy_view().cascade(key.tenant_id)
        if cascade is None:
            cascade = _DEFAULT.setdefault("", Cascade(0, _default_spec()))
        name = model or "omni-moderation-latest"
        if model is not None and model not in OPENAI_MODELS:
            catalog = await catalog_view().for_tenant(key.tenant_id)
            servable = catalog.callable(model, key.tenant_id)
            if servable is None:
                raise model_not_found(model)
            if servable.model.task != "classify":
                raise invalid_request(
                    f"`{model}` is not a moderation model: name a classification model, or "
                    "omni-moderation-latest for this organization's policy.",
                    param="model",
                )
            # The guard's scores alone, against the policy's thresholds.
            only_guard = msgspec.structs.replace(
                cascade.spec,
                guard_model=model,
                classifier=False,
                deny_terms=[],
                regexes=[],
                pii_action="off",
            )
            cascade = Cascade(key.tenant_id, only_guard)
        rid = self.rid
        # the guard's tokens, as its engines count them; checked in the key's band
        use = GuardUse(weight=key.weight, band=band(key.priority))
        grant = await limits.acquire(key, rid=rid, estimate=0)
        self.ran = True  # metered from here on, whatever happens
        status = "error"
        try:
            named = model is not None and model not in OPENAI_MODELS
            # A guard named by the caller: asked however it did a moment ago, given time.
            deadline = time.monotonic() + (
                GUARD_SECONDS if named else cascade.spec.budget_ms / 1000
            )
            checked = time.perf_counter()
            assessed = await cascade.assess(texts, deadline=deadline, asked=named, use=use)
            for found in assessed:
                moderation_checked("api", found, time.perf_counter() - checked)
            failed = next((a.failure for a in assessed if a.failure), "")
            if failed and named:
                # The caller named the guard: its scores, not the policy's fallback, or none.
                raise ApiError(
                    503, f"Moderation is unavailable: {failed}.", type="server_error",
                    code="moderation_unavailable",
                )  # fmt: skip
            answer = {
                "id": f"modr-{rid}",
                "model": name,
                "results": [f.result() for f in assessed],
            }
            status = "ok"
        finally:
            record = UsageRecord(
                request_id=rid,
                tenant_id=key.tenant_id,
                api_key_id=key.key_id,
                model=cascade.guard_model or MODEL_NAME,
                endpoint="moderations",
                status=status,
                prompt_tokens=use.tokens,
                pool=use.pool,
                replica=use.replica,
                duration_ms=int((time.perf_counter() - t0) * 1000),
                started_at=started,
                finished_at=datetime.now(UTC),
            )
            metrics.moderation_request(
                tenant_slug=key.tenant_slug, model=record.model, status=status
            )
            pipe = Batch()
            # The guard's tokens count toward the key's limits and budgets, at their price.
            grant.release_into(pipe, use.tokens, await guard_cost(key, record.model, use.tokens))
            metering.spool_into(pipe, record)
            await pipe.execute()
        await self.send_response(200, orjson.dumps(answer), headers=[JSON, *grant.headers])
