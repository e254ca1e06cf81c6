"""Weight-only quantised linears in the model (``quant/methods.py``, the layers).

A tiny checkpoint's linears are rounded to kvserve's packed layout and
loaded under their canonical names; the oracle is Hugging Face's model
with the same weights dequantised in place ("fake quant"), float32. Act-order
checkpoints get a random input permutation per linear input (shared by the
parts of a packed linear, as GPTQ's are). Also: ignore lists, the errors a
bad layout raises, dummy weights, and LoRA over a quantised base.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvserve.config import ModelConfig
from kvserve.layers.linear import Linear
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM, get_model_class
from kvserve.models.source import resolve_model_config
from kvserve.quant.config import QuantConfig
from kvserve.quant.packing import QuantizedWeight, dequantize, quantize_rtn
from tests.unit.test_models import PagedRunner, hf_logits, prompt, rel_err

RTOL = 1e-4

# (bits, group_size, symmetric, act_order)
SCHEMES = {
    "int8": (8, -1, True, False),
    "int4-g32-asym": (4, 32, False, False),
    "int4-g32-act-order": (4, 32, True, True),
}
LINEAR_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                 "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}


def quantize_checkpoint(
    tensors: dict[str, torch.Tensor], config: QuantConfig, linear_names: set[str], seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(canonical tensors to load, HF tensors with those linears dequantised)."""
    generator = torch.Generator().manual_seed(seed)
    canonical: dict[str, torch.Tensor] = {}
    fake_quant: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if module == name or module not in linear_names or not config.quantizes(module):
            canonical[name] = fake_quant[name] = tensor
            continue
        perm = None
        if config.act_order:
            layer, _, child = module.rpartition(".")
            key = f"{layer}.{LINEAR_INPUTS[child]}"
            perm = perms.setdefault(key, torch.randperm(tensor.shape[1], generator=generator))
        qw = quantize_rtn(tensor if perm is None else tensor[:, perm], config.bits,
                          config.group_size, config.symmetric, scale_dtype=torch.float32)
        qw.perm = perm
        canonical |= {f"{module}.qweight": qw.qweight, f"{module}.scales": qw.scales}
        if qw.zeros is not None:
            canonical[f"{module}.zeros"] = qw.zeros
        if perm is not None:
            canonical[f"{module}.perm"] = perm
        fake_quant[name] = dequantize(qw, original_order=True)
    return canonical, fake_quant


def build(config: ModelConfig) -> CausalLM:
    with torch.device("cpu"):
        return get_model_class(config.architecture)(config).eval()


def load_quantized(
    path: Path, quant: QuantConfig
) -> tuple[CausalLM, ModelConfig, dict[str, torch.Tensor]]:
    """Our quantised model of the checkpoint at ``path``, and the fake-quant HF tensors."""
    config, _ = resolve_model_config(str(path))
    config = dataclasses.replace(config, quantization=quant)
    model = build(config)
    canonical, fake_quant = quantize_checkpoint(
        load_file(path / "model.safetensors"), quant, model.linear_module_names())
    model.load_weights(canonical.items())
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)
    return model, config, fake_quant


