from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Billing (prices, usage ledger, invoices)"

    def ready(self) -> None:
        # The receivers that queue the Stripe side of invoices (billing.signals).
        from billing import tasks  # noqa: F401
