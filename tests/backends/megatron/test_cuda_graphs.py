"""megatron-core's local CUDA graphs (`cuda_graph_impl=local`, slime/backends/megatron/cuda_graphs.py) wired on
CPU: which options ask for them and which are refused, the RNG tracker init_megatron seeds, the shape guard,
the eager switch of forward-only passes, the frozen-embedding hook and the graph-safe RNG checkpoint state.
The graphs themselves run in test_cuda_graphs_gpu.py."""

from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron import cuda_graphs
from slime.config import load_config
from slime.errors import ConfigError


@pytest.mark.parametrize(("options", "wanted"), [
    ({}, False), ({"cuda_graph_impl": "none"}, False), ({"cuda_graph_impl": "local"}, True),
    ({"enable_cuda_graph": True}, True), ({"enable_cuda_graph": False}, False),
    ({"cuda_graph_impl": "transformer_engine"}, False),
])
def test_which_options_ask_for_local_graphs(options, wanted):
    assert cuda_graphs.requested(options) is wanted


def test_the_local_graphs_pass_config_validation():
    assert load_config(None, ["--cuda-graph-impl", "local"]).megatron == {"cuda_graph_impl": "local"}
    assert load_config(None, ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"]).megatron["cuda_graph_scope"] \
        == "attn"


@pytest.mark.parametrize(("argv", "message"), [
    (["--cuda-graph-impl", "transformer_engine"],
     "megatron.cuda_graph_impl: Transformer Engine's graphs .* use cuda_graph_impl=local"),
    (["--external-cuda-graph"], "megatron.external_cuda_graph: Transformer Engine's graphs"),
    (["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
     "megatron.cuda_graph_scope: 'full_iteration' captures the whole iteration"),
    (["--cuda-graph-impl", "local", "--cuda-graph-scope", "moe_router"], "'moe_router' applies to MoE"),
    (["--cuda-graph-impl", "local", "--colocate"], "cluster.offload_train: the colocated offload moves the weights"),
    (["--enable-cuda-graph", "--offload-train"], "cluster.offload_train: the colocated offload"),
    (["--cuda-graph-impl", "local", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512"],
     "train.use_dynamic_batch_size: dynamic batching changes the micro-batch shapes"),
    (["--cuda-graph-impl", "local", "--recompute-granularity", "full"],
     "megatron.recompute_granularity: full activation recomputation"),
])
def test_what_the_trainer_cannot_graph_is_refused_at_config_time(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, argv)


def test_without_graphs_the_other_options_stay_allowed():
    config = load_config(None, ["--colocate", "--recompute-granularity", "full", "--use-dynamic-batch-size",
                                "--max-tokens-per-gpu", "512"])
    assert not cuda_graphs.requested(config.megatron)


def test_graphs_need_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda_graphs.check_device({})  # nothing asked, nothing refused
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        cuda_graphs.check_device({"cuda_graph_impl": "local"})


def test_init_megatron_seeds_the_graph_safe_tracker_when_the_options_ask(monkeypatch):
    from slime.backends.megatron import bridge, cpu_compat

    seeds = []
    monkeypatch.setattr(cpu_compat, "activate", lambda: None)  # no process group, no CPU patches in this process
    monkeypatch.setattr(bridge.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(bridge.parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(bridge, "model_parallel_cuda_manual_seed", lambda seed, **kw: seeds.append((seed, kw)))
    monkeypatch.setattr(cuda_graphs, "check_device", lambda megatron: None)  # a CPU machine; the GPU test has CUDA
    bridge.init_megatron(1)
    bridge.init_megatron(2, megatron={"cuda_graph_impl": "local"})
    bridge.init_megatron(3, megatron={"enable_cuda_graph": True, "hidden_dropout": 0.0})
    bridge.init_megatron(4, megatron={"hidden_dropout": 0.0})
    assert seeds == [(1, {"use_cudagraphable_rng": False, "force_reset_rng": True}),
                     (2, {"use_cudagraphable_rng": True, "force_reset_rng": True}),
                     (3, {"use_cudagraphable_rng": True, "force_reset_rng": True}),
                     (4, {"use_cudagraphable_rng": False, "force_reset_rng": True})]
    with pytest.raises(ConfigError, match="full_iteration"):  # checked before any process group is made
        bridge.init_megatron(5, megatron={"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})
    assert len(seeds) == 4


def test_the_bridge_refuses_graph_options_without_the_graph_safe_tracker(monkeypatch):
    from megatron.core.tensor_parallel import random as mcore_random

    from slime.backends.megatron import bridge

    monkeypatch.setattr(cuda_graphs, "check_device", lambda megatron: None)
    monkeypatch.setattr(mcore_random, "get_cuda_rng_tracker", lambda: mcore_random.CudaRNGStatesTracker())
    bridge._check_graph_rng({})  # no graphs asked: any tracker will do
    with pytest.raises(ConfigError, match="megatron.cuda_graph_impl: Transformer Engine's graphs"):
        bridge._check_graph_rng({"cuda_graph_impl": "transformer_engine"})  # bench/train_step.py has no config check
    with pytest.raises(ConfigError, match="graph-safe CUDA RNG tracker: pass the same megatron options to "
                                          "init_megatron"):
        bridge._check_graph_rng({"cuda_graph_impl": "local"})
    monkeypatch.setattr(mcore_random, "get_cuda_rng_tracker", _graph_safe_tracker)
    bridge._check_graph_rng({"cuda_graph_impl": "local"})


def _graph_safe_tracker() -> object:
    """megatron's graph-safe tracker kind (its constructor asserts CUDA-graph support, which a CPU build of
    torch lacks: the flag is set after construction)."""
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.CudaRNGStatesTracker()
    tracker.use_cudagraphable_rng = True
    return tracker


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cudagraph_manager = torch.nn.Module()  # what GraphableMegatronModule holds under cuda_graph_impl=local


class _Chunk(torch.nn.Module):
    def __init__(self, impl: str = "local") -> None:
        super().__init__()
        self.config = SimpleNamespace(cuda_graph_impl=impl, recompute_granularity=None)
        self.embedding = torch.nn.Embedding(16, 4)
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])


def test_forward_only_passes_run_eagerly_and_keep_the_captured_managers():
    chunk = _Chunk()
    managers = [layer.cudagraph_manager for layer in chunk.layers]
    assert cuda_graphs.enabled([chunk]) and not cuda_graphs.enabled([_Chunk("none")])
    with cuda_graphs.eager([chunk]):
        assert not any(hasattr(layer, "cudagraph_manager") for layer in chunk.layers)
        assert chunk.config.cuda_graph_impl == "none"  # megatron's schedule then captures nothing either
    assert [layer.cudagraph_manager for layer in chunk.layers] == managers  # the same objects: graphs kept
    assert chunk.config.cuda_graph_impl == "local"
    with pytest.raises(RuntimeError), cuda_graphs.eager([chunk]):
        raise RuntimeError("a failing pass")
    assert [layer.cudagraph_manager for layer in chunk.layers] == managers


def test_a_micro_batch_shape_without_a_graph_is_refused_before_the_step():
    chunk, other = _Chunk(), _Chunk()
    cuda_graphs.check_shapes([chunk], [(3, 64)])  # nothing captured yet: the recording step may use any shape
    cuda_graphs.note_captured([chunk], [(2, 64), (1, 64)])
    cuda_graphs.note_captured([chunk], [(2, 128)])  # later captures do not widen the first step's set
    cuda_graphs.check_shapes([chunk], [(2, 64), (2, 64), (1, 64)])
    with pytest.raises(ConfigError, match=r"micro-batch shape \[2, 128\] \[rows, tokens\] has no CUDA graph; the "
                                          r"graphs were captured for \[\[1, 64\], \[2, 64\]\].*data_pad_size_multiplier"):
        cuda_graphs.check_shapes([chunk], [(2, 64), (2, 128)])
    cuda_graphs.check_shapes([other], [(2, 128)])  # per model chunk


def test_a_frozen_embedding_makes_the_first_layer_input_require_grad():
    frozen, trained, plain = _Chunk(), _Chunk(), _Chunk("none")
    for chunk in (frozen, plain):
        chunk.embedding.weight.requires_grad_(False)
    assert cuda_graphs.prepare([frozen, trained, plain]) == 1  # only the graphed chunk with a frozen embedding
    tokens = torch.tensor([[1, 2, 3]])
    assert frozen.embedding(tokens).requires_grad
    assert not plain.embedding(tokens).requires_grad
    with torch.no_grad():  # forward-only passes build no graph
        assert not frozen.embedding(tokens).requires_grad


def test_a_training_graphs_input_buffers_stay_out_of_the_reuse_pool(monkeypatch):
    """megatron returns a graph's copied-into input buffers to its reuse pool after capturing the forward
    (stood in for here: the GPU capture is in test_cuda_graphs_gpu.py); a training graph's backward still reads
    them, so keep_saved_inputs takes them back out, and leaves forward-only captures' reuse alone."""
    from megatron.core.transformer import cuda_graphs as mcore_graphs

    pool = mcore_graphs._CudagraphGlobalRecord.tensor_reuse_pool.pool
    spare = torch.zeros(2)

    def megatron_capture(runner, *args, **kwargs):  # what create_fwd_graph does with its buffers at the end
        pool.extend(runner.fwd_graph_input_surface)
        return "captured"

    monkeypatch.setattr(mcore_graphs._CudaGraphRunner, "create_fwd_graph", megatron_capture)
    monkeypatch.setattr(mcore_graphs._CudagraphGlobalRecord.tensor_reuse_pool, "pool", [spare])
    pool = mcore_graphs._CudagraphGlobalRecord.tensor_reuse_pool.pool
    assert cuda_graphs.keep_saved_inputs() is True
    assert cuda_graphs.keep_saved_inputs() is False  # once per process
    training = SimpleNamespace(grad_enabled=True, fwd_graph_input_surface=(torch.zeros(3), torch.zeros(4)))
    forward_only = SimpleNamespace(grad_enabled=False, fwd_graph_input_surface=(torch.zeros(5),))
    assert mcore_graphs._CudaGraphRunner.create_fwd_graph(training, [], {}) == "captured"
    assert [t.numel() for t in pool] == [2]  # the training graph's inputs stay its own; the spare stays pooled
    mcore_graphs._CudaGraphRunner.create_fwd_graph(forward_only, [], {})
    assert [t.numel() for t in pool] == [2, 5]


def test_the_patched_megatron_graph_runner_still_has_what_keep_saved_inputs_wraps():
    import inspect

    from megatron.core.transformer import cuda_graphs as mcore_graphs

    source = inspect.getsource(inspect.unwrap(mcore_graphs._CudaGraphRunner.create_fwd_graph))
    assert "tensor_reuse_pool.insert(buf)" in source and "fwd_graph_input_surface" in source
    assert "self.grad_enabled" in inspect.getsource(mcore_graphs._CudaGraphRunner.__init__)


def test_the_graph_safe_tracker_state_is_saved_as_bytes_and_restored_in_place(monkeypatch):
    from megatron.core.tensor_parallel import random as mcore_random

    from slime.backends.megatron.rng_state import capture_rng_state, restore_rng_state

    # the graph-safe tracker's streams are generators (CUDA ones on a GPU; CPU ones stand in for them here)
    tracker = _graph_safe_tracker()
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(7),
                        "data-parallel-rng": torch.Generator().manual_seed(8)})
    monkeypatch.setattr(mcore_random, "get_cuda_rng_tracker", lambda: tracker)
    generators = dict(tracker.get_states())
    state = capture_rng_state()
    expected = torch.rand(3, generator=generators["model-parallel-rng"])  # the draw after the capture
    restore_rng_state(state)
    assert tracker.get_states()["model-parallel-rng"] is generators["model-parallel-rng"]  # graphs registered it
    assert torch.equal(torch.rand(3, generator=generators["model-parallel-rng"]), expected)
    state["megatron_tracker"]["expert-parallel-rng"] = state["megatron_tracker"]["data-parallel-rng"]
    with pytest.raises(ValueError, match="expert-parallel-rng"):
        restore_rng_state(state)
