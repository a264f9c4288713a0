from __future__ import annotations

from django.db import models


class UsageRecord(models.Model):
    """One served request, as the engine counted it. Immutable; ``request_id`` is unique.

    Written in batches from the Redis spool the gateway fills (never on the request path),
    idempotently: replaying the spool cannot double-count.
    """

    class Mode(models.TextChoices):
        ONLINE = "online", "Online"
        BATCH = "batch", "Batch"

    class Status(models.TextChoices):
        OK = "ok", "Completed"
        CUT_OFF = "cut_off", "Cut off (client left)"
        ERROR = "error", "Error"
        CONTENT_FILTER = "content_filter", "Stopped by moderation"
        CACHE_HIT = "cache_hit", "Answered from the response cache"

    request_id = models.CharField(max_length=64, unique=True)
    # No foreign-key constraints and no single-column indexes on the ledger: the insert itself
    # checks that each record's tenant and key exist (``usage_records_insert``), tenants and
    # keys are never deleted (suspended, revoked), and Django's PROTECT still refuses a delete
    # through the ORM. The deferred constraint checks cost as much as the rest of an insert
    # together, and every read by tenant uses (tenant, started_at) (bench/scale.py).
    tenant = models.ForeignKey(
        "tenants.Tenant",
        on_delete=models.PROTECT,
        related_name="+",
        db_constraint=False,
        db_index=False,
    )
    api_key = models.ForeignKey(
        "tenants.ApiKey",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        db_constraint=False,
        db_index=False,
    )
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True)
    # The routed name asked for when a route (a canary) picked the target: model and adapter
    # then name the target that served it.
    route = models.CharField(max_length=200, blank=True)
    endpoint = models.CharField(max_length=32)
    mode = models.CharField(max_length=8, choices=Mode.choices, default=Mode.ONLINE)
    status = models.CharField(max_length=16, choices=Status.choices)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    cost_micros = models.BigIntegerField(null=True, blank=True)
    pool = models.CharField(max_length=64, blank=True)
    replica = models.CharField(max_length=200, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(default=0)
    error = models.CharField(max_length=300, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    # The priority class it ran in (tenants.priority): a class can carry its own price.
    priority = models.CharField(max_length=16, default="standard")

    class Meta:
        # Reads by tenant and time use the btree; reads by time alone (month closing,
        # reconciliation windows) use BRIN indexes on started_at and finished_at, which the
        # ledger's append order keeps tiny (PostgreSQL only: migration 0003).
        indexes = [
            models.Index(fields=["tenant", "started_at"], name="usage_tenant_started"),
            # The dashboard's "recent problems": small, since most requests end well (a hit
            # of the response cache is not a problem).
            models.Index(
                fields=["tenant", "-started_at"],
                condition=~models.Q(status__in=["ok", "cache_hit"]),
                name="usage_tenant_problems",
            ),
        ]

    def __str__(self) -> str:
        return self.request_id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Price(models.Model):
    """What a model costs, per 1M tokens in US dollars, from ``effective_from`` on.

    A price per 1M tokens in dollars is also the price of one token in micro-dollars, the
    unit of the ledger. ``tenant`` set makes it that tenant's contract price, which wins
    over the list price (tenant blank) in force at the same moment. Rows are never edited
    once in force: a new price is a new row, so a change never rewrites history.
    """

    model = models.ForeignKey("fleet.Model", on_delete=models.PROTECT, related_name="prices")
    tenant = models.ForeignKey(
        "tenants.Tenant",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="Blank: the list price. Set: this tenant's contract price.",
    )
    input_per_mtok = models.DecimalField(max_digits=14, decimal_places=6)
    cached_input_per_mtok = models.DecimalField(max_digits=14, decimal_places=6)
    output_per_mtok = models.DecimalField(max_digits=14, decimal_places=6)
    batch_discount_percent = models.DecimalField(
        max_digits=5, decimal_places=2, default=0, help_text="Off every batch-mode token."
    )
    # The priority classes' own prices (docs/priority.md): standard pays the price as it is.
    interactive_surcharge_percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=0,
        help_text="On every token of an online request in the interactive class.",
    )
    background_discount_percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=0,
        help_text="Off every token of an online request in the background class.",
    )
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "tenant", "-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "tenant", "effective_from"], name="price_unique_start"
            ),
            models.UniqueConstraint(
                fields=["model", "effective_from"],
                condition=models.Q(tenant__isnull=True),
                name="list_price_unique_start",
            ),
            models.CheckConstraint(
                condition=models.Q(input_per_mtok__gte=0)
                & models.Q(cached_input_per_mtok__gte=0)
                & models.Q(output_per_mtok__gte=0)
                & models.Q(batch_discount_percent__gte=0)
                & models.Q(batch_discount_percent__lte=100)
                & models.Q(interactive_surcharge_percent__gte=0)
                & models.Q(background_discount_percent__gte=0)
                & models.Q(background_discount_percent__lte=100),
                name="price_not_negative",
                violation_error_message=(
                    "Prices and the interactive surcharge cannot be negative, and the batch "
                    "and background discounts must be 0-100 percent."
                ),
            ),
        ]

    def __str__(self) -> str:
        who = f" for {self.tenant_id}" if self.tenant_id else ""
        return f"{self.model_id}{who} from {self.effective_from:%Y-%m-%d %H:%M}"


