from django.contrib import admin
from django.http import HttpRequest, HttpResponseRedirect, JsonResponse
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane import auth_apis


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def favicon(request: HttpRequest) -> HttpResponseRedirect:
    """Pages name their icon; this is for clients that ask for the conventional path anyway
    (resolved per request: the static files' manifest is read when it exists)."""
    return HttpResponseRedirect(static("dashboard/favicon.svg"))


# The Swagger UI page with the CSP nonce on its inline set-up script and style.
swagger_ui = SpectacularSwaggerView.as_view(
    url_name="schema", template_name="dashboard/swagger_ui.html"
)

api_patterns = [
    path("auth/token/", auth_apis.TokenCreateApi.as_view(), name="token-create"),
    path("auth/token/revoke/", auth_apis.TokenRevokeApi.as_view(), name="token-revoke"),
    path("auth/token/revoke-all/", auth_apis.TokenRevokeAllApi.as_view(), name="token-revoke-all"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", swagger_ui, name="docs"),
    path("schema/swagger-ui/", swagger_ui, name="swagger-ui"),  # drf-spectacular's usual URL
    path("", include("billing.urls")),
    path("", include("tenants.urls")),
    path("", include("adapters.urls")),
    path("", include("inference.urls")),
    path("", include("moderation.urls")),
]

urlpatterns = [
    path("", RedirectView.as_view(url="/app/", permanent=False)),
    path("app/", include("dashboard.urls")),
    path("healthz", healthz, name="healthz"),
    path("favicon.ico", favicon),
    path("admin/", admin.site.urls),
    path("api/", include(api_patterns)),
    path("", include("batches.urls")),  # /v1/files, /v1/batches
]
