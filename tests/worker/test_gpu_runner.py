"""The engine on an NVIDIA GPU (skipped without CUDA).

- the runner on cuda generates the CPU runner's greedy tokens (tiny float32 model, margin rule)
  and its teacher-forced logits within 1e-3;
- decode CUDA graphs give the eager step's logits (float32 within 1e-3 of scale, bf16 within
  2e-2 and the same top-1), stay valid after the KV cache is unmapped and re-mapped;
- bf16 logits vs HF transformers on the GPU, teacher-forced over 1920 positions of a 4-layer
  model with Llama-3-8B widths (prefill chunks, then graph-replayed decode steps): top-1 equal
  to float32 HF's on >= 99 % of the positions where bf16 cannot flip it (>= 512 of them), and
  no noisier than HF's own bf16 run;
- the KV cache's VMM range keeps its addresses and a captured graph across unmap/remap, and grows
  in place;
- `resident serve` refuses a --gpu-memory-utilization that leaves no room, naming the flags;
- a worker attached to a cuda_vmm daemon keeps serving after the daemon is killed with -9;
- figures: graph capture time per batch size, decode step time with and without graphs on the
  Llama-3-8B shape (RESIDENT_GPU_FIGURES=path writes them as JSON).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from serve_helpers import MODEL_NAME, daemon_helpers, http, metric, serve_env, servable_tiny_model, start_serve, \
    stop_serve
from weights_util import fused_weights_from_hf_folder

from resident.daemon.layout import plan
from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.kv_cache import KVCache
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0)
MARGIN = 1e-3


def _config(path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def _generate(runner: ModelRunner, engine_config: EngineConfig, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(engine_config, runner)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _teacher_forced(runner: ModelRunner, seqs: list[list[int]], block_size: int) -> list[torch.Tensor]:
    per = -(-max(map(len, seqs)) // block_size)
    scheduled = [ScheduledRequest(f"t{i}", s, 0, list(range(i * per, (i + 1) * per)), True, GREEDY, s, [])
                 for i, s in enumerate(seqs)]
    logits = runner.logits(SchedulerOutput(scheduled, sum(map(len, seqs)))).cpu()
    out, start = [], 0
    for s in seqs:
        out.append(logits[start:start + len(s)])
        start += len(s)
    return out


# --- CPU vs GPU ------------------------------------------------------------------------------
def test_cuda_runner_matches_the_cpu_runner(tiny_model) -> None:
    path = tiny_model("llama3")
    mc, weights = _config(path), fused_weights_from_hf_folder(path)
    ec = EngineConfig(block_size=8, num_kv_blocks=96, max_model_len=128, max_num_seqs=8)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(k)] for k in (5, 17, 33)]
    cpu = ModelRunner(mc, ec, weights)
    gpu = ModelRunner(mc, ec, {k: v.cuda() for k, v in weights.items()}, device="cuda")
    assert gpu.kernels.backend == "triton" and gpu.graphs is not None
    want = _generate(cpu, ec, prompts, 24)
    got = _generate(gpu, ec, prompts, 24)
    assert gpu.graphs.num_replays > 0, "decode steps did not replay CUDA graphs"
    seqs = [p + w for p, w in zip(prompts, want)]
    ref = _teacher_forced(ModelRunner(mc, ec, weights), seqs, 8)
    dev = _teacher_forced(ModelRunner(mc, ec, {k: v.cuda() for k, v in weights.items()}, device="cuda",
                                      cuda_graphs="off"), seqs, 8)
    for p, w, g, r, d in zip(prompts, want, got, ref, dev):
        scale = r.abs().max().item()
        assert (d - r).abs().max().item() <= 1e-3 * max(1.0, scale)
        # Greedy tokens equal up to the first near-tie of the CPU's distribution.
        top2 = r[len(p) - 1:].topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        sure = next((i for i, m in enumerate(margins) if m < MARGIN), len(w))
        assert g[:sure] == w[:sure], (g, w, sure)


def test_async_scheduling_on_gpu_gives_the_synchronous_tokens(tiny_model) -> None:
    """Steps launched before the previous step's tokens are read (placeholders substituted on
    the device, the tokens read back through pinned buffers) generate the same tokens as
    synchronous steps, greedy and seeded sampling, through CUDA graphs."""
    path = tiny_model("llama3")
    mc, weights = _config(path), {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    ec = EngineConfig(block_size=8, num_kv_blocks=96, max_model_len=128, max_num_seqs=8)
    rng = random.Random(1)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)]
    prompts = [[rng.randrange(256) for _ in range(k)] for k in (7, 19, 30)]
    got = {}
    for mode in (False, True):
        runner = ModelRunner(mc, ec, weights, device="cuda")
        engine = LLMEngine(ec, runner, async_scheduling=mode)
        assert engine.async_scheduling == mode
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        assert runner.graphs.num_replays > 0
        got[mode] = out
        runner.close()
    assert got[True] == got[False] and all(len(t) == 20 for t in got[True].values())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logit_bias_min_tokens_allowed_ids_and_bad_words_on_gpu(tiny_model, async_scheduling) -> None:
    """The sampler's logit changes on CUDA tensors, beside plain greedy rows in graph-replayed
    steps: min_tokens keeps the stop token greedy decoding picks first out of the first 5 tokens
    (and out of the output's end until then), a +100 logit bias makes greedy pick its token, -100
    keeps it out; allowed_token_ids keeps sampling within its ids; a bad word (that token) never
    comes."""
    path = tiny_model("llama3")
    mc, weights = _config(path), {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    ec = EngineConfig(block_size=8, num_kv_blocks=96, max_model_len=128, max_num_seqs=8)
    prompt = [random.Random(2).randrange(256) for _ in range(11)]
    runner = ModelRunner(mc, ec, weights, device="cuda")
    engine = LLMEngine(ec, runner, async_scheduling=async_scheduling)

    def run(requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
        for rid, sp in requests.items():
            engine.add_request(rid, prompt, sp)
        out: dict[str, list[int]] = {rid: [] for rid in requests}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return out

    first = run({"plain": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)})["plain"]
    t0 = first[0]
    forced = (t0 + 1) % mc.vocab_size
    allowed = [(t0 + k) % mc.vocab_size for k in (2, 5, 7)]
    got = run({"plain": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
               "stop": SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[t0], ignore_eos=True),
               "min": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, stop_token_ids=[t0],
                                     ignore_eos=True),
               "up": SamplingParams(temperature=0.0, max_tokens=4, logit_bias={forced: 100.0}, ignore_eos=True),
               "down": SamplingParams(temperature=0.0, max_tokens=4, logit_bias={t0: -100.0}, ignore_eos=True),
               "allowed": SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=allowed,
                                         ignore_eos=True),
               "bad": SamplingParams(temperature=0.0, max_tokens=8, bad_words_token_ids=[[t0]], ignore_eos=True)})
    assert runner.graphs.num_replays > 0
    assert got["plain"] == first and got["stop"] == [t0]
    assert len(got["min"]) >= 5 and t0 not in got["min"][:5], got["min"]
    assert got["up"] == [forced] * 4 and got["down"][0] != t0
    assert len(got["allowed"]) == 6 and set(got["allowed"]) <= set(allowed), got["allowed"]
    assert len(got["bad"]) == 8 and t0 not in got["bad"], got["bad"]
    runner.close()


# --- CUDA graphs vs eager ----------------------------------------------------------------------
def _decode_schedule(seed: int, n: int, vocab: int) -> list[list[tuple[int, int]]]:
    rng = random.Random(seed)
    return [[(i, rng.randrange(vocab)) for i in rng.sample(range(n), size)] for size in (1, 3, 5, 9, 2, 9, 7)]


def _run_steps(runner: ModelRunner, prompts: list[list[int]], steps, tables) -> list[torch.Tensor]:
    seqs = [list(p) for p in prompts]
    sched = [ScheduledRequest(f"r{i}", p, 0, tables[i], True, GREEDY, p, []) for i, p in enumerate(prompts)]
    outs = [runner.logits(SchedulerOutput(sched, sum(map(len, prompts)))).float().cpu()]
    for step in steps:
        batch = []
        for i, tok in step:
            batch.append(ScheduledRequest(f"r{i}", [tok], len(seqs[i]), tables[i], True, GREEDY, seqs[i], []))
            seqs[i].append(tok)
        outs.append(runner.logits(SchedulerOutput(batch, len(batch))).float().cpu())
    return outs


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 2e-2)])
def test_graphs_give_the_eager_logits(tiny_model, dtype, tol) -> None:
    path = tiny_model("qwen3", dtype=dtype)
    mc = _config(path)
    weights = {k: v.cuda() for k, v in fused_weights_from_hf_folder(path, getattr(torch, dtype)).items()}
    ec = EngineConfig(block_size=8, num_kv_blocks=120, max_model_len=96, max_num_seqs=12)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 40))] for _ in range(9)]
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(9)]
    steps = _decode_schedule(2, 9, 256)
    graphed = ModelRunner(mc, ec, weights, device="cuda", cuda_graphs="eager")
    graphed.capture_graphs()
    assert set(graphed.graphs.capture_s) == set(graphed.graphs.sizes) == {1, 2, 4, 8, 12}
    eager = ModelRunner(mc, ec, weights, device="cuda", cuda_graphs="off")
    got = _run_steps(graphed, prompts, steps, tables)
    want = _run_steps(eager, prompts, steps, tables)
    assert graphed.graphs.num_replays == len(steps)
    for g, w in zip(got, want):
        scale = w.abs().max().item()
        assert (g - w).abs().max().item() <= tol * scale
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    # Unmapped and re-mapped KV memory at the same addresses: the same graphs give the same logits.
    ptr = graphed.kv_cache.tensors[0].data_ptr()
    graphed.kv_cache.unmap()
    graphed.kv_cache.remap()
    assert graphed.kv_cache.tensors[0].data_ptr() == ptr
    again = _run_steps(graphed, prompts, steps, tables)
    for a, g in zip(again, got):
        torch.testing.assert_close(a, g, atol=1e-5 * g.abs().max().item(), rtol=0)


# --- bf16 vs HF transformers at Llama-3-8B widths ---------------------------------------------
#: Projection weights' std. HF's default (0.02) makes a random 4-layer model at these widths
#: chaotic: its own bf16 run agrees with its float32 run on only ~74 % of top-1 tokens (measured
#: on CPU), so no bf16 implementation could show 99 %. At 0.01 the layers still decide the
#: output (shuffling the positions changes 65 % of top-1 tokens) and bf16 is stable enough.
LAYER_STD = 0.01


def llama8b_wide_hf(device: str, num_layers: int = 4):
    """A random model with Llama-3-8B widths (vocab 32000) in float32 on `device`: (hf, config dict)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.02)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".layers." in name and name.endswith("proj.weight"):
                p.normal_(0.0, LAYER_STD, generator=g)
    return hf, cfg.to_dict()


