"""Framework folders: what transformers, PEFT, the Trainer, accelerate,
diffusers and sentence-transformers put beside a model, and what it says.

- ``role_of``: the role of a file the frameworks write beside the model
  (``optimizer.pt``: optimizer state, ``rng_state.pth``: RNG state,
  ``training_args.bin``: training arguments, ``config.json``...), so that a
  Trainer ``checkpoint-N/`` or an accelerate ``save_state`` folder reads as
  its model, with every other file listed by role;
- ``pick_model``: of a folder's checkpoint files, the one the framework
  loads as the model (``loaders``: ``model.safetensors`` before
  ``pytorch_model.bin``, ``adapter_model.safetensors`` for PEFT, never a
  variant beside the plain model), when the others all have roles;
- ``folder_facts``: what the folder's JSON says, by content: a transformers
  ``config.json`` (``architectures``, ``model_type``,
  ``tie_word_embeddings``), a PEFT ``adapter_config.json`` (type, rank,
  target modules, base model), a Trainer's ``trainer_state.json``,
  accelerate's ``random_states_N.pkl``, a diffusers ``model_index.json``, a
  sentence-transformers ``modules.json``.

- ``other_framework``: the folders other frameworks write (a TensorFlow
  SavedModel or checkpoint, an orbax checkpoint), named when refused.

Only names and small JSON files are read here: the companions' pickles are
scanned by ``ckptool.read.companions``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

from ckptool.model import Framework
from ckptool.read import fs
from ckptool.read.layouts import loaders

MAX_JSON_BYTES = 4 << 20  # config files are a few kB; a tokenizer.json is never read here

# the files other runtimes load beside the model, which no framework unpickles
# (optimum-intel's openvino_model.bin is raw weights): read by no one here
OPENVINO = "OpenVINO export (optimum-intel; raw weights, never unpickled)"
NOT_PICKLES = (OPENVINO,)
# files the frameworks write beside a model, and what each holds (patterns
# compiled on first use: ``_roles``, not by every run that imports this)
ROLES: tuple[tuple[str, str], ...] = (
        (r"^optimizer(_\d+)?\.(pt|bin)$", "optimizer state"),
        (r"^scheduler(_\d+)?\.(pt|bin)$", "LR scheduler state"),
        (r"^rng_state(_\d+)?\.pth$", "RNG state (Trainer)"),
        (r"^random_states_\d+\.pkl$", "RNG state (accelerate)"),
        (r"^training_args\.bin$", "training arguments (Trainer)"),
        (r"^trainer_state\.json$", "trainer state (JSON)"),
        (r"^scaler(_\d+)?\.(pt|bin)$", "gradient scaler state"),
        (r"^sampler(_\d+)?\.bin$", "sampler state (accelerate)"),
        (r"^dl_state_dict(_\d+)?\.bin$", "data loader state (accelerate)"),
        (r"^custom_checkpoint_\d+\.pkl$", "registered object (accelerate)"),
        (r"^config\.json$", "model config"),
        (r"^generation_config\.json$", "generation config"),
        (r"^adapter_config\.json$", "adapter config (PEFT)"),
        (r"^(tokenizer(_config)?\.json|special_tokens_map\.json|vocab\.(txt|json)"
         r"|merges\.txt|tokenizer\.model|added_tokens\.json|spiece\.model"
         r"|sentencepiece\.bpe\.model|(source|target)\.spm|bpe\.codes)$", "tokenizer"),
        (r"^chat_template\.(jinja|json)$", "chat template"),
        (r"^(video_)?preprocessor_config\.json$", "preprocessor config"),
        (r"^processor_config\.json$", "processor config"),
        (r"^(tf_model\.h5|flax_model\.msgpack|rust_model\.ot)$",
         "the model for another framework (TensorFlow, Flax, Rust)"),
        (r"^.+\.onnx(_data)?$", "ONNX model"),
        (r"^(modeling|configuration|tokenization|processing|image_processing"
         r"|feature_extraction|video_processing)_\w+\.py$",
         "custom code (trust_remote_code=True runs it)"),
        (r"^model_index\.json$", "pipeline index (diffusers)"),
        (r"^(modules|sentence_bert_config|config_sentence_transformers)\.json$",
         "sentence-transformers config"),
        (r"^(README\.md|\.gitattributes|LICENSE(\.txt)?)$", "model card or repository file"),
        (r"^(zero_to_fp32|zero_to_torch)\.py$", "DeepSpeed recovery script"),
        (r"^latest$", "DeepSpeed tag pointer"),
        (r"^openvino_[\w.-]*\.(xml|bin)$", OPENVINO),
        (r"^\w+\.py$", "Python file (ckptool never runs it)"),
)
# the roles above that are what resuming training reads, not the model
TRAINING_STATE = frozenset({
    "optimizer state", "LR scheduler state", "RNG state (Trainer)", "RNG state (accelerate)",
    "training arguments (Trainer)", "trainer state (JSON)", "gradient scaler state",
    "sampler state (accelerate)", "data loader state (accelerate)",
    "registered object (accelerate)", "DeepSpeed recovery script", "DeepSpeed tag pointer"})
# what each framework loads as the model, in the order it looks
MODEL_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors",
               "pytorch_model.bin", "diffusion_pytorch_model.safetensors",
               "diffusion_pytorch_model.bin", "pytorch_model.pt")
# frameworks whose loader reads the model by its file name from the folder
LOADS_BY_NAME = ("transformers", "trainer", "peft", "diffusers", "sentence-transformers")
# accelerate numbers a second prepared model model_1.safetensors, pytorch_model_1.bin
OTHER_MODEL = r"^(model|pytorch_model)_(\d+)\.(safetensors|bin)$"


@functools.cache
def _roles() -> tuple[tuple[re.Pattern[str], str], ...]:
    return tuple((re.compile(pattern), role) for pattern, role in ROLES)


# transformers' base_model_prefix by model_type: a task model (LlamaForCausalLM)
# keeps its base model's weights under it ("model.layers.0..."), the base
# model class (LlamaModel) without it
BASE_PREFIX = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                     "gemma", "gemma2", "gemma3_text", "phi", "phi3", "opt", "bart", "mbart",
                     "whisper", "olmo", "olmo2", "starcoder2", "cohere", "granite",
                     "deepseek_v2", "deepseek_v3", "smollm3", "glm", "helium"), "model"),
    **dict.fromkeys(("gpt2", "gptj", "falcon", "bloom", "mpt", "gpt_bigcode", "codegen",
                     "t5", "mt5"), "transformer"),
    "bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert",
    "albert": "albert", "electra": "electra", "deberta": "deberta", "deberta-v2": "deberta",
    "gpt_neox": "gpt_neox", "vit": "vit", "camembert": "roberta", "mpnet": "mpnet",
}


def own_naming(kind: str, model_type: str | None, prefix: str) -> bool:
    """Whether a state dict's non-wrapper ``prefix`` is the framework's own
    naming: PEFT's ``base_model.model.`` (over the base model's); or the
    base model's prefix a transformers task model puts its weights under
    (``model.`` for a Llama, ``bert.`` for a BERT; for an architecture not
    listed, any one component). ``model.model.`` is never a Llama's own."""
    if not prefix:
        return True
    if kind == "peft":
        return prefix.startswith("base_model.model.")
    known = BASE_PREFIX.get(model_type or "")
    if known is not None:
        return prefix == f"{known}."
    return prefix.count(".") == 1


