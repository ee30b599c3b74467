"""``model.disable_dropout``: every dropout probability of a transformers config, nested ones included."""

from __future__ import annotations

import torch
from drivetrain_engine_core.kit import disable_dropout_in_config, disable_dropout_modules
from transformers import AutoConfig


def test_config_dropout_fields_of_several_families_are_zeroed_and_nothing_else() -> None:
    gpt2 = AutoConfig.for_model("gpt2", resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3, n_layer=2)
    disable_dropout_in_config(gpt2)
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop, gpt2.summary_first_dropout) == (0, 0, 0, 0)
    assert gpt2.n_layer == 2
    assert gpt2.layer_norm_epsilon == 1e-5
    bert = AutoConfig.for_model("bert", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    disable_dropout_in_config(bert)
    assert (bert.hidden_dropout_prob, bert.attention_probs_dropout_prob) == (0, 0)


def test_nested_text_config_is_reached_and_unset_fields_stay_unset() -> None:
    outer = AutoConfig.for_model("llava", text_config={"model_type": "llama", "attention_dropout": 0.25})
    outer.classifier_dropout = None
    disable_dropout_in_config(outer)
    assert outer.text_config.attention_dropout == 0
    assert outer.classifier_dropout is None


def test_dropout_modules_are_zeroed() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.4), torch.nn.Dropout2d(0.1))
    disable_dropout_modules(module)
    assert [layer.p for layer in module if isinstance(layer, torch.nn.Dropout | torch.nn.Dropout2d)] == [0, 0]
