"""A step's training figures, as the console, ``events.jsonl`` and ``summary.json`` show them.

Backends report per rank (:attr:`TrainingSide.last_step_info`-style dicts): each cell's last
pipeline stage its share of the objective's figures (``objective``: sums over its micro-steps),
the core its gradient norm. The step's figures are the sums over cells, and the ratios of sums.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["training_figures"]


def training_figures(cell_infos: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """A step's training figures from its cells' per-rank statistics (each cell's last stage
    reports its objective figures, the core its gradient norm): loss, grad norm, the fraction of
    the learning rate the step was trained at, the fraction of
    executions clipped (for a token-level objective: the mean share of an execution's tokens) and
    of tokens, mean and max importance ratio π/π_b over trained tokens, tokens trained, and the
    sampler–trainer gap on them (mean and max |log π_θ − log π_b|, the K3 estimate of
    KL(π_b ‖ π_θ) per token), the share of tokens a correction truncated or masked, and the
    policy's mean entropy there. ``None`` where a backend reported nothing."""
    total: dict[str, float] = {"loss": 0.0, "executions": 0.0, "clipped": 0.0, "clipped_tokens": 0.0,
                               "corrected_tokens": 0.0, "entropy_sum": 0.0,
                               "ratio_sum": 0.0, "tokens": 0.0, "abs_delta_sum": 0.0, "k3_sum": 0.0,
                               "ratio_pass_tokens": 0.0, "ratio_pass_s": 0.0, "kl_ref_sum": 0.0,
                               "reference_pass_s": 0.0}
    ratio_max, delta_max, grad_norm, lr, seen = 0.0, 0.0, None, None, False
    for infos in cell_infos:
        for info in infos:
            fig = info.get("objective")
            if fig:
                seen = True
                for k in total:
                    total[k] += float(fig.get(k, 0.0))
                ratio_max = max(ratio_max, float(fig.get("ratio_max", 0.0)))
                delta_max = max(delta_max, float(fig.get("abs_delta_max", 0.0)))
            if info.get("grad_norm") is not None:
                grad_norm = float(info["grad_norm"])
            if info.get("lr") is not None:  # the core's optimizer, as its schedule set it
                lr = float(info["lr"])
    if not seen:
        return {"loss": None, "grad_norm": grad_norm, "lr": lr, "clip_fraction": None, "token_clip_fraction": None,
                "correction_fraction": None, "entropy": None,
                "ratio_mean": None, "ratio_max": None, "tokens": None, "logp_diff_mean": None,
                "logp_diff_max": None, "kl_k3": None, "kl_ref": None, "ratio_pass_tokens": None, "ratio_pass_s": None,
                "reference_pass_s": None}
    tokens = total["tokens"]
    return {
        "loss": round(total["loss"], 6),
        "grad_norm": None if grad_norm is None else round(grad_norm, 6),
        "lr": lr,
        "clip_fraction": round(total["clipped"] / total["executions"], 4) if total["executions"] else None,
        "token_clip_fraction": round(total["clipped_tokens"] / tokens, 4) if tokens else None,
        # tokens a sampler–trainer correction truncated (tis) or masked (mis, icepop)
        "correction_fraction": round(total["corrected_tokens"] / tokens, 4) if tokens else None,
        # the policy's entropy (nats) at the trained tokens, at each call's sampling temperature
        "entropy": round(total["entropy_sum"] / tokens, 6) if tokens else None,
        "ratio_mean": round(total["ratio_sum"] / tokens, 4) if tokens else None,
        "ratio_max": round(ratio_max, 4) if tokens else None,
        "tokens": int(tokens),
        # the sampler–trainer gap on the trained tokens (with the policy's drift for stale ones)
        "logp_diff_mean": round(total["abs_delta_sum"] / tokens, 6) if tokens else None,
        "logp_diff_max": round(delta_max, 6) if tokens else None,
        "kl_k3": round(total["k3_sum"] / tokens, 8) if tokens else None,
        # the forward-only pass that gives split executions their whole-execution ratio
        "ratio_pass_tokens": int(total["ratio_pass_tokens"]),
        "ratio_pass_s": round(total["ratio_pass_s"], 3),
        # a KL penalty: its estimate of KL(π_θ ‖ π_ref) per trained token, and the reference passes' time
        "kl_ref": round(total["kl_ref_sum"] / tokens, 8) if tokens else None,
        "reference_pass_s": round(total["reference_pass_s"], 3),
    }
