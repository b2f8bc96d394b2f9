"""ModelConfig, the model registry and the ModelRunner (batching, sampling, warm-up, dtypes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weights_util import fused_weights_from_hf_folder

from resident.daemon.layout import plan
from resident.daemon.quant import quantize_fp8_per_tensor
from resident.worker.config import ModelConfig, ModelConfigError
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import BatchError, ModelRunner
from resident.worker.models import get_model_class
from resident.worker.models.llama import WeightsError
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
ENGINE = EngineConfig(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=256)


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def make_runner(path: Path, weights: dict | None = None, engine: EngineConfig = ENGINE) -> ModelRunner:
    return ModelRunner(ModelConfig.from_hf(config_of(path)), engine, weights or fused_weights_from_hf_folder(path))


# --- ModelConfig -----------------------------------------------------------------------
def test_both_rope_spellings_give_the_same_config(tiny_model) -> None:
    new = config_of(tiny_model("llama3"))
    assert "rope_parameters" in new
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = new["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = {("type" if k == "rope_type" else k): v
                           for k, v in new["rope_parameters"].items() if k != "rope_theta"}
    a, b = ModelConfig.from_hf(new), ModelConfig.from_hf(old)
    assert a == b
    assert a.rope.type == "llama3" and a.rope.factor == 8.0 and a.rope.original_max_position_embeddings == 256
    assert a.rope.theta == 500000.0 and a.tie_word_embeddings


def test_config_variants(tiny_model) -> None:
    qwen2 = ModelConfig.from_hf(config_of(tiny_model("qwen2")))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(config_of(tiny_model("qwen3")))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128 and not qwen3.qkv_bias
    llama = ModelConfig.from_hf({**config_of(tiny_model("llama")), "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias
    assert ModelConfig.from_hf(config_of(tiny_model("mistral", sliding_window=32))).sliding_windows == (32, 32)
    q2 = {**config_of(tiny_model("qwen2")), "use_sliding_window": True, "sliding_window": 16,
          "max_window_layers": 1, "layer_types": None}
    assert ModelConfig.from_hf(q2).sliding_windows == (None, 16)
    assert ModelConfig.from_hf({**q2, "use_sliding_window": False}).sliding_windows == (None, None)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "'yarn' is not supported; supported: default, linear, llama3"),
    ({"architectures": ["GPT2LMHeadModel"]}, "supported: LlamaForCausalLM, MistralForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    # NaN and inf passed the `<= 0` checks, and the model computed NaN
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number > 0, got inf"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     "rope_theta must be a finite number > 0, got nan"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": float("inf")}},
     "factor must be a finite number > 0"),
])
def test_unsupported_configs_fail_clearly(tiny_model, change: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf({**config_of(tiny_model("llama")), **change})


def test_model_registry_lists_supported_architectures() -> None:
    assert get_model_class("Qwen3ForCausalLM").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="'Gemma2ForCausalLM' is not supported; supported: LlamaForCausalLM"):
        get_model_class("Gemma2ForCausalLM")


# --- construction ----------------------------------------------------------------------
def test_runner_uses_the_weights_without_copying(tiny_model) -> None:
    path = tiny_model("qwen2")
    weights = fused_weights_from_hf_folder(path)
    runner = make_runner(path, weights)
    layer = runner.model.layers[1]
    assert layer.qkv_proj.weight.data_ptr() == weights["model.layers.1.self_attn.qkv_proj.weight"].data_ptr()
    assert layer.qkv_proj.bias.data_ptr() == weights["model.layers.1.self_attn.qkv_proj.bias"].data_ptr()
    assert runner.model.embed_tokens.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()


def test_wrong_weights_fail_clearly(tiny_model) -> None:
    path = tiny_model("llama")
    weights = fused_weights_from_hf_folder(path)
    cfg = ModelConfig.from_hf(config_of(path))
    with pytest.raises(WeightsError, match="lack 1 tensor"):
        ModelRunner(cfg, ENGINE, {k: v for k, v in weights.items() if k != "model.norm.weight"})
    with pytest.raises(WeightsError, match="has shape"):
        ModelRunner(cfg, ENGINE, {**weights, "model.norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match="never converted"):
        ModelRunner(cfg, ENGINE, weights, dtype=torch.bfloat16)


def test_kv_cache_bytes_per_block_matches_the_allocation(tiny_model) -> None:
    runner = make_runner(tiny_model("qwen3"))
    per_block = ModelRunner.kv_cache_bytes_per_block(runner.model_config, torch.float32, ENGINE.block_size)
    assert per_block * ENGINE.num_kv_blocks == runner.kv_cache.nbytes
    assert ModelRunner.kv_cache_bytes_per_block(runner.model_config, torch.bfloat16, 8) == per_block


# --- execution -------------------------------------------------------------------------
def _req(rid, tokens, start, table, sample=True, params=GREEDY, prompt=None, output=None) -> ScheduledRequest:
    return ScheduledRequest(rid, list(tokens), start, list(table), sample, params,
                            list(prompt if prompt is not None else tokens), list(output or []))


def _generate_alone(runner: ModelRunner, rid: str, prompt: list[int], table: list[int], steps: int,
                    params: SamplingParams = GREEDY) -> list[int]:
    out = runner.execute(SchedulerOutput([_req(rid, prompt, 0, table, params=params)], len(prompt)))
    tokens = [out.sampled[rid]]
    for _ in range(steps - 1):
        pos = len(prompt) + len(tokens) - 1
        step = _req(rid, [tokens[-1]], pos, table, params=params, prompt=prompt, output=tokens)
        tokens.append(runner.execute(SchedulerOutput([step], 1)).sampled[rid])
    return tokens


def test_batched_equals_unbatched(tiny_model) -> None:
    path = tiny_model("llama3")
    prompts = {"a": list(range(3, 22)), "b": list(range(40, 45)), "c": list(range(100, 131))}
    tables = {"a": [9, 2, 30, 11, 5, 6, 7, 8], "b": [1, 0, 3, 4, 12, 13], "c": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]}
    alone = {rid: _generate_alone(make_runner(path), rid, p, tables[rid], 6) for rid, p in prompts.items()}

    runner = make_runner(path)
    outputs = {rid: [] for rid in prompts}
    # a: whole prompt at once; b: prefilled in two chunks; c: three chunks, joining late
    plan_ = [
        [("a", 0, 19), ("b", 0, 2), ("c", 0, 10)],
        [("b", 2, 5), ("c", 10, 20)],
        [("c", 20, 31)],
    ]
    for step in plan_:
        scheduled = [_req(rid, prompts[rid][s:e], s, tables[rid], sample=(e == len(prompts[rid]) and not outputs[rid]),
                          prompt=prompts[rid], output=outputs[rid]) for rid, s, e in step]
        scheduled += [_req(rid, [outputs[rid][-1]], len(prompts[rid]) + len(outputs[rid]) - 1, tables[rid],
                           prompt=prompts[rid], output=outputs[rid])
                      for rid in prompts if outputs[rid] and rid not in {r for r, _, _ in step}]
        out = runner.execute(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled)))
        assert set(out.sampled) == {s.request_id for s in scheduled if s.sample}
        for rid, tok in out.sampled.items():
            outputs[rid].append(tok)
    while any(len(o) < 6 for o in outputs.values()):
        scheduled = [_req(rid, [o[-1]], len(prompts[rid]) + len(o) - 1, tables[rid], prompt=prompts[rid], output=o)
                     for rid, o in outputs.items() if len(o) < 6]
        for rid, tok in runner.execute(SchedulerOutput(scheduled, len(scheduled))).sampled.items():
            outputs[rid].append(tok)
    assert outputs == alone


def test_seeded_requests_reproduce_across_batches_and_restart_after_finish(tiny_model) -> None:
    path = tiny_model("qwen3")
    params = SamplingParams(temperature=1.0, seed=1234)
    prompt, table = list(range(10, 17)), [3, 1, 4, 15, 9]
    runner = make_runner(path)
    alone = _generate_alone(runner, "s", prompt, table, 8, params)
    assert len(set(alone)) > 1
    # finishing drops the generator: the same id and seed start over
    runner.execute(SchedulerOutput([], 0, finished_request_ids={"s"}))
    assert _generate_alone(runner, "s", prompt, table, 8, params) == alone
    # ... and so does a new request under that id whose predecessor's generator was never dropped
    # (it finished in another engine over this runner): its first sampled token starts a fresh stream
    assert _generate_alone(runner, "s", prompt, table, 8, params) == alone

    other = make_runner(path)
    noisy = SamplingParams(temperature=1.0)
    tokens: list[int] = []
    others: list[int] = []
    for i in range(8):
        s = _req("s", prompt if i == 0 else [tokens[-1]], 0 if i == 0 else len(prompt) + i - 1, table,
                 params=params, prompt=prompt, output=tokens)
        o = _req("o", prompt if i == 0 else [others[-1]], 0 if i == 0 else len(prompt) + i - 1, [20, 21, 22, 23, 24],
                 params=noisy, prompt=prompt, output=others)
        out = other.execute(SchedulerOutput([o, s], len(s.token_ids) + len(o.token_ids)))
        tokens.append(out.sampled["s"])
        others.append(out.sampled["o"])
    assert tokens == alone


def test_non_sampling_chunks_and_logprobs(tiny_model) -> None:
    runner = make_runner(tiny_model("mistral"))
    lp = SamplingParams(temperature=0.0, logprobs=3)
    out = runner.execute(SchedulerOutput([
        _req("partial", range(5, 13), 0, [0, 1, 2], sample=False),
        _req("full", range(5, 9), 0, [3], params=lp),
        _req("plain", range(7, 9), 0, [4]),
    ], 14))
    assert set(out.sampled) == {"full", "plain"} and set(out.logprobs) == {"full"}
    entry = out.logprobs["full"]
    assert entry.token_id == out.sampled["full"] and len(entry.top) == 3 and entry.top[0][0] == entry.token_id
    assert runner.execute(SchedulerOutput([], 0)).sampled == {}


@pytest.mark.parametrize("bad, message", [
    (lambda: _req("x", range(9), 0, [0, 1]), "cannot hold positions up to 8"),
    (lambda: _req("x", range(3), 0, [64]), "block id outside"),
    (lambda: _req("x", range(3), 0, [-1]), "block id outside"),
    (lambda: _req("x", [999], 0, [0]), "token id outside"),
    (lambda: _req("x", [3, -2], 0, [0]), "token id outside"),
    (lambda: _req("x", [1], 64, list(range(17))), "exceed max_model_len"),
])
def test_bad_batches_fail_naming_the_request(tiny_model, bad, message: str) -> None:
    runner = make_runner(tiny_model("llama"))
    with pytest.raises(BatchError, match=message):
        runner.execute(SchedulerOutput([bad()], 1))


@pytest.mark.parametrize("full", [None, True], ids=["cpu-short", "gpu-full"])
def test_warmup_leaves_a_clean_cache_and_runners_rebuild(tiny_model, full) -> None:
    path = tiny_model("llama")
    first = make_runner(path)
    reference = _generate_alone(first, "r", list(range(30, 50)), [0, 1, 2, 3, 4, 5, 6], 5)
    del first
    runner = make_runner(path)
    runner.warmup(full)
    assert all(int(t.count_nonzero()) == 0 for t in runner.kv_cache.tensors)
    assert _generate_alone(runner, "r", list(range(30, 50)), [0, 1, 2, 3, 4, 5, 6], 5) == reference


# --- dtypes and fp8 --------------------------------------------------------------------
def _logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    table = list(range(-(-len(tokens) // ENGINE.block_size)))
    return runner.logits(SchedulerOutput([_req("x", tokens, 0, table, sample=False)], len(tokens)))


def test_bfloat16_weights_compute_in_bfloat16(tiny_model) -> None:
    path = tiny_model("qwen2")
    tokens = list(range(1, 40))
    ref = _logits(make_runner(path), tokens)
    runner = make_runner(path, fused_weights_from_hf_folder(path, torch.bfloat16))
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.tensors[0].dtype == torch.bfloat16
    got = _logits(runner, tokens)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_fp8_per_tensor_weights_run_w8a8(tiny_model) -> None:
    # A realistic weight scale: the fixtures' large init amplifies any error through layers.
    path = tiny_model("llama", init_std=0.05)
    weights = fused_weights_from_hf_folder(path)
    quantizable = {f.name for f in plan(config_of(path), set(_hf_names(path))) if f.quantizable}
    fp8 = dict(weights)
    for name in quantizable:
        fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale"] = quantize_fp8_per_tensor(weights[name])
    runner = make_runner(path, fp8)
    assert {layer.qkv_proj.name for layer in runner.model.layers} == {"fp8_per_tensor"}
    assert runner.dtype == torch.float32
    tokens = list(range(1, 40))
    ref, got = _logits(make_runner(path, weights), tokens), _logits(runner, tokens)
    rel = (got - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.1, rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    # Quantizing activations too costs at most about as much as quantizing the weights did.
    deq = {**weights, **{n: fp8[n].float() * fp8[n.removesuffix(".weight") + ".weight_scale"] for n in quantizable}}
    weight_only = (_logits(make_runner(path, deq), tokens) - ref).norm() / ref.norm()
    assert rel < 2 * weight_only, (rel, weight_only)


def _hf_names(path: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            names.extend(fh.keys())
    return names
