"""The real-architecture corpus end to end: Hugging Face and torch models trained with real ``Trainer.fit`` runs,
quiet when healthy with the default callbacks, each injected fault caught by its rule within its window.

The 14 training runs of the architectures and their first faults take 139 s on the shared 2-core machine when it is
quiet (456 s while other jobs ran); the 10 short runs of issue 35's faults and twins (10 to 150 steps) add 37 s: within
the corpus's 180 s share of the suite, so they are not marked ``slow``.
"""

import pytest
import torch

from lightning_diag.demo.corpus import ARCHITECTURES, CORPUS, build_corpus, run_corpus
from lightning_diag.demo.corpus_data import CorpusDataModule, make_image_dataset, make_seq2seq_dataset
from lightning_diag.rules.catalog import ALL_RULES

pytest.importorskip("transformers")

HEALTHY = [n for n, e in CORPUS.items() if e.healthy and n in ARCHITECTURES]
#: The healthy twins of issue 35's faults (an architecture with the fault's set-up done right).
TWINS = [n for n, e in CORPUS.items() if e.healthy and n not in ARCHITECTURES]
FAULTS = [n for n, e in CORPUS.items() if not e.healthy]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_corpus_covers_the_architectures_people_train():
    assert set(HEALTHY) == set(ARCHITECTURES) == {
        "bert", "gpt2", "llama", "bart", "vit", "cnn", "lstm", "finetune"
    }  # fmt: skip
    for name in FAULTS:
        entry = CORPUS[name]
        assert entry.onset_step is not None and entry.arch in ARCHITECTURES
        assert all(rule in ALL_RULES for rule in entry.expected_rules), name
    with pytest.raises(ValueError, match="`name`"):
        build_corpus("nope")
    with pytest.raises(ValueError, match="`task`"):
        CorpusDataModule("audio")


def test_llama_has_grouped_query_attention_and_bart_cross_attention():
    llama, _, _ = build_corpus("llama")
    assert llama.net.config.num_key_value_heads < llama.net.config.num_attention_heads
    bart, _, _ = build_corpus("bart")
    assert any("encoder_attn" in n for n, _ in bart.named_modules())


def test_tasks_are_deterministic_and_learnable_shapes():
    a, b = make_image_dataset(16, seed=3), make_image_dataset(16, seed=3)
    assert torch.equal(a.tensors[0], b.tensors[0])
    source, target = make_seq2seq_dataset(4, seed=0).tensors
    assert torch.equal(source[:, :-1].flip(1), target[:, :-1])
    shuffled = CorpusDataModule("classify", n_train=64, shuffle_targets=True)
    plain = CorpusDataModule("classify", n_train=64)
    shuffled.setup("fit"), plain.setup("fit")
    assert torch.equal(shuffled.train_set.tensors[0], plain.train_set.tensors[0])
    assert not torch.equal(shuffled.train_set.tensors[2], plain.train_set.tensors[2])


def test_finetune_freezes_on_purpose():
    model, _, _ = build_corpus("finetune")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("net.bert.embeddings.", "net.bert.encoder.layer.0.")) for n in frozen)


_RUNS: dict = {}


def _healthy_run(name, tmp_path_factory):
    """Each healthy architecture trains once per session; two tests read its alerts."""
    if name not in _RUNS:
        _RUNS[name] = run_corpus(name, root=str(tmp_path_factory.mktemp(name)))
    return _RUNS[name]


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_architecture_converges_and_gradient_and_loss_rules_stay_quiet(tmp_path_factory, name):
    result = _healthy_run(name, tmp_path_factory)
    serious = [a.format() for a in result.alerts if a.severity != "info" and not a.rule.startswith("attn_")]
    assert serious == []
    assert result.global_step == CORPUS[name].max_steps
    # trained, not idle: the loss fell well below its start (the rules were judged on a learning model)
    assert sum(result.losses[-3:]) / 3 < 0.6 * result.losses[0], result.losses
    infos = [a for a in result.alerts if a.rule == "grad_frozen"]
    if name == "finetune":  # deliberate freezing is information, once per frozen block
        assert {a.source for a in infos} == {"net.bert.embeddings", "net.bert.encoder.layer.0"}
        assert all(a.severity == "info" for a in infos)
    else:
        assert infos == []


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_architecture_attention_rules_stay_quiet(tmp_path_factory, name):
    result = _healthy_run(name, tmp_path_factory)
    assert [a.format() for a in result.alerts if a.severity != "info" and a.rule.startswith("attn_")] == []
    if name == "bart":
        # the decoder's causal self-attention parks on the start token (attention sinks) and the cross-attention
        # learns the reversal one-to-one: both low-entropy, both healthy, each said once per module as `info`
        notes = {a.source: a.message for a in result.alerts if a.rule == "attn_entropy_low"}
        assert "attention sink" in notes["net.model.decoder.layers.0.self_attn"]
        assert "alignment" in notes["net.model.decoder.layers.0.encoder_attn"]


@pytest.mark.parametrize("name", TWINS)
def test_healthy_twin_raises_no_warning(tmp_path, name):
    result = run_corpus(name, root=str(tmp_path))
    assert [a.format() for a in result.alerts if a.severity != "info"] == []
    assert result.global_step == CORPUS[name].max_steps


@pytest.mark.parametrize("name", FAULTS)
def test_fault_is_caught_by_its_rule_within_its_window(tmp_path, name):
    entry = CORPUS[name]
    result = run_corpus(name, root=str(tmp_path))
    for rule in entry.expected_rules:
        hits = [a for a in result.alerts if a.rule == rule and a.severity != "info"]
        assert hits, (rule, [a.format() for a in result.alerts])
        assert entry.onset_step <= hits[0].global_step <= entry.onset_step + entry.window, hits[0].format()
    if name in ("bert_high_lr", "cnn_dead_relu"):  # the verdict says which collapse it is
        collapse = next(a for a in result.alerts if a.rule == "grad_collapse")
        assert "dead network" in collapse.message
    if name == "llama_logit_growth":  # the heads collapsing at one step make one alert naming them, not 8
        low = [a for a in result.alerts if a.rule == "attn_entropy_low" and a.severity != "info"]
        steps = [a.global_step for a in low]
        assert len(steps) == len(set(steps)), [a.format() for a in low]
        assert "heads in" in low[0].message, low[0].format()
    if name == "bert_high_lr":  # one event, not a flood of per-layer warnings
        assert [a for a in result.alerts if a.rule == "grad_vanish"] == []
