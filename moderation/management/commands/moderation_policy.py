from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.commands import parse_positive_int
from moderation.policy import ACTIONS, OUTPUT_MODES, PII_ACTIONS, PolicyInvalid
from moderation.selectors import moderation_policy_get
from moderation.services import moderation_policy_set
from tenants.models import Tenant
from tenants.selectors import tenant_get_by_slug


class Command(BaseCommand):
    help = (
        "Create or change a tenant's moderation policy (options not given keep their value). "
        "Takes effect on every web process within two seconds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        parser.add_argument(
            "--action", help=f"For deny terms, regexes and every category: {'|'.join(ACTIONS)}."
        )
        parser.add_argument(
            "--deny-term",
            nargs="*",
            metavar="TERM",
            help="The deny terms (replaces the list; none given: empty).",
        )
        parser.add_argument(
            "--regex",
            nargs="*",
            metavar="PATTERN",
            help="The tenant's regexes, RE2 syntax (replaces the list).",
        )
        parser.add_argument("--pii", help=f"Card numbers and IBANs: {'|'.join(PII_ACTIONS)}.")
        parser.add_argument("--output-mode", help=f"{'|'.join(OUTPUT_MODES)}.")
        parser.add_argument("--window", help="Tokens in one output window.")
        parser.add_argument("--overlap", help="Tokens two windows share.")
        parser.add_argument(
            "--fail", choices=("open", "closed"), help="When a check fails or runs out of time."
        )
        parser.add_argument("--budget-ms", help="The checks' time budget, in milliseconds.")
        parser.add_argument("--guard-model", help="A classification model on a pool ('' for none).")
        parser.add_argument(
            "--no-classifier", action="store_true", help="Turn the embedded classifier off."
        )
        parser.add_argument(
            "--classifier", action="store_true", help="Turn the embedded classifier on."
        )
        parser.add_argument(
            "--off", action="store_true", help="Stop moderating the tenant (the policy is kept)."
        )
        parser.add_argument("--on", action="store_true", help="Moderate the tenant again.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            tenant = tenant_get_by_slug(slug=options["slug"])
        except Tenant.DoesNotExist:
            raise CommandError(f"no tenant with slug {options['slug']!r}") from None
        changes: dict[str, Any] = {}
        chosen = (("action", ACTIONS), ("pii", PII_ACTIONS), ("output_mode", OUTPUT_MODES))
        for option, choices in chosen:
            value = options[option]
            if value is not None:
                if value not in choices:
                    flag = "--" + option.replace("_", "-")
                    raise CommandError(f"{flag} must be one of {', '.join(choices)}, not {value!r}")
                changes["pii_action" if option == "pii" else option] = value
        current = moderation_policy_get(tenant=tenant)
        if options["action"] is not None and current is not None:
            # One action for everything: the categories follow it.
            changes["categories"] = {
                name: {**rule, "action": options["action"]}
                for name, rule in current.categories.items()
            }
        if options["deny_term"] is not None:
            changes["deny_terms"] = options["deny_term"]
        if options["regex"] is not None:
            changes["regexes"] = options["regex"]
        window = parse_positive_int(options["window"], option="--window", maximum=2048)
        if window is not None:
            changes["window_tokens"] = window
            if options["overlap"] is None:
                changes["overlap_tokens"] = window // 4
        if options["overlap"] is not None:
            changes["overlap_tokens"] = (
                0
                if options["overlap"] == "0"
                else parse_positive_int(options["overlap"], option="--overlap", maximum=2047)
            )
        budget = parse_positive_int(options["budget_ms"], option="--budget-ms", maximum=10_000)
        if budget is not None:
            changes["budget_ms"] = budget
        if options["fail"] is not None:
            changes["fail_open"] = options["fail"] == "open"
        if options["guard_model"] is not None:
            changes["guard_model"] = options["guard_model"]
        if options["no_classifier"] or options["classifier"]:
            changes["classifier"] = bool(options["classifier"])
        if options["off"] or options["on"]:
            changes["enabled"] = bool(options["on"])
        try:
            policy = moderation_policy_set(tenant=tenant, changes=changes, actor=None)
        except PolicyInvalid as exc:
            raise CommandError(str(exc)) from None
        state = "on" if policy.enabled else "off"
        self.stdout.write(
            f"moderation of {tenant.slug}: {state}, action {policy.action}, "
            f"{len(policy.deny_terms)} deny terms, {len(policy.regexes)} regexes, "
            f"pii {policy.pii_action}, output {policy.output_mode} "
            f"(window {policy.window_tokens}, overlap {policy.overlap_tokens}), "
            f"fail {'open' if policy.fail_open else 'closed'} after {policy.budget_ms} ms"
        )
