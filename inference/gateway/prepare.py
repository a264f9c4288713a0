"""Everything before the engine: validate, resolve the model, take the limits, run the
guard's rules, wait for admission to a replica. ``prepare`` returns the ``Call`` the other
phases take; an ``ApiError`` here leaves nothing held."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from django.conf import settings
from redis.exceptions import RedisError

from billing.pricing import price_of
from contract import (
    Catalog,
    Servable,
    UsageRecord,
    price_in_force,
)
from controlplane.logs import request_id_new, request_id_var
from inference.gateway import cache, cache_semantic, limits, metrics
from inference.gateway.admission import BANDS, DEFAULT_BAND
from inference.gateway.admit import (
    admit_to,
    borrow_or_admit,
    give_back,
    release_quietly,
    take_and_admit,
)
from inference.gateway.auth import KeyInfo
from inference.gateway.call import Adapter, Call, Route, State
from inference.gateway.catalog import catalog_view
from inference.gateway.checks import check_content_parts, check_max_tokens
from inference.gateway.errors import ApiError, invalid_request, model_not_found, overloaded
from inference.gateway.priority import request_class
from inference.gateway.salt import cache_salt, salted_prefix
from inference.gateway.schema import PREFILL_ONLY, ParsedRequest, parse_request, upstream_body
from tenants.priority import band

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_ESTIMATE = 256  # tokens assumed when max_tokens is not given


# How the semantic cache embeds a request's text: (the embedding model, the text) -> its
# vector, or None when it cannot be had (the lookup is then exact only).
Embed = Callable[[str, str], Awaitable[list[float] | None]]

# What runs before admission (``prepare``): (the request's id, the request as validated, its
# response-cache ticket, which the screen may turn to a bypass) -> None to let it queue for a
# replica, or the refusal the client gets.
Screen = Callable[[str, ParsedRequest, "cache.Ticket | None"], Awaitable[str | None]]


def _resolve(
    catalog: Catalog, name: str, key: KeyInfo, pool: str | None = None, endpoint: str = ""
) -> tuple[str, Servable, Adapter | None]:
    """(pool, what the tenant calls, adapter) for the ``model`` a request names
    (``Catalog.callable`` decides what a tenant may call): for a routed name (a canary), the
    target this request drew, which it keeps to its end. ``pool`` names the pool to run on
    instead of the model's online one (a batch line on a spot pool)."""
    target = catalog.route(name, random.random())  # noqa: S311 (a traffic split, not a secret)
    found = catalog.callable(target, key.tenant_id, routed=False)
    if found is None:
        raise model_not_found(name)
    _check_task(name, found.model.task, endpoint)
    adapter = None
    if found.adapter is not None:
        if not found.adapter.path:
            raise ApiError(
                503,
                f"`{name}` cannot be loaded onto the engines: adapter storage has no "
                "local files (see docs/adapters.md on adapter storage).",
                type="server_error",
                code="adapter_unavailable",
            )
        engine_name = found.adapter.engine_name
        adapter = Adapter(
            engine_name=engine_name,
            label=engine_name.rpartition("/")[2],
            path=found.adapter.path,
        )
    if pool is not None:
        given = catalog.pools.get(pool)
        if given is None or given.model != found.base:
            raise ApiError(
                503, f"Pool `{pool}` does not serve `{name}`.", type="server_error", code="no_pool"
            )
        return pool, found, adapter
    if found.pool is None:
        raise ApiError(
            503, f"No online pool serves `{name}` right now.", type="server_error", code="no_pool"
        )
    return found.pool, found, adapter


def _check_task(name: str, task: str, endpoint: str) -> None:
    """Each endpoint takes the models of its task (a pool's engine runs one runner)."""
    wanted = "embed" if endpoint in PREFILL_ONLY else "generate"
    if task == wanted:
        return
    if task == "classify":
        why = "is a classification model: it moderates text (POST /v1/moderations)"
    elif task == "embed":
        why = "is an embedding model: it embeds text (POST /v1/embeddings)"
    else:
        why = "writes text (POST /v1/chat/completions, /v1/completions)"
    does = "it does not write any" if wanted == "generate" else "it makes no embeddings"
    raise invalid_request(
        f"`{name}` {why}; {does}. GET /v1/models lists each model's task.", param="model"
    )


