"""Instrumentation: Lightning-free torch code that reaches into a model while it trains.

Attention capture and recording, non-finite localisation, weight/optimizer snapshots for rollback, gradient
measurement, activation-gradient hooks, clocks, memory readings and batch inspection. It imports torch and the
core, never Lightning, so it is usable (and tested) outside a Trainer.
"""
