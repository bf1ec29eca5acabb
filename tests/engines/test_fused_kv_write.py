"""The decode step's rotary + key/value cache write as one compiled function (`slots.rotate_write_kv_fn`,
`--disable-fused-kv-write` turns it off): on CPU, compiled with inductor's C++ backend as `SlotDecoder.__init__`
compiles it on CUDA, the decode logits and every cache equal the unfused step's (compiled-free rotary, two
`index_put_`) after several steps with rows at different positions, for Qwen2, Qwen3 (q/k norms) and Llama; the
generated code scatters into the cache buffers themselves (no cache-sized buffer, no copy back, one kernel); the
flag reaches the scheduler and /server_info."""

import re

import pytest
import torch
from slot_models import build
from torch._inductor.utils import run_and_get_code

from slime.compiled import compiled
from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.fusion import ProjectionFusion
from slime.engines.builtin.slots import SlotDecoder, rotate_write_kv_fn

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [9], [12, 13, 14, 15, 16, 17]]
_COMPILED: dict = {}  # one compiled function per model type's rotary, shared by the tests (compiling is ~10 s)


def fuse_kv_write(decoder: SlotDecoder) -> list[int]:
    """Turn on what `fuse_kv_write=True` turns on with CUDA graphs (here compiled for CPU); the returned list
    counts the compiled function's calls."""
    apply_rotary = decoder._rotate
    if apply_rotary not in _COMPILED:
        _COMPILED[apply_rotary] = compiled(rotate_write_kv_fn(apply_rotary), "(test)", dynamic=True)
    built, calls = _COMPILED[apply_rotary], []

    def counted(*args):
        calls.append(1)
        return built(*args)

    decoder.fuse_kv_write = True
    decoder._rotate_write = counted
    return calls


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_fused_kv_write_decodes_and_fills_the_caches_as_the_unfused_step(tiny_kit, kind):
    model = build(tiny_kit, kind)
    projections = ProjectionFusion(model)
    plain, fused = (SlotDecoder(model, slots=6, max_len=32, device=CPU, cuda_graphs=False, projections=projections)
                    for _ in range(2))
    assert not plain.fuse_kv_write  # CPU: off unless turned on, as the other compiled pieces
    calls = fuse_kv_write(fused)
    generator = torch.Generator().manual_seed(3)
    for a, b in zip(plain.keys + plain.values, fused.keys + fused.values, strict=True):
        a.copy_(torch.randn(a.shape, generator=generator))  # not zeros: a write in the wrong place shows
        b.copy_(a)
    pointers = [t.data_ptr() for t in fused.keys + fused.values]
    with torch.inference_mode():
        for decoder in (plain, fused):  # rows 1..4 prefilled (lengths 9, 3, 1, 6), row 0 a request at 20
            decoder.prefill(PROMPTS, first_slot=1)
        lengths = [20] + [len(p) for p in PROMPTS]
        for step in range(3):
            tokens = torch.tensor([7, 21, 22, 23, 24]) + step
            positions = [n + step for n in lengths]
            want, got = plain.decode(tokens, positions), fused.decode(tokens, positions)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert not torch.allclose(got[1], got[2], atol=1e-3)  # rows differ: a row mix-up would show
    assert len(calls) == 3 * len(model.model.layers)  # once per layer and step: the fused path ran
    assert [t.data_ptr() for t in fused.keys + fused.values] == pointers
    for layer in range(len(model.model.layers)):
        for a, b in ((plain.keys[layer], fused.keys[layer]), (plain.values[layer], fused.values[layer])):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)  # every slot and position, written or not


