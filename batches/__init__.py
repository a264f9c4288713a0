"""Offline batch jobs: OpenAI's Files and Batch APIs, run by Celery on spot vLLM pools.

A batch's lines live in Postgres, one row each; Celery messages only wake workers. A worker
claims a chunk of lines (``FOR UPDATE SKIP LOCKED``, with a lease and an owner token), runs
them through the gateway's own request path on the batch's spot pool
(``inference.gateway.headless.run_whole``: the same limits, fair admission and routing as
online traffic), and stores each line's result together with its usage record in one
transaction that only the line's current owner can commit: a redelivered task, a killed
worker or a vanished replica costs a retry of the lines in flight, never a loss and never a
duplicate, and the ledger holds exactly what the output files hold.
"""
