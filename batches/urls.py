"""``/v1/files`` and ``/v1/batches``, routed to Django ahead of the gateway's consumers
(``controlplane/asgi.py``)."""

from django.urls import path

from batches import v1

urlpatterns = [
    path("v1/files", v1.files, name="v1-files"),
    path("v1/files/<str:file_id>", v1.file_detail, name="v1-file"),
    path("v1/files/<str:file_id>/content", v1.file_content, name="v1-file-content"),
    path("v1/batches", v1.batches, name="v1-batches"),
    path("v1/batches/<str:batch_id>", v1.batch_detail, name="v1-batch"),
    path("v1/batches/<str:batch_id>/cancel", v1.batch_cancel, name="v1-batch-cancel"),
]