def test_the_compiled_write_scatters_into_the_caches_in_one_kernel():
    """Inductor re-inplaces the functionalized `index_put` + copy back: the generated code hands the caches to
    its one kernel as outputs and allocates nothing cache-sized (a whole-cache copy would need a buffer with the
    cache's length dimension, and a `copy_` or a second kernel back into the cache)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    batch, heads, kv_heads, dim, slots, length = 5, 4, 2, 16, 8, 32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 1, h, dim, generator=generator).transpose(1, 2) for h in (heads, kv_heads, kv_heads))
    cos, sin = (torch.randn(batch, 1, dim, generator=generator) for _ in range(2))
    keys, values = (torch.randn(slots, kv_heads, length, dim, generator=generator) for _ in range(2))
    rows, positions = torch.arange(batch), torch.tensor([3, 0, 7, 1, 30])
    want_keys, want_values = keys.clone(), values.clone()
    eager = rotate_write_kv_fn(apply_rotary_pos_emb)
    want_q = eager(q, k, v, cos, sin, want_keys, want_values, rows, positions)
    pointers = keys.data_ptr(), values.data_ptr()
    compiled = torch.compile(rotate_write_kv_fn(apply_rotary_pos_emb), dynamic=True)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        got_q, codes = run_and_get_code(compiled, q, k, v, cos, sin, keys, values, rows, positions)
    assert torch.equal(got_q, want_q) and torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert (keys.data_ptr(), values.data_ptr()) == pointers
    (code,) = [c for c in codes if "def call(" in c]
    call = code[code.index("def call("):]
    kernels = re.findall(r"^\s+(cpp_fused_\w+)\((.*)\)$", call, re.MULTILINE)
    assert len(kernels) == 1 and "index_put" in kernels[0][0], kernels
    sizes = dict(re.findall(r"assert_size_stride\((\w+), \(([^)]*)\)", call))
    caches = [name for name, size in sizes.items() if len(size.split(",")) == 4 and size.split(",")[2].strip() != "1"]
    assert len(caches) == 2  # the two [slots, kv_heads, max_len, D] inputs
    assert all(name in kernels[0][1].split(", ") for name in caches)  # the kernel gets the caches themselves
    allocations = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", call)
    assert allocations and all(a.split(",")[2].strip() == "1" for a in allocations), allocations  # [B, h, 1, D]
    assert "copy_" not in call and "extern_kernels" not in call
    # and no loop of the kernel runs over the caches' slots or length (a whole-cache copy fused into the kernel
    # loops over slots x kv_heads x max_len x D): its size arguments come last, named ks0, ks1, ... in its source
    symbols = [a for a in kernels[0][1].split(", ") if re.fullmatch(r"s\d+", a)]
    cache_size = sizes[caches[0]].split(", ")
    whole = {f"ks{symbols.index(cache_size[0])}", f"ks{symbols.index(cache_size[2])}"}
    bounds = re.findall(r"for\(int64_t \w+=[^;]*; \w+<([^;]*);", code)
    assert bounds and not [b for b in bounds if whole & set(re.findall(r"\bks\d+\b", b))], bounds


def test_the_flag_reaches_the_decoder_scheduler_and_server_info(tiny_kit):
    from slime.engines.builtin.server import build_parser, engine_args_from

    assert engine_args_from(build_parser().parse_args(["--model", "m", "--disable-fused-kv-write"])).disable_fused_kv_write
    assert not engine_args_from(build_parser().parse_args(["--model", "m"])).disable_fused_kv_write
    model = build(tiny_kit, "qwen2")
    for flag in (True, False):  # CPU: never on, as `fused` (the compiled pieces are for CUDA graphs)
        assert not SlotDecoder(model, slots=2, max_len=16, device=CPU, cuda_graphs=True, fuse_kv_write=flag).fuse_kv_write
    engine = BuiltinEngine(EngineArgs(model_path=str(tiny_kit.model_dir), kv_cache="slots"))
    try:
        assert engine.scheduler.fuse_kv_write is False
        assert engine.server_info()["internal_states"][0]["fused_kv_write"] is False
        assert engine.server_info()["disable_fused_kv_write"] is False
    finally:
        engine.shutdown()
