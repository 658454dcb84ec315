"""A step's training figures: sums over cells, ratios of sums."""

from __future__ import annotations


def test_training_figures_sum_over_cells_and_take_ratios_of_sums() -> None:
    from gyre_core.orchestrator.training_figures import training_figures

    core = [{"grad_norm": 0.5, "lr": 3e-4, "objective": {"loss": 0.25, "executions": 3, "clipped": 1, "clipped_tokens": 6,
                                             "ratio_sum": 30.0, "ratio_max": 1.2, "tokens": 30,
                                             "abs_delta_sum": 0.3, "abs_delta_max": 0.05, "k3_sum": 0.0015,
                                             "ratio_pass_tokens": 12, "ratio_pass_s": 0.25}}]
    sat = [{"objective": {"loss": -0.05, "executions": 1, "clipped": 1, "clipped_tokens": 2, "ratio_sum": 10.5,
                          "ratio_max": 1.5, "tokens": 10, "abs_delta_sum": 0.5, "abs_delta_max": 0.4, "k3_sum": 0.0025,
                          "ratio_pass_tokens": 4, "ratio_pass_s": 0.125}}]
    f = training_figures([core, sat])
    assert f == {"loss": 0.2, "grad_norm": 0.5, "lr": 3e-4, "clip_fraction": 0.5, "token_clip_fraction": 0.2,
                 "correction_fraction": 0.0, "entropy": 0.0,
                 "ratio_mean": 1.0125, "ratio_max": 1.5, "tokens": 40,
                 "logp_diff_mean": 0.02, "logp_diff_max": 0.4, "kl_k3": 0.0001,
                 "ratio_pass_tokens": 16, "ratio_pass_s": 0.375, "kl_ref": 0.0, "reference_pass_s": 0.0}
    assert training_figures([[{"rank": 0}]])["loss"] is None  # a backend that reports nothing: no figures
