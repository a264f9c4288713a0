"""The Files and Batch APIs as a developer uses them — the official OpenAI SDK against a live
stack (web, Celery worker and beat) and a real vLLM CPU engine serving a spot pool: the
whole lifecycle, validation failures, partial and total failures, cancel mid-run, expiry,
idempotent retries, pagination and tenant isolation; every line answered exactly once and
the ledger equal to the output files."""

from __future__ import annotations

import io
import os
import signal
import socket
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import openai
import orjson
import pytest
from django.core.files import File as DjangoFile
from django.core.files.storage import default_storage
from django.utils import timezone

from batches.lines import claim, store
from batches.models import Batch, File, Line
from batches.runner import batch_run
from batches.services import batches_expire
from billing.models import UsageRecord
from billing.services import price_set
from contract import UsageRecord as UsageRecord_
from fleet.models import Model
from tenants.models import ApiKey
from tenants.services import api_key_create, tenant_limits_update
from tests import contract
from tests.engines import Engine
from tests.live import wait_for
from tests.serving import World, catalog_everywhere, spot_pool, world

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

__all__ = ["world"]  # the fixture


@pytest.fixture
def spot(world: World, engine: Engine) -> World:
    """The world's online pool, and a spot pool of the same model on the same engine."""
    spot_pool([engine])
    catalog_everywhere()
    return world


def _client(world: World, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=world.stack.url + "/v1", max_retries=0)


def _line(custom_id: str, *, content: str = "Say hello.", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
            **body,
        },
    }


def _short_then_long(prefix: str, n: int) -> list[dict[str, Any]]:
    """Lines for a batch that must still be running when the test acts on it: the first is
    short (its completion is the signal to act), every other one is 900 tokens long (about a
    second even on a fast AMX CPU; 10 s and more after the signal, while a poll is 0.5 s)."""
    return [
        _line(f"{prefix}{i}", max_tokens=8 if i == 0 else 900, ignore_eos=True) for i in range(n)
    ]


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines
    )


def _upload(client: openai.OpenAI, lines: list[Any], name: str = "input.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(_jsonl(lines))), purpose="batch").id


def _create(client: openai.OpenAI, file_id: str, **extra: Any) -> Any:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", **extra
    )


def _until(
    client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], timeout: float = 120
) -> Any:
    seen: list[Any] = []

    def check() -> bool:
        seen.append(client.batches.retrieve(batch_id))
        return done(seen[-1])

    wait_for(check, timeout=timeout, every=0.5)
    return seen[-1]


def _finished(batch: Any) -> bool:
    return batch.status in {"completed", "failed", "cancelled", "expired"}


def _content(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines() if x]


