"""Choosing (φ, μ) for a target mean staleness: E[d] = φ + (μ − 1)/2 (the staleness law)."""

from __future__ import annotations

import math

from gyre_core.config import ConfigError, Mode

GYRE_DEFAULT_PHI = 0.5
"""Gyre keeps half a batch of extra dispatch to absorb stragglers, and spends the rest of the
staleness budget on longer bursts (the paper's μ=3, φ=0.5 at E[d]=1.5)."""


def expected_staleness(phi: float, mu: int) -> float:
    return phi + (mu - 1) / 2


def solve_burst(
    mode: Mode | str, target: float, *, mu: int | None = None, phi: float | None = None
) -> tuple[float, int]:
    """Return (φ, μ) with φ + (μ − 1)/2 = ``target`` for ``mode``.

    Async uses μ = 1; Colocate uses φ = 0 (it cannot dispatch extra without interrupting
    harnesses); Gyre uses φ = min(0.5, target) and the longest burst the rest allows. Giving ``mu``
    or ``phi`` overrides the mode's choice; the other is derived from the law.
    """
    mode = Mode.parse(mode)
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target >= 0):
        raise ConfigError(f"staleness: target E[d] must be a finite number ≥ 0, got {target!r}")
    if mu is not None and phi is not None:
        if abs(expected_staleness(phi, mu) - target) > 1e-9:
            raise ConfigError(
                f"staleness: φ={phi} and μ={mu} give E[d]={expected_staleness(phi, mu)}, not {target}"
            )
        return _checked(phi, mu)
    if mu is not None:
        return _checked(target - (mu - 1) / 2, mu)
    if phi is not None:
        mu_f = 2 * (target - phi) + 1
        if abs(mu_f - round(mu_f)) > 1e-9:
            raise ConfigError(f"staleness: φ={phi} leaves μ={mu_f:g}, which is not a whole number")
        return _checked(phi, int(round(mu_f)))
    if mode is Mode.ASYNC:
        return _checked(target, 1)
    if mode is Mode.COLOCATE:
        return solve_burst(mode, target, phi=0.0)
    phi0 = min(GYRE_DEFAULT_PHI, target)
    mu = int(math.floor(2 * (target - phi0) + 1e-9)) + 1
    return _checked(target - (mu - 1) / 2, mu)


def _checked(phi: float, mu: int) -> tuple[float, int]:
    if not isinstance(mu, int) or mu < 1:
        raise ConfigError(f"steps_per_burst: μ must be an integer ≥ 1, got {mu!r}")
    if phi < -1e-9:
        raise ConfigError(f"extra_dispatch: φ must be ≥ 0, got {phi:g} (μ={mu} is too long for the target)")
    return max(0.0, round(phi, 12)), mu


def burst_lengths(target: float) -> list[int]:
    """Every μ the target allows (φ ≥ 0)."""
    return list(range(1, int(math.floor(2 * target + 1e-9)) + 2))


def burst_candidates(target: float, phi: float | None = None) -> list[tuple[float, int]]:
    """The (φ, μ) pairs ``--auto-burst`` simulates.

    Without ``phi``: every μ the target allows, each with φ = target − (μ − 1)/2 on the law, from
    the longest extra dispatch (μ = 1, φ = target) to none (φ < 1/2). With ``phi`` fixed: every μ
    whose E[d] = φ + (μ − 1)/2 stays within the target (a staleness budget, not a point).
    """
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target >= 0):
        raise ConfigError(f"staleness: target E[d] must be a finite number ≥ 0, got {target!r}")
    if phi is None:
        return [_checked(target - (mu - 1) / 2, mu) for mu in burst_lengths(target)]
    if not (math.isfinite(phi) and phi >= 0):
        raise ConfigError(f"extra_dispatch: φ must be ≥ 0, got {phi!r}")
    if phi > target + 1e-9:
        raise ConfigError(f"extra_dispatch: φ={phi:g} alone exceeds the target E[d]={target:g}")
    mus = range(1, int(math.floor(2 * (target - phi) + 1e-9)) + 2)
    return [_checked(phi, mu) for mu in mus]
