"""``output_collapse``: predictions that no longer depend on the input (framework-free).

Fed by :class:`~lightning_diag.AnomalyAlarm` (:mod:`lightning_diag.callbacks.anomaly_alarm.output_collapse_check`
measures) on its sampled training steps. The model's output ``[B, ...]`` (the ``LightningModule``'s forward output, its
``logits`` entry for a mapping; see :class:`~lightning_diag.instrument.output_watch.OutputSpreadWatch`) gives, per
output element, its standard deviation across the ``B`` samples and its mean; ``spread`` and ``level`` average them
over the elements. The relative spread ``spread / (spread + |level|)`` is 0 when every sample gets the same output
and about 1 for outputs centred on zero. The judged statistic is the output's relative spread **over the input's**
(the same measure of the module's floating-point input of that batch; the output's alone where the input is token
ids or no tensor): about 1 when the outputs vary as much as the inputs do, whatever their scale. Below
``threshold`` (``1e-2``: outputs 100 times more alike than their inputs) on ``patience`` (3) consecutive sampled
steps, the outputs no longer depend on the input: labels scaled wrongly for the loss (class ids divided by 255
under an MSE: near-uniform softmax outputs, 0.003 to 0 of their level against inputs spread 0.75 of theirs), a
softmax over a single output unit, every unit of a layer dead. A generative model whose outputs vary little around
a large level because its inputs do (a denoiser of a narrow cloud: outputs about 0.009, inputs 0.023, the statistic
about 0.4) or a classifier confident near convergence (0.5 and more) stays well above it. An all-zero output (a
zero-initialised last layer) says nothing and is not judged. A batch of one sample has no spread: it is not measured
(said once). One event alerts once: after the alert, every measurement below ``threshold`` keeps it alive, and
it ends only after ``2 x patience - 1`` measurements above it in a row (a batch of two samples gives a spread that
hovers around the threshold while the outputs stay alike: 5 alerts in 1,900 steps instead of 20). The margin
noted (:meth:`~lightning_diag.rules.base.Rule.observe`) is the statistic that decides: the largest of the last
``patience`` measurements.

The validation predictions are not judged: "every prediction the same class" cannot be told from a
generative or regression output ``[B, C]`` whose largest element is always the same one.
"""

from __future__ import annotations

import math

from lightning_diag.core.record import Alert
from lightning_diag.core.registry import COUNT, FRACTION, RULES, CheckSpec, RuleSpec, register
from lightning_diag.rules.base import Latch, Rule, StepContext
from lightning_diag.rules.measures import Measure, Measures
from lightning_diag.rules.rows import Check, LoggedRun, fmt, measure, run_setting, serious_alerts
from lightning_diag.stats.spread import relative_spread

__all__ = [
    "DEFAULT_OUTPUT_COLLAPSE_PATIENCE",
    "DEFAULT_OUTPUT_COLLAPSE_THRESHOLD",
    "OUTPUTS_VARY_CHECK",
    "OUTPUT_COLLAPSE",
    "OUTPUT_COLLAPSE_SPEC",
    "OutputCollapseRule",
]

OUTPUT_COLLAPSE_SPEC = register(
    RuleSpec(
        "output_collapse",
        "AnomalyAlarm",
        "warning",
        1e-2,
        "the model's outputs spread across the batch, relative to their level, less than {threshold:g} times as "
        "much as its inputs on {patience:g} consecutive sampled steps: predictions no longer depend on the input",
        settings={"patience": 3},
        limits={"threshold": FRACTION, "patience": COUNT},
        check="outputs_vary",
    )
)
OUTPUT_COLLAPSE = OUTPUT_COLLAPSE_SPEC.rule_id
#: The rule's row of the ``lightning-diag report`` checklist (registered by :mod:`lightning_diag.rules.catalog`).
OUTPUTS_VARY_CHECK = CheckSpec(
    "outputs_vary", "Model", "Outputs depend on the input: their spread across a batch above {output_collapse:g} of "
    "their level"
)

#: ``output_collapse``: the outputs' relative spread across the batch over the inputs' below which the outputs are
#: taken as independent of the input.
DEFAULT_OUTPUT_COLLAPSE_THRESHOLD: float = OUTPUT_COLLAPSE_SPEC.value({})
#: ``output_collapse``: consecutive sampled steps the spread must stay below it.
DEFAULT_OUTPUT_COLLAPSE_PATIENCE: int = int(OUTPUT_COLLAPSE_SPEC.settings["patience"])

#: The first measurements whose largest relative spread the message quotes as the early value.
_EARLY = 3


