"""The zoo's families: tiny models nobody on this project wrote, each a Workload factory.

Hugging Face families are built from tiny configs of the installed ``transformers``
(no download, no network); the vision, contrastive and fine-tuning models are
written here the way a user would write them. Every factory seeds torch before
building, so a one-device run and a distributed run start from the same weights.
Random ops are switched off (dropout, layer drop, SpecAugment masking) except in
the ``-dropout`` variants, which train with a model's default dropout.

The file imports nothing relative, so ``chronotope run tests/zoo/models.py:cnn_bn``
loads any family as a user's model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from chronotope.models.workload import Workload

BATCH = 4
SEQ = 12
VOCAB = 128
IMAGE = 16  # pixels per side
LABELS = 5  # classes of the classification heads
RANDOM_FIELDS = ("drop", "mask_time_prob", "mask_feature_prob")  # config fields that draw


def _deterministic(config: Any) -> Any:
    """``config`` with every probability of a random op set to 0, sub-configs included."""
    for key, value in config.to_dict().items():
        sub = getattr(config, key, None)
        if isinstance(sub, tf.PretrainedConfig):
            _deterministic(sub)
        elif isinstance(value, float) and any(f in key for f in RANDOM_FIELDS):
            setattr(config, key, 0.0)
    return config


def _build(model_cls: Any, config: Any, seed: int, dropout: bool = False) -> nn.Module:
    if not dropout:
        _deterministic(config)
    torch.manual_seed(seed)
    return model_cls(config).train()


def _tokens(shape: tuple[int, ...], seed: int, low: int = 3, high: int = VOCAB) -> torch.Tensor:
    """Token ids above the special ids 0-2 (pad, bos, eos in the configs here)."""
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


def _pixels(seed: int, batch: int, channels: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, IMAGE, IMAGE, generator=g)


def _classes(seed: int, batch: int, classes: int = LABELS) -> torch.Tensor:
    return torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(seed + 1))


def _causal_lm(name: str, model_cls: Any, config: Any, seed: int, batch_size: int | None,
               dropout: bool = False) -> Workload:
    """A decoder-only language model whose labels are its inputs (the model shifts them)."""
    model = _build(model_cls, config, seed, dropout)
    ids = _tokens((batch_size or BATCH, SEQ), seed)
    return Workload(model, (), {"input_ids": ids, "labels": ids}, name=name)


SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
               use_cache=False, attn_implementation="sdpa", **SPECIAL)


# --- decoder-only language models ---------------------------------------------------------

def opt(seed: int = 0, batch_size: int | None = None, dropout: bool = False) -> Workload:
    """OPTForCausalLM: learned positions with an offset, pre-norm blocks, tied head."""
    config = tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=32,
                          word_embed_proj_dim=32, use_cache=False, attn_implementation="sdpa",
                          **SPECIAL)
    name = "opt-dropout" if dropout else "opt"
    return _causal_lm(name, tf.OPTForCausalLM, config, seed, batch_size, dropout)


def opt_dropout(seed: int = 0, batch_size: int | None = None) -> Workload:
    """OPT with its default dropout (0.1): random ops in every block."""
    return opt(seed, batch_size, dropout=True)


def gpt_neo(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GPTNeoForCausalLM: alternating global and local (windowed) attention layers."""
    config = tf.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                             intermediate_size=64, max_position_embeddings=32,
                             attention_types=[[["global", "local"], 1]], window_size=4,
                             use_cache=False, **SPECIAL)
    return _causal_lm("gpt-neo", tf.GPTNeoForCausalLM, config, seed, batch_size)


