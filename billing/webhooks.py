"""Stripe's webhook endpoint. Not under session or token auth: Stripe signs each call."""

from __future__ import annotations

import logging

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from billing.stripe_sync import (
    EventDeferred,
    WebhookRejected,
    stripe_event_apply,
    stripe_event_verify,
)

log = logging.getLogger(__name__)

MAX_BODY = 512 * 1024  # Stripe's events are a few KB


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    if len(request.body) > MAX_BODY:
        return JsonResponse({"error": "Payload too large."}, status=413)
    try:
        event = stripe_event_verify(
            payload=request.body, signature=request.headers.get("Stripe-Signature", "")
        )
    except WebhookRejected as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    try:
        outcome = stripe_event_apply(event=event)
    except EventDeferred as exc:
        # Non-2xx: Stripe delivers it again later, once what it refers to has arrived.
        log.info("stripe event %s deferred: %s", event.id, exc)
        return JsonResponse({"deferred": str(exc)}, status=409)
    log.info("stripe event %s (%s): %s", event.id, event.type, outcome)
    return JsonResponse({"received": True, "outcome": outcome})
