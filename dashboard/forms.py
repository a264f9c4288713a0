from __future__ import annotations

from django import forms
from django.core.files import File

from tenants.models import ApiKey, adapter_name_validator


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