def fused_from_hf(hf, cfg_dict: dict) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    weights = {}
    for fused in plan(cfg_dict, set(state)):
        parts = [state[s] for s in fused.sources]
        weights[fused.name] = (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).contiguous()
    return weights


def teacher_forced_bf16_vs_hf(device: str, num_seqs: int = 6, length: int = 320, prefill: int = 256,
                              chunk: int = 128) -> dict:
    """Our bf16 logits (chunked prefill, then decode steps) vs HF's float32 and bf16 logits."""
    hf, cfg_dict = llama8b_wide_hf(device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (num_seqs, length), generator=gen)
    with torch.inference_mode():
        want32 = hf(ids.to(device)).logits.float().cpu()
        hf = hf.to(torch.bfloat16)
        want16 = hf(ids.to(device)).logits.float().cpu()
    weights = fused_from_hf(hf, cfg_dict)
    mc = ModelConfig.from_hf(cfg_dict)
    ec = EngineConfig(block_size=16, num_kv_blocks=num_seqs * 20 + 16, max_model_len=512, max_num_seqs=8,
                      max_num_batched_tokens=1024)
    runner = ModelRunner(mc, ec, weights, device=device)
    seqs = ids.tolist()
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(num_seqs)]
    ours = [[] for _ in range(num_seqs)]
    for start in range(0, prefill, chunk):    # chunked prefill over the cached context
        sched = [ScheduledRequest(f"s{i}", s[start:start + chunk], start, tables[i], True, GREEDY, s, [])
                 for i, s in enumerate(seqs)]
        logits = runner.logits(SchedulerOutput(sched, num_seqs * chunk)).cpu()
        for i in range(num_seqs):
            ours[i].append(logits[i * chunk:(i + 1) * chunk])
    for pos in range(prefill, length):         # decode steps (CUDA graphs on a GPU)
        sched = [ScheduledRequest(f"s{i}", [s[pos]], pos, tables[i], True, GREEDY, s, []) for i, s in enumerate(seqs)]
        logits = runner.logits(SchedulerOutput(sched, num_seqs)).cpu()
        for i in range(num_seqs):
            ours[i].append(logits[i:i + 1])
    got = torch.stack([torch.cat(o) for o in ours]).float()               # [B, L, V]
    top32 = want32.argmax(-1)
    margin = want32.topk(2, dim=-1).values
    margin = margin[..., 0] - margin[..., 1]
    hf_err = (want16 - want32).abs().amax(-1)
    # Positions where bf16 cannot flip the top-1: float32's top-2 margin exceeds twice the
    # largest deviation of HF's own bf16 logits there.
    sure = margin > 2 * hf_err
    return {
        "num_positions": top32.numel(), "num_sure": int(sure.sum()),
        "ours_vs_fp32_sure": (got.argmax(-1) == top32)[sure].float().mean().item(),
        "ours_vs_fp32": (got.argmax(-1) == top32).float().mean().item(),
        "hf_bf16_vs_fp32": (want16.argmax(-1) == top32).float().mean().item(),
        "ours_vs_hf_bf16": (got.argmax(-1) == want16.argmax(-1)).float().mean().item(),
        "ours_max_err": (got - want32).abs().max().item(), "hf_bf16_max_err": hf_err.max().item(),
        "graph_replays": runner.graphs.num_replays if runner.graphs is not None else 0,
    }


