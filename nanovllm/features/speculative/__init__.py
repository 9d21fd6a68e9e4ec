"""Speculative decoding, a layer of its own: loaded when speculative_config (config.py) asks for
it. It enters the core through two objects built at start-up in place of the plain ones:
SpeculativeScheduler (scheduling.py: how many drafts each decoding sequence verifies, by policy.py
and ngram.py, and the accounting of a verified step) and SpeculativeRunner (runner.py:
the draft model's part of a step, draft_model.py, then the verify step, rejection_sampler.py).
"""
