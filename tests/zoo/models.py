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

from chronotope.workload import Workload

BATCH = 4
SEQ = 16  # a zigzag of 8 chunks (context parallel over 4) divides it
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



# --- more Hugging Face families ------------------------------------------------------------

def t5_v1_1(seed: int = 0, batch_size: int | None = None) -> Workload:
    """T5ForConditionalGeneration (v1.1): gated-GELU feed-forward, relative position buckets,
    an untied LM head, the decoder's inputs shifted from the labels."""
    config = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                         num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                         relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
                         tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
                         eos_token_id=1, use_cache=False)
    model = _build(tf.T5ForConditionalGeneration, config, seed)
    b = batch_size or BATCH
    kwargs = {"input_ids": _tokens((b, SEQ), seed), "labels": _tokens((b, SEQ // 2), seed + 1)}
    return Workload(model, (), kwargs, name="t5-v1.1")


def albert(seed: int = 0, batch_size: int | None = None) -> Workload:
    """AlbertForMaskedLM: one transformer layer's weights shared by every layer, a factorized
    (smaller) embedding projected up to the hidden size."""
    config = tf.AlbertConfig(**ENCODER, embedding_size=16, attn_implementation="sdpa")
    model = _build(tf.AlbertForMaskedLM, config, seed)
    b = batch_size or BATCH
    ids = _tokens((b, SEQ), seed)
    labels = torch.where(_tokens((b, SEQ), seed + 1, 0, 4) == 0, ids, -100)
    labels[:, 0] = ids[:, 0]  # a target in every row
    return Workload(model, (), {"input_ids": ids, "labels": labels}, name="albert")


def gemma3(seed: int = 0, batch_size: int | None = None) -> Workload:
    """Gemma3ForCausalLM (text only): q/k RMS norms, a sliding and a full attention layer with
    their own rotary tables, scaled embeddings."""
    config = tf.Gemma3TextConfig(**{**DECODER, "num_key_value_heads": 1}, head_dim=8,
                                 query_pre_attn_scalar=8, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"])
    return _causal_lm("gemma3", tf.Gemma3ForCausalLM, config, seed, batch_size)


def deepseek_v3(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DeepseekV3ForCausalLM: multi-head latent attention whose keys are written into slices
    of a ``new_empty`` tensor, a dense first layer, then grouped top-k routing over 4 experts
    plus a shared expert."""
    config = tf.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 moe_intermediate_size=16, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4,
                                 n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                                 n_group=2, topk_group=1, first_k_dense_replace=1,
                                 kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                                 qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32,
                                 use_cache=False, attn_implementation="sdpa", **SPECIAL)
    return _causal_lm("deepseek-v3", tf.DeepseekV3ForCausalLM, config, seed, batch_size)


def deepseek_v2(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DeepseekV2ForCausalLM: latent attention with rotary embeddings as complex products
    (``view_as_complex`` times ``polar``), group-limited top-k routing over 4 experts plus a
    shared expert."""
    config = tf.DeepseekV2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 moe_intermediate_size=16, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4,
                                 n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                                 topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                 first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                 qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                 max_position_embeddings=32, use_cache=False,
                                 attn_implementation="sdpa", **SPECIAL)
    return _causal_lm("deepseek-v2", tf.DeepseekV2ForCausalLM, config, seed, batch_size)


def gpt_bigcode(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GPTBigCodeForCausalLM: multi-query attention (one key-value head) from a fused c_attn."""
    config = tf.GPTBigCodeConfig(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                 n_head=4, n_inner=64, multi_query=True, use_cache=False,
                                 attn_implementation="sdpa", **SPECIAL)
    return _causal_lm("gpt-bigcode", tf.GPTBigCodeForCausalLM, config, seed, batch_size)


def granite(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GraniteForCausalLM: Llama blocks with embedding, residual, attention and logit
    multipliers."""
    config = tf.GraniteConfig(**DECODER, embedding_multiplier=4.0, residual_multiplier=0.5,
                              attention_multiplier=0.25, logits_scaling=2.0)
    return _causal_lm("granite", tf.GraniteForCausalLM, config, seed, batch_size)


def olmoe(seed: int = 0, batch_size: int | None = None) -> Workload:
    """OlmoeForCausalLM: q/k RMS norms over all heads, top-2 of 4 experts with the router's
    balancing loss."""
    config = tf.OlmoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2,
                            output_router_logits=True)
    return _causal_lm("olmoe", tf.OlmoeForCausalLM, config, seed, batch_size)


def switch(seed: int = 0, batch_size: int | None = None) -> Workload:
    """SwitchTransformersForConditionalGeneration: top-1 of 4 experts, one module each, an
    expert capacity of 3 tokens per sequence (of 16: the rest dropped), the router's z and
    balancing losses."""
    config = tf.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_heads=4, num_experts=4,
        expert_capacity=3, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        use_cache=False)
    model = _build(tf.SwitchTransformersForConditionalGeneration, config, seed)
    b = batch_size or BATCH
    kwargs = {"input_ids": _tokens((b, SEQ), seed), "labels": _tokens((b, SEQ // 2), seed + 1),
              "output_router_logits": True}
    return Workload(model, (), kwargs, name="switch")


def mamba(seed: int = 0, batch_size: int | None = None) -> Workload:
    """MambaForCausalLM on the slow (pure torch) path: a causal depthwise conv1d and a selective
    scan as a Python loop over the sequence."""
    config = tf.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2,
                            expand=2, conv_kernel=4, time_step_rank=4, use_cache=False,
                            use_mambapy=False, use_associative_scan=False, **SPECIAL)
    return _causal_lm("mamba", tf.MambaForCausalLM, config, seed, batch_size)


def bigbird(seed: int = 0, batch_size: int | None = None) -> Workload:
    """BigBirdForSequenceClassification with full attention (block-sparse needs sequences of
    many 64-token blocks): a first-token classifier head on padded rows."""
    config = tf.BigBirdConfig(**ENCODER, attention_type="original_full", num_labels=LABELS,
                              problem_type="single_label_classification")
    return _classify("bigbird", tf.BigBirdForSequenceClassification, config, seed, batch_size)


def convnext(seed: int = 0, batch_size: int | None = None) -> Workload:
    """ConvNextForImageClassification: depthwise 7x7 convs, channels-last layer norms, layer
    scale, a patchify stem and strided downsampling (drop path 0 here)."""
    config = tf.ConvNextConfig(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16],
                               depths=[1, 1], drop_path_rate=0.0, layer_scale_init_value=0.5,
                               image_size=IMAGE, num_labels=LABELS)
    model = _build(tf.ConvNextForImageClassification, config, seed)
    b = batch_size or BATCH
    kwargs = {"pixel_values": _pixels(seed, b), "labels": _classes(seed, b)}
    return Workload(model, (), kwargs, name="convnext")


def swin(seed: int = 0, batch_size: int | None = None) -> Workload:
    """SwinForImageClassification: windowed attention, shifted windows (torch.roll and a mask
    built by slice assignment), relative position bias tables, patch merging."""
    config = tf.SwinConfig(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16,
                           depths=[2, 2], num_heads=[2, 4], window_size=2, mlp_ratio=2.0,
                           drop_path_rate=0.0, num_labels=LABELS)
    model = _build(tf.SwinForImageClassification, config, seed)
    b = batch_size or BATCH
    kwargs = {"pixel_values": _pixels(seed, b), "labels": _classes(seed, b)}
    return Workload(model, (), kwargs, name="swin")


class SiglipClassifier(nn.Module):
    """SiglipVisionModel's pooled output (attention pooling by a probe, then position 0 of the
    pooled sequence) under a linear head."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision = tf.SiglipVisionModel(config)
        self.head = nn.Linear(config.hidden_size, LABELS)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.vision(pixel_values=pixel_values).pooler_output)


def siglip(seed: int = 0, batch_size: int | None = None) -> Workload:
    """SiglipVisionModel + head: a multihead-attention pooling head (nn.MultiheadAttention with
    a learned probe) that reads one position of its output, cross-entropy on top."""
    config = _deterministic(tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE, patch_size=4, vision_use_head=True, attn_implementation="sdpa"))
    torch.manual_seed(seed)
    model = SiglipClassifier(config).train()
    b = batch_size or BATCH
    return Workload(model, (_pixels(seed, b),), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="siglip")


# --- more models written here --------------------------------------------------------------

def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """Two downsamplings (max pool, strided conv), two upsamplings (transposed conv, bilinear
    resize), skip connections concatenated on the channel dim."""

    def __init__(self, channels: int = 3, width: int = 8) -> None:
        super().__init__()
        self.enc1 = _block(channels, width)
        self.enc2 = _block(width, 2 * width)
        self.down2 = nn.Conv2d(2 * width, 2 * width, 2, stride=2)
        self.bottom = _block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _block(4 * width, 2 * width)
        self.dec1 = _block(3 * width, width)
        self.out = nn.Conv2d(width, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)  # 16 x 16
        e2 = self.enc2(F.max_pool2d(e1, 2))  # 8 x 8
        m = self.bottom(self.down2(e2))  # 4 x 4
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))  # 8 x 8
        up1 = F.interpolate(d2, scale_factor=2, mode="bilinear", align_corners=False)
        d1 = self.dec1(torch.cat([up1, e1], dim=1))  # 16 x 16
        return self.out(d1)


def unet(seed: int = 0, batch_size: int | None = None) -> Workload:
    """UNet regressed to a target image with MSE: skip concatenations, transposed convs."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    return Workload(UNet(), (_pixels(seed, b),), targets=(_pixels(seed + 1, b),),
                    loss_fn=F.mse_loss, name="unet")


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (batch, seq, vocab) logits against (batch, seq) next tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LSTMLM(nn.Module):
    """Embedding, a 2-layer batch-first LSTM, a vocabulary head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(ids))
        return self.head(h)


def _next_tokens(seed: int, batch_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _tokens((batch_size or BATCH, SEQ + 1), seed)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lstm_lm(seed: int = 0, batch_size: int | None = None) -> Workload:
    """LSTMLM with next-token cross-entropy: nn.LSTM's fused recurrent kernel (flat weights)."""
    torch.manual_seed(seed)
    inputs, targets = _next_tokens(seed, batch_size)
    return Workload(LSTMLM(), (inputs,), targets=(targets,), loss_fn=token_cross_entropy,
                    name="lstm-lm")


class BiGRUClassifier(nn.Module):
    """Embedding, a bidirectional GRU, both directions' final states concatenated, a head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.gru = nn.GRU(width, width, num_layers=1, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * width, LABELS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(self.embed(ids))  # h: (directions, batch, width)
        return self.head(torch.cat([h[-2], h[-1]], dim=-1))


def gru_lm(seed: int = 0, batch_size: int | None = None) -> Workload:
    """BiGRUClassifier: a bidirectional GRU whose final hidden state is batch-second."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    return Workload(BiGRUClassifier(), (_tokens((b, SEQ), seed),), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="gru-lm")


class BagRecommender(nn.Module):
    """A sum EmbeddingBag over each user's item ids (flat ids + offsets), then an MLP to a
    click logit."""

    def __init__(self, items: int = VOCAB, width: int = 16) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(items, width, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.items(ids, offsets)).squeeze(-1)


def embedding_bag(seed: int = 0, batch_size: int | None = None) -> Workload:
    """BagRecommender with BCE-with-logits: bags of 1-4 ids; the batch is the bags, not the
    flat ids tensor (its length is the sum of the bags', 10 here)."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    lengths = torch.arange(b) % 4 + 1
    offsets = torch.cumsum(lengths, 0) - lengths
    ids = _tokens((int(lengths.sum()),), seed, 0, VOCAB)
    clicks = (_classes(seed, b, 2)).float()
    return Workload(BagRecommender(), (ids, offsets), targets=(clicks,),
                    loss_fn=F.binary_cross_entropy_with_logits, name="embedding-bag")


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """timm's stochastic depth: zero a whole sample's residual branch with probability p."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x.div(1 - p) * keep


class DropPathBlock(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.p = p
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + drop_path(self.mlp(self.norm(x)), self.p, self.training)


class DropPathNet(nn.Module):
    """Tokens projected in, residual pre-norm MLP blocks with drop path, mean pool, head."""

    def __init__(self, features: int = 24, width: int = 32, depth: int = 2,
                 p: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.Sequential(*(DropPathBlock(width, p) for _ in range(depth)))
        self.head = nn.Linear(width, LABELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)).mean(1))


def drop_path_net(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DropPathNet (p=0.1, random on purpose): a tensor's bernoulli_() on torch's generator,
    one draw per sample."""
    torch.manual_seed(seed)
    model = DropPathNet().train()
    b = batch_size or BATCH
    x = torch.randn(b, SEQ, 24, generator=torch.Generator().manual_seed(seed))
    return Workload(model, (x,), targets=(_classes(seed, b),), loss_fn=F.cross_entropy,
                    name="drop-path")


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class CheckpointedNet(nn.Module):
    """Residual MLP blocks each run through torch.utils.checkpoint (activations recomputed in
    the backward)."""

    def __init__(self, reentrant: bool, features: int = 24, width: int = 32,
                 depth: int = 2) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, LABELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h.mean(1))


def _checkpointed(name: str, reentrant: bool, seed: int, batch_size: int | None) -> Workload:
    torch.manual_seed(seed)
    b = batch_size or BATCH
    x = torch.randn(b, SEQ, 24, generator=torch.Generator().manual_seed(seed))
    return Workload(CheckpointedNet(reentrant), (x,), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name=name)


def checkpointed(seed: int = 0, batch_size: int | None = None) -> Workload:
    """CheckpointedNet with use_reentrant=False (saved-tensor hooks recompute the block)."""
    return _checkpointed("checkpointed", False, seed, batch_size)


def checkpointed_reentrant(seed: int = 0, batch_size: int | None = None) -> Workload:
    """CheckpointedNet with use_reentrant=True (an autograd.Function reruns the block)."""
    return _checkpointed("checkpointed-reentrant", True, seed, batch_size)


NODES = 8  # the gnn's batch: one row per node


class GCN(nn.Module):
    """Two graph convolutions over a fixed random graph: the first multiplies by the
    symmetrically normalized dense adjacency (a buffer), the second sums messages over the
    edge list with index_add_."""

    def __init__(self, nodes: int, features: int = 16, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        adj = (torch.rand(nodes, nodes, generator=g) < 0.3).float()
        adj = ((adj + adj.t() + torch.eye(nodes)) > 0).float()  # undirected, self loops
        norm = adj.sum(1).rsqrt()
        self.register_buffer("adj", norm[:, None] * adj * norm[None, :])
        src, dst = adj.nonzero(as_tuple=True)
        self.register_buffer("src", src)
        self.register_buffer("dst", dst)
        self.register_buffer("edge_weight", self.adj[src, dst])
        self.lin1 = nn.Linear(features, width)
        self.lin2 = nn.Linear(width, LABELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.adj @ self.lin1(x))
        m = self.lin2(h)
        out = torch.zeros_like(m)
        return out.index_add_(0, self.dst, m[self.src] * self.edge_weight[:, None])


def gnn(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GCN node classification: the batch is the graph's nodes, mixed by the adjacency."""
    torch.manual_seed(seed)
    n = batch_size or NODES
    model = GCN(n, seed=seed)
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return Workload(model, (x,), targets=(_classes(seed, n),), loss_fn=F.cross_entropy,
                    name="gnn")


class GQABlock(nn.Module):
    """Pre-norm causal attention with 4 query heads sharing 2 key-value heads
    (scaled_dot_product_attention's enable_gqa), then an MLP."""

    def __init__(self, width: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * kv_heads * self.dim)
        self.o = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2 * self.kv_heads, self.dim).transpose(1, 2).chunk(2, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class GQALM(nn.Module):
    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.blocks = nn.Sequential(*(GQABlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids) + self.pos)))


def sdpa_gqa(seed: int = 0, batch_size: int | None = None) -> Workload:
    """GQALM with next-token cross-entropy: SDPA's is_causal and enable_gqa flags."""
    torch.manual_seed(seed)
    inputs, targets = _next_tokens(seed, batch_size)
    return Workload(GQALM(), (inputs,), targets=(targets,), loss_fn=token_cross_entropy,
                    name="sdpa-gqa")


class GradReverse(torch.autograd.Function):
    """Identity forward, gradient times -alpha backward (domain-adversarial training)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.alpha * g, None


class RoundSTE(torch.autograd.Function):
    """Round forward, identity backward (a straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class DomainAdversarial(nn.Module):
    """Features quantized through a straight-through round, a label head, and a domain head
    behind a gradient-reversal layer."""

    def __init__(self, features: int = 24, width: int = 32, alpha: float = 0.5) -> None:
        super().__init__()
        self.alpha = alpha
        self.encoder = nn.Sequential(nn.Linear(features, width), nn.Tanh())
        self.mix = nn.Linear(width, width)
        self.label = nn.Linear(width, LABELS)
        self.domain = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = RoundSTE.apply(self.encoder(x) * 4) / 4  # 2-bit-ish activations
        h = F.relu(self.mix(h))
        return self.label(h), self.domain(GradReverse.apply(h, self.alpha)).squeeze(-1)


def adversarial_loss(out: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor,
                     domains: torch.Tensor) -> torch.Tensor:
    logits, domain_logits = out
    return F.cross_entropy(logits, labels) + F.binary_cross_entropy_with_logits(domain_logits,
                                                                                 domains)


def custom_function(seed: int = 0, batch_size: int | None = None) -> Workload:
    """DomainAdversarial: two torch.autograd.Functions whose backward is not their forward's
    derivative (gradient reversal; straight-through round)."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    x = torch.randn(b, 24, generator=torch.Generator().manual_seed(seed))
    domains = _classes(seed + 7, b, 2).float()
    return Workload(DomainAdversarial(), (x,), targets=(_classes(seed, b), domains),
                    loss_fn=adversarial_loss, name="custom-function")


class NoGradCentering(nn.Module):
    """Activations centered by a batch mean computed under torch.no_grad (no gradient through
    the statistic), and an EMA of the features updated in place under no_grad."""

    def __init__(self, features: int = 24, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(width, LABELS))
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.no_grad():
            center = h.mean(0, keepdim=True)
            if self.training:
                self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.head(h - center)


def no_grad(seed: int = 0, batch_size: int | None = None) -> Workload:
    """NoGradCentering: a no_grad block whose result is used, an EMA buffer written in place."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    x = torch.randn(b, 24, generator=torch.Generator().manual_seed(seed))
    return Workload(NoGradCentering(), (x,), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="no-grad")


class InplaceSlices(nn.Module):
    """In-place writes that eager autograd accepts: a parameter added into one position of a
    cloned tensor, two projections copied into slices of a new_empty tensor, an in-place
    relu, then mul_ and masked_fill_ on a linear's output."""

    def __init__(self, width: int = 32, split: int = 12) -> None:
        super().__init__()
        self.split = split
        self.embed = nn.Embedding(VOCAB, width)
        self.first = nn.Parameter(torch.randn(width) * 0.1)
        self.left = nn.Linear(width, split)
        self.right = nn.Linear(width, width - split)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, LABELS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).clone()
        h[:, 0] += self.first
        k = self.split
        z = h.new_empty(h.shape)
        z[..., :k].copy_(self.left(h))
        z[..., k:].copy_(self.right(h))
        z = F.relu(z, inplace=True)
        out = self.mix(z)
        out.mul_(2)
        out.masked_fill_((ids % 5 == 0)[..., None], 0.0)
        return self.head(out.mean(1))


def inplace_slices(seed: int = 0, batch_size: int | None = None) -> Workload:
    """InplaceSlices with cross-entropy: slice += on a clone, copy_ into new_empty slices,
    relu(inplace=True), mul_, masked_fill_."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    return Workload(InplaceSlices(), (_tokens((b, SEQ), seed),), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="inplace-slices")


class UnusedPooler(nn.Module):
    """An MLP classifier that also owns a pooler its forward never calls."""

    def __init__(self, features: int = 24, width: int = 32) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, width), nn.GELU())
        self.pooler = nn.Linear(width, width)  # never used: gets no gradient
        self.head = nn.Linear(width, LABELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def unused_param(seed: int = 0, batch_size: int | None = None) -> Workload:
    """UnusedPooler: parameters outside the graph (grad None, SGD leaves them unchanged)."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    x = torch.randn(b, 24, generator=torch.Generator().manual_seed(seed))
    return Workload(UnusedPooler(), (x,), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="unused-param")


class CountingMLP(nn.Module):
    """An MLP that counts its forward calls in an integer buffer (``self.steps += 1``)."""

    def __init__(self, features: int = 24, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, LABELS))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.net(x)


