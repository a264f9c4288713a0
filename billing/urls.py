from django.urls import path

from billing import apis, webhooks

app_name = "billing"

urlpatterns = [
    path("usage/", apis.UsageApi.as_view(), name="usage"),
    path("costs/", apis.CostsApi.as_view(), name="costs"),
    path("stripe/webhook/", webhooks.stripe_webhook, name="stripe-webhook"),
    path("tenants/<slug:slug>/usage.csv", apis.UsageExportApi.as_view(), name="usage-csv"),
    path("tenants/<slug:slug>/invoices/", apis.InvoiceListApi.as_view(), name="invoice-list"),
    path(
        "tenants/<slug:slug>/invoices/finalize/",
        apis.InvoiceFinalizeApi.as_view(),
        name="invoice-finalize",
    ),
    path(
        "tenants/<slug:slug>/invoices/<int:invoice_id>/",
        apis.InvoiceDetailApi.as_view(),
        name="invoice-detail",
    ),
    path(
        "tenants/<slug:slug>/invoices/<int:invoice_id>/lines.csv",
        apis.InvoiceLinesCsvApi.as_view(),
        name="invoice-lines-csv",
    ),
    path(
        "tenants/<slug:slug>/invoices/<int:invoice_id>/void/",
        apis.InvoiceVoidApi.as_view(),
        name="invoice-void",
    ),
]
