"""TTFT predictor: a polynomial in the batch's token count, fitted to a profile sweep.

Prefill time on a disaggregated prefill instance depends almost only on the number of
tokens in the forward pass (paper §6.4): linear GEMM work plus causal attention that grows
with the square. A polynomial of degree ≤ 3 fitted by least squares to measured
``(num_tokens, seconds)`` samples predicts it well; the scheduler calls it for every slack
and every batching decision, so :meth:`TTFTPredictor.predict_s` is plain float arithmetic.

The JSON file is versioned (``format_version``) and records where it was measured, so a
profile taken on other hardware is recognisable as such.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowprefill.errors import InvalidRequestError

FORMAT_VERSION: Literal[1] = 1


class FitError(BaseModel):
    model_config = ConfigDict(frozen=True)

    mean_abs_pct: float = Field(description="Mean absolute percentage error over the samples.")
    max_abs_pct: float = Field(description="Largest absolute percentage error.")
    mean_abs_ms: float = Field(description="Mean absolute error in milliseconds.")
    num_samples: int = Field(description="How many samples the error was computed on.")


class TTFTPredictor(BaseModel):
    """``predict_s(n) = sum(coefficients[i] * n**i)``, never below ``min_latency_s``."""

    model_config = ConfigDict(frozen=True)

    format_version: Literal[1] = FORMAT_VERSION
    coefficients: list[float] = Field(description="Ascending powers of the token count.")
    min_latency_s: float = Field(0.0, ge=0, description="Floor of any prediction.")
    min_tokens: int = Field(1, ge=1, description="Smallest token count profiled.")
    max_tokens: int = Field(1, ge=1, description="Largest token count profiled.")
    fit_error: FitError | None = None
    samples: list[tuple[int, float]] = Field(default_factory=list)
    hardware: str = Field("", description="Device the profile was measured on.")
    model: str = Field("", description="Model the profile was measured with.")
    created_at: str = ""

    @field_validator("coefficients")
    @classmethod
    def _check_coefficients(cls, v: list[float]) -> list[float]:
        if not 1 <= len(v) <= 4:
            raise ValueError("a TTFT predictor has 1 to 4 coefficients (degree ≤ 3)")
        if not all(math.isfinite(c) for c in v):
            raise ValueError("coefficients must be finite")
        return v

    @property
    def degree(self) -> int:
        return len(self.coefficients) - 1

    @property
    def monotone(self) -> bool:
        """Whether :meth:`predict_s` never decreases as the token count grows, exactly,
        in floating point: true when no coefficient but the constant is negative (each
        Horner step then multiplies or adds non-negative numbers, and IEEE rounding is
        monotone; the floor keeps it so). A fit with a negative term may still be
        monotone over the profiled range, but this does not claim it."""
        return all(c >= 0 for c in self.coefficients[1:])

    def predict_s(self, num_tokens: int) -> float:
        """Predicted prefill latency of a forward pass over ``num_tokens`` tokens."""
        acc = 0.0
        for c in reversed(self.coefficients):  # Horner
            acc = acc * num_tokens + c
        return max(acc, self.min_latency_s)

    # ------------------------------------------------------------- fitting

    @classmethod
    def fit(
        cls,
        samples: list[tuple[int, float]],
        degree: int = 2,
        *,
        hardware: str = "",
        model: str = "",
    ) -> TTFTPredictor:
        """Least-squares fit; each sample is ``(num_tokens, seconds)``.

        Weighted by 1/seconds so that short prompts — where the urgent SLOs live — are
        fitted in relative terms rather than swamped by the long ones.
        """
        if not 0 <= degree <= 3:
            raise InvalidRequestError(f"polynomial degree must be 0..3, got {degree}")
        if len({n for n, _ in samples}) <= degree:
            raise InvalidRequestError(
                f"a degree-{degree} fit needs more than {degree} distinct token counts"
            )
        x = np.array([n for n, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        if np.any(y <= 0) or np.any(x <= 0):
            raise InvalidRequestError("profile samples must have positive tokens and times")
        coef = np.polynomial.polynomial.polyfit(x, y, degree, w=1.0 / y)
        predictor = cls(
            coefficients=[float(c) for c in coef],
            min_latency_s=float(y.min()) * 0.5,
            min_tokens=int(x.min()),
            max_tokens=int(x.max()),
            samples=[(int(n), float(t)) for n, t in samples],
            hardware=hardware,
            model=model,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        return predictor.model_copy(update={"fit_error": predictor.error_on(samples)})

    def error_on(self, samples: list[tuple[int, float]]) -> FitError:
        if not samples:
            raise InvalidRequestError("no samples to measure the error on")
        rel = [abs(self.predict_s(n) - t) / t for n, t in samples]
        abs_ms = [abs(self.predict_s(n) - t) * 1e3 for n, t in samples]
        return FitError(
            mean_abs_pct=100 * sum(rel) / len(rel),
            max_abs_pct=100 * max(rel),
            mean_abs_ms=sum(abs_ms) / len(abs_ms),
            num_samples=len(samples),
        )

    # ----------------------------------------------------------------- I/O

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TTFTPredictor:
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise InvalidRequestError(f"TTFT profile {p} does not exist") from None
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"TTFT profile {p} is not valid JSON: {e}") from None
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version != FORMAT_VERSION:
            raise InvalidRequestError(
                f"TTFT profile {p} has format_version {version!r}; this build reads "
                f"{FORMAT_VERSION} (re-run `flowprefill profile`)"
            )
        return cls.model_validate(raw)

    @classmethod
    def linear(cls, per_token_s: float, fixed_s: float = 0.0) -> TTFTPredictor:
        """A hand-set linear model (tests, simulations with a known cost)."""
        return cls(coefficients=[fixed_s, per_token_s], min_latency_s=0.0)
