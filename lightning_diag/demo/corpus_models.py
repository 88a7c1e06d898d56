"""The real-architecture corpus's networks: Hugging Face ``transformers`` models built from small configs (no
download) and plain torch models, one per architecture of :data:`ARCHITECTURES`.

Example:
    >>> ARCHITECTURES["vit"]
    'image'
    >>> sum(p.numel() for p in build_net("cnn").parameters())
    14260
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_diag.demo.corpus_data import IMAGE_CLASSES, IMAGE_SIZE, SEQ2SEQ_VOCAB
from lightning_diag.demo.synthetic import LM_VOCAB_SIZE, NUM_CLASSES, VOCAB_SIZE

__all__ = ["ARCHITECTURES", "build_net", "hf_quiet"]

#: Architecture -> its task of :class:`~lightning_diag.demo.corpus_data.CorpusDataModule`.
ARCHITECTURES: dict[str, str] = {
    "bert": "classify",
    "gpt2": "lm",
    "llama": "lm",
    "bart": "seq2seq",
    "vit": "image",
    "cnn": "image",
    "lstm": "classify",
    "finetune": "classify",
}

_D = 64


def hf_quiet() -> None:
    """Silence ``transformers``' logging below errors."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _labels(n: int) -> dict[str, Any]:
    return {"num_labels": n}  # a PretrainedConfig keyword the configs' signatures do not declare


def build_net(arch: str) -> nn.Module:
    """The bare network of ``arch`` (initialised from the current torch seed).

    Raises:
        ValueError: If ``arch`` is not a key of :data:`ARCHITECTURES`.
    """
    if arch in ("bert", "finetune"):
        from transformers import BertConfig, BertForSequenceClassification

        return BertForSequenceClassification(
            BertConfig(
                vocab_size=VOCAB_SIZE,
                hidden_size=_D,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=2 * _D,
                max_position_embeddings=32,
                **_labels(NUM_CLASSES),
                pad_token_id=0,
            )
        )
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=LM_VOCAB_SIZE, n_embd=_D, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
            )
        )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=LM_VOCAB_SIZE,
                hidden_size=_D,
                intermediate_size=2 * _D,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    if arch == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        return BartForConditionalGeneration(
            BartConfig(
                vocab_size=SEQ2SEQ_VOCAB,
                d_model=_D,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=2 * _D,
                decoder_ffn_dim=2 * _D,
                max_position_embeddings=32,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
                forced_eos_token_id=None,
            )
        )
    if arch == "vit":
        from transformers import ViTConfig, ViTForImageClassification

        return ViTForImageClassification(
            ViTConfig(
                image_size=IMAGE_SIZE,
                patch_size=4,
                num_channels=1,
                hidden_size=_D,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=2 * _D,
                **_labels(IMAGE_CLASSES),
            )
        )
    if arch == "cnn":
        layers: list[nn.Module] = []
        width = 1
        for out in (16, 32, 32):
            layers += [nn.Conv2d(width, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]
            width = out
        return nn.Sequential(
            nn.Sequential(*layers), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, IMAGE_CLASSES)
        )
    if arch == "lstm":
        return _LSTMClassifier()
    raise ValueError(f"Expected argument `arch` to be one of {sorted(ARCHITECTURES)}, but got {arch!r}")


class _LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, _D, padding_idx=0)
        self.rnn = nn.LSTM(_D, _D, num_layers=2, batch_first=True)
        self.head = nn.Linear(_D, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        last = (~padding_mask).sum(1) - 1
        return self.head(out[torch.arange(tokens.shape[0]), last])
