"""Gyre's token-in/token-out (TITO) proxy: every model call of every harness passes through here.

It serves each harness in its own API (OpenAI ``/v1/chat/completions``, Anthropic
``/v1/messages``), renders requests into token ids with the model's chat template, calls the
rollout engines with ``input_ids``, and records exactly what the policy produced into each
execution's trajectory tree. ``types`` is the API-neutral seam between the two
HTTP faces and the recording core.
"""