def role_of(name: str) -> str | None:
    """What a file the frameworks write beside a model holds, or None."""
    for pattern, role in _roles():
        if pattern.match(name):
            return role
    m = re.match(OTHER_MODEL, name)
    if m and m.group(2) != "0":
        return f"model {m.group(2)} (accelerate's model_{m.group(2)})"
    return None


def pick_model(checkpoints: list[str], configured: bool = False) -> str | None:
    """Of a folder's checkpoint files, the model the framework loads: the
    one file left once the files with a role beside a model are set aside;
    in a folder a framework's config describes (``configured``), the file
    it loads by name whatever else is there (``model.safetensors`` before
    ``pytorch_model.bin``, as transformers looks; a ``model.fixed.pth``
    beside it is not read). A folder whose other files have a framework's
    roles (accelerate's ``optimizer.bin``, ``random_states_0.pkl``) is one
    too: its framework loads the model by name. None when that leaves no
    single answer."""
    rest = [n for n in checkpoints if role_of(n) is None]
    if len(rest) == 1:
        return rest[0]
    if not configured and len(rest) == len(checkpoints):
        return None
    choice = loaders.choose(rest)
    if choice is not None and choice.name is not None and not choice.index:
        return choice.name
    named = [n for n in MODEL_FILES if n in rest]
    return named[0] if named else None