def counter_buffer(seed: int = 0, batch_size: int | None = None) -> Workload:
    """CountingMLP: an in-place update of a long scalar buffer that no loss reads."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    x = torch.randn(b, 24, generator=torch.Generator().manual_seed(seed))
    return Workload(CountingMLP(), (x,), targets=(_classes(seed, b),),
                    loss_fn=F.cross_entropy, name="counter-buffer")


class CausalBlock(nn.Module):
    """Pre-norm causal self-attention (fused qkv, SDPA) and an MLP."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.o = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class LastTokenClassifier(nn.Module):
    """A causal transformer classifier that pools the last position, ``h[:, -1, :]``."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.blocks = nn.Sequential(*(CausalBlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, LABELS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.blocks(self.embed(ids) + self.pos))
        return self.head(h[:, -1, :])


def last_token(seed: int = 0, batch_size: int | None = None) -> Workload:
    """LastTokenClassifier with cross-entropy: pooling reads one position of the sequence."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    return Workload(LastTokenClassifier(), (_tokens((b, SEQ), seed),),
                    targets=(_classes(seed, b),), loss_fn=F.cross_entropy, name="last-token")


class UncertaintyRegressor(nn.Module):
    """An MLP regressor that also returns its learned log-variance parameter."""

    def __init__(self, features: int = 24, width: int = 32, out: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, out))
        self.log_var = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), self.log_var


