"""Built-in tasks: small, verifiable, multi-turn tool-using tasks for the embedded default run.

A task is three things: an instance generator (what the execution is asked), a harness program
that plays the agent loop against Gyre's proxy over HTTP like any black-box harness, and an
evaluator (a ``gyre_evaluate`` hook implementation) that scores the workspace the harness leaves.
"""
