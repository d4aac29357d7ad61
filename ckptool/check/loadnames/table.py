"""The load-time renames of transformers 5.25.0 (``conversion_mapping.py``),
for the families whose folders are written in the old key layout and
renamed by ``from_pretrained``: used where transformers itself cannot be
asked (it is not installed, or the model is not a transformers class).

``tests/fixtures/frameworks/check_rename_table.py`` compares this table with
an installed transformers' own mapping, family by family.
"""

from __future__ import annotations

from ckptool.check.loadnames.rules import Rule

VERSION = "transformers 5.25.0"

# the families transformers builds others on (conversion_mapping.py copies
# their lists and adds to them)
MIXTRAL = (
    Rule((".block_sparse_moe.",), (".mlp.",)),
    Rule((".experts.*.w1.weight", ".experts.*.w3.weight"), (".experts.gate_up_proj",),
         ("stack", "cat1")),
    Rule((".experts.*.w2.weight",), (".experts.down_proj",), ("stack",)),
)
QWEN2_MOE = (
    Rule(("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
         ("mlp.experts.gate_up_proj",), ("stack", "cat1")),
    Rule(("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",), ("stack",)),
)
LLAVA = (
    Rule(("^language_model.lm_head",), ("lm_head",)),
    Rule(("^language_model",), ("model.language_model",)),
    Rule(("^vision_tower",), ("model.vision_tower",)),
    Rule(("^multi_modal_projector",), ("model.multi_modal_projector",)),
)
VIT = (
    Rule((r"encoder\.layer\.",), ("layers.",)),
    Rule(("attention.query",), ("q_proj",)),
    Rule(("attention.key",), ("k_proj",)),
    Rule(("attention.value",), ("v_proj",)),
    Rule(("attention.output.dense",), ("attention.o_proj",)),
    Rule(("intermediate.dense",), ("mlp.fc1",)),
    Rule(("output.dense",), ("mlp.fc2",)),
)
FAMILIES: dict[str, tuple[Rule, ...]] = {
    "mixtral": MIXTRAL,
    "minimax_m2": (
        *MIXTRAL,
        Rule((".block_sparse_moe.e_score_correction_bias",), (".mlp.e_score_correction_bias",)),
    ),
    "qwen2_moe": QWEN2_MOE,
    "ernie4_5_moe": (
        *QWEN2_MOE,
        Rule(("mlp.moe_statics.e_score_correction_bias",),
             ("mlp.gate.moe_statics.e_score_correction_bias",)),
    ),
    "exaone_moe": (
        *QWEN2_MOE,
        Rule(("mlp.e_score_correction_bias",), ("mlp.gate.e_score_correction_bias",)),
    ),
    "llava": LLAVA,
    "llava_next": (*LLAVA, Rule(("^image_newline",), ("model.image_newline",))),
    # a folder written by a multimodal base class (LlavaModel, PaliGemmaModel...)
    "LlavaModel": (Rule(("^language_model.model",), ("language_model",)),),
    "vit": VIT,
    "beit": (
        *VIT,
        Rule(("encoder.relative_position_bias",), ("shared_position_bias",)),
        Rule(("attention.attention.relative_position_bias.relative_position_bias_table",),
             ("relative_position_bias.relative_position_bias_table",)),
    ),
    "dinov2": (
        Rule(("attention.attention.query",), ("attention.q_proj",)),
        Rule(("attention.attention.key",), ("attention.k_proj",)),
        Rule(("attention.attention.value",), ("attention.v_proj",)),
        Rule(("attention.output.dense",), ("attention.o_proj",)),
        Rule(("mlp.weights_in.weight",), ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
             ("chunk0",)),
        Rule(("mlp.weights_in.bias",), ("mlp.gate_proj.bias", "mlp.up_proj.bias"), ("chunk0",)),
        Rule(("mlp.weights_out",), ("mlp.down_proj",)),
    ),
}
# applied to every model, after its family's
LEGACY = (
    Rule(("LayerNorm.gamma",), ("LayerNorm.weight",)),
    Rule(("LayerNorm.beta",), ("LayerNorm.bias",)),
    Rule((".weight_g",), (".parametrizations.weight.original0",)),
    Rule((".weight_v",), (".parametrizations.weight.original1",)),
    Rule((r"^model\.language_model\.model", r"^language_model\.model\.model"),
         ("model.language_model",)),
)
# config.json's model_type -> family (those whose mapping is the family's as it is)
MODEL_TYPES = {
    "mixtral": "mixtral", "minimax": "mixtral",
    **dict.fromkeys((
        "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "flex_olmo", "deepseek_v2",
        "deepseek_v3", "deepseek_v32", "dots1", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
        "glm4v_moe", "longcat_flash", "solar_open", "mellum", "beam", "hunyuan_v1_moe",
        "sarvam_mla", "cohere2_moe", "afmoe", "qwen3_omni_moe"), "qwen2_moe"),
    **dict.fromkeys((
        "llava", "aria", "paligemma", "aya_vision", "got_ocr2", "gemma3", "internvl",
        "vipllava", "mistral3"), "llava"),
    **dict.fromkeys(("llava_next", "llava_next_video", "llava_onevision"), "llava_next"),
    "minimax_m2": "minimax_m2", "ernie4_5_moe": "ernie4_5_moe", "exaone_moe": "exaone_moe",
    "dinov2": "dinov2", "beit": "beit",
    **dict.fromkeys((
        "vit", "deit", "ijepa", "vit_mae", "vit_msn", "vivit",
        "audio-spectrogram-transformer"), "vit"),
}


# config.json's architectures[0] -> family, where transformers keys the
# renames by the class (a multimodal base class has its own)
CLASSES = dict.fromkeys((
    "LlavaModel", "AriaModel", "PaliGemmaModel", "AyaVisionModel", "GotOcr2Model",
    "Gemma3Model", "InternVLModel", "VipLlavaModel", "Mistral3Model", "LlavaNextModel",
    "LlavaNextVideoModel", "LlavaOnevisionModel"), "LlavaModel")


def rules_for(model_type: str | None,
              model_class: str | None = None) -> tuple[str, tuple[Rule, ...]] | None:
    """(family, its rules then the legacy ones) for a config's model_type
    and architecture."""
    family = CLASSES.get(model_class or "") or MODEL_TYPES.get(model_type or "")
    if family is None:
        return None
    return family, FAMILIES[family] + LEGACY