def configures_model(files: list[str]) -> bool:
    """Whether a folder holds a framework's config for the model in it."""
    return bool({"config.json", "adapter_config.json"} & set(files))


def folder_facts(directory: str, files: list[str], dirs: list[str]) -> Framework | None:
    """What the framework files in ``directory`` say (no companions yet),
    or None for a folder no framework wrote."""
    has = set(files)
    config = json_file(directory, "config.json") if "config.json" in has else None
    model_class, model_type, tied = _model_facts(config)
    adapter = json_file(directory, "adapter_config.json") if "adapter_config.json" in has else None
    here = fs.basename(directory) + "/"
    if isinstance(adapter, dict) and "peft_type" in adapter:
        facts = _adapter_facts(adapter)
        return Framework("peft", directory, f"a PEFT {facts['peft_type']} adapter ({here})",
                         model_class=facts.get("base_model_class"),
                         evidence="adapter_config.json", adapter=facts)
    index = json_file(directory, "model_index.json") if "model_index.json" in has else None
    if isinstance(index, dict) and "_class_name" in index:
        parts = tuple(sorted(k for k, v in index.items() if isinstance(v, list) and len(v) == 2
                             and k in dirs))
        return Framework("diffusers", directory,
                         f"a diffusers pipeline ({index['_class_name']}, {here})",
                         model_class=str(index["_class_name"]), evidence="model_index.json",
                         components=parts)
    if "modules.json" in has and isinstance(json_file(directory, "modules.json"), list):
        return Framework("sentence-transformers", directory,
                         f"a sentence-transformers model ({here})", model_class=model_class,
                         model_type=model_type, tie_word_embeddings=tied,
                         evidence="modules.json" if model_class is None else "config.json")
    evidence = "config.json" if model_class or model_type else ""
    if "trainer_state.json" in has or "training_args.bin" in has:
        return Framework("trainer", directory, f"a transformers Trainer checkpoint ({here})",
                         model_class, model_type, tied, evidence=evidence)
    if any(re.match(r"^random_states_\d+\.pkl$", n) for n in files):
        return Framework("accelerate", directory, f"an accelerate save_state folder ({here})",
                         model_class, model_type, tied, evidence=evidence)
    if evidence:
        if isinstance(config, dict) and "_class_name" in config:
            return Framework("diffusers", directory, f"a diffusers model folder ({here})",
                             model_class or model_type, None, None, evidence=evidence)
        return Framework("transformers", directory, f"a transformers model folder ({here})",
                         model_class, model_type, tied, evidence=evidence)
    return None