def gpt_j(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GPTJForCausalLM: parallel attention and MLP, partial rotary embeddings."""
    config = tf.GPTJConfig(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                           rotary_dim=4, use_cache=False, **SPECIAL)
    return _causal_lm("gpt-j", tf.GPTJForCausalLM, config, seed, batch_size)


def mistral(seed: int = 0, batch_size: int | None = None) -> Workload:
    """MistralForCausalLM: grouped-query attention with a sliding window shorter than SEQ."""
    config = tf.MistralConfig(**{**DECODER, "sliding_window": 8, "head_dim": 8})
    return _causal_lm("mistral", tf.MistralForCausalLM, config, seed, batch_size)


def mistral_frozen(seed: int = 0, batch_size: int | None = None) -> Workload:
    """Mistral fine-tuned with its embedding and first block frozen (requires_grad=False)."""
    w = mistral(seed, batch_size)
    w.model.model.embed_tokens.requires_grad_(False)
    w.model.model.layers[0].requires_grad_(False)
    w.name = "mistral-frozen"
    return w


def qwen2(seed: int = 0, batch_size: int | None = None) -> Workload:
    """Qwen2ForCausalLM: biases on the q/k/v projections, tied embeddings."""
    config = tf.Qwen2Config(**DECODER, tie_word_embeddings=True)
    return _causal_lm("qwen2", tf.Qwen2ForCausalLM, config, seed, batch_size)


def phi(seed: int = 0, batch_size: int | None = None) -> Workload:
    """PhiForCausalLM: parallel blocks, partial rotary, a biased LM head."""
    config = tf.PhiConfig(**{**DECODER, "num_key_value_heads": 4}, partial_rotary_factor=0.5)
    return _causal_lm("phi", tf.PhiForCausalLM, config, seed, batch_size)


def gemma(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GemmaForCausalLM: multi-query attention, scaled embeddings, (1 + w) RMS norms."""
    config = tf.GemmaConfig(**{**DECODER, "num_key_value_heads": 1, "head_dim": 8})
    return _causal_lm("gemma", tf.GemmaForCausalLM, config, seed, batch_size)


def falcon(seed: int = 0, batch_size: int | None = None) -> Workload:
    """FalconForCausalLM: fused query-key-value, multi-query attention, rotary positions."""
    config = tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, multi_query=True, use_cache=False,
                             attn_implementation="sdpa", **SPECIAL)
    return _causal_lm("falcon", tf.FalconForCausalLM, config, seed, batch_size)


def bloom(seed: int = 0, batch_size: int | None = None) -> Workload:
    """BloomForCausalLM: ALiBi position biases (baddbmm) and an embedding layer norm."""
    config = tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                            use_cache=False, **SPECIAL)
    return _causal_lm("bloom", tf.BloomForCausalLM, config, seed, batch_size)


# --- mixtures of experts ----------------------------------------------------------------

def mixtral(seed: int = 0, batch_size: int | None = None) -> Workload:
    """MixtralForCausalLM: top-2 of 4 experts per token, with the router's balancing loss."""
    config = tf.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                              output_router_logits=True)
    return _causal_lm("mixtral", tf.MixtralForCausalLM, config, seed, batch_size)


def qwen2_moe(seed: int = 0, batch_size: int | None = None) -> Workload:
    """Qwen2MoeForCausalLM: top-2 of 4 routed experts plus a gated shared expert."""
    config = tf.Qwen2MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return _causal_lm("qwen2-moe", tf.Qwen2MoeForCausalLM, config, seed, batch_size)


# --- encoder-decoder ----------------------------------------------------------------------

