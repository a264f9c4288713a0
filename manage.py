#!/usr/bin/env python
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        settings.INSTALLED_APPS  # noqa: B018 - read the settings now: a bad value is one line
    except ImproperlyConfigured as exc:
        sys.exit(f"error: {exc}")
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