def test_a_batch_runs_on_the_spot_pool_and_its_results_match_the_ledger(spot: World) -> None:
    tenant, key = spot.tenant()
    client = _client(spot, key)
    price_set(
        model=Model.objects.get(name="tiny-chat"),
        input_per_mtok=Decimal(1),
        output_per_mtok=Decimal(2),
        batch_discount_percent=Decimal(50),
        actor=None,
    )
    lines = [_line(f"req-{i}", content=f"Count to {i}.") for i in range(6)]
    file_id = _upload(client, lines)
    stored = client.files.retrieve(file_id)
    assert (stored.purpose, stored.filename, stored.bytes) == (
        "batch",
        "input.jsonl",
        len(_jsonl(lines)),
    )
    assert client.files.content(file_id).content == _jsonl(lines)
    created = _create(client, file_id, metadata={"job": "nightly"})
    assert created.status == "validating" and created.metadata == {"job": "nightly"}
    assert created.expires_at == created.created_at + 24 * 3600
    batch = _until(client, created.id, _finished)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.error_file_id is None
    output = _content(client, batch.output_file_id)
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(6)]  # input order
    for item in output:
        assert set(item) == {"id", "custom_id", "response", "error"}
        assert item["id"].startswith("batch_req_") and item["error"] is None
        assert item["response"]["status_code"] == 200
        assert item["response"]["body"]["object"] == "chat.completion"
        # The engine answers a line whole; its body is OpenAI's object, as online.
        contract.validate("CreateChatCompletionResponse", item["response"]["body"])
        assert isinstance(item["response"]["body"]["choices"][0]["message"]["content"], str)
    # The answers' text came through (the tiny model may end one at once; not all six).
    assert any(o["response"]["body"]["choices"][0]["message"]["content"] for o in output), output
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    # The ledger holds exactly the lines answered, in batch mode at the batch price.
    records = list(UsageRecord.objects.filter(tenant=tenant))
    assert sorted(r.request_id for r in records) == sorted(
        o["response"]["request_id"] for o in output
    )
    assert {r.mode for r in records} == {"batch"} and {r.pool for r in records} == {"spot"}
    completion = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
    prompt = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in output)
    assert batch.usage.output_tokens == completion == sum(r.completion_tokens for r in records)
    assert batch.usage.input_tokens == prompt == sum(r.prompt_tokens for r in records)
    for r in records:  # a micro-dollar per token in, two out, half off in batch mode
        expected = (Decimal(r.prompt_tokens) + 2 * r.completion_tokens) / 2
        assert r.cost_micros == int(expected.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    # Each line keeps what its record cost (the dashboard's cost so far sums them).
    costs = dict(Line.objects.filter(batch_id=batch.id).values_list("request_id", "cost_micros"))
    assert costs == {r.request_id: r.cost_micros for r in records}
    # The online pool never saw the batch.
    assert not UsageRecord.objects.filter(tenant=tenant, pool="online").exists()


def test_a_bad_file_fails_the_batch_naming_each_line(spot: World) -> None:
    _, key = spot.tenant()
    client = _client(spot, key)
    file_id = _upload(
        client,
        [
            _line("a"),
            b"{not json",
            _line("a"),  # duplicate custom_id
            {**_line("c"), "url": "/v1/completions"},
            _line("d", stream=True),
            _line("e", model="another-model"),
        ],
    )
    batch = _until(client, _create(client, file_id).id, _finished)
    assert batch.status == "failed" and batch.failed_at
    found = {(e.code, e.line) for e in batch.errors.data}
    assert ("invalid_json_line", 2) in found
    assert ("duplicate_custom_id", 3) in found
    assert ("url_mismatch", 4) in found
    assert ("model_mismatch", None) in found
    assert any(code == "invalid_request" and line == 5 for code, line in found)  # stream
    assert batch.request_counts.total == 0 and batch.output_file_id is None
    assert not Line.objects.filter(batch_id=batch.id).exists()


def test_a_model_the_tenant_cannot_call_fails_the_batch(spot: World) -> None:
    _, key = spot.tenant()
    client = _client(spot, key)
    file_id = _upload(
        client, [_line("a", model="no-such-model"), _line("b", model="no-such-model")]
    )
    batch = _until(client, _create(client, file_id).id, _finished)
    assert batch.status == "failed"
    assert [e.code for e in batch.errors.data] == ["model_not_found"]


def test_lines_that_fail_go_to_the_error_file_and_all_failed_is_completed(spot: World) -> None:
    _, key = spot.tenant()
    client = _client(spot, key)
    # More than the model's context: a 400 for that line.
    too_long: dict[str, Any] = {"max_tokens": 100_000}
    file_id = _upload(client, [_line("ok-1"), _line("bad", **too_long), _line("ok-2")])
    batch = _until(client, _create(client, file_id).id, _finished)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    assert [o["custom_id"] for o in _content(client, batch.output_file_id)] == ["ok-1", "ok-2"]
    (error,) = _content(client, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["type"] == "invalid_request_error"

    file_id = _upload(client, [_line("x", **too_long), _line("y", **too_long)])
    batch = _until(client, _create(client, file_id).id, _finished)
    assert batch.status == "completed" and batch.output_file_id is None
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 2}
    assert len(_content(client, batch.error_file_id)) == 2


@pytest.mark.under_load
def test_cancel_mid_run_keeps_what_ran_and_cancels_the_rest(spot: World) -> None:
    tenant, key = spot.tenant(max_concurrency=1)  # one line at a time: the cancel lands mid-run
    client = _client(spot, key)
    file_id = _upload(client, _short_then_long("n", 12))
    created = _create(client, file_id)
    _until(
        client,
        created.id,
        lambda b: b.request_counts is not None and b.request_counts.completed >= 1,
    )
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    again = client.batches.cancel(created.id)  # a repeated cancel changes nothing
    assert (
        again.status in {"cancelling", "cancelled"}
        and again.cancelling_at == cancelling.cancelling_at
    )
    batch = _until(client, created.id, _finished)
    assert batch.status == "cancelled" and batch.cancelled_at
    counts = batch.request_counts
    assert counts.total == 12 and 1 <= counts.completed < 12
    assert counts.completed + counts.failed == 12
    output = _content(client, batch.output_file_id)
    errors = _content(client, batch.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(o["custom_id"] for o in output + errors) == sorted(f"n{i}" for i in range(12))
    ledger = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(ledger.values_list("request_id", flat=True)) == sorted(
        o["response"]["request_id"] for o in output
    )
    assert client.batches.cancel(created.id).status == "cancelled"  # still nothing changes
    finished = _until(client, _create(client, _upload(client, [_line("z")])).id, _finished)
    assert finished.status == "completed"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(finished.id)  # finished otherwise: 409


@pytest.mark.under_load
def test_an_expired_batch_keeps_its_answers_and_bills_nothing_else(spot: World) -> None:
    tenant, key = spot.tenant(max_concurrency=1)
    client = _client(spot, key)
    file_id = _upload(client, _short_then_long("e", 10))
    created = _create(client, file_id)
    _until(
        client,
        created.id,
        lambda b: b.request_counts is not None and b.request_counts.completed >= 1,
    )
    # The clock moves past the 24 h window, and the sweep (beat runs it every few seconds)
    # comes round.
    Batch.objects.filter(pk=created.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    batches_expire()
    batch = _until(client, created.id, _finished)
    assert batch.status == "expired" and batch.expired_at
    output = _content(client, batch.output_file_id)
    errors = _content(client, batch.error_file_id)
    assert output and errors and len(output) + len(errors) == 10
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    ledger = UsageRecord.objects.filter(tenant=tenant)
    assert sorted(ledger.values_list("request_id", flat=True)) == sorted(
        o["response"]["request_id"] for o in output
    )


def test_a_line_run_twice_is_stored_and_billed_once(spot: World) -> None:
    """Two workers on the same batch (a message delivered twice, or the sweeper waking a
    second one): every line once in the output and the ledger."""
    tenant, key = spot.tenant()
    client = _client(spot, key)
    file_id = _upload(client, [_line(f"d{i}") for i in range(8)])
    created = _create(client, file_id)
    _until(client, created.id, lambda b: b.status != "validating")
    for _ in range(3):  # more runs of the same batch, here, beside the stack's worker
        batch_run(batch_id=created.id, seconds=30)
    batch = _until(client, created.id, _finished)
    output = _content(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == [f"d{i}" for i in range(8)]
    assert UsageRecord.objects.filter(tenant=tenant).count() == 8


def test_a_price_changed_between_two_runs_bills_the_second_run_at_the_new_price(
    spot: World,
) -> None:
    """The stack's Celery worker runs its event loop only during a batch run. Its catalog copy
    must not stay the one from before a change made between two runs: each run ends its
    catalog watch (``batches/runner.py``), so no worker process is left subscribed but deaf
    (its acknowledgement never comes: the wait fails, as it did without the end), and the
    second batch is billed at the new price. That the next run looks at the version before
    its first line (``CatalogView.get``) is pinned by the quick contract test
    (``tests/test_catalog_contract.py``): which of the worker's two processes runs the
    second batch is Celery's choice, and a process that never ran one reads afresh."""
    tenant, key = spot.tenant()
    client = _client(spot, key)
    model = Model.objects.get(name="tiny-chat")

    def priced(per_mtok: int) -> None:
        price_set(
            model=model,
            input_per_mtok=Decimal(per_mtok),
            output_per_mtok=Decimal(2 * per_mtok),
            batch_discount_percent=Decimal(0),
            actor=None,
        )
        catalog_everywhere()  # every process holding a copy applied it

    def run(name: str) -> list[UsageRecord]:
        batch = _until(client, _create(client, _upload(client, [_line(name)])).id, _finished)
        assert batch.status == "completed", batch
        ids = [o["response"]["request_id"] for o in _content(client, batch.output_file_id)]
        return list(UsageRecord.objects.filter(tenant=tenant, request_id__in=ids))

    for per_mtok, name in ((1, "before"), (1000, "after")):
        priced(per_mtok)
        [record] = run(name)
        expected = Decimal(per_mtok) * (record.prompt_tokens + 2 * record.completion_tokens)
        assert record.cost_micros == int(expected), (name, record.cost_micros, expected)


def test_batch_work_takes_turns_between_tenants(spot: World) -> None:
    """Validations and runs go to the tenant whose turn it is, not to the batches in the
    order they came: six batches of one tenant queued before another tenant's one, the
    other's is validated and answered before the first tenant's fourth (before, it waited
    behind all six). The worker is stopped while they are created, so that all seven are
    queued when it comes back."""
    _, busy_key = spot.tenant()
    _, quiet_key = spot.tenant()
    busy_client, quiet_client = _client(spot, busy_key), _client(spot, quiet_key)
    busy_file = _upload(busy_client, [_line("b", max_tokens=2)])
    quiet_file = _upload(quiet_client, [_line("q", max_tokens=2)])
    worker = spot.stack.processes["worker"]
    os.killpg(worker.pid, signal.SIGSTOP)
    try:
        busy_ids = [_create(busy_client, busy_file).id for _ in range(6)]
        quiet_id = _create(quiet_client, quiet_file).id
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
    for client, batch_id in [*((busy_client, i) for i in busy_ids), (quiet_client, quiet_id)]:
        assert _until(client, batch_id, _finished).status == "completed"

    def validated(batch_id: str) -> Any:
        return Batch.objects.get(pk=batch_id).in_progress_at

    def answered(batch_id: str) -> Any:
        line = Line.objects.get(batch_id=batch_id)
        return UsageRecord.objects.get(request_id=line.request_id).started_at

    for when in (validated, answered):
        busy_order = sorted(when(i) for i in busy_ids)
        assert when(quiet_id) < busy_order[3], when.__name__


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_hostile_lines_hold_the_worker_in_bounded_memory(spot: World) -> None:
    """Lines near the line bound whose bodies grow ~25x when parsed (a list of empty lists:
    3 bytes each in the file, ~80 once parsed) go through a real worker: validated, run (the
    gateway refuses the unknown field, each line an error line) and written out. The worker
    processes' peak memory grows by less than 200 MiB: the validator inserts 2 MiB of lines
    at a time, a run keeps 8 MiB of bodies in flight as JSON text, the files are written
    without parsing the lines. Before, the validator held 1,000 parsed lines, a run 128 and
    the file writer 500: measured, 702 MiB for these 24 lines (91 MiB now)."""
    _, key = spot.tenant()
    client = _client(spot, key)
    junk = b"[" + b"[]," * 330_000 + b"[]]"  # ~1 MB; parsed, ~27 MB
    line = _line("h", max_tokens=1)
    lines = [
        orjson.dumps(line | {"custom_id": f"h{i}"})[:-2] + b', "junk": ' + junk + b"}}"
        for i in range(24)
    ]
    file_id = _upload(client, lines)
    worker = spot.stack.processes["worker"].pid
    processes = [worker, *_children(worker)]
    before = {pid: _rss_kib(pid, "VmRSS") for pid in processes}
    for pid in processes:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) from here on
    batch = _until(_client(spot, key), _create(client, file_id).id, _finished, timeout=180)
    grown_mib = max(_rss_kib(pid, "VmHWM") - before[pid] for pid in processes) / 1024
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 24, "completed": 0, "failed": 24}
    errors = _content(client, batch.error_file_id)
    assert {e["response"]["body"]["error"]["param"] for e in errors} == {"junk"}
    assert grown_mib < 200, f"a worker process grew by {grown_mib:.0f} MiB"


def test_parameter_errors_are_a_400_and_other_tenants_objects_a_404(spot: World) -> None:
    owner, key = spot.tenant()
    _, other_key = spot.tenant()
    client, other = _client(spot, key), _client(spot, other_key)
    file_id = _upload(client, [_line("a")])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/moderations",  # not a batch endpoint here
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="48h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError):
        _create(client, file_id, metadata={f"k{i}": "v" for i in range(17)})
    with pytest.raises(openai.BadRequestError):
        _create(client, file_id, metadata={"k" * 65: "v"})
    with pytest.raises(openai.NotFoundError):
        _create(other, file_id)  # another tenant's file
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(file_id)
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("notes.txt", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", io.BytesIO(b"\n\n")), purpose="batch")
    batch = _create(client, file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert [b.id for b in other.batches.list()] == []
    inference_only = api_key_create(
        tenant=owner,
        name="online only",
        created_by=None,
        scopes=["inference"],
    )
    with pytest.raises(openai.PermissionDeniedError):
        _client(spot, inference_only.secret).files.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            api_key="sk-ip-nope", base_url=spot.stack.url + "/v1", max_retries=0
        ).files.list()
    assert client.files.delete(file_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    # Quotas (tests/batches/test_quotas.py): the SDK gets OpenAI's shape, naming the quota.
    tenant_limits_update(tenant=owner, actor=None, limits={"storage_mb": 1})
    big = _jsonl([_line(f"q{i}", content="x" * 1000) for i in range(1100)])
    with pytest.raises(openai.BadRequestError) as full:
        client.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    assert full.value.code == "storage_quota_exceeded" and "1 MiB" in full.value.message


def test_listing_pages_and_an_idempotency_key_makes_a_retry_safe(spot: World) -> None:
    _, key = spot.tenant()
    client = _client(spot, key)
    file_id = _upload(client, [_line("a")])
    first = _create(client, file_id, extra_headers={"Idempotency-Key": "job-1"})
    again = _create(client, file_id, extra_headers={"Idempotency-Key": "job-1"})
    assert again.id == first.id
    with pytest.raises(openai.ConflictError):  # the same key for another request
        _create(client, file_id, metadata={"x": "y"}, extra_headers={"Idempotency-Key": "job-1"})
    ids = [first.id] + [_create(client, file_id).id for _ in range(4)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == ids[::-1][2:4] and rest.has_more
    assert [b.id for b in client.batches.list()] == ids[::-1]  # the SDK follows the pages
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)
    uploaded = [file_id, _upload(client, [_line("b")], name="second.jsonl")]
    listed = client.files.list(purpose="batch")
    assert [f.id for f in listed.data][:2] == uploaded[::-1]
    for batch_id in ids:
        _until(client, batch_id, _finished)


def test_a_result_from_a_worker_that_lost_its_claim_is_neither_stored_nor_billed(
    spot: World,
) -> None:
    """A worker whose lease ran out (it hung, or was partitioned away) and whose lines were
    claimed again: when it comes back with an answer, nothing of it is stored or billed."""
    tenant, _ = spot.tenant()
    # A batch running, held by a run chain (ours, here): the stack's sweeper leaves it alone.
    batch = Batch.objects.create(
        tenant=tenant,
        api_key=ApiKey.objects.get(tenant=tenant),
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        status=Batch.Status.IN_PROGRESS,
        in_progress_at=timezone.now(),
        running_until=timezone.now() + timedelta(hours=1),
        expires_at=timezone.now() + timedelta(hours=24),
    )
    line = Line.objects.create(batch=batch, number=1, custom_id="late", body={})
    (mine,) = claim(batch.pk, "worker-a", 1)
    Line.objects.filter(pk=line.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    (theirs,) = claim(batch.pk, "worker-b", 1)  # the lease ran out: another worker takes it
    assert theirs.pk == mine.pk == line.pk
    now = timezone.now()
    record = UsageRecord_(
        request_id="late-answer",
        tenant_id=tenant.pk,
        api_key_id=batch.api_key_id,
        model="tiny-chat",
        endpoint="chat.completions",
        mode="batch",
        status="ok",
        prompt_tokens=5,
        completion_tokens=3,
        started_at=now,
        finished_at=now,
    )
    assert not store(mine, "worker-a", 200, {"usage": {}}, record)
    assert not UsageRecord.objects.filter(request_id="late-answer").exists()
    assert Line.objects.get(pk=line.pk).state == Line.State.RUNNING  # still worker-b's
    assert store(theirs, "worker-b", 200, {"usage": {}}, record)
    assert UsageRecord.objects.filter(request_id="late-answer").count() == 1
    assert Line.objects.get(pk=line.pk).state == Line.State.DONE


def test_a_hostile_file_name_comes_back_quoted_in_the_download(spot: World) -> None:
    """The uploader names the file: its download header quotes and encodes the name (RFC
    6266), so quotes and non-ASCII neither break the header nor forge a parameter."""
    _, key = spot.tenant()
    client = _client(spot, key)
    name = 'night "run"; filename=evil.exe é.jsonl'
    file_id = _upload(client, [_line("a")], name=name)
    stored = client.files.retrieve(file_id).filename  # the SDK escapes the quotes itself
    assert stored.endswith("; filename=evil.exe é.jsonl")
    response = httpx.get(
        f"{spot.stack.url}/v1/files/{file_id}/content",
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200
    header = response.headers["content-disposition"]
    kind, _, encoded = header.partition("; filename*=utf-8''")
    assert kind == "attachment" and encoded  # one parameter, RFC 5987-encoded
    assert not set(encoded) & set(' ";') and unquote(encoded) == stored


def _upload_headers(port: int, authorization: str) -> bytes:
    """Send only the headers of a 150 MB upload (not a byte of it), then read the answer."""
    headers = (
        "POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 150000000\r\n"
        f"{authorization}\r\n"
    )
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(headers.encode())
        while chunk := conn.recv(65536):  # until the server closes (it answers "close")
            answer += chunk
    return answer


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        ("", "missing_api_key"),
        ("Authorization: Bearer sk-ip-0123456789ab_" + "x" * 43 + "\r\n", "invalid_api_key"),
    ],
)
def test_an_upload_without_a_valid_key_is_refused_before_its_body_is_read(
    world: World, authorization: str, code: str
) -> None:
    """Django reads a request's whole body before its view sees the key: without the check
    from the headers, anyone could make a web process take 200 MB. Refused at once, in
    OpenAI's shape, while the client has sent nothing but headers (a wait for the body
    would time out here)."""
    port = int(world.stack.url.rsplit(":", 1)[1])
    answer = _upload_headers(port, authorization)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), answer[:200]
    assert orjson.loads(body)["error"]["code"] == code


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_four_downloads_of_a_big_file_hold_the_web_process_flat(world: World) -> None:
    """Four clients download a 120 MB batch file at once: the web process's peak memory
    grows by less than 64 MB (one chunk per download). Served from a synchronous iterator,
    Django read each download whole into memory first: ~480 MB, never given back."""
    tenant, key = world.tenant()
    size = 120 * 2**20
    with tempfile.TemporaryFile() as spool:
        line = b'{"custom_id": "x", "response": {"status_code": 200}}'.ljust(1023) + b"\n"
        for _ in range(size // len(line)):
            spool.write(line)
        path = default_storage.save(f"files/{tenant.pk}/big.jsonl", DjangoFile(spool))
    row = File.objects.create(
        tenant=tenant, purpose=File.Purpose.BATCH_OUTPUT, filename="big.jsonl", bytes=size,
        lines=size // 1024, path=path,
    )  # fmt: skip
    web = world.stack.processes["web"].pid
    try:
        before = _rss_kib(web, "VmRSS")
        Path(f"/proc/{web}/clear_refs").write_text("5")  # the peak (VmHWM) from here on

        def download(_: int) -> int:
            with httpx.stream(
                "GET",
                f"{world.stack.url}/v1/files/{row.id}/content",
                headers={"authorization": f"Bearer {key}"},
                timeout=120,
            ) as response:
                assert response.status_code == 200
                assert int(response.headers["content-length"]) == size
                return sum(len(chunk) for chunk in response.iter_bytes(1 << 20))

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(download, range(4))) == [size] * 4
        grown_mib = (_rss_kib(web, "VmHWM") - before) / 1024
        assert grown_mib < 64, f"the web process grew by {grown_mib:.0f} MiB"
    finally:
        default_storage.delete(path)


def _open_fds(pid: int, path: str) -> int:
    """How many of the process's file descriptors are open on ``path``."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd) == path
        except FileNotFoundError:
            continue  # closed meanwhile
    return count


def test_a_download_the_client_leaves_closes_its_file(world: World) -> None:
    """A client that goes away mid-download leaves no file open in the web process. The
    client reads through a small socket buffer, so the server is still sending (its file
    open) when the client leaves."""
    tenant, key = world.tenant()
    size = 32 * 2**20
    with tempfile.TemporaryFile() as spool:
        spool.write(b"x" * size)
        spool.seek(0)
        path = default_storage.save(f"files/{tenant.pk}/left.jsonl", DjangoFile(spool))
    row = File.objects.create(
        tenant=tenant, purpose=File.Purpose.BATCH_OUTPUT, filename="left.jsonl", bytes=size,
        lines=1, path=path,
    )  # fmt: skip
    web = world.stack.processes["web"].pid
    where = default_storage.path(path)
    port = int(world.stack.url.rsplit(":", 1)[1])
    request = (
        f"GET /v1/files/{row.id}/content HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\n\r\n"
    ).encode()
    try:
        for _ in range(3):
            with socket.socket() as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
                conn.settimeout(30)
                conn.connect(("127.0.0.1", port))
                conn.sendall(request)
                assert conn.recv(1 << 16).startswith(b"HTTP/1.1 200")
                wait_for(lambda: _open_fds(web, where) == 1, timeout=10)  # still sending
        wait_for(lambda: _open_fds(web, where) == 0, timeout=10)
    finally:
        default_storage.delete(path)
