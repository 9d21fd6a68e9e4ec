"""Speculative decoding, a layer of its own: loaded when speculative_config asks for it.

It enters the core through two objects built at start-up in place of the plain ones:
  scheduling.py  Speculation, the scheduler's `speculation` hook: how many drafts each decoding
                 sequence verifies (policy.py's draft_limit; ngram.py's drafts), and the
                 accounting of a verified step (rejected drafts rolled back, Sequence.rollback);
  runner.py      SpeculativeRunner, the model runner built in place of ModelRunner: the draft
                 model's part of a step (draft_model.py), then the verify step in place of the
                 plain forward-and-sample (rejection_sampler.py).
"""