def uncertainty_mse(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Kendall-style homoscedastic uncertainty: exp(-s) * mse + s."""
    pred, s = out
    return torch.exp(-s) * F.mse_loss(pred, y) + s


def uncertainty_loss(seed: int = 0, batch_size: int | None = None) -> Workload:
    """UncertaintyRegressor: a parameter returned by forward and read only by the loss."""
    torch.manual_seed(seed)
    b = batch_size or BATCH
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 24, generator=g), torch.randn(b, 4, generator=g)
    return Workload(UncertaintyRegressor(), (x,), targets=(y,), loss_fn=uncertainty_mse,
                    name="uncertainty-loss")



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
    "t5-v1.1": t5_v1_1,
    "albert": albert,
    "gemma3": gemma3,
    "deepseek-v2": deepseek_v2,
    "deepseek-v3": deepseek_v3,
    "gpt-bigcode": gpt_bigcode,
    "granite": granite,
    "olmoe": olmoe,
    "switch": switch,
    "mamba": mamba,
    "bigbird": bigbird,
    "convnext": convnext,
    "swin": swin,
    "siglip": siglip,
    "unet": unet,
    "lstm-lm": lstm_lm,
    "gru-lm": gru_lm,
    "embedding-bag": embedding_bag,
    "drop-path": drop_path_net,
    "checkpointed": checkpointed,
    "checkpointed-reentrant": checkpointed_reentrant,
    "gnn": gnn,
    "sdpa-gqa": sdpa_gqa,
    "custom-function": custom_function,
    "no-grad": no_grad,
    "inplace-slices": inplace_slices,
    "unused-param": unused_param,
    "counter-buffer": counter_buffer,
    "last-token": last_token,
    "uncertainty-loss": uncertainty_loss,
}
