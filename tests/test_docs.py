import re
from pathlib import Path

import lightning_diag.callbacks.anomaly_alarm.alarm as alarm_module
import lightning_diag.callbacks.attention_entropy.monitor as attention_module
import lightning_diag.callbacks.data_diagnostics.diagnostics as data_module
import lightning_diag.rules.attention_logits as attention_logit_rules
import lightning_diag.rules.attention_specs as attention_rules
import lightning_diag.rules.data_sample as data_rules
import lightning_diag.rules.data_sequences as sequence_rules
import lightning_diag.rules.errors as error_rules
import lightning_diag.rules.output_collapse as output_rules
import lightning_diag.rules.quantization_error as quantization_rules
import lightning_diag.rules.replicas as replica_rules
import lightning_diag.rules.robustness as robustness_rules
import lightning_diag.rules.rollback as rollback_rules
import lightning_diag.rules.sharp_minimum as sharp_rules
import lightning_diag.rules.update_size as update_size_rules
import lightning_diag.rules.updates_applied as update_rules
from lightning_diag.rules import activations as activation_rules
from lightning_diag.rules import (
    amp_not_applied,
    dataloader_bound,
    grad_collapse,
    grad_layer_spread,
    grad_norm_band,
    grad_settings,
    loss_outlier,
    loss_stagnant,
    loss_swing,
    memory_growth,
    step_time_fluctuation,
    step_time_periodic,
    val_decline,
    val_fluctuation,
    zero_output,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: The modules whose ``DEFAULT_*`` constants the thresholds table documents (the detectors without a threshold,
#: ``train_override_bypassed``, ``eval_randomness`` and ``eval_before_training``, have none).
MODULES = (
    loss_swing, val_decline, val_fluctuation, loss_stagnant, alarm_module, grad_norm_band, grad_layer_spread,
    grad_collapse, grad_settings, attention_rules, attention_module, data_rules, data_module, sharp_rules,
    quantization_rules, dataloader_bound, step_time_periodic, step_time_fluctuation, memory_growth, error_rules,
    robustness_rules, update_rules, replica_rules, sequence_rules, amp_not_applied, loss_outlier, zero_output,
    activation_rules, update_size_rules, output_rules, attention_logit_rules,
)


def _rows():
    for line in (DOCS / "thresholds.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[2].startswith("`DEFAULT_"):
            yield cells


def test_thresholds_table_matches_the_constants():
    rows = list(_rows())
    documented = {}
    for _rule, argument, constant, default, _meaning, _source in rows:
        name = constant.strip("`")
        value = next(getattr(m, name) for m in (*MODULES, rollback_rules) if hasattr(m, name))
        assert float(default) == float(value), name
        documented[name] = argument
    in_code = {n for m in MODULES for n in dir(m) if n.startswith("DEFAULT_")}
    assert in_code <= set(documented), f"undocumented constants: {in_code - set(documented)}"


def test_every_registry_default_is_documented_with_its_field():
    """Each rule threshold and setting the registry declares has a row naming its ``rules=`` field (or, for a
    shared setting of what a callback measures, its constructor argument) and its default."""
    from lightning_diag.core.registry import RULES, SETTINGS

    rows = {(rule.strip("`"), field.strip("`")): float(default) for rule, field, _c, default, _m, _s in _rows()}
    declared = {}
    for spec in RULES.values():
        for name in spec.fields:
            value = spec.threshold if name == "threshold" else spec.settings[name]
            declared[(spec.rule_id, name)] = float(value)  # type: ignore[arg-type]
    for setting in SETTINGS.values():
        family, _, name = setting.key.rpartition(".")
        where = (family, name) if setting.argument is None else (f"{family}_*", f"{setting.argument}=` (argument)")
        declared[where] = float(setting.default)
    assert declared and declared.items() <= rows.items(), sorted(set(declared.items()) - set(rows.items()))


def test_every_documented_field_is_accepted_by_its_callback():
    """A row's field set through ``rules=`` builds the callback and reaches ``thresholds()``; an argument row names
    a real constructor argument with that default."""
    import inspect

    import lightning_diag
    from lightning_diag.core.registry import RULES, SETTINGS, owner_of

    for rule, field, _constant, default, _m, _s in _rows():
        name, field = rule.strip("`"), field.strip("`")
        if field.endswith("=` (argument)") or field.endswith("="):
            argument = field.split("=")[0]
            owner = next(s.owner for s in RULES.values() if s.rule_id.startswith(name.rstrip("*")))
            parameters = inspect.signature(getattr(lightning_diag, owner)).parameters
            assert argument in parameters, (rule, argument)
            if default != "`()`":
                assert float(parameters[argument].default) == float(default), (rule, argument)
            continue
        family = next((s for s in SETTINGS.values() if s.key == f"{name}.{field}"), None)
        owner = owner_of(name) or (family.owner if family is not None else None)
        assert owner is not None, rule
        callback = getattr(lightning_diag, owner)(rules={name: {field: float(default)}})
        key = name if field == "threshold" else f"{name}.{field}"
        assert callback.setting(key) == float(default), (rule, field)


def test_anomaly_alarm_page_lists_every_tag_and_rule():
    page = (DOCS / "anomaly_alarm.md").read_text()
    for needle in (
        "diag/lr/",
        "diag/loss/train_step",
        "diag/loss/train_epoch",
        "diag/loss/train_window",
        "diag/loss/swing",
        "diag/loss/val",
        "diag/loss/val_fluctuation",
        "diag/loss/train_fluctuation",
        "nonfinite_loss",
        "nonfinite_grad",
        "loss_swing",
        "val_decline",
        "val_fluctuation",
    ):
        assert needle in page, needle
    import inspect

    from lightning_diag import AnomalyAlarm
    from lightning_diag.core.registry import RULES

    known = {*inspect.signature(AnomalyAlarm).parameters}
    for match in re.findall(r"`(\w+)=", page):
        assert match in known, match
    for rule, field in re.findall(r"`(\w+)\.(\w+)`", page):  # a rule field written `<rule>.<field>`
        if rule in RULES and RULES[rule].owner == "AnomalyAlarm":
            assert field in RULES[rule].fields, (rule, field)


def test_gradient_flow_page_lists_every_tag_and_rule():
    page = (DOCS / "gradient_flow.md").read_text()
    for needle in (
        "diag/grad_norm/total",
        "diag/grad_norm/<layer>",
        "diag/weight_norm/",
        "diag/update_ratio/",
        "diag/grad_hist/",
        "grad_vanish",
        "grad_explode",
        "grad_layer_spread",
        "grad_collapse",
        "before clipping",
    ):
        assert needle in page, needle


def test_attention_page_lists_every_tag_rule_and_argument():
    import inspect

    from lightning_diag import AttentionEntropyMonitor, record_attention, record_hf_attentions

    page = (DOCS / "attention_entropy.md").read_text()
    for needle in (
        "diag/attn_entropy/<module>/head_<h>",
        "diag/attn_entropy/<module>/mean",
        "diag/attn_entropy/<module>/uniform",
        "diag/attn_sink/<module>",
        "diag/attn_map/<module>",
        "diag/attn_heads/similarity",
        "diag/attn_heads/pca",
        "attn_entropy_low",
        "attn_entropy_high",
        "attn_sink",
        "record_attention",
        "record_hf_attentions",
        "before dropout",
        "4.85",
    ):
        assert needle in page, needle
    known = {
        *inspect.signature(AttentionEntropyMonitor).parameters,
        *inspect.signature(record_attention).parameters,
        *inspect.signature(record_hf_attentions).parameters,
        *("attn_implementation", "output_attentions", "need_weights"),  # Hugging Face / torch arguments
    }
    for match in re.findall(r"`(\w+)=", page):
        assert match in known, match


def test_probe_pages_list_every_tag_rule_and_argument():
    import inspect

    from lightning_diag import QuantizationProbe, SharpnessProbe

    for page, kind, rule, tags in (
        ("sharpness_probe.md", SharpnessProbe, "sharp_minimum",
         ("gap", "relative_gap", "loss", "perturbed_loss", "grad_norm", "layer/")),
        ("quantization_probe.md", QuantizationProbe, "quantization_error",
         ("end_to_end", "loss_float", "loss_int8", "worst_layer_ratio", "max_error_pct", "relative_mse",
          "relative_mse_per_channel", "output_mse", "outlier_ratio", "input_outlier_ratio")),
    ):
        text = (DOCS / page).read_text()
        assert f"`{rule}`" in text and page in (DOCS / "index.md").read_text(), page
        for name in tags:
            assert name in text, (page, name)
        for arg in inspect.signature(kind).parameters:
            assert f"`{arg}`" in text, (page, arg)


def test_data_diagnostics_page_lists_every_tag_rule_and_argument():
    import inspect

    from lightning_diag import DataDiagnostics

    page = (DOCS / "data_diagnostics.md").read_text()
    for needle in (
        "diag/data/vocab_kl",
        "diag/data/oov_share",
        "diag/data/leaked_fraction",
        "diag/data/<split>/label_std",
        "diag/data/label_distribution",
        "diag/data/<split>/seq_len",
        "diag/data/summary",
        "data_vocab_shift",
        "data_leakage",
        "label_imbalance",
        "data_nonfinite",
        "Jaccard",
        "bit for bit",
    ):
        assert needle in page, needle
    for name in inspect.signature(DataDiagnostics).parameters:
        assert f"{name}=" in page, name
