"""Control API for a tenant's members and invitations, and who the caller is (``me``)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import paginate, request_user, tenant_access
from tenants import selectors, services
from tenants.access import Perm
from tenants.models import (
    Invitation,
    Role,
    User,
)

# --- Members -------------------------------------------------------------------------------


class MembershipOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    username = serializers.CharField(source="user.username")
    email = serializers.EmailField(source="user.email")
    role = serializers.CharField()
    created_at = serializers.DateTimeField()


class MemberListApi(APIView):
    @extend_schema(responses=MembershipOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug)
        members = selectors.membership_list(tenant=access.tenant)
        return paginate(request, self, members, MembershipOutputSerializer)


class MemberUpdateApi(APIView):
    class InputSerializer(serializers.Serializer[Any]):
        role = serializers.ChoiceField(choices=Role.choices)

    @extend_schema(request=InputSerializer, responses=MembershipOutputSerializer)
    def post(self, request: Request, slug: str, membership_id: int) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        membership = selectors.membership_get(tenant=access.tenant, membership_id=membership_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.membership_change_role(
            membership=membership,
            role=data.validated_data["role"],
            actor=request_user(request),
            actor_role=None if access.is_staff else access.role,
        )
        return Response(MembershipOutputSerializer(membership).data)


class MemberRemoveApi(APIView):
    @extend_schema(request=None, responses={204: None})
    def post(self, request: Request, slug: str, membership_id: int) -> Response:
        access = tenant_access(request, slug)
        membership = selectors.membership_get(tenant=access.tenant, membership_id=membership_id)
        user = request_user(request)
        leaving = membership.user_id == user.pk  # anyone may leave (but not the last owner)
        if not leaving and not access.can(Perm.MEMBERS_MANAGE):
            raise exceptions.PermissionDenied(f"Your role in {slug} does not allow this.")
        services.membership_remove(
            membership=membership,
            actor=user,
            actor_role=None if access.is_staff or leaving else access.role,
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- Invitations -----------------------------------------------------------------------------
# People join a tenant only by accepting an invitation: an owner or admin creates a one-time
# link and passes it on; nothing here says whether an account exists for anyone.


class InvitationOutputSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    role = serializers.CharField()
    status = serializers.SerializerMethodField()
    created_by = serializers.CharField(source="created_by.username", default=None)
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()

    def get_status(self, obj: Invitation) -> str:
        """``pending``, ``accepted``, ``revoked`` or ``expired``."""
        if obj.accepted_at is not None:
            return "accepted"
        if obj.revoked_at is not None:
            return "revoked"
        return "pending" if obj.is_open else "expired"


class InvitationListApi(APIView):
    """The tenant's pending invitations (not yet used, revoked or expired)."""

    @extend_schema(responses=InvitationOutputSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        invitations = selectors.invitation_list_open(tenant=access.tenant)
        return paginate(request, self, invitations, InvitationOutputSerializer)


class InvitationCreateApi(APIView):
    """A one-time invitation link (valid 7 days). Its token is in this response only; only
    owners invite owners."""

    class InputSerializer(serializers.Serializer[Any]):
        role = serializers.ChoiceField(choices=Role.choices)

    class OutputSerializer(InvitationOutputSerializer):
        token = serializers.CharField(help_text="Shown only in this response.")
        url = serializers.CharField(
            help_text="The link to pass on (the dashboard's sign-up or one-click join page)."
        )

    @extend_schema(request=InputSerializer, responses={201: OutputSerializer})
    def post(self, request: Request, slug: str) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.invitation_create(
            tenant=access.tenant,
            role=data.validated_data["role"],
            actor=request_user(request),
            actor_role=None if access.is_staff else access.role,
        )
        body = {
            **InvitationOutputSerializer(issued.invitation).data,
            "token": issued.token,
            "url": request.build_absolute_uri(reverse("dashboard:join", args=[issued.token])),
        }
        response = Response(body, status=status.HTTP_201_CREATED)
        response["Cache-Control"] = "no-store"  # the token is in this response, once
        return response


class InvitationRevokeApi(APIView):
    @extend_schema(request=None, responses=InvitationOutputSerializer)
    def post(self, request: Request, slug: str, invitation_id: int) -> Response:
        access = tenant_access(request, slug, Perm.MEMBERS_MANAGE)
        invitation = selectors.invitation_get(tenant=access.tenant, invitation_id=invitation_id)
        invitation = services.invitation_revoke(invitation=invitation, actor=request_user(request))
        return Response(InvitationOutputSerializer(invitation).data)


class InvitationAcceptApi(APIView):
    """Join the tenant an invitation names, as the calling user (the link works once)."""

    class InputSerializer(serializers.Serializer[Any]):
        token = serializers.CharField(max_length=200)

    @extend_schema(request=InputSerializer, responses={201: MembershipOutputSerializer})
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            membership = services.invitation_accept(
                token=data.validated_data["token"], user=request_user(request)
            )
        except DjangoValidationError as exc:
            raise exceptions.ValidationError({"token": exc.messages}) from None
        return Response(MembershipOutputSerializer(membership).data, status=status.HTTP_201_CREATED)


# --- Me ----------------------------------------------------------------------------------------


class MeApi(APIView):
    class OutputSerializer(serializers.Serializer[Any]):
        username = serializers.CharField()
        email = serializers.EmailField()
        is_staff = serializers.BooleanField()
        memberships = serializers.SerializerMethodField()

        def get_memberships(self, user: User) -> list[dict[str, str]]:
            return [
                {"tenant": m.tenant.slug, "role": m.role}
                for m in user.memberships.select_related("tenant")
            ]

    @extend_schema(responses=OutputSerializer)
    def get(self, request: Request) -> Response:
        return Response(self.OutputSerializer(request_user(request)).data)
