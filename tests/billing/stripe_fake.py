"""Stripe's servers, recorded: the one thing faked in this suite, and only at the ``stripe``
library's HTTP-client layer. Everything above it (the library's request building, retries,
idempotency headers, response parsing) runs for real.

Responses are shaped like Stripe's (API version 2026-10-28.endive, the library's): the
ids, objects and fields our code reads are the ones Stripe returns.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlparse

import stripe


@dataclass
class Call:
    method: str
    path: str
    params: dict[str, str]
    idempotency_key: str | None


class RecordedStripe(stripe.HTTPClient):
    """Answers like Stripe, and replays the first answer for a repeated idempotency key."""

    name = "recorded"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.fail_on: str | None = None  # a path prefix that fails once (a crash mid-push)
        self._replies: dict[str, tuple[str, int]] = {}
        self._ids = 0
        # What Stripe knows of payments: the payment intent that pays each finalized invoice.
        self.payment_intents: dict[str, str] = {}
        self.created: list[str] = []  # ids of the objects Stripe really created

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None,
        post_data: Any = None,
        *,
        _usage: list[str] | None = None,
    ) -> tuple[str, int, Mapping[str, str]]:
        parsed = urlparse(url)
        path = parsed.path
        params = dict(parse_qsl(post_data or parsed.query or "", keep_blank_values=True))
        key = (headers or {}).get("Idempotency-Key")
        self.calls.append(Call(method.upper(), path, params, key))
        if key and key in self._replies:
            body, status = self._replies[key]
            return body, status, {"request-id": "req_replayed", "idempotent-replayed": "true"}
        if self.fail_on and path.startswith(self.fail_on):
            self.fail_on = None
            raise stripe.APIConnectionError("connection reset (recorded failure)")
        body, status = self._answer(path, params)
        if method.upper() == "POST" and status == 200 and path.count("/") == 2:
            self.created.append(json.loads(body)["id"])
        if key:
            self._replies[key] = (body, status)
        return body, status, {"request-id": f"req_{len(self.calls)}"}

    def close(self) -> None:
        pass

    def _id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}_Test{self._ids:06d}"

    def _answer(self, path: str, p: dict[str, str]) -> tuple[str, int]:
        now = int(time.time())
        if path == "/v1/customers":
            obj: dict[str, Any] = {
                "id": self._id("cus"),
                "object": "customer",
                "created": now,
                "name": p.get("name"),
                "email": p.get("email"),
                "livemode": False,
                "metadata": _metadata(p),
            }
        elif path == "/v1/invoices":
            obj = _invoice(self._id("in"), p.get("customer", ""), "draft", now)
        elif path == "/v1/invoiceitems":
            obj = {
                "id": self._id("ii"),
                "object": "invoiceitem",
                "amount": int(p["amount"]),
                "currency": p["currency"],
                "customer": p["customer"],
                "description": p.get("description"),
                "invoice": p.get("invoice"),
                "livemode": False,
                "metadata": _metadata(p),
            }
        elif path.endswith("/finalize"):
            obj = _invoice(path.split("/")[3], "cus_x", "open", now)
            obj["hosted_invoice_url"] = f"https://invoice.stripe.com/i/acct_test/{obj['id']}"
            self.payment_intents[obj["id"]] = self._id("pi")
        elif path == "/v1/invoice_payments":
            wanted = p.get("payment[payment_intent]")
            obj = {
                "object": "list",
                "url": "/v1/invoice_payments",
                "has_more": False,
                "data": [
                    {
                        "id": f"inpay_{pi}",
                        "object": "invoice_payment",
                        "invoice": invoice_id,
                        "is_default": True,
                        "livemode": False,
                        "status": "paid",
                        "payment": {"type": "payment_intent", "payment_intent": pi},
                    }
                    for invoice_id, pi in self.payment_intents.items()
                    if pi == wanted
                ],
            }
        elif path.endswith("/void"):
            obj = _invoice(path.split("/")[3], "cus_x", "void", now)
        else:
            error = {"error": {"type": "invalid_request_error", "message": f"No route {path}"}}
            return json.dumps(error), 404
        return json.dumps(obj), 200


def _metadata(p: dict[str, str]) -> dict[str, str]:
    return {k[9:-1]: v for k, v in p.items() if k.startswith("metadata[")}


def _invoice(invoice_id: str, customer: str, status: str, now: int) -> dict[str, Any]:
    return {
        "id": invoice_id,
        "object": "invoice",
        "customer": customer,
        "status": status,
        "currency": "usd",
        "collection_method": "send_invoice",
        "created": now,
        "livemode": False,
        "hosted_invoice_url": None,
        "metadata": {},
    }


def signed(payload: dict[str, Any], secret: str, *, at: int | None = None) -> tuple[bytes, str]:
    """A webhook body and its Stripe-Signature header, signed as Stripe signs."""
    body = json.dumps(payload).encode()
    ts = at or int(time.time())
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return body, f"t={ts},v1={mac}"


def event(event_id: str, kind: str, obj: dict[str, Any], *, created: int) -> dict[str, Any]:
    return {
        "id": event_id,
        "object": "event",
        "api_version": "2026-10-28.endive",
        "created": created,
        "type": kind,
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "data": {"object": obj},
    }
