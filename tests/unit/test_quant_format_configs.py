"""Reading producers' ``quantization_config`` into ``QuantConfig``
(``quant/formats/parse.py``), and ``--quantization`` against the checkpoint.

The good configs are the ones the committed fixtures' producers wrote
(``tests/fixtures/quant/*/config.json``) and the spellings other releases
use; every unsupported value must be a ValueError naming the field and its
value.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve.quant.config import QuantConfig
from kvserve.quant.formats import (
    QUANTIZATION_CHOICES,
    parse_quantization_config,
    read_quantize_config,
    resolve_quantization,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quant"

# fixture -> (bits, group_size, symmetric, checkpoint_format, act_order)
EXPECTED = {
    "llmc-gptq-w4a16-g128": (4, 128, True, "compressed-tensors", False),
    "llmc-gptq-w4a16-asym-g32-actorder": (4, 32, False, "compressed-tensors", False),
    "llmc-awq-w4a16-asym-g128": (4, 128, False, "compressed-tensors", False),
    "llmc-gptq-w8a16-channel": (8, -1, True, "compressed-tensors", False),
    "llmc-w8a8-int8-smoothquant": (8, -1, True, "compressed-tensors", False),
    "llmc06-gptq-w4a16-g32-actorder-group": (4, 32, True, "compressed-tensors", True),
    "gptqmodel-w4-g32-desc-act-asym": (4, 32, False, "gptq", True),
    "gptqmodel-w4-g32-sym": (4, 32, True, "gptq", False),
    "gptqmodel-w4-g32-asym-v2": (4, 32, False, "gptq_v2", False),
    "autoawq-gemm-w4-g64": (4, 64, False, "awq", False),
}


def hf(qc: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": qc}


def gptq(**overrides: Any) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq", **overrides}


def awq(**overrides: Any) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None, **overrides}


def ct(weights: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    scheme = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": 128, "actorder": None, "dynamic": False,
                          **(weights or {})}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"],
            "kv_cache_scheme": None, **overrides}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_fixture_configs_parse(fixture: str) -> None:
    hf_config = json.loads((FIXTURES / fixture / "config.json").read_text())
    config = parse_quantization_config(hf_config)
    assert config is not None
    got = (config.bits, config.group_size, config.symmetric, config.checkpoint_format,
           config.act_order)
    assert got == EXPECTED[fixture]
    assert not config.quantizes("lm_head")
    assert config.quantizes("model.layers.0.self_attn.q_proj")


def test_unquantised_checkpoint_has_no_config() -> None:
    assert parse_quantization_config({"architectures": ["LlamaForCausalLM"]}) is None


def test_gptq_variants() -> None:
    config = parse_quantization_config(hf(gptq(bits=8, group_size=-1, desc_act=True,
                                               sym=False, checkpoint_format="gptq_v2")))
    assert config == QuantConfig(bits=8, group_size=-1, symmetric=False,
                                 checkpoint_format="gptq_v2", act_order=True)
    # GPTQModel's "format" when "checkpoint_format" is absent; lm_head quantised
    config = parse_quantization_config(hf({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                           "format": "gptq_v2", "lm_head": True}))
    assert config is not None and config.checkpoint_format == "gptq_v2"
    assert config.quantizes("lm_head") and config.symmetric and not config.act_order


def test_autogptq_quantize_config_json(tmp_path: Path) -> None:
    (tmp_path / "quantize_config.json").write_text(json.dumps(
        {"bits": 4, "group_size": 64, "desc_act": True, "sym": True, "static_groups": False,
         "true_sequential": True, "damp_percent": 0.01, "model_file_base_name": "model"}))
    separate = read_quantize_config(tmp_path)
    config = parse_quantization_config({"architectures": ["LlamaForCausalLM"]}, separate)
    assert config == QuantConfig(bits=4, group_size=64, checkpoint_format="gptq", act_order=True)
    assert read_quantize_config(tmp_path / "missing") is None
    (tmp_path / "quantize_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"quantize_config.json is not valid JSON"):
        read_quantize_config(tmp_path)


def test_gptqmodel_dynamic_skips_become_ignore_patterns() -> None:
    config = parse_quantization_config(hf(gptq(dynamic={
        r"+:.*\.0\.mlp\.down_proj": {"bits": 4},  # same as the base: allowed, shields
        r"-:.*\.mlp\.down_proj": {},
        r"-:model\.layers\.1\.self_attn": {},
    })))
    assert config is not None
    assert config.quantizes("model.layers.0.mlp.down_proj")  # the earlier positive rule wins
    assert not config.quantizes("model.layers.1.mlp.down_proj")
    assert not config.quantizes("model.layers.1.self_attn.q_proj")  # re.match: a prefix
    assert config.quantizes("model.layers.0.self_attn.q_proj")
    assert not config.quantizes("lm_head")


def test_optimum_modules_in_block_to_quantize() -> None:
    config = parse_quantization_config(hf(gptq(
        modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj"], ["mlp.up_proj"]])))
    assert config is not None
    assert config.quantizes("model.layers.3.self_attn.k_proj")
    assert config.quantizes("model.layers.3.mlp.up_proj")
    assert not config.quantizes("model.layers.3.self_attn.v_proj")
    assert not config.quantizes("model.layers.3.mlp.down_proj")


def test_awq_spellings_and_skipped_modules() -> None:
    # AutoAWQ's own quant_config spelling
    config = parse_quantization_config(hf({"quant_method": "awq", "w_bit": 4,
                                           "q_group_size": 64, "zero_point": True,
                                           "version": "GEMM"}))
    assert config == QuantConfig(bits=4, group_size=64, symmetric=False, checkpoint_format="awq")
    config = parse_quantization_config(hf(awq(modules_to_not_convert=["mlp.gate", "visual"])))
    assert config is not None
    assert not config.quantizes("model.layers.0.mlp.gate_proj")  # AutoAWQ: substring
    assert not config.quantizes("visual.blocks.0.attn.qkv")
    assert config.quantizes("model.layers.0.mlp.up_proj")


def test_compressed_tensors_ignore_and_targets() -> None:
    config = parse_quantization_config(hf(ct(ignore=["lm_head", "re:.*layers\\.1\\.mlp"])))
    assert config is not None
    assert not config.quantizes("model.layers.1.mlp.down_proj")  # re.match: a prefix
    assert config.quantizes("model.layers.0.mlp.down_proj")
    targets = ct()
    targets["config_groups"]["group_0"]["targets"] = ["re:.*self_attn\\..*_proj$"]
    config = parse_quantization_config(hf(targets))
    assert config is not None
    assert config.quantizes("model.layers.0.self_attn.o_proj")
    assert not config.quantizes("model.layers.0.mlp.up_proj")


def test_compressed_tensors_channel_actorder_and_groups() -> None:
    config = parse_quantization_config(hf(ct({"num_bits": 8, "strategy": "channel",
                                              "group_size": None, "actorder": "static"})))
    assert config == QuantConfig(bits=8, group_size=-1, checkpoint_format="compressed-tensors")
    config = parse_quantization_config(hf(ct({"actorder": "group", "symmetric": False})))
    assert config is not None and config.act_order and not config.symmetric
    two = ct()
    two["config_groups"]["group_1"] = {**two["config_groups"]["group_0"], "targets": ["Linear"]}
    assert parse_quantization_config(hf(two)) == parse_quantization_config(hf(ct()))


BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method='bitsandbytes'"),
    ({"bits": 4}, "quantization_config.quant_method=None"),
    (gptq(bits=3), "quantization_config.bits=3 is not supported; allowed: 4, 8"),
    (gptq(bits=None), "quantization_config.bits=None"),
    (gptq(bits=True), "quantization_config.bits=True"),
    (gptq(group_size=256), "quantization_config.group_size=256 is not supported"),
    (gptq(checkpoint_format="marlin"),
     "quantization_config.checkpoint_format='marlin'.*gptq, gptq_v2"),
    (gptq(checkpoint_format=None, format="bitblas"), "quantization_config.format='bitblas'"),
    (gptq(pack_dtype="int16"), "quantization_config.pack_dtype='int16'.*allowed: int32"),
    (gptq(desc_act="yes"), "quantization_config.desc_act='yes'.*true, false"),
    (gptq(sym=1), "quantization_config.sym=1"),
    (gptq(dynamic={r"+:.*down_proj": {"bits": 8}}),
     r"quantization_config.dynamic\['\+:.*down_proj'\]"),
    (gptq(dynamic={"-:(": {}}), "a valid regular expression"),
    (gptq(dynamic=["x"]), "quantization_config.dynamic="),
    (gptq(modules_in_block_to_quantize=[[1]]), "quantization_config.modules_in_block_to_quantize"),
    (gptq(modules_in_block_to_quantize="mlp"), "quantization_config.modules_in_block_to_quantize"),
    (gptq(dynamic={"-:x": [1]}), r"quantization_config.dynamic\['-:x'\]=\[1\].*an object"),
    (awq(version="gemv"), "quantization_config.version='gemv' is not supported; allowed: gemm"),
    (awq(version="exllama"), "quantization_config.version='exllama'"),
    (awq(bits=8), "quantization_config.bits=8.*allowed: 4"),
    (awq(group_size=-1), "quantization_config.group_size=-1.*allowed: 32, 64, 128"),
    (awq(zero_point=False), "quantization_config.zero_point=False"),
    (awq(modules_to_not_convert="lm_head"), "quantization_config.modules_to_not_convert"),
    (ct(format="naive-quantized"), "quantization_config.format='naive-quantized'.*pack-quantized"),
    # an FP8 format over int weights
    (ct(format="float-quantized"), r"group_0\.weights\.type='int' is not supported.*float"),
    (ct(config_groups={}), "quantization_config.config_groups"),
    (ct(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme"),
    (ct(transform_config={"config_groups": {"u": {}}}), "quantization_config.transform_config"),
    (ct(sparsity_config={"format": "sparse-24-bitmask"}), "quantization_config.sparsity_config"),
    (ct(ignore="lm_head"), "quantization_config.ignore='lm_head'"),
    (ct({"num_bits": 2}), "quantization_config.config_groups.group_0.weights.num_bits=2"),
    (ct({"type": "float"}), "quantization_config.config_groups.group_0.weights.type='float'"),
    (ct({"strategy": "tensor"}), "weights.strategy='tensor'.*allowed: group, channel"),
    (ct({"group_size": 16}), "weights.group_size=16.*allowed: 32, 64, 128"),
    (ct({"dynamic": True}), "weights.dynamic=True"),
    (ct({"block_structure": [128, 128]}), "weights.block_structure"),
    (ct({"actorder": "sideways"}), "weights.actorder='sideways'"),
    (ct({"symmetric": "no"}), "weights.symmetric='no'"),
]


@pytest.mark.parametrize(("qc", "message"), BAD_CONFIGS)
def test_bad_configs_name_field_and_value(qc: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(hf(qc))


def test_activation_quantisation_needs_a_w8a8_format() -> None:
    w8a8 = ct({"num_bits": 8, "strategy": "channel"})
    w8a8["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    with pytest.raises(ValueError, match=re.escape(
            "config_groups.group_0.input_activations=") + ".*format pack-quantized.*"
            "int-quantized"):
        parse_quantization_config(hf(w8a8))


def test_int_quantized_is_int8_w8a8() -> None:
    w8a8 = ct({"num_bits": 8, "strategy": "channel"}, format="int-quantized")
    w8a8["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    config = parse_quantization_config(hf(w8a8))
    assert config is not None
    assert (config.weight_type, config.name, config.bits, config.group_size) == (
        "w8a8-int8", "w8a8-int8", 8, -1)
    assert resolve_quantization(hf(w8a8), "w8a8-int8", "cfg") == config
    w8a8["config_groups"]["group_0"]["input_activations"]["symmetric"] = False
    with pytest.raises(ValueError, match=r"input_activations\.symmetric=False"):
        parse_quantization_config(hf(w8a8))
    w8a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(ValueError, match=r"input_activations\.type='float'.*allowed: int"):
        parse_quantization_config(hf(w8a8))


def test_mixed_schemes_and_layer_class_targets_are_refused() -> None:
    mixed = ct()
    mixed["config_groups"]["group_1"] = {
        "targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "int",
                                               "strategy": "channel", "symmetric": True}}
    with pytest.raises(ValueError, match=r"config_groups.group_1.weights.*one layout per model"):
        parse_quantization_config(hf(mixed))
    classes = ct()
    classes["config_groups"]["group_0"]["targets"] = ["LlamaAttention"]
    with pytest.raises(ValueError, match="targets='LlamaAttention'"):
        parse_quantization_config(hf(classes))


def test_quantization_config_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="quantization_config must be a JSON object"):
        parse_quantization_config({"quantization_config": "gptq"})


def test_resolve_takes_the_checkpoints_own_config() -> None:
    assert resolve_quantization(hf(gptq()), None, "cfg") == parse_quantization_config(hf(gptq()))
    assert resolve_quantization(hf(gptq()), "gptq", "cfg") is not None
    assert resolve_quantization(hf(awq()), "awq", "cfg") is not None
    assert resolve_quantization(hf(ct()), "compressed-tensors", "cfg") is not None
    assert resolve_quantization({"architectures": ["LlamaForCausalLM"]}, None, "cfg") is None


@pytest.mark.parametrize(("requested", "expected"), [
    ("int8", (8, -1)), ("int4", (4, 128)), ("int4-g32", (4, 32)), ("int4-g64", (4, 64)),
    ("int4-g128", (4, 128)),
])
def test_resolve_quantises_a_16_bit_checkpoint_at_load(
    requested: str, expected: tuple[int, int]
) -> None:
    config = resolve_quantization({"architectures": ["LlamaForCausalLM"]}, requested, "cfg")
    assert config is not None and config.checkpoint_format is None and config.symmetric
    assert (config.bits, config.group_size) == expected
    assert not config.quantizes("lm_head")
    with_head = resolve_quantization({}, requested, "cfg", quantize_lm_head=True)
    assert with_head is not None and with_head.quantizes("lm_head")


def test_resolve_errors_name_both_sides() -> None:
    with pytest.raises(ValueError, match=r"quantization='awq' contradicts cfg.json, whose "
                                         r"quantization_config says quant_method='gptq'"):
        resolve_quantization(hf(gptq()), "awq", "cfg.json")
    with pytest.raises(ValueError,
                       match=r"quantization='gptq' contradicts .* 'compressed-tensors'"):
        resolve_quantization(hf(ct()), "gptq", "cfg.json")
    with pytest.raises(ValueError, match=r"quantization='int4' quantises a 16-bit checkpoint at "
                                         r"load, but cfg.json is already quantised"):
        resolve_quantization(hf(awq()), "int4", "cfg.json")
    with pytest.raises(ValueError, match=r"quantization='gptq', but cfg.json has no "
                                         r"quantization_config"):
        resolve_quantization({}, "gptq", "cfg.json")
    with pytest.raises(ValueError, match="quantization='fp4' is not supported; allowed: gptq, "
                                         "awq, compressed-tensors, int8, int4"):
        resolve_quantization({}, "fp4", "cfg.json")
    with pytest.raises(ValueError, match=r"^cfg.json: quantization_config.bits=3"):
        resolve_quantization(hf(gptq(bits=3)), None, "cfg.json")
    with pytest.raises(ValueError, match="quantize_lm_head=True needs a 16-bit checkpoint"):
        resolve_quantization(hf(gptq()), None, "cfg.json", quantize_lm_head=True)


def test_choices_constant_and_no_torch_import() -> None:
    assert QUANTIZATION_CHOICES == ("gptq", "awq", "compressed-tensors", "int8", "int4",
                                    "int4-g32", "int4-g64", "int4-g128", "fp8", "w8a8-int8")
    code = ("import sys, kvserve.quant.formats; "
            "assert 'torch' not in sys.modules, 'quant.formats imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
