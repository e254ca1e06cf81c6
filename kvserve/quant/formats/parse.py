"""From a checkpoint's ``quantization_config`` (or ``--quantization``) to a ``QuantConfig``.

Reads the JSON its producer wrote, as plain data (no torch, no files except
``read_quantize_config``):

- GPTQ (GPTQModel, AutoGPTQ, optimum): ``quant_method: gptq`` in
  ``config.json``, or AutoGPTQ's separate ``quantize_config.json``;
- AWQ (AutoAWQ, transformers' ``AwqConfig``): ``quant_method: awq``,
  ``version: gemm`` only;
- compressed-tensors (llm-compressor): ``quant_method: compressed-tensors``,
  ``format: pack-quantized``, weight-only int4 / int8 schemes; ``format:
  float-quantized``, FP8 W8A8 (``FP8_DYNAMIC``, ``FP8``);
- HF's FP8 (``quant_method: fp8``, per-tensor or per-channel ``weight_scale``;
  not block-wise).

FP8 and INT8 activations are quantised per token as the model runs whatever
the checkpoint says (a static ``input_scale`` is read and dropped).

Every value kvserve cannot serve is a ``ValueError`` naming the field as
``quantization_config.<path>``, its value and what is allowed. Which linears
each producer leaves in 16 bits becomes ``QuantConfig.ignore`` (full names,
or ``re:`` patterns matched against the whole HF module name). The tensors
themselves are converted by the format modules beside this one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvserve.quant.config import GROUP_SIZES, QUANTIZE_AT_LOAD, QuantConfig, quantize_at_load

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
# every value of --quantization / LLM(quantization=); "fp8" also names HF's fp8 checkpoints
QUANTIZATION_CHOICES = CHECKPOINT_METHODS + tuple(QUANTIZE_AT_LOAD)
_QUANT_METHODS = (*CHECKPOINT_METHODS, "fp8")

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
AWQ_GROUP_SIZES = (32, 64, 128)
CT_FORMATS = ("pack-quantized", "float-quantized", "int-quantized")
# compressed-tensors W8A8 formats: their quantisation type, and kvserve's weight type
CT_W8A8_FORMATS = {"float-quantized": ("float", "fp8"), "int-quantized": ("int", "w8a8-int8")}
_FIELD = "quantization_config"


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_FIELD}.{field}={value!r} is not supported; allowed: {allowed}")


def _choice(
    qc: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any, path: str = ""
) -> Any:
    """``qc[key]`` (``default`` if absent or null), which must be one of ``allowed``;
    errors name the field as ``path.key``."""
    value = qc.get(key, default)
    if value is None:
        value = default
    if value not in allowed or isinstance(value, bool):
        raise _bad(f"{path}.{key}" if path else key, value, ", ".join(map(str, allowed)))
    return value


def _flag(qc: dict[str, Any], field: str, default: bool) -> bool:
    value = qc.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(field, value, "true, false")
    return value


def _method_of(qc: dict[str, Any]) -> str:
    method = qc.get("quant_method")
    if not isinstance(method, str) or method.lower() not in _QUANT_METHODS:
        raise _bad("quant_method", method, ", ".join(_QUANT_METHODS))
    return method.lower()


def method_of(config: QuantConfig) -> str:
    """The ``quant_method`` a checkpoint's config came from (``gptq`` for both GPTQ formats)."""
    if config.checkpoint_format is None:
        return config.name
    return "gptq" if config.checkpoint_format in GPTQ_FORMATS else config.checkpoint_format


def read_quantize_config(model_dir: Path) -> dict[str, Any] | None:
    """AutoGPTQ's / GPTQModel's ``quantize_config.json`` beside ``config.json``, if any."""
    path = model_dir / "quantize_config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} must hold a JSON object")
    return data


