"""Loading a target folder as a transformers causal LM, composite (vision + text) checkpoints included.

Most families load with ``AutoModelForCausalLM``, which also reads the text part of some composite
checkpoints (Qwen3.5: ``text_config`` and ``model.language_model.*`` tensors). Families it refuses,
such as Muse Glimmer (``MuseGlimmerForConditionalGeneration``), load with their own transformers
class; their text-only forward is then the target, and the vision modules are dropped. Only
safetensors are read and no remote code runs: no ``trust_remote_code``, no Hub kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from speculant.core.checkpoint import read_json_object
from speculant.core.errors import ConfigError
from speculant.core.target_check import TESTED_FAMILIES

_VISION_WORDS = ("vision", "visual", "audio")


def family_problem(path: str | Path) -> str | None:
    """Why transformers cannot load ``path`` as a text model (config.json's ``model_type`` unknown,
    config.json unreadable, or no causal-LM class for it), or None. Reads config.json only."""
    try:
        text_model_class(path)
    except ConfigError as exc:
        return str(exc)
    return None


def text_model_class(path: str | Path):
    """``(config, Auto class)`` that load ``path``'s text model (composites: image-text-to-text);
    a one-line ConfigError naming config.json and its model_type otherwise."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    file = Path(path) / "config.json"
    tested = f"families speculant is tested on: {', '.join(TESTED_FAMILIES)}"
    model_type = read_json_object(file).get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        raise ConfigError(f"{file}: model_type {model_type!r} is not a family transformers {transformers.__version__} "
                          f"knows, so the torch backend cannot load it ({tested})", "target.path")
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # what transformers' config classes raise for bad values
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"{file}: transformers cannot read it: {type(exc).__name__}: {first}", "target.path") from None
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return config, AutoModelForCausalLM
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return config, AutoModelForImageTextToText
    raise ConfigError(f"{file}: transformers has no causal LM for model_type {model_type!r} "
                      f"({type(config).__name__}), so the torch backend cannot load it ({tested})", "target.path")


def load_causal_lm(path: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """The model (in eval mode, no gradients) and transformers' loading info (missing / unexpected keys)."""
    from transformers import AutoModelForImageTextToText

    config, auto_class = text_model_class(path)
    options = dict(config=config, dtype=dtype, use_safetensors=True, trust_remote_code=False, output_loading_info=True,
                   use_kernels=False)  # transformers >= 5.25 would fetch and run kernels from the Hub by default
    model, info = auto_class.from_pretrained(path, **options)
    if auto_class is AutoModelForImageTextToText:
        _drop_vision(model)
    model.eval()
    model.requires_grad_(False)
    return model, info


def _drop_vision(model: torch.nn.Module) -> None:
    """Free the vision/audio towers of a composite model: a text-only forward never calls them."""
    inner = getattr(model, "model", None)
    if inner is None:
        return
    language = model.get_decoder()
    for name, child in list(inner.named_children()):
        if child is not language and any(word in name for word in _VISION_WORDS):
            setattr(inner, name, None)


def logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the family's causal-LM forward does to ``lm_head`` outputs (None: nothing), so that a
    drafter sharing the head gets the logits the target itself gives for a hidden state.
    Muse Glimmer: ``cap * tanh(x * output_multiplier / cap)``; Gemma 2/3: ``final_logit_softcapping``;
    Cohere: ``logit_scale``; Granite: ``/ logits_scaling``."""
    text = config.get_text_config(decoder=True)

    def number(name: str) -> float | None:
        value = getattr(text, name, None)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    # the same operations in the same order as the families' forwards, so the results are bit-identical
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for name in ("output_multiplier", "logit_scale"):
        if (factor := number(name)) is not None:
            steps.append(lambda x, f=factor: x * f)
    if (divisor := number("logits_scaling")) is not None:
        steps.append(lambda x, d=divisor: x / d)
    if (cap := number("final_logit_softcapping")) is not None and cap > 0:
        steps.append(lambda x, c=cap: torch.tanh(x / c) * c)
    if not steps:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in steps:
            logits = step(logits)
        return logits

    return transform
