from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "adapters"
    verbose_name = "LoRA adapters"

    def ready(self) -> None:
        # The receiver that queues an upload's validation (adapters.signals).
        from adapters import tasks  # noqa: F401
