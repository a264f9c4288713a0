from django.apps import AppConfig


class ModerationConfig(AppConfig):
    name = "moderation"
    verbose_name = "Moderation"

    def ready(self) -> None:
        # Every request the gateway serves goes through its tenant's policy from now on.
        from inference.gateway.seams import guard_source_set
        from moderation.guard import guard_source

        guard_source_set(guard_source)