class DailyUsage(models.Model):
    """The ledger summed per UTC day, tenant, key, model, adapter, mode and priority class.

    A pure function of the ledger: a (tenant, day) is recomputed whole from its records
    whenever records for it are written, so replays and late records cannot skew it.
    Every dashboard and usage API read comes from here.
    """

    day = models.DateField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True)
    mode = models.CharField(max_length=8, choices=UsageRecord.Mode.choices)
    priority = models.CharField(max_length=16, default="standard")  # as UsageRecord's
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    # Requests answered from the tenant's response cache (status cache_hit; no tokens).
    cache_hits = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0)
    unpriced = models.PositiveIntegerField(
        default=0, help_text="Records with no price in force (cost counted as 0)."
    )

    class Meta:
        indexes = [models.Index(fields=["tenant", "day"], name="daily_tenant_day")]

    def __str__(self) -> str:
        return f"{self.day} {self.tenant_id} {self.model} {self.mode}"


class BillingAccount(models.Model):
    """A tenant's identity at the payment processor (one Stripe customer per tenant)."""

    tenant = models.OneToOneField(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="billing_account"
    )
    stripe_customer_id = models.CharField(max_length=64, blank=True)
    email = models.EmailField(blank=True)
    currency = models.CharField(max_length=3, default="usd")

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.stripe_customer_id or 'no customer yet'}"


class Invoice(models.Model):
    """One tenant's usage for one calendar month (UTC), with a line per model and mode.

    Rounding rule: each line's amount is the sum of its records' costs (micro-dollars)
    rounded once, half up, to whole cents; the total is the sum of the line amounts.
    """

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        FINALIZED = "finalized", "Finalized"
        PAID = "paid", "Paid"
        VOID = "void", "Void"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    period_start = models.DateField(help_text="The first day of the month billed.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    currency = models.CharField(max_length=3, default="usd")
    total_cents = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0, help_text="Unrounded sum of the lines.")
    created_at = models.DateTimeField(auto_now_add=True)
    finalized_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    voided_at = models.DateTimeField(null=True, blank=True)
    payment_failed_at = models.DateTimeField(null=True, blank=True)
    refunded_cents = models.BigIntegerField(default=0)
    disputed = models.BooleanField(default=False)
    stripe_invoice_id = models.CharField(max_length=64, blank=True)
    stripe_status = models.CharField(max_length=32, blank=True)
    stripe_hosted_url = models.URLField(max_length=500, blank=True)
    stripe_charge_id = models.CharField(max_length=64, blank=True, db_index=True)
    stripe_payment_intent_id = models.CharField(max_length=64, blank=True, db_index=True)
    # The Stripe event time that last changed this invoice's payment state: an older event
    # arriving late (Stripe does not promise order) must not undo a newer one.
    stripe_state_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-period_start", "tenant"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "period_start"], name="invoice_per_month")
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.period_start:%Y-%m} ({self.status})"


class InvoiceLine(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    model = models.CharField(max_length=200)
    mode = models.CharField(max_length=8, choices=UsageRecord.Mode.choices)
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0)
    amount_cents = models.BigIntegerField(default=0)
    unpriced = models.PositiveBigIntegerField(default=0)
    stripe_invoice_item_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["model", "mode"]
        constraints = [
            models.UniqueConstraint(fields=["invoice", "model", "mode"], name="line_per_item")
        ]

    def __str__(self) -> str:
        return f"{self.model}, {self.mode}"

    @property
    def description(self) -> str:
        return (
            f"{self.model} ({self.mode}): {self.prompt_tokens:,} input, "
            f"{self.cached_tokens:,} of them cached, {self.completion_tokens:,} output tokens"
        )


class StripeEvent(models.Model):
    """Webhook events already applied (Stripe delivers at least once)."""

    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    created = models.DateTimeField()
    received_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"


class EngineCounterSnapshot(models.Model):
    """An engine's own cumulative token counters at one moment (from its /metrics), the
    other side of reconciliation: between two snapshots of one engine process, the ledger's
    tokens for that replica must equal the counters' growth."""

    replica = models.ForeignKey(
        "fleet.Replica", on_delete=models.CASCADE, related_name="counter_snapshots"
    )
    taken_at = models.DateTimeField()
    process_started_at = models.DateTimeField(help_text="Counters restart with the process.")
    prompt_tokens = models.PositiveBigIntegerField()
    generation_tokens = models.PositiveBigIntegerField()
    running = models.PositiveIntegerField(help_text="Requests in flight at that moment.")

    class Meta:
        indexes = [models.Index(fields=["replica", "taken_at"], name="snapshot_replica_taken")]

    def __str__(self) -> str:
        return f"{self.replica_id} at {self.taken_at:%Y-%m-%d %H:%M:%S}"