def parse_quantization_config(
    hf_config: dict[str, Any], quantize_config: dict[str, Any] | None = None
) -> QuantConfig | None:
    """The ``QuantConfig`` of a checkpoint: ``config.json``'s
    ``quantization_config``, else the separate ``quantize_config.json`` (read
    as GPTQ unless it names another method); None for a 16-bit checkpoint."""
    qc = hf_config.get("quantization_config")
    if qc is None and quantize_config is not None:
        qc = {"quant_method": "gptq", **quantize_config}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{_FIELD} must be a JSON object; got {type(qc).__name__}")
    method = _method_of(qc)
    if method == "gptq":
        return parse_gptq(qc)
    if method == "awq":
        return parse_awq(qc)
    if method == "fp8":
        return parse_hf_fp8(qc)
    return parse_compressed_tensors(qc)


def resolve_quantization(
    hf_config: dict[str, Any],
    requested: str | None,
    source: str,
    quantize_config: dict[str, Any] | None = None,
    quantize_lm_head: bool = False,
) -> QuantConfig | None:
    """The quantisation to serve a checkpoint with.

    ``requested`` is ``--quantization`` / ``LLM(quantization=)``: None takes
    what the checkpoint says (None if it is 16-bit); a checkpoint method must
    match the checkpoint's own; ``int8`` / ``int4[-gN]`` round a 16-bit
    checkpoint at load (the LM head too with ``quantize_lm_head``).
    ``source`` (the config file or preset) prefixes every error.
    """
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={requested!r} is not supported; allowed: "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    try:
        checkpoint = parse_quantization_config(hf_config, quantize_config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    if requested in ("fp8", "w8a8-int8") and checkpoint is not None \
            and checkpoint.weight_type == requested:
        return checkpoint  # a W8A8 checkpoint of that type served as it is
    if requested is None or requested in CHECKPOINT_METHODS:
        if requested is not None and checkpoint is None:
            raise ValueError(
                f"quantization={requested!r}, but {source} has no quantization_config (a 16-bit "
                f"checkpoint); to quantise it at load pass one of {', '.join(QUANTIZE_AT_LOAD)}")
        if requested is not None and checkpoint is not None and method_of(checkpoint) != requested:
            raise ValueError(
                f"quantization={requested!r} contradicts {source}, whose quantization_config "
                f"says quant_method={method_of(checkpoint)!r}; leave quantization unset or "
                f"pass {method_of(checkpoint)!r}")
        if quantize_lm_head and checkpoint is not None:
            raise ValueError(f"quantize_lm_head=True needs a 16-bit checkpoint; {source} is "
                             f"already quantised ({method_of(checkpoint)})")
        return checkpoint
    if checkpoint is not None:
        raise ValueError(
            f"quantization={requested!r} quantises a 16-bit checkpoint at load, but {source} "
            f"is already quantised (quant_method={method_of(checkpoint)!r}); leave "
            f"quantization unset or pass {method_of(checkpoint)!r}")
    return quantize_at_load(requested, quantize_lm_head)


# --- GPTQ ------------------------------------------------------------------


def parse_gptq(qc: dict[str, Any]) -> QuantConfig:
    """GPTQ as GPTQModel, AutoGPTQ and optimum write it: ``bits``,
    ``group_size``, ``desc_act``, ``sym``, ``checkpoint_format`` (or
    GPTQModel's ``format``), ``pack_dtype``, ``lm_head``, GPTQModel's
    ``dynamic`` exclusions and optimum's ``modules_in_block_to_quantize``."""
    bits = _choice(qc, "bits", (4, 8), None)
    group_size = _choice(qc, "group_size", GROUP_SIZES, 128)
    field = "checkpoint_format" if qc.get("checkpoint_format") is not None else "format"
    checkpoint_format = _choice(qc, field, GPTQ_FORMATS, "gptq")
    _choice(qc, "pack_dtype", ("int32",), "int32")
    ignore: list[str] = [] if _flag(qc, "lm_head", False) else ["lm_head"]
    ignore += _gptq_dynamic_ignore(qc, bits, group_size)
    ignore += _gptq_block_modules_ignore(qc)
    return QuantConfig(bits=bits, group_size=group_size, symmetric=_flag(qc, "sym", True),
                       checkpoint_format=checkpoint_format, act_order=_flag(qc, "desc_act", False),
                       ignore=tuple(ignore))


def _gptq_dynamic_ignore(qc: dict[str, Any], bits: int, group_size: int) -> list[str]:
    """GPTQModel's ``dynamic``: ordered ``{pattern: overrides}``, the first
    pattern that ``re.match``-es a module decides; ``-:`` skips the module.
    Skips become ignore patterns (an earlier positive rule shields a module
    from a later skip); a positive rule that changes bits, group size, sym or
    desc_act would need a second layout and is refused."""
    dynamic = qc.get("dynamic")
    if dynamic is None:
        return []
    if not isinstance(dynamic, dict):
        raise _bad("dynamic", dynamic, "an object of {pattern: overrides}")
    base = {"bits": bits, "group_size": group_size, "sym": qc.get("sym", True),
            "desc_act": qc.get("desc_act", False)}
    ignore: list[str] = []
    earlier_positive: list[str] = []
    for pattern, overrides in dynamic.items():
        regex = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        try:
            re.compile(regex)
        except re.error as e:
            raise _bad(f"dynamic[{pattern!r}]", pattern, f"a valid regular expression ({e})") from e
        if not isinstance(overrides, dict | None):
            raise _bad(f"dynamic[{pattern!r}]", overrides, "an object of overrides")
        if pattern.startswith("-:"):
            shield = "".join(f"(?!(?:{p}))" for p in earlier_positive)
            ignore.append(f"re:{shield}(?:{regex}).*")
            continue
        changed = {k: v for k, v in (overrides or {}).items() if k in base and v != base[k]}
        if changed:
            raise _bad(f"dynamic[{pattern!r}]", overrides,
                       f"overrides equal to the checkpoint's own {base} (one layout per model)")
        earlier_positive.append(regex)
    return ignore


def _gptq_block_modules_ignore(qc: dict[str, Any]) -> list[str]:
    """optimum's ``modules_in_block_to_quantize`` (lists of names inside a
    decoder layer): every other linear stays 16-bit."""
    blocks = qc.get("modules_in_block_to_quantize")
    if blocks is None:
        return []
    groups = blocks if isinstance(blocks, list) else []
    names = [n for group in groups for n in (group if isinstance(group, list) else [group])]
    if not names or not all(isinstance(n, str) for n in names):
        raise _bad("modules_in_block_to_quantize", blocks, "null or lists of module names")
    kept = "|".join(re.escape(n) for n in names)
    return [f"re:(?!.*\\.(?:{kept})$).*"]


# --- AWQ -------------------------------------------------------------------


def parse_awq(qc: dict[str, Any]) -> QuantConfig:
    """AWQ as AutoAWQ writes it (``w_bit`` / ``q_group_size`` in its own
    ``quant_config``, ``bits`` / ``group_size`` in transformers'
    ``AwqConfig``): GEMM packing, 4 bits, zero points, and
    ``modules_to_not_convert`` (substrings of module names)."""
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() not in AWQ_VERSIONS:
        raise _bad("version", version, ", ".join(AWQ_VERSIONS))
    bits_field = "bits" if "bits" in qc else "w_bit"
    bits = _choice(qc, bits_field, (4,), 4)
    group_field = "group_size" if "group_size" in qc else "q_group_size"
    group_size = _choice(qc, group_field, AWQ_GROUP_SIZES, 128)
    if not _flag(qc, "zero_point", True):
        raise _bad("zero_point", False,
                   "true (AutoAWQ's GEMM checkpoints always carry zero points)")
    skipped = qc.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(n, str) for n in skipped):
        raise _bad("modules_to_not_convert", skipped, "null or a list of module names")
    ignore = ["lm_head"] + [f"re:.*{re.escape(name)}.*" for name in skipped]
    return QuantConfig(bits=bits, group_size=group_size, symmetric=False,
                       checkpoint_format="awq", ignore=tuple(ignore))