def test_bf16_logits_agree_with_hf_on_gpu() -> None:
    r = teacher_forced_bf16_vs_hf("cuda")
    print("bf16 vs HF:", json.dumps(r))
    assert r["graph_replays"] == 320 - 256
    assert r["num_sure"] >= 512
    assert r["ours_vs_fp32_sure"] >= 0.99
    # Not noisier than HF's own bf16 run, measured against the same float32 reference.
    assert r["ours_vs_fp32"] >= r["hf_bf16_vs_fp32"] - 0.03
    assert r["ours_max_err"] <= 3 * r["hf_bf16_max_err"]


# --- the KV cache's VMM range ---------------------------------------------------------------------
def test_kv_vmm_range_unmap_remap_keeps_addresses_data_and_graphs(tiny_model) -> None:
    mc = _config(tiny_model("llama"))
    kv = KVCache.allocate(mc, 10, 16, torch.bfloat16, "cuda", max_num_blocks=8000)
    assert kv.memory is not None and kv.memory.reserved_bytes >= kv.layout.reserve_bytes
    ptrs = [t.data_ptr() for t in kv.tensors]
    assert all(t.abs().sum().item() == 0 for t in kv.tensors)          # zeroed at allocation
    static = torch.zeros(len(kv.tensors), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(torch.stack([t.float().sum() for t in kv.tensors]))
    for t in kv.tensors:
        t.copy_(torch.randn(t.shape, device="cuda"))
    graph.replay()
    torch.testing.assert_close(static, torch.stack([t.float().sum() for t in kv.tensors]))

    kv.unmap()
    assert not kv.memory.is_mapped and kv.memory.mapped_bytes == 0
    kv.remap()
    assert [t.data_ptr() for t in kv.tensors] == ptrs
    assert all(t.abs().sum().item() == 0 for t in kv.tensors)          # fresh memory, zeroed
    filled = [torch.randn(t.shape, device="cuda").to(torch.bfloat16) for t in kv.tensors]
    for t, f in zip(kv.tensors, filled):
        t.copy_(f)
    graph.replay()                                                      # the captured graph reads the new memory
    torch.testing.assert_close(static, torch.stack([f.float().sum() for f in filled]))
    for t, f in zip(kv.tensors, filled):
        assert torch.equal(t, f)

    pieces = len(kv.memory.pieces)
    kv.grow(5000)                                                       # in place: blocks do not move
    assert len(kv.memory.pieces) > pieces, "growing mapped no new memory"
    assert [t.data_ptr() for t in kv.tensors] == ptrs and kv.num_blocks == 5000
    for t, f in zip(kv.tensors, filled):
        assert torch.equal(t[:, :10], f)
        assert t[:, 10:].abs().sum().item() == 0
        t[:, 4999].fill_(1.0)                                           # the new blocks are usable
    torch.cuda.synchronize()
    kv.close()


# --- serve ---------------------------------------------------------------------------------------
def gpu_env(**extra: str) -> dict[str, str]:
    env = serve_env(**extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_serve_refuses_a_utilization_that_leaves_no_room(tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "llama", "llama")
    out = subprocess.run(
        [sys.executable, "-m", "resident.cli.main", "serve", str(model), "--port", "0", "--preload", "off",
         "--device", "cuda", "--gpu-memory-utilization", "0.001"],
        env=gpu_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "does not fit" in out.stderr and "--gpu-memory-utilization" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_worker_on_cuda_vmm_weights_survives_the_daemon(short_tmp, tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "qwen2", "qwen2")
    helpers = daemon_helpers()
    d = helpers.start_daemon(short_tmp, "--backend", "cuda_vmm", env=gpu_env())
    w = None
    try:
        with d.client("loader") as c:
            helpers.load(c, model)
        w = start_serve(model, tmp_path / "w.log", "--preload", "require", "--socket", d.socket, "--device", "cuda",
                        "--gpu-memory-utilization", "0.5", env=gpu_env())
        assert metric(w.base_url, "resident_worker_info", f'model="{MODEL_NAME}",weights_source="daemon"') == 1
        log = w.log_path.read_text()
        assert "copied" not in log, "weights were copied instead of mapped zero-copy"
        phases = w.phases()
        assert {"cuda_context", "kv_alloc", "graphs"} <= set(phases), phases
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        status, first = http(w.base_url, "POST", "/v1/completions", body)
        assert status == 200, first
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(30)
        time.sleep(0.5)
        status, second = http(w.base_url, "POST", "/v1/completions", body)
        assert status == 200, second
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert w.proc.poll() is None
    finally:
        if w is not None:
            stop_serve(w)
        d.stop()


# --- figures: graph capture and decode step time at the Llama-3-8B shape ----------------------------
def _random_llama8b(num_layers: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": num_layers, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    mc = ModelConfig.from_hf(cfg)
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"model.embed_tokens.weight": (128256, 4096), "model.norm.weight": (4096,),
              "lm_head.weight": (128256, 4096)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (4096,), f"{p}.post_attention_layernorm.weight": (4096,),
                       f"{p}.self_attn.qkv_proj.weight": (6144, 4096), f"{p}.self_attn.o_proj.weight": (4096, 4096),
                       f"{p}.mlp.gate_up_proj.weight": (28672, 4096), f"{p}.mlp.down_proj.weight": (4096, 14336)})
    weights = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        weights[name] = t
    return mc, weights


def test_figures_graph_capture_and_decode_step_time() -> None:
    num_layers = int(os.environ.get("RESIDENT_GPU_BENCH_LAYERS", "32"))
    mc, weights = _random_llama8b(num_layers)
    ec = EngineConfig(block_size=16, num_kv_blocks=32 * 70, max_model_len=1024, max_num_seqs=32,
                      max_num_batched_tokens=8192)
    figures: dict = {"num_layers": num_layers, "context_tokens": 512}
    rng = random.Random(0)
    for mode in ("eager", "off"):
        runner = ModelRunner(mc, ec, weights, device="cuda", cuda_graphs=mode)
        t0 = time.monotonic()
        runner.capture_graphs()
        if mode == "eager":
            figures["capture_total_s"] = time.monotonic() - t0
            figures["capture_s_per_batch_size"] = {str(k): round(v, 4) for k, v in
                                                   sorted(runner.graphs.capture_s.items())}
        for bs in (1, 8, 32):
            prompts = [[rng.randrange(128256) for _ in range(512)] for _ in range(bs)]
            tables = [list(range(i * 70, i * 70 + 70)) for i in range(bs)]
            sched = [ScheduledRequest(f"b{i}", p, 0, tables[i], True, GREEDY, p, []) for i, p in enumerate(prompts)]
            runner.execute(SchedulerOutput(sched, 512 * bs))
            seqs = [list(p) for p in prompts]
            times = []
            for step in range(23):
                batch = [ScheduledRequest(f"b{i}", [7], len(seqs[i]), tables[i], True, GREEDY, seqs[i], [])
                         for i in range(bs)]
                torch.cuda.synchronize()
                t = time.perf_counter()
                runner.execute(SchedulerOutput(batch, bs))   # includes input prep, sampling and its sync
                times.append(time.perf_counter() - t)
                for s in seqs:
                    s.append(7)
            step_ms = sorted(times[3:])[len(times[3:]) // 2] * 1e3
            figures[f"decode_step_ms_bs{bs}_graphs_{mode}"] = round(step_ms, 3)
        runner.close()
    print("GPU figures:", json.dumps(figures))
    path = os.environ.get("RESIDENT_GPU_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
    # Figures only: speed goals live in `resident bench throughput`, never in timed assertions
    # (on the H200 this step time was GPU-bound, so graphs on and off measured within noise).
    assert all(v > 0 for k, v in figures.items() if k.startswith("decode_step_ms"))
