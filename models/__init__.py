"""Llama and BERT on tk_ops, with a pure-PyTorch reference path, and their training script.

``models.llama`` / ``models.bert``: the models (state_dict-compatible with Hugging Face's
``LlamaForCausalLM`` / ``BertForMaskedLM``), and ``models.based``, ``models.mamba2``,
``models.hyena`` the linear-time ones, ``models.gdn`` the Qwen3-Next-style Gated DeltaNet hybrid;
``models.data``: corpus, tokenizer, batches (``python -m models.data prepare``); ``models.train``: the
training loop and its command line (``python -m models.train``), with ``models.presets`` (each model's
presets), ``models.parallel`` (torchrun, DDP, FSDP2) and ``models.checkpoint`` (save, resume, ``load_model``).
"""

from models.bert import BertConfig, BertForMaskedLM
from models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["BertConfig", "BertForMaskedLM", "LlamaConfig", "LlamaForCausalLM"]