def _model_facts(config: Any) -> tuple[str | None, str | None, bool | None]:
    """(architecture, model_type, tie_word_embeddings) of a config.json:
    transformers' (``architectures``, ``model_type``) or diffusers'
    (``_class_name``). transformers ties by default."""
    if not isinstance(config, dict):
        return None, None, None
    arch = config.get("architectures")
    model_class = arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) \
        else config.get("_class_name") if isinstance(config.get("_class_name"), str) else None
    model_type = config["model_type"][:100] if isinstance(config.get("model_type"), str) \
        else None
    model_class = model_class[:200] if isinstance(model_class, str) else None
    if model_class is None and model_type is None:
        return None, None, None
    return model_class, model_type, _ties_head(config, model_class)


# classes with an output embedding (a language-model head) that a config can tie
LM_HEAD = (r"(ForCausalLM|LMHeadModel|WithLMHead(Model)?|ForConditionalGeneration"
           r"|ForMaskedLM|ForPreTraining|ForSeq2SeqLM|ForSpeechSeq2Seq)$")


def _ties_head(config: dict[str, Any], model_class: str | None) -> bool | None:
    """Whether the model ties its output embedding to its input embedding:
    None for a class with no such head (``RobertaModel``, a classifier) or
    none named. ``tie_word_embeddings`` as the config says, or, where it
    does not, as the transformers that wrote it meant: 4.x leaves out a
    value equal to ``PretrainedConfig``'s default, True (a T5's, a BERT's
    config.json); 5.x writes it wherever the model has one."""
    if model_class is None or not re.search(LM_HEAD, model_class):
        return None
    tied = config.get("tie_word_embeddings")
    if isinstance(tied, bool):
        return tied
    version = config.get("transformers_version")
    major = re.match(r"^(\d+)\.", version) if isinstance(version, str) else None
    return True if major is not None and int(major.group(1)) < 5 else None


def _adapter_facts(adapter: dict[str, Any]) -> dict[str, Any]:
    """What an adapter_config.json says, each field only when it has the type
    PEFT writes (a hostile config shows no junk)."""
    def text(key: str) -> str | None:
        value = adapter.get(key)
        return value[:200] if isinstance(value, str) else None

    def number(key: str) -> int | float | None:
        value = adapter.get(key)
        return value if type(value) in (int, float) else None

    targets = adapter.get("target_modules")
    targets = sorted(t[:100] for t in targets if isinstance(t, str))[:64] \
        if isinstance(targets, list) else text("target_modules")
    facts = {"peft_type": text("peft_type") or "unknown", "r": number("r"),
             "lora_alpha": number("lora_alpha"), "target_modules": targets,
             "base_model": text("base_model_name_or_path"), "task_type": text("task_type")}
    auto = adapter.get("auto_mapping")
    if isinstance(auto, dict) and isinstance(auto.get("base_model_class"), str):
        facts["base_model_class"] = auto["base_model_class"]
    return {k: v for k, v in facts.items() if v is not None}


def json_file(directory: str, name: str) -> Any:
    """The JSON in ``directory/name``, or None (missing, too big, not JSON,
    not a regular file)."""
    path = os.path.join(directory, name)
    try:
        if not fs.regular(path):
            return None
        with fs.open_binary(path) as f:
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            return None
        return json.loads(data)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def other_framework(files: list[str], dirs: list[str]) -> tuple[str, str] | None:
    """Checkpoint directories of other frameworks, by the files they write."""
    names = set(files)
    if "saved_model.pb" in names or "saved_model.pbtxt" in names:
        return ("a TensorFlow SavedModel", "load it with tf.saved_model.load; transformers' "
                "from_pretrained(..., from_tf=True) converts TensorFlow models")
    if names & {"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt"} or (
            "checkpoint" in names and "d" in dirs):
        return ("an orbax (JAX) checkpoint",
                "restore it with orbax.checkpoint; transformers' from_pretrained(..., "
                "from_flax=True) converts Flax models")
    if any(n.endswith(".index") for n in names) and any(
            re.search(r"\.data-\d{5}-of-\d{5}$", n) for n in names):
        return ("a TensorFlow checkpoint (.index + .data files)",
                "read it with tf.train.load_checkpoint")
    return None
