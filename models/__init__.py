"""Llama and BERT on tk_ops, with a pure-PyTorch reference path, and their training script.

``models.llama`` / ``models.bert``: the models (state_dict-compatible with Hugging Face's
``LlamaForCausalLM`` / ``BertForMaskedLM``); ``models.data``: corpus, tokenizer, batches
(``python -m models.data prepare``); ``models.train``: training (``python -m models.train``).
"""

from models.bert import BertConfig, BertForMaskedLM
from models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["BertConfig", "BertForMaskedLM", "LlamaConfig", "LlamaForCausalLM"]
