"""What the Responses API keeps for a tenant: each stored response, the input it was given and
the conversation it ends, so that ``previous_response_id`` continues it from any web process,
after any restart (the engines keep nothing)."""

from __future__ import annotations

from django.db import models

from tenants.models import Tenant


class StoredResponse(models.Model):
    # ``resp_`` and 48 hex digits (192 random bits): nobody guesses another's, and every
    # read filters by tenant as well.
    id = models.CharField(primary_key=True, max_length=64)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    api_key_id = models.BigIntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=64, blank=True)  # the ledger record's
    model = models.CharField(max_length=300)
    # The response object as it was answered (OpenAI's shape).
    body = models.JSONField()
    # This request's input items, each with its id (GET …/input_items).
    input_items = models.JSONField(default=list)
    # The chat messages the next response in the chain starts from: every earlier input and
    # output, but not the instructions (OpenAI's rule: they are not carried over).
    conversation = models.JSONField(default=list)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"])]

    def __str__(self) -> str:
        return self.id
