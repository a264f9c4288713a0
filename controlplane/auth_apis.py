"""User tokens for the control API (knox: stored hashed, expiring, revocable per device)."""

from typing import Any

from drf_spectacular.authentication import BasicScheme
from drf_spectacular.utils import extend_schema, inline_serializer
from knox.views import LoginView, LogoutAllView, LogoutView
from rest_framework import exceptions, serializers
from rest_framework.authentication import BasicAuthentication
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.login_throttle import api_lockout_error


class ThrottledBasicAuthentication(BasicAuthentication):
    """HTTP Basic for the token exchange, answering 429 (not 401) while axes has the
    username or the client address locked out after repeated failures."""

    def authenticate_credentials(
        self, userid: str, password: str, request: Request | None = None
    ) -> tuple[Any, None]:
        try:
            return super().authenticate_credentials(userid, password, request)
        except exceptions.AuthenticationFailed:
            # axes flags the request it refused (or the failure that reached the limit).
            if getattr(request, "axes_locked_out", False):
                raise api_lockout_error(request) from None
            raise


class ThrottledBasicScheme(BasicScheme):
    """In the OpenAPI schema it is HTTP Basic, as before."""

    target_class = "controlplane.auth_apis.ThrottledBasicAuthentication"


class TokenCreateApi(LoginView):
    authentication_classes = [ThrottledBasicAuthentication]

    @extend_schema(
        summary="Exchange a username and password (HTTP Basic) for a user token",
        request=None,
        responses=inline_serializer(
            "UserToken",
            {"expiry": serializers.DateTimeField(), "token": serializers.CharField()},
        ),
    )
    def post(self, request: Request, format: Any = None) -> Response:
        response: Response = super().post(request, format)
        return response


class TokenRevokeApi(LogoutView):
    @extend_schema(
        summary="Revoke the token used for this request", request=None, responses={204: None}
    )
    def post(self, request: Request, format: Any = None) -> Response:
        response: Response = super().post(request, format)
        return response


class TokenRevokeAllApi(LogoutAllView):
    @extend_schema(summary="Revoke every token of this user", request=None, responses={204: None})
    def post(self, request: Request, format: Any = None) -> Response:
        response: Response = super().post(request, format)
        return response