def fake_quant_hf(path: Path, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and all("rotary" in m or "lm_head" in m for m in missing)
    return hf


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantised_logits_match_fake_quant_hf(
    variant: str, scheme: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    bits, group_size, symmetric, act_order = SCHEMES[scheme]
    quant = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric,
                        act_order=act_order)
    path = tiny_checkpoint(variant)
    model, config, fake_quant = load_quantized(path, quant)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8
    assert qkv.qweight.shape == (qkv.output_size, qkv.input_size * bits // 8)
    assert (qkv.perm is not None) == act_order
    assert not hasattr(model.lm_head, "qweight")  # lm_head is ignored by default
    hf = fake_quant_hf(path, fake_quant)
    tokens = prompt(24, seed=3, vocab_size=config.vocab_size)
    runner = PagedRunner(model, config)
    logits = torch.cat([runner.step({0: tokens[:17]})[0], runner.step({0: tokens[17:]})[0]])
    expected = hf_logits(hf, tokens)
    assert rel_err(logits, expected) < RTOL
    unquantised = hf_logits(fake_quant_hf(path, load_file(path / "model.safetensors")), tokens)
    assert rel_err(logits, unquantised) > 10 * RTOL  # the rounding is really applied


def test_ignore_list_and_quantised_lm_head(tiny_checkpoint: Callable[[str], Path]) -> None:
    quant = QuantConfig(bits=8, group_size=32, ignore=(r"re:.*layers\.1\.mlp\..*",))
    path = tiny_checkpoint("llama")
    model, config, fake_quant = load_quantized(path, quant)
    assert model.lm_head.qweight.shape == (config.vocab_size, config.hidden_size)
    assert hasattr(model.model.layers[1].mlp.down_proj, "weight")
    assert hasattr(model.model.layers[1].self_attn.o_proj, "qweight")
    hf = fake_quant_hf(path, fake_quant)
    tokens = prompt(12, seed=4, vocab_size=config.vocab_size)
    logits = PagedRunner(model, config).step({0: tokens})[0]
    assert rel_err(logits, hf_logits(hf, tokens)) < RTOL


def test_packed_parts_must_agree_on_quantisation(tiny_checkpoint: Callable[[str], Path]) -> None:
    config, _ = resolve_model_config(str(tiny_checkpoint("llama")))
    config = dataclasses.replace(config, quantization=QuantConfig(
        bits=4, group_size=32, ignore=("model.layers.0.self_attn.k_proj",)))
    with pytest.raises(ValueError, match=r"k_proj.*quantise all of them or none"):
        build(config)


def test_tied_lm_head_cannot_be_quantised(tiny_checkpoint: Callable[[str], Path]) -> None:
    config, _ = resolve_model_config(str(tiny_checkpoint("llama_tied")))
    config = dataclasses.replace(config, quantization=QuantConfig(bits=8, group_size=-1,
                                                                  ignore=()))
    with pytest.raises(ValueError, match="lm_head is tied"):
        build(config)


def test_group_size_must_divide_every_input(tiny_checkpoint: Callable[[str], Path]) -> None:
    config, _ = resolve_model_config(str(tiny_checkpoint("llama")))  # hidden 64, FFN 128
    config = dataclasses.replace(config, quantization=QuantConfig(bits=4, group_size=128))
    with pytest.raises(ValueError, match=r"multiple of the group size 128.*has 64"):
        build(config)


def _loaded_with(
    path: Path, quant: QuantConfig, edit: Callable[[dict[str, torch.Tensor]], None]
) -> None:
    config, _ = resolve_model_config(str(path))
    model = build(dataclasses.replace(config, quantization=quant))
    canonical, _ = quantize_checkpoint(load_file(path / "model.safetensors"), quant,
                                       model.linear_module_names())
    edit(canonical)
    model.load_weights(canonical.items())


def test_bad_quantised_tensors_are_named(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama")
    asym = QuantConfig(bits=4, group_size=32, symmetric=False)
    name = "model.layers.0.mlp.down_proj"

    def wrong_scales(t: dict[str, torch.Tensor]) -> None:
        t[f"{name}.scales"] = t[f"{name}.scales"][:, :1]

    with pytest.raises(ValueError, match=f"'{name}.scales'.*shape"):
        _loaded_with(path, asym, wrong_scales)

    def no_zeros(t: dict[str, torch.Tensor]) -> None:
        del t[f"{name}.zeros"]

    with pytest.raises(ValueError, match=f"lacks 1 tensor.*{name}.zeros"):
        _loaded_with(path, asym, no_zeros)

    def other_perm(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.v_proj.perm"] = torch.randperm(64)

    act_order = QuantConfig(bits=4, group_size=32, act_order=True)
    with pytest.raises(ValueError, match=r"v_proj.perm.*another act-order permutation"):
        _loaded_with(path, act_order, other_perm)


def test_not_a_permutation_is_refused() -> None:
    method_config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=16, hidden_size=32, intermediate_size=32,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=32,
        sliding_windows=(None,),
        quantization=QuantConfig(bits=8, group_size=32, act_order=True))
    model = build(method_config)
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.perm.data.zero_()
    with pytest.raises(ValueError, match="not a permutation"):
        o_proj.quant_method.process_weights_after_loading(o_proj)


def test_dummy_quantised_weights(tiny_checkpoint: Callable[[str], Path]) -> None:
    config, _ = resolve_model_config(str(tiny_checkpoint("llama")))
    quant = QuantConfig(bits=4, group_size=32, act_order=True, ignore=())
    config = dataclasses.replace(config, quantization=quant)
    model = load_model(config, None, "dummy", torch.float32, "cpu", seed=7)
    again = load_model(config, None, "dummy", torch.float32, "cpu", seed=7)
    head = model.lm_head
    assert torch.equal(head.qweight, again.lm_head.qweight)
    assert head.perm is None  # the identity is dropped
    weight = dequantize(QuantizedWeight(head.qweight, head.scales, None, 4, 32))
    assert 0.01 < float(weight.std()) < 0.03  # DUMMY_STD, rounded
    tokens = prompt(8, seed=5, vocab_size=config.vocab_size)
    assert torch.isfinite(PagedRunner(model, config).step({0: tokens})[0]).all()


def test_lora_wraps_a_quantised_base(tiny_checkpoint: Callable[[str], Path],
                                     tmp_path: Path) -> None:
    from kvserve.config import LoRAConfig
    from kvserve.lora.layers import LoRALinear
    from kvserve.lora.manager import LoRAManager

    model, config, _ = load_quantized(tiny_checkpoint("llama"), QuantConfig(bits=8,
                                                                            group_size=-1))
    tokens = prompt(10, seed=6, vocab_size=config.vocab_size)
    before = PagedRunner(model, config).step({0: tokens})[0]
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.device("cpu"))
    wrapped = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(wrapped, LoRALinear) and wrapped.lora_a.dtype == torch.float32
    assert manager.linears
    after = PagedRunner(model, config).step({0: tokens})[0]
    torch.testing.assert_close(after, before)  # no adapter in the batch: the base alone


@pytest.mark.parametrize(("bits", "group_size", "symmetric"),
                         [(4, 32, True), (4, -1, False), (8, -1, True)])
def test_triton_kernels_in_the_layer_match_the_reference(
    bits: int, group_size: int, symmetric: bool
) -> None:
    """Under ``set_triton_ops`` a quantised linear holds the kernels' layout and
    runs ``quant_matmul`` (the interpreter here, float16); switched off again
    it holds packing.py's layout, bit for bit."""
    from kvserve.layers.activation import SiluAndMul
    from kvserve.layers.custom_ops import set_triton_ops
    from kvserve.layers.linear import MergedColumnLinear
    from kvserve.quant.methods import WeightOnlyLinearMethod

    method = WeightOnlyLinearMethod(QuantConfig(bits=bits, group_size=group_size,
                                                symmetric=symmetric))
    generator = torch.Generator().manual_seed(bits)
    with torch.device("cpu"):
        gate_up = MergedColumnLinear(64, [96, 96], quant_method=method).half()
        down = Linear(96, 64, bias=True, quant_method=method).half()
    for layer in (gate_up, down):
        layer.quant_method.init_dummy(layer, generator, std=0.05)
        if layer.bias is not None:
            layer.bias.data.normal_(0, 0.1, generator=generator)
    before = {name: p.clone() for name, p in [*gate_up.named_parameters(),
                                              *down.named_parameters()]}
    x = torch.randn(5, 64, generator=generator).half()
    act = SiluAndMul()
    reference = [gate_up(x), gate_up(x[:1]), down.forward_gated(gate_up(x[:1]), act)]
    set_triton_ops(torch.nn.ModuleList([gate_up, down]), True)
    assert gate_up.scales.shape == (1 if group_size == -1 else 2, 192)  # group-major
    kernels = [gate_up(x), gate_up(x[:1]), down.forward_gated(gate_up(x[:1]), act)]
    for ours, expected in zip(kernels, reference, strict=True):
        torch.testing.assert_close(ours, expected, rtol=2e-3, atol=2e-3)
    set_triton_ops(torch.nn.ModuleList([gate_up, down]), False)
    after = dict([*gate_up.named_parameters(), *down.named_parameters()])
    assert all(torch.equal(after[name], p) for name, p in before.items())
