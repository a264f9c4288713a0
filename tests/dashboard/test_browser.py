"""The dashboard in a real browser (Playwright driving Debian's Chromium) against a live stack
(uvicorn, Celery worker and beat, Postgres, Redis): what a tenant admin does, as they do it.

Every page visited is saved to ``var/screenshots/`` so a reviewer can look without running
anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from playwright.sync_api import Browser, Page, expect, sync_playwright

from adapters.models import Adapter
from devkit.adapters import TINY_CONFIG, config, lora_tensors, safetensors
from fleet.models import Model, Pool
from tenants.models import ApiKey, User
from tenants.services import api_key_create
from tests.billing.test_usage import _record, insert_with_rollups
from tests.conftest import ROOT, TenantPeople
from tests.live import Stack, stack_start, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SHOTS = ROOT / "var" / "screenshots"
PASSWORD = "a browser test password"


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def dash_stack(serving_db_url: str, media: Path) -> Iterator[Stack]:
    env = {"INFERPLANE_MEDIA_ROOT": str(media), "DJANGO_ALLOW_ASYNC_UNSAFE": ""}
    stack = stack_start(serving_db_url, name="dashboard", extra_env=env)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # still plain synchronous code (Playwright's documented setting for Django tests).
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
            args=["--no-sandbox"],  # CI runs as root
        )
        yield browser
        browser.close()
    if previous is None:
        del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


# Chromium logs what the Content-Security-Policy blocks as console errors; the page's own
# securitypolicyviolation events say it too (the init script runs outside the page's CSP).
CSP_WATCH = """document.addEventListener("securitypolicyviolation", (e) =>
  console.error(`CSP violation: ${e.violatedDirective} blocked ${e.blockedURI || "inline"}`));"""


def watch_csp(page: Page) -> list[str]:
    """The CSP violations ``page`` reports, as they happen."""
    violations: list[str] = []
    page.context.add_init_script(CSP_WATCH)

    def note(message: Any) -> None:
        text = message.text
        if message.type == "error" and (
            "Content Security Policy" in text or text.startswith("CSP violation")
        ):
            violations.append(f"{page.url}: {text}")

    page.on("console", note)
    return violations


@pytest.fixture
def page(chromium: Browser) -> Iterator[Page]:
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    violations = watch_csp(page)
    yield page
    context.close()
    assert violations == [], "pages broke the Content-Security-Policy"


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def log_in(page: Page, stack: Stack, user: User) -> None:
    # The live processes use the production hasher (the tests' own settings use a fast one).
    hasher = PBKDF2PasswordHasher()
    User.objects.filter(pk=user.pk).update(password=hasher.encode(PASSWORD, hasher.salt()))
    page.goto(f"{stack.url}/app/login/")
    page.get_by_label("Username").fill(user.get_username())
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/app/t/**")


def test_log_in_and_a_wrong_password(page: Page, dash_stack: Stack, people: TenantPeople) -> None:
    page.goto(f"{dash_stack.url}/app/t/acme/")
    page.wait_for_url("**/app/login/**")
    page.get_by_label("Username").fill("owner")
    page.get_by_label("Password").fill("wrong")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("alert")).to_contain_text("correct username and password")
    shot(page, "login-error")
    log_in(page, dash_stack, people.owner)
    expect(page.get_by_role("heading", level=1)).to_contain_text("Acme")


def test_a_key_is_shown_once_and_revoking_it_locks_the_gateway_out(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    log_in(page, dash_stack, people.developer)
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Name").fill("support bot")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("[data-secret]").inner_text().strip()
    assert secret.startswith("sk-ip-")
    expect(page.get_by_role("button", name="Copy")).to_be_visible()
    shot(page, "keys-created")
    key = ApiKey.objects.get(tenant=people.tenant)

    models = httpx.get(f"{dash_stack.url}/v1/models", headers={"authorization": f"Bearer {secret}"})
    assert models.status_code == 200

    page.goto(f"{dash_stack.url}/app/t/acme/keys/")  # shown once: now only the prefix
    assert secret not in page.content()
    row = page.locator(f"tr[data-prefix='{key.prefix}']")
    expect(row).to_contain_text(key.display_prefix)
    expect(row).to_contain_text("active")
    shot(page, "keys")

    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Revoke").click()
    expect(page.locator(f"tr[data-prefix='{key.prefix}']")).to_contain_text("revoked")

    def refused() -> bool:
        answer = httpx.get(
            f"{dash_stack.url}/v1/models", headers={"authorization": f"Bearer {secret}"}
        )
        return answer.status_code == 401

    wait_for(refused, timeout=10)


def test_a_long_name_keeps_every_action_in_sight_and_details_read_as_json(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    name = "k" * 100  # the longest name the form takes, with nowhere to break a line
    log_in(page, dash_stack, people.owner)
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Name").fill(name)
    page.get_by_role("button", name="Create key").click()
    page.goto(f"{dash_stack.url}/app/t/acme/keys/")
    key = ApiKey.objects.get(tenant=people.tenant, name=name)
    row = page.locator(f"tr[data-prefix='{key.prefix}']")
    expect(row).to_contain_text(name)  # the whole name, wrapped
    for action in ("Rotate", "Revoke"):
        expect(row.get_by_role("button", name=action)).to_be_in_viewport(ratio=1)
    shot(page, "keys-long-name")
    # Its page: the key's limits beside the tenant's, changed here as through the API.
    row.get_by_role("link", name=name).click()
    page.get_by_label("Requests per minute").fill("30")
    page.get_by_role("button", name="Save the key's limits").click()
    expect(page.locator("#key-limits tbody tr").first).to_contain_text("30")
    shot(page, "key")

    page.goto(f"{dash_stack.url}/app/t/acme/audit/")
    entry = page.locator("tr[data-action='api_key.create']").first
    opened = entry.locator("details")
    expect(opened.locator("summary")).to_be_in_viewport(ratio=1)
    opened.locator("summary").click()
    details = json.loads(opened.locator("pre").inner_text())  # JSON, as the API gives it
    assert details["name"] == name and details["prefix"] == key.prefix
    shot(page, "audit-details")


def test_a_viewer_sees_no_key_creation_and_an_outsider_gets_404(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    api_key_create(tenant=people.tenant, name="ci", created_by=people.owner)
    log_in(page, dash_stack, people.viewer)
    page.goto(f"{dash_stack.url}/app/t/acme/keys/")
    expect(page.get_by_role("cell", name="ci", exact=True)).to_be_visible()
    expect(page.get_by_role("button", name="Create key")).to_have_count(0)
    expect(page.get_by_role("button", name="Revoke")).to_have_count(0)
    shot(page, "keys-viewer")

    page.context.clear_cookies()
    log_in(page, dash_stack, people.outsider)
    for url in ("/app/t/acme/", "/app/t/acme/keys/", "/app/t/acme/adapters/"):
        response = page.goto(f"{dash_stack.url}{url}")
        assert response is not None and response.status == 404
    shot(page, "outsider-404")


def test_finance_sees_only_what_it_may_use_and_errors_are_styled_pages(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    missing: list[str] = []  # every 404 the browser met, the favicon's included
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    log_in(page, dash_stack, people.finance)
    nav = page.locator("nav.sections")
    expect(nav.get_by_role("link", name="Invoices")).to_be_visible()
    expect(nav.get_by_role("link", name="Playground")).to_have_count(0)  # it cannot get a key
    expect(nav.get_by_role("link", name="Audit log")).to_have_count(0)
    assert missing == []

    response = page.goto(f"{dash_stack.url}/app/t/acme/audit/")
    assert response is not None and response.status == 403
    expect(page.locator("[data-error-page='403']")).to_be_visible()
    expect(page.get_by_role("heading", level=1)).to_have_text("Not allowed")
    expect(page.get_by_role("link", name="Back to the dashboard")).to_be_visible()
    # styled by the dashboard's own stylesheet (the page's card, not the browser's default)
    radius = page.locator("[data-error-page]").evaluate("e => getComputedStyle(e).borderRadius")
    assert radius not in ("", "0px")
    shot(page, "finance-403")

    missing.clear()
    response = page.goto(f"{dash_stack.url}/app/t/no-such-tenant/")
    assert response is not None and response.status == 404
    expect(page.locator("[data-error-page='404']")).to_be_visible()
    assert missing == [f"{dash_stack.url}/app/t/no-such-tenant/"]  # the page alone: its icon loads
    shot(page, "not-found")


def test_the_usage_chart_draws_real_data(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    now = datetime.now(UTC)
    days = [now - timedelta(days=d) for d in (0, 1, 3)]
    insert_with_rollups(
        [
            _record(
                people.tenant,
                prompt_tokens=1000 * (i + 1),
                completion_tokens=100,
                cost_micros=250_000,
                started_at=when.isoformat(),
                finished_at=when.isoformat(),
            )
            for i, when in enumerate(days)
        ]
    )
    log_in(page, dash_stack, people.finance)
    chart = page.locator("#usage-chart")
    expect(chart).to_have_attribute("data-points", "6")  # 3 days x (tokens, spend)
    drawn = page.evaluate(
        """() => {
        const c = document.getElementById('usage-chart');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let inked = 0;
        for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++;
        return inked;
    }"""
    )
    assert drawn > 1000  # the canvas has bars and a line on it, not just a blank box
    this_month = [d for d in days if d.month == now.month]
    expect(page.locator("[data-metric=requests]")).to_have_text(str(len(this_month)))
    shot(page, "overview")


def test_an_adapter_upload_shows_progress_then_its_verdict(
    page: Page, dash_stack: Stack, people: TenantPeople, tmp_path: Path, settings: Any
) -> None:
    model = Model.objects.create(
        name="tiny-chat",
        served_name="tiny-chat",
        context_length=1024,
        supports_lora=True,
        architecture=TINY_CONFIG,
    )
    Pool.objects.create(name="online", kind="dedicated", model=model, max_lora_rank=8)
    (tmp_path / "adapter_config.json").write_bytes(config())
    (tmp_path / "adapter_model.safetensors").write_bytes(safetensors(lora_tensors()))
    (tmp_path / "bad.safetensors").write_bytes(safetensors(lora_tensors(rank=4)))

    log_in(page, dash_stack, people.developer)
    page.get_by_role("link", name="LoRA adapters").click()
    for name, weights in (
        ("support-bot", "adapter_model.safetensors"),
        ("broken", "bad.safetensors"),
    ):
        page.get_by_label("Name").fill(name)
        page.get_by_label("adapter_config.json").set_input_files(tmp_path / "adapter_config.json")
        page.get_by_label("adapter_model.safetensors").set_input_files(tmp_path / weights)
        page.get_by_role("button", name="Upload").click()
        page.wait_for_url("**/adapters/")
        expect(page.locator(f"tr[data-adapter='{name}:1']")).to_be_visible()
    # The table polls while a version validates; the stack's worker gives the verdicts.
    expect(page.locator("tr[data-adapter='support-bot:1']")).to_contain_text(
        "ready", timeout=30_000
    )
    broken = page.locator("tr[data-adapter='broken:1']")
    expect(broken).to_contain_text("rejected", timeout=30_000)
    expect(broken.locator(".reason")).not_to_be_empty()
    shot(page, "adapters")

    # An upload the server refuses (a name its rules reject) shows why, on the same page...
    page.get_by_label("Name").fill("Not A Name!")
    page.get_by_label("adapter_config.json").set_input_files(tmp_path / "adapter_config.json")
    page.get_by_label("adapter_model.safetensors").set_input_files(tmp_path / "bad.safetensors")
    page.get_by_role("button", name="Upload").click()
    refused = page.locator("[data-upload-error]")
    expect(refused).to_be_visible()
    expect(refused).not_to_be_empty()
    expect(page.locator("[data-progress]")).to_be_hidden()
    expect(page.get_by_role("button", name="Upload")).to_be_enabled()
    assert not Adapter.objects.filter(name__iexact="not a name!").exists()
    shot(page, "adapters-refused")
    # ...whose scripts still run: Delete asks first, and a "no" keeps the version.
    asked: list[str] = []

    def answer(dialog: Any, accept: bool) -> None:
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", lambda dialog: answer(dialog, accept=False))
    broken.get_by_role("button", name="Delete").click()
    expect(page.locator("tr[data-adapter='broken:1']")).to_have_count(1)
    assert len(asked) == 1 and Adapter.objects.get(name="broken").deleted_at is None

    page.once("dialog", lambda dialog: answer(dialog, accept=True))
    broken.get_by_role("button", name="Delete").click()
    expect(page.locator("tr[data-adapter='broken:1']")).to_have_count(0)
    assert len(asked) == 2 and Adapter.objects.get(name="broken").deleted_at is not None


def test_an_owner_invites_and_the_invitee_signs_up_through_the_link(
    page: Page, chromium: Browser, dash_stack: Stack, people: TenantPeople
) -> None:
    log_in(page, dash_stack, people.owner)
    page.get_by_role("link", name="Members").click()
    page.get_by_label("Role of the invitee").select_option("finance")
    page.get_by_role("button", name="Create invitation link").click()
    link = page.locator("[data-join-url]").inner_text().strip()
    shot(page, "members-invited")

    invitee = chromium.new_context().new_page()
    invitee_violations = watch_csp(invitee)
    invitee.goto(link)
    expect(invitee.get_by_role("heading", level=1)).to_contain_text("Join Acme")
    shot(invitee, "join")
    invitee.get_by_label("Username").fill("newcomer")
    invitee.get_by_label("Password", exact=True).fill("a long enough pass phrase")
    invitee.get_by_label("Password confirmation").fill("a long enough pass phrase")
    invitee.get_by_role("button", name="Create account and join").click()
    invitee.wait_for_url("**/app/t/acme/")
    expect(invitee.locator(".who")).to_contain_text("finance")
    invitee.context.close()
    assert invitee_violations == []

    page.reload()
    expect(page.locator("tr[data-member='newcomer']")).to_be_visible()
    shot(page, "members")


def test_the_usage_csv_downloads_and_matches_the_table(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    import csv
    import io

    from billing.invoicing import invoice_compute

    now = datetime.now(UTC)
    insert_with_rollups(
        [
            _record(
                people.tenant,
                model=model,
                mode=mode,
                prompt_tokens=500 + i,
                completion_tokens=50,
                cost_micros=123_456 * (i + 1),
                started_at=(now - timedelta(days=i % 2)).isoformat(),
                finished_at=(now - timedelta(days=i % 2)).isoformat(),
            )
            for i, (model, mode) in enumerate(
                [("tiny-chat", "online"), ("tiny-chat", "batch"), ("big-chat", "online")]
            )
        ]
    )
    log_in(page, dash_stack, people.finance)
    page.get_by_role("link", name="Usage").click()
    # tiny-chat on 2 days + big-chat on 1 + spend on 2 days
    expect(page.locator("#usage-chart")).to_have_attribute("data-points", "5")
    table = [
        [cell.strip() for cell in row.locator("td").all_inner_texts()]
        for row in page.locator("#usage-rows tbody tr").all()
    ]
    shot(page, "usage")
    with page.expect_download() as download:
        page.get_by_role("link", name="Download CSV").click()
    path = download.value.path()
    rows = list(csv.reader(io.StringIO(Path(path).read_text())))
    assert rows[0][:5] == ["day", "model", "adapter", "api_key", "mode"]
    assert len(rows) - 1 == len(table) == 3
    for csv_row, table_row in zip(rows[1:], table, strict=True):
        # the table names the key beside its prefix; the CSV has the name in its last column
        day, model, adapter, key, *numbers, name = csv_row
        assert [day, model, adapter, f"{name} {key}".strip(), *numbers] == table_row

    invoice = invoice_compute(tenant=people.tenant, period_start=now.date().replace(day=1))
    page.get_by_role("link", name="Invoices").click()
    shot(page, "invoices")
    page.get_by_role("link", name=now.strftime("%B %Y")).click()
    expect(page.locator("[data-invoice-total]")).to_contain_text(f"{invoice.total_cents // 100}")
    shot(page, "invoice")


@pytest.mark.engine
def test_the_operator_page_shows_a_request_running_live(
    page: Page, dash_stack: Stack, people: TenantPeople, engine: Any
) -> None:
    import threading

    from tests.serving import world_rows

    world_rows([engine])
    key = api_key_create(tenant=people.tenant, name="k", created_by=people.owner).secret
    log_in(page, dash_stack, people.staff)
    page.goto(f"{dash_stack.url}/app/ops/")
    replica = page.locator(f"tr[data-replica='{engine.url}']")
    expect(replica).to_contain_text("ready")
    expect(replica.locator("[data-in-flight]")).to_have_text("0 / 8")

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{dash_stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 1000,
                "ignore_eos": True,
                "n": 4,
                "stream": True,
            },
            timeout=120,
        ) as response:
            for _ in response.iter_lines():
                pass

    runner = threading.Thread(target=stream)
    runner.start()
    # No reload: the table refreshes itself while the request runs, and after it ends.
    # Capacity counts sequences (the request's n=4 is four of the replica's eight); the
    # tenant runs one request.
    expect(replica.locator("[data-in-flight]")).to_have_text("4 / 8", timeout=20_000)
    expect(page.locator("tr[data-tenant='acme'] [data-running]")).to_have_text("1")
    shot(page, "operator")
    runner.join(timeout=120)
    expect(replica.locator("[data-in-flight]")).to_have_text("0 / 8", timeout=20_000)


@pytest.mark.engine
def test_the_playground_streams_from_the_real_engine(
    page: Page, dash_stack: Stack, people: TenantPeople, engine: Any
) -> None:
    from billing.models import UsageRecord
    from tests.serving import world_rows

    world_rows([engine])
    log_in(page, dash_stack, people.developer)
    page.get_by_role("link", name="Playground").click()
    page.get_by_label("Model").select_option("tiny-chat")
    page.get_by_label("max_tokens").fill("48")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("[data-tps]")).not_to_have_text("—", timeout=30_000)
    assert page.locator("[data-answer]").inner_text().strip()
    assert page.locator("[data-ttft]").inner_text().endswith(" ms")
    shown = page.locator("[data-tokens]").inner_text()  # "<in> in / <out> out"
    out = int(shown.split("/")[1].split()[0])
    assert 0 < out <= 48
    shot(page, "playground")
    # Metered like any request, under the tab's playground key.
    record = wait_for(lambda: UsageRecord.objects.filter(tenant=people.tenant).first())
    assert record.completion_tokens == out and record.api_key is not None
    assert record.api_key.name == "playground · developer"


def test_the_operator_runs_a_pool_from_its_page_and_it_stays_live(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    """From the operator page to the pool's own: a replica added, drained, removed (asked
    first), each in the pool's changes; a change made through the control API shows up
    without a reload (the fragment polls, like every live page)."""
    from fleet.models import Replica
    from inference.services import model_ensure, pool_ensure, replica_drain

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"])
    log_in(page, dash_stack, people.staff)
    page.goto(f"{dash_stack.url}/app/ops/")
    page.get_by_role("link", name="online", exact=True).click()
    expect(page.get_by_role("heading", name="Pool online")).to_be_visible()
    page.get_by_label("Engine URL").fill("http://gpu-b:8000")
    page.get_by_role("button", name="Add replica").click()
    row = page.locator("tr[data-replica='http://gpu-b:8000']")
    expect(row).to_contain_text("down")
    row.get_by_role("button", name="Drain").click()
    expect(row).to_contain_text("draining")

    asked: list[str] = []

    def dismiss(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)
    row.get_by_role("button", name="Remove").click()
    page.wait_for_timeout(300)
    assert asked == ["Remove online-2 from online?"]
    expect(row).to_be_visible()  # dismissed: still there
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Remove").click()
    expect(row).to_have_count(0)
    changes = page.locator("#pool-changes")
    for action in ("replica.add", "replica.drain", "replica.remove"):
        expect(changes.locator(f"tr[data-action='{action}']")).to_contain_text("operator")

    replica_drain(replica=Replica.objects.get(url="http://gpu-a:8000"))  # elsewhere
    expect(page.locator("tr[data-replica='http://gpu-a:8000']")).to_contain_text(
        "draining", timeout=3_000
    )
    shot(page, "operator-pool")


@pytest.mark.engine
def test_the_overview_shows_requests_refused_for_a_limit(
    page: Page, dash_stack: Stack, people: TenantPeople, engine: Any
) -> None:
    from tenants.services import tenant_limits_update
    from tests.serving import world_rows

    world_rows([engine])
    tenant_limits_update(tenant=people.tenant, actor=None, limits={"rpm": 1})
    key = api_key_create(tenant=people.tenant, name="k", created_by=people.owner)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {key.secret}"}

    def send() -> int:
        return httpx.post(
            f"{dash_stack.url}/v1/chat/completions", json=body, headers=headers, timeout=60
        ).status_code

    assert send() == 200
    assert send() == 429  # one request per minute
    log_in(page, dash_stack, people.owner)
    expect(page.locator("[data-metric=rejected]")).to_have_text("1")
    row = page.locator("#rejections tbody tr").first
    expect(row).to_contain_text(key.api_key.display_prefix.rstrip("…"))
    expect(row).to_contain_text("requests per minute")
    shot(page, "overview-429")


def test_staff_change_limits_and_the_audit_log_shows_it(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    log_in(page, dash_stack, people.staff)
    page.goto(f"{dash_stack.url}/app/t/acme/limits/")
    page.get_by_label("Requests per minute").fill("600")
    page.get_by_label("Fair-share weight").fill("2")
    page.get_by_label("Stored files (MiB)").fill("500")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#limits")).to_contain_text("600")
    expect(page.locator("[data-weight]")).to_have_text("2")
    expect(page.locator("[data-quota=storage_mb]")).to_contain_text("500.0\xa0MB")
    expect(page.locator("[data-quota=max_open_batches]")).to_contain_text("50 batches (default)")
    shot(page, "limits")
    page.get_by_role("link", name="Audit log").click()
    expect(page.locator("tr[data-action='tenant.limits']")).to_contain_text("operator")
    expect(page.locator("tr[data-action='tenant.update']")).to_be_visible()
    shot(page, "audit")


def test_swagger_ui_and_the_admin_work_under_the_csp(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    """Both run inline code of their own (with the response's nonce); the fixture fails the
    test on any violation the browser reports."""
    page.goto(f"{dash_stack.url}/api/docs/")
    expect(page.locator(".opblock").first).to_be_visible()  # the schema fetched and drawn
    expect(page.locator("[data-path='/api/tenants/{slug}/invitations/create/']")).to_be_visible()
    shot(page, "api-docs")

    User.objects.filter(pk=people.staff.pk).update(is_superuser=True)
    hasher = PBKDF2PasswordHasher()
    User.objects.filter(pk=people.staff.pk).update(password=hasher.encode(PASSWORD, hasher.salt()))
    page.goto(f"{dash_stack.url}/admin/")
    page.get_by_label("Username").fill(people.staff.get_username())
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#site-name")).to_contain_text("Inferplane operations")
    page.goto(f"{dash_stack.url}/admin/tenants/tenant/")
    expect(page.locator("#result_list")).to_contain_text("acme")
    page.goto(f"{dash_stack.url}/admin/tenants/tenant/{people.tenant.pk}/change/")
    expect(page.locator("#id_name")).to_have_value(people.tenant.name)
    shot(page, "admin")


def test_repeated_failed_logins_show_the_lockout_on_the_form(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    page.goto(f"{dash_stack.url}/app/login/")
    for _ in range(10):  # the live stack's limit (INFERPLANE_LOGIN_FAILURE_LIMIT)
        page.get_by_label("Username").fill("viewer")
        page.get_by_label("Password").fill("wrong")
        page.get_by_role("button", name="Log in").click()
        page.wait_for_load_state()
    expect(page.get_by_role("alert")).to_contain_text("Too many failed logins")
    shot(page, "login-locked")


def test_an_open_batches_page_shows_a_new_batch_and_its_lines_as_they_finish(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    from batches.models import Batch, Line

    issued = api_key_create(tenant=people.tenant, name="sdk", created_by=people.owner)
    log_in(page, dash_stack, people.developer)
    page.get_by_role("link", name="Batches").click()
    expect(page.locator("#batches")).to_contain_text("No batches yet")

    client = dash_stack.openai(issued.secret)  # as a developer's program makes one
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    upload = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    made = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    expect(page.locator(f'tr[data-batch="{made.id}"]')).to_be_visible(timeout=3_000)

    # A batch whose runner stores answers as they come: the row moves before the batch ends.
    batch = Batch.objects.create(
        tenant=people.tenant,
        api_key=issued.api_key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        status=Batch.Status.IN_PROGRESS,
        in_progress_at=datetime.now(UTC),
        expires_at=datetime.now(UTC) + timedelta(hours=24),
    )
    Line.objects.bulk_create(
        Line(batch=batch, number=i, custom_id=f"c{i}", body={}, state="pending")
        for i in range(1, 5)
    )
    row = page.locator(f'tr[data-batch="{batch.id}"]')
    expect(row.locator("[data-counts]")).to_have_text("0 done, 0 failed of 4", timeout=3_000)
    Line.objects.filter(batch=batch, number__lte=2).update(state="done")
    expect(row.locator("[data-counts]")).to_have_text("2 done, 0 failed of 4", timeout=3_000)
    expect(row.get_by_role("progressbar")).to_have_attribute("value", "2")
    expect(row.locator(".badge")).to_have_text("in_progress…")
    shot(page, "batches-live")


def test_the_batches_page_shows_progress_and_a_cancel_lands(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    from batches.models import Batch, Line

    key = api_key_create(tenant=people.tenant, name="batch", created_by=people.owner).api_key
    batch = Batch.objects.create(
        tenant=people.tenant,
        api_key=key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        status=Batch.Status.IN_PROGRESS,
        in_progress_at=datetime.now(UTC),  # validated
        expires_at=datetime.now(UTC) + timedelta(hours=24),
    )
    states = ["done", "done", "done", "pending", "pending"]
    Line.objects.bulk_create(
        Line(batch=batch, number=i, custom_id=f"c{i}", body={}, state=s, completion_tokens=4)
        for i, s in enumerate(states, start=1)
    )
    log_in(page, dash_stack, people.developer)
    page.get_by_role("link", name="Batches").click()
    row = page.locator(f'tr[data-batch="{batch.id}"]')
    expect(row.get_by_role("progressbar")).to_have_attribute("value", "3")
    expect(row.locator("[data-counts]")).to_have_text("3 done, 0 failed of 5")
    shot(page, "batches-running")
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Cancel").click()
    # The worker finalizes it; the table, polled while a batch runs, shows the end.
    expect(row.locator(".badge")).to_have_text("cancelled", timeout=30_000)
    expect(row.locator("[data-counts]")).to_have_text("3 done, 2 failed of 5")
    expect(row.get_by_role("link", name="errors")).to_be_visible()
    expect(row.get_by_role("button", name="Cancel")).to_have_count(0)
    shot(page, "batches-cancelled")


def test_a_batch_started_from_the_page_uploads_with_progress_and_its_page_follows_it(
    page: Page, dash_stack: Stack, people: TenantPeople, tmp_path: Path
) -> None:
    """The file goes up with a progress bar, the batch is made for the key chosen, and its
    page follows it without a reload: the worker's verdict, then lines as they finish."""
    from batches.models import Batch, Line

    key = api_key_create(
        tenant=people.tenant, name="nightly", created_by=people.developer, scopes=["batch"]
    ).api_key
    log_in(page, dash_stack, people.developer)
    page.get_by_role("link", name="Batches").click()
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
    lines = b"".join(
        json.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        ).encode()
        + b"\n"
        for i in range(3)
    )
    form = page.locator("#batch-upload")
    # Refused by the server (the Files API's rule): said on the form, the page left as it is.
    (tmp_path / "in.txt").write_bytes(lines)
    form.get_by_label("Input file (.jsonl)").set_input_files(tmp_path / "in.txt")
    form.get_by_role("button", name="Upload and start").click()
    expect(form.locator("[data-upload-error]")).to_contain_text("must be JSONL")
    assert not Batch.objects.exists()
    (tmp_path / "in.jsonl").write_bytes(lines)
    form.get_by_label("Input file (.jsonl)").set_input_files(tmp_path / "in.jsonl")
    expect(form.get_by_label("Run as key")).to_have_value(str(key.pk))
    form.get_by_label("Description (metadata, optional)").fill("from the page")
    form.get_by_role("button", name="Upload and start").click()
    page.wait_for_url("**/batches/batch_*/")  # sent by the uploads' script (progress, errors)
    made = Batch.objects.get(tenant=people.tenant)
    assert (made.api_key_id, made.metadata) == (key.pk, {"description": "from the page"})
    assert page.url.endswith(f"/app/t/acme/batches/{made.id}/")
    # The worker validates it; the page says so by itself.
    expect(page.locator("[data-status]")).not_to_have_text("validating", timeout=30_000)
    shot(page, "batch-started")

    # A running batch's page: its lines move as they finish, before the batch does.
    running = Batch.objects.create(
        tenant=people.tenant,
        api_key=key,
        input_file_id=made.input_file_id,
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        status=Batch.Status.IN_PROGRESS,
        in_progress_at=datetime.now(UTC),
        expires_at=datetime.now(UTC) + timedelta(hours=24),
    )
    Line.objects.bulk_create(
        Line(batch=running, number=i, custom_id=f"c{i}", body={}, state="pending")
        for i in range(1, 5)
    )
    page.goto(f"{dash_stack.url}/app/t/acme/batches/{running.id}/")
    expect(page.locator("tr[data-state='pending'] td")).to_have_text("4")
    Line.objects.filter(batch=running, number__lte=3).update(state="done", completion_tokens=5)
    expect(page.locator("tr[data-state='done'] td")).to_have_text("3", timeout=3_000)
    expect(page.locator("[data-counts]")).to_have_text("3 done, 0 failed of 4")
    expect(page.locator("[data-tokens]")).to_contain_text("15 out")
    shot(page, "batch-running")


