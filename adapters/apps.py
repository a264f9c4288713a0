from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "adapters"
    verbose_name = "LoRA adapters"

    def ready(self) -> None:
        # The receiver that queues an upload's validation (adapters.signals), and those of
        # what lower apps announce (adapters.receivers).
        from adapters import receivers, tasks  # noqa: F401