async def prepare(
    *,
    key: KeyInfo,
    raw_body: bytes,
    endpoint: str,
    pool: str | None = None,
    mode: str = "online",
    ledger: Callable[[UsageRecord], None] | None = None,
    whole: bool = False,
    rid: str = "",
    screen: Screen | None = None,
    surface: str = "",
    asked: cache.Directives | None = None,
    embed: Embed | None = None,
    lend: str | None = None,
    lend_open: Callable[[], bool] | None = None,
) -> Call:
    """Everything before the engine, for a request whose key was authenticated; on the
    model's online pool, or on ``pool`` (by name) when given. ``mode``, ``ledger`` and
    ``whole``: see ``Call``; ``rid``: the request's id, if the transport made it already;
    ``surface``: the public endpoint, when the request runs as another (``ParsedRequest``);
    ``asked``: what the request's headers ask of the response cache (``cache.Directives``).
    An answer the cache holds takes no replica: the call comes back with a ``hit`` ticket.
    ``lend``: an online pool that lends idle room (a batch line's model's): the call runs
    there if it lends room now (``Admission.borrow``), else on ``pool`` — or, when ``pool``
    is that pool itself (no spot pool), once it lends room, within the pool's queue wait
    (a 503 after it). A call waiting in ``pool``'s queue takes room ``lend`` has first
    (``lending.queue_or_borrow``), while ``lend_open`` says it may still ask.

    ``screen`` runs once the limits are taken (a refused request still counts toward the
    key's request rate) and before admission: what it refuses never waits for a replica.
    The call it refused comes back ``FILTERED``, holding no slot, its refusal as its error
    (the caller settles it: a ledger record with no tokens)."""
    t0 = time.perf_counter()
    started_at = datetime.now(UTC)
    parsed = parse_request(raw_body, endpoint)
    parsed.surface = surface
    view = catalog_view()
    catalog = await view.for_tenant(key.tenant_id)
    pool_name, found, adapter = _resolve(catalog, parsed.model, key, pool, endpoint)
    priority = parsed.priority = request_class(key, parsed.body.get("service_tier"), mode=mode)
    model = found.model
    pool_info = catalog.pools[pool_name]
    lender = catalog.pools.get(lend) if lend is not None else None
    if lender is not None and (lender.model != found.base or not lender.lend_percent):
        lender = None  # it serves another model now, or lends nothing
    if lend == pool_name and lender is None:
        raise overloaded(5, f"Pool `{pool_name}` lends no room to batch work.")
    _check_fits(parsed, pool_info.max_inflight)
    check_content_parts(
        parsed,
        images=model.accepts_images,
        audio=model.accepts_audio,
        url_domains=settings.INFERPLANE_MEDIA_URL_DOMAINS,
    )
    prefill_only = endpoint in PREFILL_ONLY  # answered whole; nothing generated
    whole = whole or prefill_only
    max_tokens = (
        None
        if prefill_only
        else check_max_tokens(
            parsed,
            context_length=model.context_length,
            tenant_cap=key.limit("max_tokens_per_request"),
        )
    )
    # The id the transport made for this request (its early answers carried it), else a new
    # one; from here on every line this task logs carries it (controlplane.logs).
    if rid:
        request_id_var.set(rid)
    else:
        rid = request_id_new()
    salt = cache_salt(key.tenant_id, parsed.body.get("cache_salt"))
    served_name = adapter.engine_name if adapter else model.served_name
    # Before anything is held: a body the engine cannot be sent is refused with nothing to
    # give back.
    body = upstream_body(
        parsed, served_name=served_name, max_tokens=max_tokens, cache_salt=salt, whole=whole
    )
    # What a cached answer must have been made by: the adapter's version, or the base
    # model as the engines serve it (a model made again under the name is another).
    version = f"{found.name}|{served_name}|{model.created}"
    ticket = cache.ticket(
        key, parsed, version=version, max_tokens=max_tokens, asked=asked, mode=mode
    )
    completion_estimate = (
        0 if prefill_only else parsed.sequences * (max_tokens or DEFAULT_COMPLETION_ESTIMATE)
    )
    rates = price_in_force(model.prices, tenant_id=key.tenant_id, at=started_at.timestamp())
    planned = limits.plan(
        key,
        rid=rid,
        estimate=parsed.prompt_estimate + completion_estimate,
        sequences=parsed.sequences,
        estimated_cost=price_of(
            rates,
            prompt_tokens=parsed.prompt_estimate,
            completion_tokens=completion_estimate,
            batch=mode == "batch",
            priority=priority,
        ),
    )
    prefix = salted_prefix(salt, parsed.prefix_hash)
    refusal: str | None = None
    replica, lent = "", False  # refused, or answered from the cache: never sent
    if (
        screen is None
        and lender is None
        and (ticket is None or not (ticket.read or ticket.semantic is not None))
        # A pool that lends room takes it back for a request that would wait: not for one
        # its limits may refuse.
        and not pool_info.lend_percent
        and not limits.refused_lately(key)
    ):
        # Nothing decides between the limits and admission: both go in one round trip.
        queued_at = time.perf_counter()
        grant, replica = await take_and_admit(
            view, pool_name, pool_info, planned, key, parsed, adapter, prefix, priority
        )
    else:
        grant = await limits.take(planned)
        queued_at = time.perf_counter()
        try:
            if screen is not None:
                refusal = await screen(rid, parsed, ticket)
            if refusal is None and ticket is not None and ticket.read:
                await _look_up(ticket)
            if refusal is None and ticket is not None and not ticket.hit and ticket.store:
                await _look_up_similar(ticket, embed)
            if refusal is None and not (ticket is not None and ticket.hit):
                if lender is not None and lend is not None:
                    replica, lent = await borrow_or_admit(
                        view,
                        pool_name,
                        pool_info,
                        lend,
                        lender,
                        lend_open or (lambda: True),
                        rid,
                        key,
                        parsed,
                        grant,
                        adapter,
                        prefix,
                        priority,
                    )
                    if lent:
                        pool_name, pool_info = lend, lender
                else:
                    replica = await admit_to(
                        view,
                        pool_name,
                        pool_info,
                        rid,
                        key,
                        parsed,
                        grant,
                        adapter,
                        prefix,
                        priority,
                    )
        except BaseException:
            await asyncio.shield(release_quietly(grant))
            raise
    # A replica newer than our copy of the catalog.
    if replica and replica not in pool_info.replicas:
        try:
            await view.refresh()
        except BaseException:  # the slot is ours already: give it back with the limits
            await asyncio.shield(give_back(pool_name, rid, grant))
            raise
        pool_info = (view.data or catalog).pools.get(pool_name, pool_info)
    call = Call(
        rid=rid,
        key=key,
        parsed=parsed,
        route=Route(
            pool=pool_name,
            replicas=pool_info.replicas,
            replica=replica,
            max_loras=pool_info.max_loras,
            # Pools that lend schedule by priority: lent work after every band.
            engine_priority=(
                (BANDS if lent else band(priority)) - DEFAULT_BAND
                if pool_info.lend_percent
                else None
            ),
            lent=lent,
        ),
        served_name=served_name,
        grant=grant,
        body=body,
        started_at=started_at,
        t0=t0,
        headers=[
            (b"x-request-id", rid.encode()),
            *grant.headers,
            *(ticket.headers() if ticket is not None else ()),
        ],
        rates=rates,
        base_model=found.base,
        adapter=adapter,
        routed_name=parsed.model if parsed.model in catalog.routes else "",
        mode=mode,
        ledger=ledger,
        whole=whole,
        cache=ticket,
        priority=priority,
    )
    if refusal is not None:
        call.fail(refusal, outcome=State.FILTERED)
        return call
    if ticket is not None and ticket.hit:
        return call  # it waited for no replica
    call.queue_wait = time.perf_counter() - queued_at
    metrics.queue_waited(
        pool=pool_name, tenant_slug=key.tenant_slug, priority=priority, seconds=call.queue_wait
    )
    return call