# --- compressed-tensors ----------------------------------------------------


def parse_compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    """compressed-tensors as llm-compressor writes it: ``format``
    ``pack-quantized`` (W4A16 and W8A16 alike), one weight-only scheme over
    ``config_groups`` (int, 4 or 8 bits, group or channel strategy), and
    ``ignore`` (exact names or ``re:`` prefix matches)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _bad("config_groups", groups, "an object of one or more quantisation schemes")
    top_format = qc.get("format")
    kv_scheme = qc.get("kv_cache_scheme")
    if kv_scheme is not None and (not isinstance(kv_scheme, dict) or (
            kv_scheme.get("type"), kv_scheme.get("num_bits")) != ("float", 8)):
        raise _bad("kv_cache_scheme", kv_scheme,
                   "null or an 8-bit float scheme (its k_scale / v_scale serve "
                   "--kv-cache-dtype fp8_e4m3)")
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise _bad(field, qc[field], "null or {} (sparse or rotated weights are not supported)")
    schemes: list[tuple[str, QuantConfig]] = []
    targets: list[str] = []
    for name, scheme in groups.items():
        if not isinstance(scheme, dict):
            raise _bad(f"config_groups.{name}", scheme, "a scheme object")
        group_format = scheme.get("format") or top_format
        if group_format not in CT_FORMATS:
            field = f"config_groups.{name}.format" if scheme.get("format") else "format"
            raise _bad(field, group_format, ", ".join(CT_FORMATS))
        path = f"config_groups.{name}"
        schemes.append((name, _ct_w8a8_scheme(scheme, path, group_format)
                        if group_format in CT_W8A8_FORMATS else _ct_scheme(scheme, path)))
        scheme_targets = scheme.get("targets")
        if not isinstance(scheme_targets, list) or not scheme_targets:
            raise _bad(f"config_groups.{name}.targets", scheme_targets, "a list of targets")
        targets += scheme_targets
    first_name, first = schemes[0]
    for name, other in schemes[1:]:
        if other != first:
            raise _bad(f"config_groups.{name}.weights", groups[name].get("weights"),
                       f"the same weight scheme as config_groups.{first_name} (one layout per "
                       "model)")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _bad("ignore", ignore, "a list of module names or 're:' patterns")
    patterns = [_ct_pattern(i) for i in ignore] + _ct_targets_ignore(targets)
    return QuantConfig(bits=first.bits, group_size=first.group_size, symmetric=first.symmetric,
                       checkpoint_format="compressed-tensors", act_order=first.act_order,
                       ignore=tuple(patterns), weight_type=first.weight_type)


def _ct_w8a8_scheme(scheme: dict[str, Any], path: str, group_format: str) -> QuantConfig:
    """A ``float-quantized`` (e4m3) or ``int-quantized`` (int8) entry: symmetric
    8-bit weights per channel or per tensor, 8-bit activations of the same
    type per token (dynamic) or per tensor (static)."""
    quant_type, weight_type = CT_W8A8_FORMATS[group_format]
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise _bad(f"{path}.weights", weights, "a weight quantisation object")
    w = f"{path}.weights"
    _choice(weights, "type", (quant_type,), None, w)
    _choice(weights, "num_bits", (8,), None, w)
    _choice(weights, "strategy", ("channel", "tensor"), None, w)
    if weights.get("symmetric", True) is not True:
        raise _bad(f"{w}.symmetric", weights.get("symmetric"), "true")
    if weights.get("block_structure") is not None:
        raise _bad(f"{w}.block_structure", weights.get("block_structure"), "null")
    acts = scheme.get("input_activations")
    if acts is not None:
        a = f"{path}.input_activations"
        if not isinstance(acts, dict):
            raise _bad(a, acts, "null or an activation quantisation object")
        _choice(acts, "type", (quant_type,), None, a)
        _choice(acts, "num_bits", (8,), None, a)
        _choice(acts, "strategy", ("token", "tensor"), None, a)
        if acts.get("symmetric", True) is not True:
            raise _bad(f"{a}.symmetric", acts.get("symmetric"), "true")
    if scheme.get("output_activations") is not None:
        raise _bad(f"{path}.output_activations", scheme["output_activations"], "null")
    return QuantConfig(bits=8, group_size=-1, checkpoint_format="compressed-tensors",
                       weight_type=weight_type)


# --- HF fp8 -----------------------------------------------------------------


def parse_hf_fp8(qc: dict[str, Any]) -> QuantConfig:
    """transformers' ``FP8`` config: e4m3 ``weight`` with its ``weight_scale``
    (one per tensor or per output channel), ``activation_scheme`` dynamic or
    static, ``modules_to_not_convert``; block-wise scales are refused."""
    _choice(qc, "activation_scheme", ("dynamic", "static"), "dynamic")
    if qc.get("weight_block_size") is not None:
        raise _bad("weight_block_size", qc["weight_block_size"],
                   "null (block-wise FP8 scales are not supported)")
    skipped = qc.get("modules_to_not_convert") or []
    if not isinstance(skipped, list) or not all(isinstance(n, str) for n in skipped):
        raise _bad("modules_to_not_convert", skipped, "null or a list of module names")
    return QuantConfig(bits=8, group_size=-1, checkpoint_format="fp8", weight_type="fp8",
                       ignore=("lm_head", *skipped))


def _ct_scheme(scheme: dict[str, Any], path: str) -> QuantConfig:
    """One ``config_groups`` entry -> its weight layout; activations must be 16-bit."""
    for field in ("input_activations", "output_activations"):
        if scheme.get(field) is not None:
            raise ValueError(
                f"{_FIELD}.{path}.{field}={scheme[field]!r} is not supported with format "
                "pack-quantized (allowed: null, weight-only W4A16 / W8A16; W8A8 comes as "
                "format int-quantized or float-quantized)")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise _bad(f"{path}.weights", weights, "a weight quantisation object")
    w = f"{path}.weights"
    bits = _choice(weights, "num_bits", (4, 8), 8, w)
    if weights.get("type", "int") != "int":
        raise _bad(f"{w}.type", weights.get("type"), "int")
    if weights.get("dynamic", False) not in (False, None):
        raise _bad(f"{w}.dynamic", weights.get("dynamic"), "false")
    if weights.get("block_structure") is not None:
        raise _bad(f"{w}.block_structure", weights.get("block_structure"), "null")
    strategy = weights.get("strategy")
    if strategy == "channel":
        group_size = -1
    elif strategy == "group":
        group_size = _choice(weights, "group_size", GROUP_SIZES[:-1], None, w)
    else:
        raise _bad(f"{w}.strategy", strategy, "group, channel")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise _bad(f"{w}.symmetric", symmetric, "true, false")
    actorder = weights.get("actorder")
    # "weight" / "static" reorder only during calibration: groups stay contiguous
    if actorder not in (None, False, "weight", "static", "group", "dynamic", True):
        raise _bad(f"{w}.actorder", actorder, "null, weight, static, group")
    return QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric,
                       checkpoint_format="compressed-tensors",
                       act_order=actorder in ("group", "dynamic", True))


def _ct_pattern(name: str) -> str:
    """compressed-tensors matches ``re:`` with ``re.match`` (a prefix);
    QuantConfig matches the whole name, so the pattern gains a ``.*``."""
    return f"re:(?:{name[3:]}).*" if name.startswith("re:") else name


def _ct_targets_ignore(targets: list[str]) -> list[str]:
    """Targets other than every ``Linear``: linears matching none stay 16-bit."""
    if "Linear" in targets:
        return []
    regexes = []
    for target in targets:
        if target.startswith("re:"):
            regexes.append(f"(?:{target[3:]}).*")
        elif "." in target or not target[:1].isupper():
            regexes.append(re.escape(target))
        else:  # a layer class name
            raise _bad("config_groups.*.targets", target,
                       "Linear, module names or 're:' patterns (other layer classes are not "
                       "supported)")
    return [f"re:(?!(?:{'|'.join(regexes)})\\Z).*"]