def bart(seed: int = 0, batch_size: int | None = None) -> Workload:
    """BartForConditionalGeneration: the decoder's inputs are the labels shifted right."""
    config = tf.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                           decoder_start_token_id=2, use_cache=False,
                           attn_implementation="sdpa", **SPECIAL)
    model = _build(tf.BartForConditionalGeneration, config, seed)
    b = batch_size or BATCH
    kwargs = {"input_ids": _tokens((b, SEQ), seed), "labels": _tokens((b, SEQ // 2), seed + 1)}
    return Workload(model, (), kwargs, name="bart")


# --- encoders with a classification or token head ------------------------------------------

ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=40, pad_token_id=0)


def _classify(name: str, model_cls: Any, config: Any, seed: int, batch_size: int | None,
              padded: bool = True) -> Workload:
    """A sequence classifier on padded token rows (the mask hides each row's tail)."""
    model = _build(model_cls, config, seed)
    b = batch_size or BATCH
    ids = _tokens((b, SEQ), seed)
    kwargs: dict[str, Any] = {"input_ids": ids, "labels": _classes(seed, b)}
    if padded:
        lengths = torch.arange(b) % 4 + SEQ - 3  # rows of SEQ-3 .. SEQ real tokens
        kwargs["attention_mask"] = (torch.arange(SEQ) < lengths[:, None]).long()
    return Workload(model, (), kwargs, name=name)


def roberta_cls(seed: int = 0, batch_size: int | None = None) -> Workload:
    """RobertaForSequenceClassification: positions offset past the padding id."""
    config = tf.RobertaConfig(**ENCODER, num_labels=LABELS, attn_implementation="sdpa")
    return _classify("roberta-cls", tf.RobertaForSequenceClassification, config, seed,
                     batch_size)


def distilbert_cls(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DistilBertForSequenceClassification: a pre-classifier on the first token."""
    config = tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                 max_position_embeddings=32, num_labels=LABELS,
                                 attn_implementation="sdpa", pad_token_id=0)
    return _classify("distilbert-cls", tf.DistilBertForSequenceClassification, config, seed,
                     batch_size)


DEBERTA = dict(ENCODER, relative_attention=True, position_buckets=8, max_relative_positions=16,
               pos_att_type=["p2c", "c2p"], position_biased_input=False)


def deberta_v2(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DebertaV2ForSequenceClassification: disentangled relative-position attention.

    ``problem_type`` is set: without it the model picks its loss by ``if`` on how many
    labels are non-negative (a data-dependent branch neither torch.fx nor torch.export
    can capture)."""
    config = tf.DebertaV2Config(**DEBERTA, num_labels=LABELS,
                                problem_type="single_label_classification")
    return _classify("deberta-v2", tf.DebertaV2ForSequenceClassification, config, seed,
                     batch_size)


def deberta_v2_mlm(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DebertaV2ForMaskedLM: relative-position attention and a tied prediction head."""
    config = tf.DebertaV2Config(**DEBERTA)
    model = _build(tf.DebertaV2ForMaskedLM, config, seed)
    b = batch_size or BATCH
    ids = _tokens((b, SEQ), seed)
    labels = torch.where(_tokens((b, SEQ), seed + 1, 0, 4) == 0, ids, -100)
    labels[:, 0] = ids[:, 0]  # a target in every row
    return Workload(model, (), {"input_ids": ids, "labels": labels}, name="deberta-v2-mlm")


def electra(seed: int = 0, batch_size: int | None = None) -> Workload:
    """ElectraForPreTraining: the discriminator's per-token replaced-or-not loss."""
    config = tf.ElectraConfig(**ENCODER, embedding_size=16, attn_implementation="sdpa")
    model = _build(tf.ElectraForPreTraining, config, seed)
    b = batch_size or BATCH
    ids = _tokens((b, SEQ), seed)
    replaced = (_tokens((b, SEQ), seed + 1, 0, 4) == 0).long()  # about a quarter replaced
    return Workload(model, (), {"input_ids": ids, "labels": replaced}, name="electra")


# --- vision, audio, two towers --------------------------------------------------------------

def vit(seed: int = 0, batch_size: int | None = None) -> Workload:
    """ViTForImageClassification: a patch convolution, a class token, a linear head."""
    config = tf.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          num_labels=LABELS, attn_implementation="sdpa")
    model = _build(tf.ViTForImageClassification, config, seed)
    b = batch_size or BATCH
    kwargs = {"pixel_values": _pixels(seed, b), "labels": _classes(seed, b)}
    return Workload(model, (), kwargs, name="vit")


def whisper(seed: int = 0, batch_size: int | None = None) -> Workload:
    """WhisperForConditionalGeneration: a conv1d stem over mel frames, a frozen sinusoidal
    position table in the encoder, a text decoder."""
    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1,
                              decoder_layers=1, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              max_source_positions=8, max_target_positions=16,
                              decoder_start_token_id=1, use_cache=False,
                              attn_implementation="sdpa", **SPECIAL)
    model = _build(tf.WhisperForConditionalGeneration, config, seed)
    b = batch_size or BATCH
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(b, config.num_mel_bins, 2 * config.max_source_positions, generator=g)
    kwargs = {"input_features": features, "labels": _tokens((b, 6), seed + 1)}
    return Workload(model, (), kwargs, name="whisper")


def wav2vec2(seed: int = 0, batch_size: int | None = None) -> Workload:
    """Wav2Vec2ForSequenceClassification: a conv1d feature encoder with group norm, a
    grouped positional convolution, mean pooling and a classifier on raw audio."""
    config = tf.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64,
                               conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4),
                               num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
                               num_labels=LABELS, classifier_proj_size=16,
                               attn_implementation="sdpa")
    model = _build(tf.Wav2Vec2ForSequenceClassification, config, seed)
    b = batch_size or BATCH
    audio = torch.randn(b, 128, generator=torch.Generator().manual_seed(seed))
    return Workload(model, (), {"input_values": audio, "labels": _classes(seed, b)},
                    name="wav2vec2")