def _check_fits(parsed: ParsedRequest, capacity: int) -> None:
    """A request is as many sequences as the engine will run for it (prompts x n); one that
    a replica cannot run at once would hold a whole replica, or wait forever: refused."""
    if parsed.sequences > capacity and parsed.endpoint in PREFILL_ONLY:
        raise invalid_request(
            f"This request has {parsed.sequences} inputs; a replica of this model embeds at "
            f"most {capacity} at once. Send fewer inputs per request.",
            param="input",
            code="request_too_large",
        )
    if parsed.sequences > capacity:
        shape = f"{parsed.prompts} prompts x n={parsed.sequences // parsed.prompts}"
        raise invalid_request(
            f"This request runs {parsed.sequences} sequences at once ({shape}); a replica "
            f"of this model runs at most {capacity}. Send fewer prompts or a smaller n.",
            param="n" if parsed.prompts == 1 else "prompt",
            code="request_too_large",
        )


async def _look_up(ticket: cache.Ticket) -> None:
    """A miss when Redis cannot say: the engine answers, as without a cache."""
    try:
        await cache.lookup(ticket)
    except RedisError:
        log.warning("response cache unavailable", exc_info=True)
        cache.pass_by(ticket, "unavailable")


async def _look_up_similar(ticket: cache.Ticket, embed: Embed | None) -> None:
    """A single-turn request of a semantic cache: its text embedded (on the tenant's
    embedding model, as the tenant's own request) and looked up among its partition's."""
    semantic = ticket.semantic
    if semantic is None or embed is None:
        return
    values = await embed(semantic.model, semantic.text)
    if not values:
        ticket.semantic, ticket.reason = None, "semantic-unavailable"
        return
    try:
        await cache_semantic.lookup_similar(ticket, cache_semantic.unit_vector(values))
    except (RedisError, ValueError):
        log.warning("semantic cache unavailable", exc_info=True)
        ticket.semantic, ticket.reason = None, "semantic-unavailable"