# Every page of the dashboard, for the screenshot tour: (name, path under /app/).
TENANT_PAGES = [
    ("overview", "t/acme/"),
    ("keys", "t/acme/keys/"),
    ("key", "t/acme/keys/{key}/"),
    ("members", "t/acme/members/"),
    ("audit", "t/acme/audit/"),
    ("limits", "t/acme/limits/"),
    ("moderation", "t/acme/moderation/"),
    ("cache", "t/acme/cache/"),
    ("playground", "t/acme/playground/"),
    ("usage", "t/acme/usage/"),
    ("invoices", "t/acme/invoices/"),
    ("invoice", "t/acme/invoices/{invoice}/"),
    ("adapters", "t/acme/adapters/"),
    ("batches", "t/acme/batches/"),
    ("batch", "t/acme/batches/{batch}/"),
]
OPERATOR_PAGES = [("ops", "ops/"), ("pool", "ops/pools/online/"), ("prices", "ops/prices/")]


@pytest.mark.parametrize("persona", ["owner", "admin", "developer", "finance", "viewer", "staff"])
def test_every_page_for_every_role_is_whole_and_saved_as_a_screenshot(
    page: Page, dash_stack: Stack, people: TenantPeople, persona: str
) -> None:
    """Each role walks every page: each is whole (200) or a styled refusal (403, or 404 for
    the operator's pages), never a 500, and never breaks the CSP; the screenshots
    (``var/screenshots/role-<role>-<page>.png``) are what a reviewer looks at."""
    from batches.models import Batch
    from billing.invoicing import invoice_compute
    from inference.services import model_ensure, pool_ensure

    model = model_ensure(name="tiny-chat", served_name="tiny-chat", context_length=1024)
    pool_ensure(name="online", kind="dedicated", model=model, replica_urls=["http://gpu-a:8000"])
    key = api_key_create(tenant=people.tenant, name="support bot", created_by=people.owner)
    month = datetime.now(UTC).date().replace(day=1)
    invoice = invoice_compute(tenant=people.tenant, period_start=month)
    batch = Batch.objects.create(
        tenant=people.tenant,
        api_key=key.api_key,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        model="tiny-chat",
        status=Batch.Status.COMPLETED,
        expires_at=datetime.now(UTC) + timedelta(hours=24),
    )
    ids = {"key": key.api_key.pk, "invoice": invoice.pk, "batch": batch.id}
    log_in(page, dash_stack, people.user(persona))
    pages = TENANT_PAGES + OPERATOR_PAGES
    seen: dict[str, int] = {}
    for name, path in pages:
        response = page.goto(f"{dash_stack.url}/app/{path.format(**ids)}")
        assert response is not None
        seen[name] = response.status
        shot(page, f"role-{persona}-{name}")
    assert set(seen.values()) <= {200, 403, 404}, seen
    expected_operator = 200 if persona == "staff" else 404
    assert {seen[name] for name, _ in OPERATOR_PAGES} == {expected_operator}
    assert seen["overview"] == 200 and seen["batches"] == 200


def test_the_overview_tiles_follow_usage_without_a_reload(
    page: Page, dash_stack: Stack, people: TenantPeople
) -> None:
    from tests.billing.test_usage import _record, insert_with_rollups

    log_in(page, dash_stack, people.viewer)
    requests = page.locator("[data-metric=requests]")
    expect(requests).to_have_text("0")
    insert_with_rollups([_record(people.tenant), _record(people.tenant)])  # as the worker does
    expect(requests).to_have_text("2", timeout=8_000)  # polled every 5 s
    expect(page.locator("[data-metric=tokens]")).to_have_text("36")
