"""Muse Glimmer's own DFlash assistant (transformers' ``muse_glimmer_assistant``) as a DFlash draft.

The assistant is a DFlash draft in transformers' layout; this module maps its config.json and
tensor names onto :mod:`speculant.drafters.dflash.config`'s, so the DFlash modules run it.
What differs from a published DFlash config, as transformers' modeling and generation code
(5.24) does it:

- Keys sit at the top level (``mask_token_id``, ``target_layer_ids``, ``block_size``), there is
  no ``num_target_layers`` and no ``vocab_size`` (the assistant has no embedding and no head).
- ``encoder.fc`` / ``encoder.output_norm_enc`` are DFlash's ``fc`` / ``hidden_norm``.
- Every layer is bidirectional (no ``is_causal`` key; DFlash's published rule would make its
  sliding layers causal), and a sliding layer keeps keys with ``|query - key| <= sliding_window``
  (``sliding_window_bidirectional_overlay``), one more than DFlash's ``< sliding_window``.
- The block's input rows are the target's embedding rows *without* the target's weightless
  ``embed_norm`` (``DFlashTokenCandidateGenerator._get_noise_embeds``).
- Draft logits are the target's bare ``lm_head`` (no ``output_multiplier``, no soft-cap).
- The target's hidden states are transformers' ``hidden_states[i + 1]``: layer ``i``'s output,
  except the last layer's, which ``capture_outputs`` replaces by the final-normed state.
- The layout defaults of ``MuseGlimmerAssistantConfig`` apply to absent keys.
"""

from __future__ import annotations

from speculant.core.problems import Problem

MODEL_TYPE = "muse_glimmer_assistant"
TARGET_MODEL_TYPES = ("muse_glimmer", "muse_glimmer_text")
# on-disk name -> DFlash name
TENSOR_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}

# MuseGlimmerAssistantConfig's class defaults (used when config.json omits a key)
DEFAULTS = dict(hidden_size=6656, intermediate_size=19968, num_hidden_layers=5, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
                sliding_window=2048, hidden_act="silu", block_size=16, mask_token_id=201818,
                target_layer_ids=[1, 13, 25, 37, 49])
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 500000.0}


def is_assistant(raw: dict) -> bool:
    return raw.get("model_type") == MODEL_TYPE


def dflash_raw(raw: dict) -> dict:
    """The assistant's config.json rewritten as a published DFlash config.json."""
    get = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    layers = get["num_hidden_layers"]
    layer_types = raw.get("layer_types") or ["sliding_attention"] * (layers if isinstance(layers, int) else 0)
    window = get["sliding_window"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": MODEL_TYPE,
        **{k: get[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                               "hidden_act")},
        "rope_parameters": raw.get("rope_parameters") or dict(DEFAULT_ROPE),
        "layer_types": layer_types,
        # inclusive |q - k| <= W in transformers is DFlash's exclusive window W + 1
        "sliding_window": window + 1 if isinstance(window, int) else window,
        "is_causal": False,
        "attention_bias": False,
        "block_size": get["block_size"],
        "dflash_config": {k: get[k] for k in ("mask_token_id", "target_layer_ids", "block_size")},
    }


def config_problems(raw: dict) -> list[Problem]:
    """What the assistant layout cannot hold that DFlash would not notice."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        return [Problem("drafter.path (hidden_act)", f"hidden_act {act!r}: the DFlash modules run SiLU MLPs only",
                        "use an assistant with hidden_act silu")]
    return []


def final_feature(cfg) -> int | None:
    """Which ``target_layer_ids`` entry reads the target's last layer (final-normed), if any."""
    last = (cfg.num_target_layers or 0) - 1
    return cfg.target_layer_ids.index(last) if last in cfg.target_layer_ids else None


def disk_names(expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """DFlash's expected tensors under the assistant's on-disk names."""
    to_disk = {v: k for k, v in TENSOR_NAMES.items()}
    return {to_disk.get(name, name): shape for name, shape in expected.items()}


def target_problems(target) -> list[Problem]:
    """The assistant drafts for Muse Glimmer only."""
    model_type = getattr(target, "model_type", None)
    if target is not None and model_type not in TARGET_MODEL_TYPES:
        return [Problem("drafter.path", f"a muse_glimmer_assistant drafts for a Muse Glimmer target, "
                        f"not a {model_type} one", "use the assistant published with your target")]
    return []
