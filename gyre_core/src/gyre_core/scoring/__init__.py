"""Scoring an agent's work when the agent's code is hostile.

Under RL the policy is optimised against whatever scores it, so the code a scorer imports (the
agent's solution) is an adversary: it can plant modules that shadow the test runner, exit the
process that runs the tests, patch the runner or the files the tests import, print a verdict, or
kill its parent. This package holds the pieces that make those tricks fail:

* :mod:`~gyre_core.scoring.verdict`: the signed verdict an evaluator prints for Gyre (a token
  that Gyre writes to the evaluator's standard input, which no scored code ever reads);
* :mod:`~gyre_core.scoring.unittest_scorer` (``gyre-score unittest``): runs a task's own tests,
  written from the task record into a fresh folder, in a separate isolated Python, and rewards
  each named test the runner's own report shows passing;
* :mod:`~gyre_core.scoring.unittest_runner`: that separate Python's side.
"""
