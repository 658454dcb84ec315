"""Traces are validated line by line before anything runs; the trace workload resamples
deterministically; the synthetic generator reproduces the paper's Figure 5 statistics."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_core.config import ConfigError
from gyre_core.scheduler.events import Outcome
from gyre_core.simulator.workload import (
    PAPER_122B,
    TRACE_OUTCOMES,
    ExecutionRecord,
    GroupDraw,
    SyntheticParams,
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
BASE = '"query": "a", "duration_s": 1, "outcome": "failed"'

# ------------------------------------------------------------------------------ trace parsing


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"query": "a", "duration_s": -3, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": 0, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": "long", "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": true, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": NaN, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": Infinity, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": 1e400, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "duration_s": null, "outcome": "completed"}', 'field "duration_s"'),
        ('{"query": "a", "outcome": "completed"}', 'field "duration_s" is missing'),
        ('{"query": "", "duration_s": 1, "outcome": "completed"}', 'field "query"'),
        ('{"query": 17, "duration_s": 1, "outcome": "completed"}', 'field "query"'),
        ('{"duration_s": 1, "outcome": "completed"}', 'field "query" is missing'),
        ('{"query": "a", "duration_s": 1, "outcome": "cancelled"}', 'field "outcome"'),
        ('{"query": "a", "duration_s": 1, "outcome": "done"}', 'field "outcome"'),
        ('{"query": "a", "duration_s": 1, "outcome": 1}', 'field "outcome"'),
        ('{"query": "a", "duration_s": 1}', 'field "outcome" is missing'),
        ("{" + BASE + ', "tokens": 0}', 'field "tokens"'),
        ("{" + BASE + ', "tokens": -5}', 'field "tokens"'),
        ("{" + BASE + ', "tokens": 2.5}', 'field "tokens"'),
        ("{" + BASE + ', "tokens": true}', 'field "tokens"'),
        ("{" + BASE + ', "tokens": "12"}', 'field "tokens"'),
        ('["a", 1, "completed"]', "expected a JSON object, got list"),
        ('"a"', "expected a JSON object, got str"),
        ("null", "expected a JSON object, got NoneType"),
        ('{"query": "a", "duration_s": 1, ', "invalid JSON"),
        (GOOD + " x", "invalid JSON"),
    ],
)
def test_a_malformed_line_is_rejected_with_its_line_and_field(line: str, needle: str) -> None:
    with pytest.raises(TraceError) as err:
        parse_trace_lines([GOOD, "", line, GOOD], source="t.jsonl")
    message = str(err.value)
    assert message.startswith("t.jsonl line 3: ") and needle in message, message


def test_the_message_reads_as_documented() -> None:
    lines = [GOOD] * 6 + ['{"query": "a", "duration_s": -3, "outcome": "completed"}']
    with pytest.raises(TraceError) as err:
        parse_trace_lines(lines, source="trace.jsonl")
    assert str(err.value) == 'trace.jsonl line 7: field "duration_s" must be a finite number > 0, got -3'


def test_an_empty_trace_is_an_error() -> None:
    for lines in ([], ["", "  ", "\t"]):
        with pytest.raises(TraceError, match="t.jsonl: the trace holds no executions"):
            parse_trace_lines(lines, source="t.jsonl")


def test_unknown_keys_are_ignored_blank_lines_skipped_and_tokens_optional() -> None:
    text = "\n".join([
        '{"query": "a", "duration_s": 5, "outcome": "harness_timeout", "tokens": 7, "model": "x"}',
        "",
        '{"query": "b", "duration_s": 2.5, "outcome": "overall_timeout", "tokens": null}',
        '{"query": "b", "duration_s": 1.0, "outcome": "failed"}',
    ])
    records = parse_trace_lines(text)
    assert records == [
        ExecutionRecord("a", 5.0, Outcome.HARNESS_TIMEOUT, 7),
        ExecutionRecord("b", 2.5, Outcome.OVERALL_TIMEOUT, None),
        ExecutionRecord("b", 1.0, Outcome.FAILED, None),
    ]
    assert isinstance(records[0].duration_s, float)


def test_a_bad_last_line_fails_the_whole_file(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join([GOOD] * 50 + ['{"query": "a", "duration_s": 1, "outcome": "cancelled"}']) + "\n")
    with pytest.raises(TraceError, match=r'run\.jsonl line 51: field "outcome"'):
        load_trace(path)


def test_a_line_that_is_not_utf8_is_named(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(GOOD.encode() + b"\r\n" + b'{"query": "\xff", "duration_s": 1, "outcome": "failed"}\n')
    with pytest.raises(TraceError, match=r"run\.jsonl line 2: not UTF-8"):
        load_trace(path)


# ------------------------------------------------------------------------------- round trip


def test_a_synthetic_trace_round_trips_through_a_file(tmp_path) -> None:
    records = synthesize_trace(PAPER_122B, n_queries=30, n_per_query=4, seed=2)
    assert len(records) == 120 and len({r.query for r in records}) == 30
    write_trace(records, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == records
    assert synthesize_trace(PAPER_122B, n_queries=30, n_per_query=4, seed=2) == records


records_st = st.lists(
    st.builds(
        ExecutionRecord,
        query=st.text(min_size=1, max_size=20).filter(str.strip),
        duration_s=st.floats(min_value=1e-6, max_value=1e7, allow_nan=False, allow_infinity=False),
        outcome=st.sampled_from(TRACE_OUTCOMES),
        tokens=st.none() | st.integers(1, 10**12),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=60, deadline=None)
@given(records=records_st)
def test_any_valid_records_round_trip(tmp_path_factory, records: list[ExecutionRecord]) -> None:
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(records, path)
    assert load_trace(path) == records


@pytest.mark.parametrize(
    "bad",
    [ExecutionRecord("a", 1.0, Outcome.CANCELLED), ExecutionRecord("a", 0.0, Outcome.COMPLETED),
     ExecutionRecord("a", 1.0, Outcome.COMPLETED, 0), ExecutionRecord("", 1.0, Outcome.COMPLETED)],
)
def test_write_trace_refuses_what_load_trace_would_reject(tmp_path, bad: ExecutionRecord) -> None:
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match=r"write_trace: records\[1\]: field "):
        write_trace([ExecutionRecord("a", 1.0, Outcome.COMPLETED), bad], path)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_missing_tokens_are_proportional_to_duration() -> None:
    records = [ExecutionRecord("a", 100.0, Outcome.COMPLETED, 1000), ExecutionRecord("a", 50.0, Outcome.COMPLETED)]
    filled = with_default_tokens(records)
    assert filled[0].tokens == 1000 and filled[1].tokens == 500


# ----------------------------------------------------------------------------- trace workload

TRACE = [ExecutionRecord(q, float(10 * k + i + 1), Outcome.COMPLETED, 10) for k, q in enumerate("abc") for i in range(5)]


@given(n=st.integers(1, 12), seed=st.integers(0, 2**32))
def test_trace_workload_draws_n_executions_of_one_query_deterministically(n: int, seed: int) -> None:
    wl = TraceWorkload(TRACE)
    a = wl.draw_group(random.Random(seed), n)
    b = TraceWorkload(list(TRACE)).draw_group(random.Random(seed), n)
    assert a == b and len(a.executions) == n
    own = [r for r in TRACE if r.query == a.query]
    assert all(r.query == a.query and r in own for r in a.executions)
    if n <= len(own):  # enough recorded executions: a sample without replacement
        assert len(set(a.executions)) == n
    else:  # all of them, topped up by resampling
        assert set(a.executions) == set(own)


def test_trace_workload_draws_queries_uniformly_not_by_execution_count() -> None:
    records = [ExecutionRecord("one", 1.0, Outcome.COMPLETED)]
    records += [ExecutionRecord("many", float(i + 1), Outcome.FAILED) for i in range(60)]
    records += [ExecutionRecord("few", float(i + 1), Outcome.COMPLETED) for i in range(3)]
    wl, rng = TraceWorkload(records), random.Random(5)
    counts = Counter(wl.draw_group(rng, 4).query for _ in range(3000))
    assert set(counts) == {"one", "many", "few"}
    assert all(abs(c / 3000 - 1 / 3) < 0.04 for c in counts.values())


def test_trace_workload_rejects_empty_and_cancelled_input() -> None:
    with pytest.raises(TraceError, match="no executions"):
        TraceWorkload([])
    with pytest.raises(TraceError, match="not a trace outcome"):
        TraceWorkload([ExecutionRecord("a", 1.0, Outcome.CANCELLED)])
    with pytest.raises(ValueError, match="n: must be"):
        TraceWorkload(TRACE).draw_group(random.Random(0), 0)


def test_trace_workload_from_file(tmp_path) -> None:
    write_trace(TRACE, tmp_path / "t.jsonl")
    wl = TraceWorkload.from_file(tmp_path / "t.jsonl")
    assert wl.queries == ("a", "b", "c")
    assert wl.draw_group(random.Random(3), 7) == TraceWorkload(TRACE).draw_group(random.Random(3), 7)


# ------------------------------------------------------------------------- synthetic workload


@pytest.mark.parametrize("seed", [0, 1])
def test_synthetic_paper_preset_reproduces_figure_5(seed: int) -> None:
    """10,000 groups of 16 (~0.5 s). Across 200 seeds of 3,000 groups the spread (one SD) is
    0.7% (mean execution), 0.5% (mean query), 0.53 pp (≥ 4 h), 0.38 pp (harness timeouts) and
    0.09 pp (overall timeouts); at 10,000 groups it is ~1.8x smaller. Tolerances, all ≥ 4 SD:
    means ±2% relative; ≥ 4 h share ±1.2 pp; harness-timeout rate ±1 pp; overall-timeout rate
    ±0.25 pp."""
    rng = random.Random(seed)
    wl = SyntheticWorkload(PAPER_122B)
    stats = workload_stats(wl.draw_group(rng, 16) for _ in range(10_000))
    assert stats["n_groups"] == 10_000 and stats["n_executions"] == 160_000
    assert stats["mean_execution_h"] == pytest.approx(1.93, rel=0.02)
    assert stats["mean_query_h"] == pytest.approx(2.96, rel=0.02)
    assert stats["frac_queries_ge_4h"] == pytest.approx(0.0951, abs=0.012)
    assert stats["harness_timeout_rate"] == pytest.approx(0.0625, abs=0.01)
    assert stats["overall_timeout_rate"] == pytest.approx(0.0087, abs=0.0025)
    assert stats["failed_rate"] == pytest.approx(PAPER_122B.failure_rate, abs=0.005)
    assert stats["mean_tokens"] == pytest.approx(PAPER_122B.tokens_per_hour * 1.93, rel=0.03)


def test_timeouts_cluster_in_hard_queries() -> None:
    """Hard queries time out together: most groups have no harness timeout at all, and the ones
    that do have many (independent timeouts at 6.25% would touch 64% of groups of 16)."""
    rng, wl = random.Random(9), SyntheticWorkload(PAPER_122B)
    per_group = [sum(r.outcome is Outcome.HARNESS_TIMEOUT for r in wl.draw_group(rng, 16).executions)
                 for _ in range(3000)]
    touched = [c for c in per_group if c]
    assert len(touched) / len(per_group) < 0.12
    assert sum(touched) / len(touched) > 8


params_st = st.builds(
    SyntheticParams,
    duration_scale_h=st.floats(0.05, 5.0),
    duration_shape=st.floats(0.5, 8.0),
    difficulty_sigma=st.floats(0.0, 1.0),
    harness_timeout_h=st.floats(0.5, 6.0),
    overall_budget_h=st.just(8.0),
    hard_query_fraction=st.floats(0.0, 1.0),
    stall_prob=st.floats(0.0, 1.0),
    budget_query_fraction=st.floats(0.0, 1.0),
    budget_expiry_prob=st.floats(0.0, 1.0),
    failure_rate=st.floats(0.0, 1.0),
    failure_max_fraction=st.floats(0.01, 1.0),
    tokens_per_hour=st.floats(1.0, 1e6),
    tokens_sigma=st.floats(0.0, 1.0),
)


@settings(max_examples=80, deadline=None)
@given(params=params_st, n=st.integers(1, 24), seed=st.integers(0, 2**32))
def test_synthetic_draws_are_seeded_and_consistent(params: SyntheticParams, n: int, seed: int) -> None:
    wl = SyntheticWorkload(params)
    g = wl.draw_group(random.Random(seed), n)
    assert g == SyntheticWorkload(params).draw_group(random.Random(seed), n)
    assert len(g.executions) == n and all(r.query == g.query for r in g.executions)
    h_s, budget_s = params.harness_timeout_h * 3600, params.overall_budget_h * 3600
    for r in g.executions:
        assert r.outcome in TRACE_OUTCOMES and isinstance(r.tokens, int) and r.tokens >= 1
        assert math.isfinite(r.duration_s) and r.duration_s > 0
        if r.outcome is Outcome.HARNESS_TIMEOUT:
            assert r.duration_s == h_s
        elif r.outcome is Outcome.OVERALL_TIMEOUT:
            assert r.duration_s == budget_s > h_s
        elif r.outcome is Outcome.COMPLETED:
            assert r.duration_s < h_s
        else:  # failed part-way
            assert r.duration_s <= max(params.failure_max_fraction * h_s, 1.0) + 1e-9


def test_synthetic_rejects_a_bad_group_size() -> None:
    with pytest.raises(ValueError, match="n: must be"):
        SyntheticWorkload().draw_group(random.Random(0), 0)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"duration_scale_h": 0.0}, "duration_scale_h"),
        ({"duration_shape": -1.0}, "duration_shape"),
        ({"duration_shape": True}, "duration_shape"),
        ({"difficulty_sigma": -0.1}, "difficulty_sigma"),
        ({"harness_timeout_h": float("nan")}, "harness_timeout_h"),
        ({"harness_timeout_h": "4.5"}, "harness_timeout_h"),
        ({"overall_budget_h": 3.5}, "overall_budget_h"),  # must exceed the harness timeout
        ({"hard_query_fraction": 1.5}, "hard_query_fraction"),
        ({"stall_prob": -0.1}, "stall_prob"),
        ({"budget_query_fraction": 2.0}, "budget_query_fraction"),
        ({"budget_expiry_prob": 1.01}, "budget_expiry_prob"),
        ({"failure_rate": 1.5}, "failure_rate"),
        ({"failure_max_fraction": 0.0}, "failure_max_fraction"),
        ({"tokens_per_hour": float("inf")}, "tokens_per_hour"),
        ({"tokens_sigma": -1.0}, "tokens_sigma"),
    ],
)
def test_invalid_synthetic_params_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):
        dataclasses.replace(PAPER_122B, **change)
    assert issubclass(ConfigError, ValueError)


def test_defaults_are_the_paper_preset() -> None:
    assert SyntheticParams() == PAPER_122B
    assert PAPER_122B.overall_budget_h > PAPER_122B.harness_timeout_h >= 4.0


# --------------------------------------------------------------------------------- statistics


def test_workload_stats_match_a_hand_computation() -> None:
    h = 3600.0
    groups = [
        GroupDraw("a", (ExecutionRecord("a", 1 * h, Outcome.COMPLETED, 10),
                        ExecutionRecord("a", 4 * h, Outcome.HARNESS_TIMEOUT, 30))),
        GroupDraw("b", (ExecutionRecord("b", 2 * h, Outcome.FAILED),
                        ExecutionRecord("b", 3 * h, Outcome.OVERALL_TIMEOUT, 20))),
    ]
    stats = workload_stats(iter(groups))
    assert stats["mean_execution_h"] == pytest.approx(2.5)
    assert stats["mean_query_h"] == pytest.approx(3.5)
    assert stats["frac_queries_ge_4h"] == 0.5  # exactly 4 h counts
    assert stats["harness_timeout_rate"] == stats["overall_timeout_rate"] == stats["failed_rate"] == 0.25
    assert stats["mean_tokens"] == pytest.approx(20.0)  # over the executions that carry tokens
    assert workload_stats([GroupDraw("c", (ExecutionRecord("c", 1.0, Outcome.COMPLETED),))])["mean_tokens"] is None
    with pytest.raises(ValueError, match="no groups"):
        workload_stats([])
