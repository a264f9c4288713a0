from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Batches (files, batch jobs)"

    def ready(self) -> None:
        # The receivers that queue what the services ask for (batches.signals).
        from batches import tasks  # noqa: F401
