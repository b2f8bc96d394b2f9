"""The prefetch's sampler and other-ops stages (worker/op_prefetch.py) on CPU: the real Sampler
with the warm-up's params at every row count, nothing of theirs outliving them or touching
another generator, and the forward-ops list covering what a tiny model's warm-up launches
outside the GEMMs, the Triton layers and the sampler."""
from __future__ import annotations

import dataclasses
import gc
import json
import weakref
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.gemm_prefetch import other_ops, plan_for, run_stage, warmup_sampling_params
from resident.worker.kernels import dispatch
from resident.worker.layers.sampler import Sampler
from resident.worker.model_runner import ModelRunner
from resident.worker.op_prefetch import warm_forward_ops, warm_sampler

CPU = torch.device("cpu")
PLENTY = lambda: 1 << 40   # noqa: E731 - free bytes: everything fits
ENGINE = EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=2048)


@pytest.fixture
def sampler_calls(monkeypatch):
    """Every Sampler call: ("greedy", rows) or ("rows", [SamplingRow]), still calling through."""
    calls: list[tuple[str, object]] = []
    call, greedy = Sampler.__call__, Sampler.greedy

    def spy_call(self, logits, rows):
        calls.append(("rows", list(rows)))
        return call(self, logits, rows)

    def spy_greedy(logits):
        calls.append(("greedy", logits.shape[0]))
        return greedy(logits)
    monkeypatch.setattr(Sampler, "__call__", spy_call)
    monkeypatch.setattr(Sampler, "greedy", staticmethod(spy_greedy))
    return calls


def test_the_sampler_runs_the_warm_ups_params_at_every_row_count(sampler_calls):
    greedy, seeded = warmup_sampling_params()
    assert warm_sampler(CPU, 300, (1, 2, 4, 8), prompt_len=32, free_bytes=PLENTY) == 8
    assert [c[1] if c[0] == "greedy" else ("rows", len(c[1])) for c in sampler_calls] == [
        1, ("rows", 1), 2, ("rows", 2), 4, ("rows", 4), 8, ("rows", 8)]
    for kind, rows in sampler_calls:
        if kind == "greedy":
            continue
        first, rest = rows[0], rows[1:]
        # The warm-up's seeded row (penalty, top-k/p, min-p, logprobs) with its own generator;
        # the others the same params unseeded, drawing from the sampler's generator.
        assert first.params == seeded and first.generator is not None
        assert first.params.repetition_penalty != 1.0 and first.params.logprobs is not None
        assert all(r.params == dataclasses.replace(seeded, seed=None) and r.generator is None for r in rest)
        assert list(first.prompt_token_ids) == list(range(32)) and list(first.output_token_ids) == [0]
    assert greedy.temperature == 0.0


def test_a_row_count_too_large_for_the_free_memory_is_skipped(sampler_calls):
    # 4 rows x 1000 logits x 48 bytes is 192 kB, more than a quarter of 400 kB: only 1 and 2 rows run.
    assert warm_sampler(CPU, 1000, (1, 2, 4), prompt_len=8, free_bytes=lambda: 400_000) == 4
    assert [c[1] for c in sampler_calls if c[0] == "greedy"] == [1, 2]


def test_its_generators_are_its_own(sampler_calls):
    runner_sampler = Sampler(CPU, seed=123)
    runner_state = runner_sampler._generator.get_state()
    default_state = torch.get_rng_state()
    warm_sampler(CPU, 300, (1, 4), prompt_len=32, free_bytes=PLENTY)
    warm_sampler(CPU, 300, (1, 4), prompt_len=32, free_bytes=PLENTY)
    generators = [r.generator for kind, rows in sampler_calls if kind == "rows"
                  for r in rows if r.generator is not None]
    assert len(generators) == 4 and len({id(g) for g in generators}) == 4   # a fresh one per call
    assert all(g is not torch.default_generator for g in generators)
    assert torch.equal(torch.get_rng_state(), default_state)   # the process's generator never drew
    assert torch.equal(runner_sampler._generator.get_state(), runner_state)


@contextmanager
def _tracked():
    """Weak references to every tensor the ops under it create."""
    refs: list[weakref.ref] = []

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    refs.append(weakref.ref(t))
            return out
    with Track():
        yield refs


def test_nothing_outlives_the_stages():
    plan = plan_for(_config(), dtype="bfloat16", quantization="none", block_size=16,
                    max_num_batched_tokens=2048, max_model_len=None, graph_sizes=(1, 2, 4))
    with _tracked() as refs:
        assert run_stage(other_ops, plan, CPU) > 0
        assert warm_sampler(CPU, plan.vocab_size, (1, 2), plan.prefill_tokens, PLENTY) > 0
    gc.collect()
    assert refs and [r for r in refs if r() is not None] == []


def _config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 320, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


