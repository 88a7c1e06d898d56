"""The machinery every lightning_diag callback shares (imported by every callback's subpackage, never the reverse).

* ``base.py``: :class:`DiagCallback`, the base of every callback: declared rules and state, attaching to the
  driver, alerts, the quiet switch.
* ``driver.py``: the per-trainer ``Driver``: its session, step axis, shared measurements, the attached callbacks
  and the once-per-batch cadence decision.
* ``shared.py``: ``Shared``, the closed set of measurements a callback requests from the driver, and
  ``SharedMeasurements``, which measures each once a step for every reader.
* ``session.py``: ``DiagSession``, the driver's session of a run folder (writer, alert log, the run's files).
* ``step_axis.py``: ``StepAxis``, the user's step axis, one per trainer (the driver's).
* ``batch_hooks.py``: switching a callback's per-batch hooks off on quiet batches.
* ``reduction.py``: the DDP adapter of the declared state's reduction across ranks.
* ``provenance.py``: ``diag/run.json``, what a run was.
* ``unlogged.py``: running the user's ``training_step`` again without its ``self.log`` reaching the results (the
  alarm's replay and the probes).
"""
