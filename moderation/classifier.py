"""The embedded default classifier: ``alt-profanity-check``'s model, which ships in its wheel
(a TF-IDF vectorizer and a calibrated linear SVM, trained on offensive and profane text), so
it needs no download and no GPU.

What it measures is offensive or profane language, which on OpenAI's scale is closest to
``harassment``; it reports that category only and says nothing about the other twelve (a guard
model on a pool covers those). Scored here from the model's own weights, which equals the
library's ``predict_prob`` (tests check it) at a tenth of its cost: sklearn's per-call input
validation, not the arithmetic, is most of the 2-3 ms that ``predict_prob`` takes per text.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

CATEGORY = "harassment"

_lock = threading.Lock()
_model: _Scorer | None = None


class _Scorer:
    def __init__(self) -> None:
        import profanity_check.profanity_check as library  # loads the pickled model (~1 s)

        folds = library.model.calibrated_classifiers_
        self.vectorizer: Any = library.vectorizer
        self.weights = np.stack([f.estimator.coef_[0] for f in folds], axis=1)
        self.intercepts = np.array([f.estimator.intercept_[0] for f in folds])
        self.a = np.array([f.calibrators[0].a_ for f in folds])
        self.b = np.array([f.calibrators[0].b_ for f in folds])

    def scores(self, texts: list[str]) -> list[float]:
        features = self.vectorizer.transform(texts)
        decision = features @ self.weights + self.intercepts  # one column per fold
        # Each fold's sigmoid calibration, averaged (what CalibratedClassifierCV does).
        probability = 1.0 / (1.0 + np.exp(self.a * decision + self.b))
        return [float(p) for p in probability.mean(axis=1)]


def classifier() -> _Scorer:
    """The process's scorer, loaded on first use (call it off the event loop the first time:
    ``moderation.policy_view`` warms it in a thread when a policy needs it)."""
    global _model
    if _model is None:
        with _lock:
            if _model is None:
                _model = _Scorer()
    return _model


def loaded() -> bool:
    return _model is not None
