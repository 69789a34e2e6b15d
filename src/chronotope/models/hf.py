"""Hugging Face ``transformers`` models from tiny configs: no download, no network.

They exercise models written the way most users' are: keyword inputs, a
``ModelOutput`` whose ``loss`` is the training loss, and library-side masking
code. Dropout is zeroed so that eager runs repeat exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chronotope.errors import ModelLoadError
from chronotope.workload import Workload

ATTN = "sdpa"  # torch's fused attention: one op per attention in a captured graph


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # an optional extra
        raise ImportError(
            "the hf-* models need Hugging Face transformers: pip install chronotope[hf]"
        ) from e
    return transformers


def _build(config: Any, model_cls: Any, device: str | torch.device, seed: int) -> Any:
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    return model.train()


def _config(cls: Any, defaults: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """A config of ``cls`` from the defaults with ``overrides`` on top.

    Unknown override keys are rejected: a config would silently keep a misspelt one.
    """
    probe = cls()
    unknown = [k for k in overrides if k != "attn_implementation" and not hasattr(probe, k)]
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    return cls(**{"attn_implementation": ATTN, **defaults, **overrides})


def _tokens(vocab: int, shape: tuple[int, ...], seed: int, low: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, shape, generator=g)


def hf_gpt2(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    seq_len: int = 32,
    **overrides: Any,
) -> Workload:
    """GPT2LMHeadModel; kwargs ``input_ids`` and ``labels`` (B, T) (the model shifts labels)."""
    tf = _transformers()
    cfg = _config(tf.GPT2Config, dict(
        vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,  # the default ids lie outside the tiny vocabulary
    ), overrides)
    model = _build(cfg, tf.GPT2LMHeadModel, device, seed)
    model.loss_type = model.loss_type or "ForCausalLM"  # spares a log line; same loss
    ids = _tokens(cfg.vocab_size, (batch_size or 4, seq_len), seed).to(device)
    return Workload(model, (), {"input_ids": ids, "labels": ids}, name="hf-gpt2")


def hf_llama(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    seq_len: int = 32,
    **overrides: Any,
) -> Workload:
    """LlamaForCausalLM (grouped-query attention); kwargs ``input_ids`` and ``labels`` (B, T)."""
    tf = _transformers()
    cfg = _config(tf.LlamaConfig, dict(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.0, use_cache=False,
    ), overrides)
    model = _build(cfg, tf.LlamaForCausalLM, device, seed)
    ids = _tokens(cfg.vocab_size, (batch_size or 4, seq_len), seed).to(device)
    return Workload(model, (), {"input_ids": ids, "labels": ids}, name="hf-llama")


def hf_bert(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    seq_len: int = 32,
    **overrides: Any,
) -> Workload:
    """BertForMaskedLM; kwargs ``input_ids``, ``attention_mask`` (padding), ``labels`` (B, T).

    About 15% of the real tokens are masked; ``labels`` is -100 elsewhere.
    """
    tf = _transformers()
    cfg = _config(tf.BertConfig, dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ), overrides)
    model = _build(cfg, tf.BertForMaskedLM, device, seed)
    B, T = batch_size or 4, seq_len
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (B, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B, 1), generator=g)
    attention_mask = (torch.arange(T) < lengths).long()
    masked = (torch.rand(B, T, generator=g) < 0.15) & attention_mask.bool()
    masked[:, 0] = True  # at least one target per row, so the loss is never empty
    labels = torch.where(masked, ids, -100)
    input_ids = torch.where(masked, 1, ids)  # id 1 stands for [MASK]
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return Workload(model, (), {k: v.to(device) for k, v in kwargs.items()}, name="hf-bert")


def hf_t5(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    src_len: int = 32,
    tgt_len: int = 16,
    **overrides: Any,
) -> Workload:
    """T5ForConditionalGeneration; kwargs ``input_ids`` (B, S) and ``labels`` (B, T).

    The model builds the decoder inputs itself by shifting ``labels`` right.
    """
    tf = _transformers()
    cfg = _config(tf.T5Config, dict(
        vocab_size=512, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0,
        use_cache=False,
    ), overrides)
    model = _build(cfg, tf.T5ForConditionalGeneration, device, seed)
    B = batch_size or 4
    src = _tokens(cfg.vocab_size, (B, src_len), seed, low=1)
    tgt = _tokens(cfg.vocab_size, (B, tgt_len), seed + 1, low=1)
    return Workload(model, (), {"input_ids": src.to(device), "labels": tgt.to(device)},
                    name="hf-t5")


def hf_causal_lm(source: str | Path, *, device: str | torch.device = "cpu",
                 batch_size: int | None = None, seed: int = 0, seq_len: int = 32) -> Workload:
    """A Hugging Face causal language model: a ``save_pretrained`` folder (its config and
    weights), a ``config.json`` (weights drawn at ``seed``), or ``hf:TYPE`` (transformers'
    default config of that model type, such as ``hf:gpt2``); with an example batch of
    ``input_ids`` and ``labels`` (the model shifts the labels)."""
    tf = _transformers()
    text = str(source)
    path = Path(text).expanduser()
    weights = path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))
    try:
        if text.startswith("hf:"):
            config = tf.AutoConfig.for_model(text[3:])
        else:
            config = tf.AutoConfig.from_pretrained(path)
        config._attn_implementation = ATTN
        torch.manual_seed(seed)
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation=ATTN, dtype=torch.float32) if weights else \
                tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:  # no such model type, or a config of no causal language model
        raise ModelLoadError(f"{text!r}: not a causal language model transformers knows "
                             "(AutoModelForCausalLM); wrap it in a file.py:factory that "
                             f"returns its workload ({e})") from e
    longest = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None) or seq_len
    ids = _tokens(config.vocab_size, (batch_size or 4, min(seq_len, longest)), seed).to(device)
    name = text[3:] if text.startswith("hf:") else (path.name if path.is_dir() else path.stem)
    return Workload(model.train(), (), {"input_ids": ids, "labels": ids}, name=name)
