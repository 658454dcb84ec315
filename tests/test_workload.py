"""Traces are validated line by line; the synthetic generator reproduces the paper's statistics."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre_core.config import ConfigError
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.workload import (
    PAPER_122B,
    ExecutionRecord,
    SyntheticWorkload,
    TraceError,
    TraceWorkload,
    load_trace,
    parse_trace_lines,
    synthesize_trace,
    with_default_tokens,
    workload_stats,
    write_trace,
)

GOOD = '{"query": "a", "duration_s": 10.5, "outcome": "completed"}'


@pytest.mark.parametrize(
    "line,field",
    [
        ('{"query": "a", "duration_s": -3, "outcome": "completed"}', "duration_s"),
        ('{"query": "a", "duration_s": "long", "outcome": "completed"}', "duration_s"),
        ('{"query": "a", "duration_s": true, "outcome": "completed"}', "duration_s"),
        ('{"query": "a", "duration_s": NaN, "outcome": "completed"}', "duration_s"),
        ('{"query": "a", "outcome": "completed"}', "duration_s"),
        ('{"query": "", "duration_s": 1, "outcome": "completed"}', "query"),
        ('{"duration_s": 1, "outcome": "completed"}', "query"),
        ('{"query": "a", "duration_s": 1, "outcome": "cancelled"}', "outcome"),
        ('{"query": "a", "duration_s": 1, "outcome": "done"}', "outcome"),
        ('{"query": "a", "duration_s": 1, "outcome": "failed", "tokens": 0}', "tokens"),
        ('{"query": "a", "duration_s": 1, "outcome": "failed", "tokens": 2.5}', "tokens"),
        ('["a", 1, "completed"]', "JSON object"),
        ('{"query": "a", "duration_s": 1, ', "JSON"),
    ],
)
def test_a_malformed_line_is_named_with_its_field(line: str, field: str) -> None:
    with pytest.raises(TraceError) as err:
        parse_trace_lines([GOOD, "", line], source="t.jsonl")
    assert "t.jsonl line 3" in str(err.value) and field in str(err.value)


def test_an_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="no executions"):
        parse_trace_lines(["", "  "], source="t.jsonl")


def test_trace_round_trip(tmp_path) -> None:
    records = synthesize_trace(PAPER_122B, n_queries=5, n_per_query=3, seed=2)
    write_trace(records, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == records


@given(n=st.integers(1, 12), seed=st.integers(0, 2**32))
def test_trace_workload_draws_n_executions_of_one_query_deterministically(n: int, seed: int) -> None:
    records = [ExecutionRecord(q, float(i + 1), Outcome.COMPLETED, 10) for q in "abc" for i in range(5)]
    wl = TraceWorkload(records)
    a = wl.draw_group(random.Random(seed), n)
    b = wl.draw_group(random.Random(seed), n)
    assert a == b and len(a.executions) == n
    assert all(r.query == a.query and r in records for r in a.executions)
    if n <= 5:  # enough recorded executions: no repeats
        assert len(set(a.executions)) == n


def test_missing_tokens_are_proportional_to_duration() -> None:
    records = [ExecutionRecord("a", 100.0, Outcome.COMPLETED, 1000), ExecutionRecord("a", 50.0, Outcome.COMPLETED)]
    filled = with_default_tokens(records)
    assert filled[0].tokens == 1000 and filled[1].tokens == 500


def test_synthetic_paper_preset_reproduces_figure_5() -> None:
    rng = random.Random(12345)
    wl = SyntheticWorkload(PAPER_122B)
    stats = workload_stats(wl.draw_group(rng, 16) for _ in range(4000))
    # means within 3% relative, rates within 1 percentage point (0.3 for the rare overall timeout)
    assert stats["mean_execution_h"] == pytest.approx(1.93, rel=0.03)
    assert stats["mean_query_h"] == pytest.approx(2.96, rel=0.03)
    assert stats["frac_queries_ge_4h"] == pytest.approx(0.0951, abs=0.01)
    assert stats["harness_timeout_rate"] == pytest.approx(0.0625, abs=0.01)
    assert stats["overall_timeout_rate"] == pytest.approx(0.0087, abs=0.003)


@pytest.mark.parametrize(
    "change,field",
    [({"query_sigma": -1.0}, "query_sigma"), ({"failure_rate": 1.5}, "failure_rate"),
     ({"overall_budget_h": 1.0}, "overall_budget_h"), ({"harness_timeout_h": 0.0}, "harness_timeout_h"),
     ({"tokens_per_hour": float("inf")}, "tokens_per_hour")],
)
def test_invalid_synthetic_params_name_the_field(change: dict, field: str) -> None:
    import dataclasses

    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(PAPER_122B, **change)
