"""User tokens for the control API (knox: stored hashed, expiring, revocable per device)."""

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from knox.views import LoginView, LogoutAllView, LogoutView
from rest_framework import serializers
from rest_framework.authentication import BasicAuthentication
from rest_framework.request import Request
from rest_framework.response import Response


class TokenCreateApi(LoginView):
    authentication_classes = [BasicAuthentication]

    @extend_schema(
        summary="Exchange a username and password (HTTP Basic) for a user token",
        request=None,
        responses=inline_serializer(
            "UserToken",
            {"expiry": serializers.DateTimeField(), "token": serializers.CharField()},
        ),
    )
    def post(self, request: Request, format: Any = None) -> Response:
        return super().post(request, format)


class TokenRevokeApi(LogoutView):
    @extend_schema(
        summary="Revoke the token used for this request", request=None, responses={204: None}
    )
    def post(self, request: Request, format: Any = None) -> Response:
        return super().post(request, format)


class TokenRevokeAllApi(LogoutAllView):
    @extend_schema(summary="Revoke every token of this user", request=None, responses={204: None})
    def post(self, request: Request, format: Any = None) -> Response:
        return super().post(request, format)
