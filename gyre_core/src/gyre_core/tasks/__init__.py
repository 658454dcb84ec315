"""Built-in tasks: small, verifiable, tool-using tasks for the embedded run and harness checks.

- ``number-guess`` (:mod:`.number_guess`): multi-turn with a ``guess`` tool; its own harness
  (:mod:`.number_guess_harness`, the official OpenAI SDK) is the embedded default.
- ``sum-file`` (:mod:`.sum_file`): a file-writing task for black-box coding harnesses such as
  Claude Code.
- ``digits`` (:mod:`.digits`): reply with digits only, scored by the fraction of digits sampled;
  played by the ``reply`` harness (:mod:`.reply_harness`). A tiny policy learns it on a CPU in
  minutes, which is what ``benchmarks/learning_curve.py`` shows.


A task is three things: an instance generator (what the execution is asked), a harness program
that plays the agent loop against Gyre's proxy over HTTP like any black-box harness, and an
evaluator (a ``gyre_evaluate`` hook implementation) that scores the workspace the harness leaves.
"""