class OutputCollapseRule(Rule):
    """``output_collapse``: the spread of the outputs across sampled batches, relative to the inputs'.

    Example:
        >>> from lightning_diag.rules.measures import OutputSpread
        >>> rule = OutputCollapseRule(threshold=1e-2, patience=2)
        >>> def spread(s, level=0.25, batch=32, inputs=0.5):
        ...     return Measures(output_spread=OutputSpread(s, level, batch, "<root>", inputs))
        >>> [rule.judge(StepContext(0, t), spread(s)) for s, t in ((0.1, 0), (0.0, 5))]
        [[], []]
        >>> [(a.rule, a.global_step) for a in rule.judge(StepContext(0, 10), spread(0.0))]
        [('output_collapse', 10)]
        >>> rule.judge(StepContext(0, 15), spread(0.0, batch=1)), rule.unmeasured  # one sample: no spread
        ([], 1)
        >>> quiet = OutputCollapseRule(threshold=1e-2, patience=2)  # a denoiser: outputs as narrow as its inputs
        >>> [quiet.judge(StepContext(0, t), spread(0.027, 3.0, inputs=0.023)) for t in (0, 5, 10)]
        [[], [], []]
    """

    specs = (OUTPUT_COLLAPSE_SPEC,)
    state_keys = ("streak", "early", "checks", "last", "unmeasured", "recent")
    needs = frozenset({Measure.OUTPUT_SPREAD})

    def __init__(
        self, threshold: float = DEFAULT_OUTPUT_COLLAPSE_THRESHOLD, patience: int = DEFAULT_OUTPUT_COLLAPSE_PATIENCE
    ) -> None:
        super().__init__()
        self.threshold = threshold
        self.patience = max(int(patience), 1)
        self.latch = Latch.for_patience(self.patience)
        #: Consecutive sampled steps with the statistic below the threshold.
        self.streak = 0
        #: The largest statistic of the first measurements (``nan`` before any).
        self.early = math.nan
        #: Sampled steps measured (batch of 2 or more, outputs not all zero).
        self.checks = 0
        #: The last statistic measured (the output's relative spread, over the input's where known).
        self.last = math.nan
        #: Sampled steps not measured (a batch of one sample, no output seen, an all-zero output).
        self.unmeasured = 0
        #: The last ``patience`` statistics (the largest decides).
        self.recent: list[float] = []

    def judge(self, ctx: StepContext, m: Measures) -> list[Alert]:
        """Judge one sampled training step: the output's mean spread across the batch, its mean level, the batch
        size, the module that returned it (``"<root>"``: the ``LightningModule``) and the relative spread of its
        floating-point input (``nan``: unknown, the output's own relative spread is judged).

        A step whose relative spread is ``nan`` (:func:`~lightning_diag.stats.spread.relative_spread`: a spread or
        level not finite, an all-zero output) or whose batch has fewer than 2 samples stands for "nothing
        measured"; a sampled step where no output was seen is fed as such, ``OutputSpread(nan, nan, 0, "")``. It
        is counted in :attr:`unmeasured` and raises nothing; the streak, the latch and the early statistic are left
        as they are."""
        o = m.output_spread
        assert o is not None  # checked against `needs`
        spread, level, batch, source, input_relative = o.spread, o.level, o.batch, o.source, o.input_relative
        relative = relative_spread(spread, level) if batch >= 2 else math.nan
        if math.isnan(relative):
            self.unmeasured += 1
            return []
        against_input = math.isfinite(input_relative) and input_relative > 0
        value = relative / input_relative if against_input else relative
        self.checks += 1
        self.last = value
        if self.checks <= _EARLY and not value <= self.early:
            self.early = value
        self.recent = [*self.recent, value][-self.patience :]
        if len(self.recent) == self.patience:
            self.observe(max(self.recent), self.threshold, above=False)  # the statistic that decides
        self.streak = self.streak + 1 if value < self.threshold else 0
        # once in alarm, every measurement below the threshold keeps the event alive: only 2 x patience - 1
        # measurements above it in a row (the latch's clearing) end it, so a spread hovering at the threshold (a
        # small batch's noisy spread) alerts once
        below = value < self.threshold
        held = below and self.latch.is_active("spread")
        if not self.latch.update("spread", self.streak >= self.patience or held):
            return []
        early = (
            f"from the first measurement on ({self.early:.2g})"
            if self.early < self.threshold
            else f"against {self.early:.2g} on the first measurements"
        )
        which = (
            f"{relative:.2g} of their level, {value:.2g} times the relative spread of the inputs ({input_relative:.2g})"
            if against_input
            else f"{relative:.2g} of their level (the inputs' spread not known: token ids or no tensor input)"
        )
        return [
            self._alert(
                ctx,
                f"the model's outputs (`{source}`) no longer depend on the input: their spread across the batch is "
                f"{which} (std across the batch {spread:.3g}, mean level {abs(level):.3g}) on {self.streak} "
                f"consecutive sampled steps, {early} (threshold {self.threshold:g}): every input gets "
                "the same prediction. Usual causes: labels scaled "
                "wrongly for the loss (class ids divided by 255 under an MSE), a softmax over a single output unit "
                "(always 1), every unit of a layer dead. Compare a few predictions with their targets",
                source=source,
                value=value,
                threshold=self.threshold,
            )
        ]


# -- the report's outputs_vary row -----------------------------------------------------------------------------
# ``output_collapse`` logs no series (its spread is judged on sampled steps only): the row shows the alert's value,
# or says the rule was judged without a logged value. Nothing is replayed.


@measure("outputs_vary")
def _measure_output_spread(run: LoggedRun, check: Check) -> bool:
    check.threshold = RULES[OUTPUT_COLLAPSE].describe(run.thresholds)
    check.threshold_value = {"value": run_setting(run, OUTPUT_COLLAPSE)}
    alerts = serious_alerts(run.alerts, (OUTPUT_COLLAPSE,))
    if alerts:
        last = alerts[-1]
        value = fmt(last.value) if last.value is not None else "-"
        check.measured = f"outputs' spread {value} of their level at step {last.global_step} (`{last.source}`)"
    measured = OUTPUT_COLLAPSE in run.thresholds
    if measured and not alerts:
        check.add_note("judged on AnomalyAlarm's sampled steps; the spread is not logged as a series")
    return measured
