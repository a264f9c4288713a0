from __future__ import annotations

from django import forms
from django.contrib.auth.forms import UserCreationForm
from django.core.files import File

from tenants.models import ApiKey, Role, User, adapter_name_validator


class KeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What the key is for, e.g. “support bot”.")
    scopes = forms.MultipleChoiceField(
        choices=ApiKey.Scope.choices,
        initial=list(ApiKey.Scope.values),
        widget=forms.CheckboxSelectMultiple,
    )


class KeyRotateForm(forms.Form):
    grace_hours = forms.IntegerField(
        min_value=0,
        max_value=30 * 24,
        initial=24,
        label="Old key keeps working for (hours)",
    )


class AdapterUploadForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[adapter_name_validator])
    archive = forms.FileField(required=False, help_text=".zip or .tar.gz")
    adapter_config = forms.FileField(required=False, label="adapter_config.json")
    adapter_model = forms.FileField(required=False, label="adapter_model.safetensors")

    def files_given(self) -> dict[str, File]:
        return {
            part: self.cleaned_data[part]
            for part in ("archive", "adapter_config", "adapter_model")
            if self.cleaned_data.get(part)
        }


class InviteForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, initial=Role.DEVELOPER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class SignUpForm(UserCreationForm[User]):
    """A new account, made while accepting an invitation."""

    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username", "email")


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False, max_length=64, label="Action starts with")
    actor = forms.CharField(required=False, max_length=150)
    since = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))
