"""The suite's own machinery, where a flaw would show as a flake of some other test."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.core.management.color import no_style
from django.db import connection
from psycopg import sql

from tenants.models import Tenant


@pytest.mark.django_db(transaction=True)
def test_a_flush_that_deadlocks_with_a_live_writer_is_tried_again() -> None:
    """A live stack's worker may hold one table and ask for another while a transactional
    test's flush (one TRUNCATE, tables locked one by one) holds the second and waits for the
    first (CI, stop 33). Here the flush is made the victim: the writer checks for deadlocks
    only after 10 s (a superuser's setting: the suite connects as one), the flush after
    PostgreSQL's default 1 s. The test passes only if its own teardown's flush gets
    through."""
    Tenant.objects.create(name="Acme", slug="acme")
    tables = connection.introspection.django_table_names(only_existing=True)
    order = connection.ops.sql_flush(no_style(), tables)[0].split('"')[1::2]
    params = connection.get_connection_params()
    writer = psycopg.connect(
        host=params["host"],
        port=params["port"],
        user=params["user"],
        password=params.get("password"),
        dbname=params["dbname"],
    )
    writer.execute("SET deadlock_timeout = '10s'")
    last = sql.Identifier(order[-1])  # the flush's last table
    writer.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(last))

    def ask_for_the_first_table() -> None:
        # Waits until the flush has taken the first table (it waits in turn for the last).
        while not connection_waits(writer, order[-1]):
            time.sleep(0.01)  # polling a lock table, not waiting on anyone's speed
        writer.execute(sql.SQL("SELECT 1 FROM {} LIMIT 1").format(sql.Identifier(order[0])))
        writer.commit()
        writer.close()

    threading.Thread(target=ask_for_the_first_table, daemon=True).start()


def connection_waits(writer: psycopg.Connection, table: str) -> bool:
    """Whether some other session waits for a lock on ``table``."""
    with psycopg.connect(
        host=writer.info.host,
        port=writer.info.port,
        user=writer.info.user,
        dbname=writer.info.dbname,
        autocommit=True,
    ) as probe:
        row = probe.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass",
            [table],
        ).fetchone()
    return bool(row and row[0])
