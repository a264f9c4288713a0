from __future__ import annotations

import factory
from factory.declarations import LazyAttribute, Sequence, SubFactory

from tenants.models import Membership, Role, Tenant, User


class UserFactory(factory.django.DjangoModelFactory[User]):
    class Meta:
        model = User
        django_get_or_create = ["username"]

    username = Sequence(lambda n: f"user{n}")
    email = LazyAttribute(lambda u: f"{u.username}@example.com")
    password = factory.django.Password("correct horse battery staple")


class TenantFactory(factory.django.DjangoModelFactory[Tenant]):
    class Meta:
        model = Tenant

    slug = Sequence(lambda n: f"tenant-{n}")
    name = LazyAttribute(lambda t: t.slug.title())


class MembershipFactory(factory.django.DjangoModelFactory[Membership]):
    class Meta:
        model = Membership

    user = SubFactory(UserFactory)
    tenant = SubFactory(TenantFactory)
    role = Role.DEVELOPER
