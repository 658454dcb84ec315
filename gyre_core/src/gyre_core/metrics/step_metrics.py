"""One training step's figures as flat, named scalars (the ``gyre_on_metrics`` payload).

Names are ``section/figure`` so TensorBoard and W&B group them: ``train/`` (the GSPO update the
core applied), ``rollout/`` (rewards and staleness of the groups it trained on), ``executions/``
(how many are in each state now), ``switch/`` (role-switch phase times since the previous step),
``calls/`` (calls interrupted by role changes and what became of them), ``publication/``,
``engines/`` and ``proxy/`` (generated tokens per second and call latency since the previous
step, from :class:`gyre_core.proxy.call_stats.CallStats`). A
figure that was not measured (no trainable token, nothing switched) is left out, never sent as 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Mapping, Sequence

__all__ = ["step_metrics"]

_TRAIN = ("loss", "grad_norm", "lr", "clip_fraction", "token_clip_fraction", "correction_fraction", "ratio_mean",
          "ratio_max", "tokens", "entropy",
          "logp_diff_mean", "logp_diff_max", "kl_k3", "kl_ref", "micro_steps", "split_executions", "duration_s", "executions")


def _put(out: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if math.isfinite(float(value)):
        out[name] = float(value)


def step_metrics(
    record: Mapping[str, Any],
    *,
    executions: Mapping[str, Any] | None = None,
    switches: Sequence[Mapping[str, Any]] = (),
    interrupted_calls: Mapping[str, Any] | None = None,
    publication: Mapping[str, Any] | None = None,
    call_stats: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """The scalars of one step: ``record`` is the step's entry of the summary's ``step_records``,
    ``switches`` the role switches that finished since the previous step."""
    out: dict[str, float] = {}
    for k in _TRAIN:
        _put(out, f"train/{k}", record.get(k))
    _put(out, "rollout/mean_reward", record.get("mean_reward"))
    stale = [s for s in record.get("staleness", ()) if isinstance(s, (int, float))]
    if stale:
        _put(out, "rollout/staleness_mean", sum(stale) / len(stale))
        _put(out, "rollout/staleness_max", max(stale))
    _put(out, "rollout/groups", len(record.get("groups", ())))
    _put(out, "train/cells", len(record.get("cells", ())))
    for k, v in (executions or {}).items():
        _put(out, f"executions/{k}", v)
    phase_s: dict[str, list[float]] = defaultdict(list)
    for sw in switches:
        t = str(sw.get("transition", "switch"))
        phase_s[f"switch/{t}_s"].append(float(sw.get("total_s", 0.0)))
        for phase, s in (sw.get("phases") or {}).items():
            phase_s[f"switch/{t}/{phase}_s"].append(float(s))
    for name, values in phase_s.items():
        _put(out, name, sum(values) / len(values))
    for k, v in (interrupted_calls or {}).items():
        _put(out, f"calls/{k}", v)
    for k in ("export_s", "load_s"):
        _put(out, f"publication/{k}", (publication or {}).get(k))
    for k, v in (call_stats or {}).items():
        if k.startswith(("engines/", "proxy/")):
            _put(out, k, v)
    return out
