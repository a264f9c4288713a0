"""Health probes against a real vLLM CPU engine."""

from __future__ import annotations

import pytest

from inference.models import Replica
from inference.services import model_ensure, pool_ensure, replica_probe
from tests.engines import Engine, free_port

pytestmark = [pytest.mark.django_db, pytest.mark.engine]


def _replica(url: str, served_name: str = "tiny-chat") -> Replica:
    model = model_ensure(name="tiny-chat", served_name=served_name, context_length=1024)
    pool = pool_ensure(name="online", kind="dedicated", model=model, replica_urls=[url])
    return pool.replicas.get()


def test_a_live_engine_is_marked_ready(engine: Engine) -> None:
    replica = replica_probe(replica=_replica(engine.url))
    assert replica.state == Replica.State.READY
    assert replica.last_error == "" and replica.last_probe_at is not None


def test_an_engine_that_does_not_answer_is_marked_down(engine: Engine) -> None:
    replica = _replica(engine.url)
    replica_probe(replica=replica)
    replica.url = f"http://127.0.0.1:{free_port()}"
    replica.save()
    replica = replica_probe(replica=replica, timeout=1)
    assert replica.state == Replica.State.DOWN
    assert "ConnectError" in replica.last_error


def test_an_engine_serving_another_model_is_marked_down(engine: Engine) -> None:
    replica = replica_probe(replica=_replica(engine.url, served_name="llama-70b"))
    assert replica.state == Replica.State.DOWN
    assert "does not serve 'llama-70b'" in replica.last_error


def test_a_draining_replica_stays_draining(engine: Engine) -> None:
    replica = _replica(engine.url)
    replica.state = Replica.State.DRAINING
    replica.save()
    assert replica_probe(replica=replica).state == Replica.State.DRAINING
