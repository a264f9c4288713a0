from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    verbose_name = "Inference (data plane)"

    def ready(self) -> None:
        from inference import receivers  # noqa: F401  (connects the receivers)
