"""Configuration of an iota-subnet model exported for Hugging Face ``transformers``
(``AutoConfig.from_pretrained(DIR, trust_remote_code=True)``).

A Llama-3 style decoder whose layers were trained as pipeline stages with a residual bottleneck
(ResBM, arXiv 2604.11947) at every stage boundary. Written by ``iota-subnet export``; self-contained
(imports only ``transformers``), so the folder works without iota-subnet installed.
"""
from transformers import PretrainedConfig


class IotaConfig(PretrainedConfig):
    """Shape fields follow ``LlamaConfig`` names; the pipeline fields say where the bottlenecks are.

    ``layer_split``: layers per stage (sums to ``num_hidden_layers``); ``bottleneck_width`` b and
    ``identity_rank`` r: the wire width and identity path of each boundary bottleneck
    (``compression_ratio`` = hidden_size / b; 1 = no bottleneck); ``iota_rope_theta`` and
    ``iota_rope_scaling`` (Llama 3.1 keys ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``, or None) define the rotary embedding.
    """

    model_type = "iota_resbm"

    def __init__(self, vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5,
                 iota_rope_theta=10000.0, iota_rope_scaling=None, layer_split=None, compression_ratio=1,
                 bottleneck_width=None, identity_rank=None, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.iota_rope_theta = iota_rope_theta
        self.iota_rope_scaling = iota_rope_scaling
        self.layer_split = list(layer_split) if layer_split is not None else [num_hidden_layers]
        self.compression_ratio = compression_ratio
        self.bottleneck_width = bottleneck_width if bottleneck_width is not None else hidden_size
        self.identity_rank = identity_rank if identity_rank is not None else self.bottleneck_width
        kwargs.setdefault("use_cache", False)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
