"""A finished batch's output and error files, written line by line from the database (an
answer is never parsed here), linked to the batch only by the writer holding its ending's
stamp."""

from __future__ import annotations

import logging
import tempfile
from datetime import datetime

from django.db.models import TextField
from django.db.models.functions import Cast
from django.utils import timezone

from batches.files import file_delete, file_store_output
from batches.models import Batch, File, Line
from batches.wire import output_line

log = logging.getLogger(__name__)


def write_files_of(batch_id: str, stamp: datetime) -> None:
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    write_files(batch, final=batch.ending_as, stamp=stamp)


def write_files(batch: Batch, *, final: str, stamp: datetime) -> None:
    """The output file (answered lines, in input order) and the error file (the others),
    written line by line from the database to temporary files, then to storage. Only the
    holder of the ending's ``stamp`` links its files to the batch; a writer that lost its
    stamp (another took over) removes its own, and the winner removes earlier attempts'."""
    names = (f"{batch.id}_output.jsonl", f"{batch.id}_error.jsonl")
    counts = {"output": 0, "error": 0}
    with tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as error:
        # Neither the request nor the answer is parsed: a line's answer goes into its output
        # line as the JSON text the database gives (parsed, it would hold ~10x its size).
        lines = (
            Line.objects.filter(batch=batch)
            .defer("body", "response")
            .annotate(response_text=Cast("response", TextField()))
            .order_by("number")
            .iterator(chunk_size=100)
        )
        for line in lines:
            target = "output" if line.state == Line.State.DONE else "error"
            text = line.response_text
            (output if target == "output" else error).write(output_line(line, text))
            counts[target] += 1
        made: list[File] = []
        for target, content, name in (("output", output, names[0]), ("error", error, names[1])):
            if counts[target]:
                made.append(
                    file_store_output(
                        tenant=batch.tenant, name=name, content=content, lines=counts[target]
                    )
                )
    output_id = next((f.id for f in made if f.filename == names[0]), "")
    error_id = next((f.id for f in made if f.filename == names[1]), "")
    stamp_field = {
        Batch.Status.COMPLETED: "completed_at",
        Batch.Status.CANCELLED: "cancelled_at",
        Batch.Status.EXPIRED: "expired_at",
    }[Batch.Status(final)]
    linked = (
        Batch.objects.filter(pk=batch.pk, ending_at=stamp)
        .exclude(status__in=Batch.FINISHED)
        .update(
            status=final,
            output_file_id=output_id,
            error_file_id=error_id,
            **{stamp_field: timezone.now()},
        )
    )
    mine = {f.id for f in made}
    if not linked:
        for file in made:
            file_delete(file=file)
        return
    for earlier in File.objects.filter(tenant=batch.tenant, filename__in=names).exclude(
        pk__in=mine
    ):
        file_delete(file=earlier)
