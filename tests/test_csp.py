"""Content-Security-Policy on every response: scripts and styles from this origin only,
inline ones only with the response's nonce, no framing, forms posting back here only.
(The browser tests check in Chromium that no page trips over it.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client

from tests.conftest import ROOT, TenantPeople

pytestmark = pytest.mark.django_db

TEMPLATES = ROOT / "dashboard" / "templates"


def _policy(response: object) -> dict[str, list[str]]:
    header = response["Content-Security-Policy"]  # type: ignore[index]
    return {
        name: values
        for name, *values in (part.split() for part in header.split(";") if part.strip())
    }


def _logged_in(people: TenantPeople, persona: str) -> Client:
    client = Client()
    client.force_login(people.user(persona))
    return client


@pytest.mark.parametrize(
    ("persona", "url"),
    [
        (None, "/app/login/"),
        ("owner", "/app/t/acme/"),
        ("owner", "/app/t/acme/members/"),
        ("staff", "/app/ops/"),
        ("owner", "/api/tenants/"),
        (None, "/admin/login/"),
        (None, "/api/docs/"),
    ],
)
def test_every_kind_of_response_carries_a_strict_policy(
    people: TenantPeople, persona: str | None, url: str
) -> None:
    client = _logged_in(people, persona) if persona else Client()
    response = client.get(url)
    assert response.status_code == 200, url
    policy = _policy(response)
    assert policy["default-src"] == ["'self'"]
    assert policy["script-src"][0] == "'self'" and "'unsafe-inline'" not in policy["script-src"]
    assert "'unsafe-eval'" not in policy["script-src"]
    assert policy["style-src"][0] == "'self'" and "'unsafe-inline'" not in policy["style-src"]
    assert policy["connect-src"] == ["'self'"]  # includes ws:/wss: to this host (CSP 3)
    assert policy["frame-ancestors"] == ["'none'"]
    assert policy["form-action"] == ["'self'"]
    assert policy["object-src"] == ["'none'"] and policy["base-uri"] == ["'none'"]


@pytest.mark.parametrize("url", ["/api/docs/", "/api/schema/swagger-ui/"])
def test_swagger_ui_runs_its_inline_set_up_with_the_responses_nonce(
    people: TenantPeople, url: str
) -> None:
    first, second = Client().get(url), Client().get(url)
    assert first.status_code == 200 and b'"/api/schema/"' in first.content
    nonces = []
    for response in (first, second):
        [nonce] = {
            v.removeprefix("'nonce-").removesuffix("'")
            for v in _policy(response)["script-src"]
            if v.startswith("'nonce-")
        }
        body = response.content.decode()
        inline = re.findall(r"<(script|style)(?![^>]*\bsrc=)([^>]*)>", body)
        assert inline and all(f'nonce="{nonce}"' in attrs for _, attrs in inline), inline
        nonces.append(nonce)
    assert nonces[0] != nonces[1]  # one per response


def test_no_dashboard_template_needs_an_inline_exception() -> None:
    """No style attributes, inline event handlers or inline scripts (data blocks such as
    ``json_script``'s are not run, so they need nothing): the policy allows none."""
    offenders = []
    for path in sorted(TEMPLATES.rglob("*.html")):
        text = path.read_text()
        for pattern in (
            r"\sstyle=",
            r"\son[a-z]+=",
            r"href=\"javascript:",
            r"<script(?![^>]*\b(src|nonce)=)",
        ):
            if re.search(pattern, text):
                offenders.append(f"{Path(path).relative_to(ROOT)}: {pattern}")
    assert offenders == []


def test_budget_meters_are_elements_not_inline_widths(people: TenantPeople) -> None:
    from tenants.services import tenant_limits_update

    tenant_limits_update(tenant=people.tenant, actor=None, limits={"monthly_token_budget": 1000})
    page = _logged_in(people, "owner").get("/app/t/acme/").content.decode()
    assert '<meter class="meter" min="0" max="100" value="0"' in page