def clip(seed: int = 0, batch_size: int | None = None) -> Workload:
    """CLIPModel with return_loss: a text and an image tower, the symmetric contrastive loss
    over the batch's image-text similarity matrix."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ, **SPECIAL)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=IMAGE, patch_size=4)
    config = tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16,
                           attn_implementation="sdpa")
    model = _build(tf.CLIPModel, config, seed)
    b = batch_size or BATCH
    kwargs = {"input_ids": _tokens((b, SEQ), seed), "pixel_values": _pixels(seed, b),
              "return_loss": True}
    return Workload(model, (), kwargs, name="clip")


class SmallCNN(nn.Module):
    """Two conv-batch-norm-relu stages, max-pool between them, global average pool, head."""

    def __init__(self, classes: int = LABELS) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def cnn_bn(seed: int = 0, batch_size: int | None = None) -> Workload:
    """SmallCNN trained with cross-entropy: batch statistics couple the samples."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    return Workload(SmallCNN(), (_pixels(seed, b),), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="cnn-bn")


class TwoTower(nn.Module):
    """A query and a document encoder (MLPs) meeting in a scaled similarity matrix."""

    def __init__(self, features: int = 24, width: int = 32, out: int = 16) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, out))
        self.doc = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, out))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.query(q), dim=-1)
        b = F.normalize(self.doc(d), dim=-1)
        return self.scale * a @ b.t()


def symmetric_contrastive(logits: torch.Tensor) -> torch.Tensor:
    """CLIP's loss: each query picks its document and each document its query."""
    t = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, t) + F.cross_entropy(logits.t(), t)) / 2


def two_tower(seed: int = 0, batch_size: int | None = None) -> Workload:
    """TwoTower with the symmetric contrastive loss over the batch (positives on the diagonal)."""
    torch.manual_seed(seed)
    model = TwoTower()
    g = torch.Generator().manual_seed(seed)
    b = batch_size or BATCH
    q, d = torch.randn(b, 24, generator=g), torch.randn(b, 24, generator=g)
    return Workload(model, (q, d), loss_fn=symmetric_contrastive, name="two-tower")



FAMILIES = {
    "opt": opt,
    "opt-dropout": opt_dropout,
    "gpt-neo": gpt_neo,
    "gpt-j": gpt_j,
    "mistral": mistral,
    "mistral-frozen": mistral_frozen,
    "qwen2": qwen2,
    "phi": phi,
    "gemma": gemma,
    "falcon": falcon,
    "bloom": bloom,
    "mixtral": mixtral,
    "qwen2-moe": qwen2_moe,
    "bart": bart,
    "roberta-cls": roberta_cls,
    "distilbert-cls": distilbert_cls,
    "deberta-v2": deberta_v2,
    "deberta-v2-mlm": deberta_v2_mlm,
    "electra": electra,
    "vit": vit,
    "whisper": whisper,
    "wav2vec2": wav2vec2,
    "clip": clip,
    "cnn-bn": cnn_bn,
    "two-tower": two_tower,
}