# --- the forward-ops list against a real warm-up -------------------------------------------
#: Ops that launch no kernel of their own (views, metadata, allocation).
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "t", "transpose", "split", "split_with_sizes", "select", "slice",
              "detach", "detach_", "alias", "lift_fresh", "unsqueeze", "squeeze", "expand", "as_strided",
              "resolve_conj", "resolve_neg", "empty", "empty_like", "empty_strided"}
#: The GEMMs (the GEMM stage's).
_GEMMS = {"linear", "mm", "addmm", "matmul", "_scaled_mm"}


class _Ops(TorchDispatchMode):
    """(op, dtypes of its tensor arguments) of every kernel-launching op outside a marked region."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[tuple[str, tuple[str, ...]]] = set()
        self.excluded = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.excluded and name not in _NO_KERNEL and name not in _GEMMS:
            flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
            self.ops.add((name, tuple(str(a.dtype) for a in flat if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _excluding(ops: _Ops, f):
    def wrapped(*a, **kw):
        ops.excluded += 1
        try:
            return f(*a, **kw)
        finally:
            ops.excluded -= 1
    return wrapped


def test_the_forward_ops_cover_a_warm_ups_non_gemm_non_triton_ops(tiny_model, monkeypatch):
    path = tiny_model("llama")
    hf = json.loads((path / "config.json").read_text())
    ops = _Ops()
    # The layers the Triton backend runs on a GPU, and the sampler (warmed after ready), are left out.
    torch_kernels = dispatch._torch_kernels
    triton_layers = ("rms_norm", "fused_add_rms_norm", "rotary_kv_write", "silu_and_mul", "paged_attention")
    monkeypatch.setattr(dispatch, "_torch_kernels", lambda: dataclasses.replace(
        torch_kernels(), **{k: _excluding(ops, getattr(torch_kernels(), k)) for k in triton_layers}))
    for method in ("__call__", "choose"):
        monkeypatch.setattr(Sampler, method, _excluding(ops, getattr(Sampler, method)))
    monkeypatch.setattr(Sampler, "greedy", staticmethod(_excluding(ops, Sampler.greedy)))
    weights = fused_weights_from_hf_folder(path, torch.bfloat16)
    runner = ModelRunner(ModelConfig.from_hf(hf), ENGINE, weights)
    with ops:
        runner.warmup(full=True)   # the GPU's passes
    warm_up = ops.ops
    assert ("embedding", ("torch.bfloat16", "torch.int64")) in warm_up   # the trace sees the forward

    plan = plan_for(hf, dtype="bfloat16", quantization="none", block_size=ENGINE.block_size,
                    max_num_batched_tokens=ENGINE.max_num_batched_tokens, max_model_len=ENGINE.max_model_len,
                    graph_sizes=(1, 2))
    assert plan.prefill_tokens == 32 and plan.kv_block == (16, runner.model_config.num_kv_heads,
                                                           runner.model_config.head_dim)
    ops = _Ops()
    with ops, torch.inference_mode():
        warm_forward_ops(CPU, dtype=torch.bfloat16, vocab_size=plan.vocab_size, hidden_size=plan.hidden_size,
                         token_counts=plan.layer_ms, sample_rows=plan.head_ms, prefill_tokens=plan.prefill_tokens,
                         kv_block=plan.kv_block, free_bytes=PLENTY)
    assert warm_up <= ops.ops, f"the warm-up launches {sorted(warm_up - ops.ops)} the prefetch does not"


def test_the_warm_up_samples_with_the_prefetchs_params(tiny_model, monkeypatch):
    path = tiny_model("llama")
    runner = ModelRunner(ModelConfig.from_hf(json.loads((path / "config.json").read_text())), ENGINE,
                         fused_weights_from_hf_folder(path))
    seen = []
    sample = runner.sample

    def spy(logits, to_sample, *args):
        seen.extend(s.sampling_params for s in to_sample)
        return sample(logits, to_sample, *args)
    monkeypatch.setattr(runner, "sample", spy)
    runner.warmup(full=True)   # the GPU's passes: greedy (the sampler's kernels load after ready)
    greedy = warmup_sampling_params()[0]
    assert seen == [greedy, greedy]
    seen.clear()
    runner.warmup()   # CPU: one short prefill, sampled with the decode's all-options row
    assert seen == list(warmup_sampling_params())[1:]


def test_the_forward_ops_skip_an_embedding_too_large_for_the_free_memory():
    args = dict(dtype=torch.bfloat16, vocab_size=1000, hidden_size=64, token_counts=(32, 1), sample_rows=(1,),
                prefill_tokens=32, kv_block=(16, 2, 16))
    assert warm_forward_ops(CPU, free_bytes=PLENTY, **args) == 2 + 1 + 2 + 1
    # 1000 x 64 bf16 (128 kB) is more than a quarter of 400 kB: no embedding.
    assert warm_forward_ops(CPU, free_bytes=lambda: 400_000, **args) == 1 + 2 + 1
