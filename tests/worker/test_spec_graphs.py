"""Speculative verification over static (graph) inputs, and chained greedy draft passes, on CPU.

CUDA graphs cannot run here, so `VerifyGraphs(capture=False)` runs the forward a graph
records, eagerly over the same static buffers: the staging (padding short proposals to K,
bucket padding, slots, tables), the static attention path and the runner's row handling
are what is tested — against the eager verification pass, and end to end against plain
greedy decoding. tests/worker/test_spec_graphs_gpu.py replays real graphs on CUDA.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

# Also run as a script (the Triton interpreter subprocess), where conftest does not set the path.
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from fixtures_models import make_tiny_model  # noqa: E402
from test_spec_decode import run, tokens  # noqa: E402
from weights_util import fused_weights_from_hf_folder  # noqa: E402

from resident.worker.config import ModelConfig  # noqa: E402
from resident.worker.engine import LLMEngine  # noqa: E402
from resident.worker.engine_config import EngineConfig  # noqa: E402
from resident.worker.layers.attention import AttentionMetadata, paged_attention  # noqa: E402
from resident.worker.model_runner import ModelRunner  # noqa: E402
from resident.worker.outputs import ScheduledRequest  # noqa: E402
from resident.worker.sampling_params import SamplingParams  # noqa: E402
from resident.worker.spec_decode.build import build_spec_runner  # noqa: E402
from resident.worker.spec_decode.config import SpecConfig  # noqa: E402
from resident.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from resident.worker.spec_decode.draft_chain import chainable, stage_chain  # noqa: E402
from resident.worker.spec_decode.verify_graphs import (PAD_TOKEN, VerifyGraphs, stage_verify_batch,  # noqa: E402
                                                       verify_batch_sizes, verify_graphs_for)

BS = 4
NUM_BLOCKS = 160
#: The runner gets one block more than the scheduler hands out: the padding block.
ENGINE = EngineConfig(block_size=BS, num_kv_blocks=NUM_BLOCKS, max_model_len=96, max_num_batched_tokens=64,
                      max_num_seqs=8)
RUNNER = EngineConfig(block_size=BS, num_kv_blocks=NUM_BLOCKS + 1, max_model_len=96, max_num_batched_tokens=64,
                      max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def decode(rid: str, token: int, start: int, table: list[int], num_spec: int = 4,
           params: SamplingParams = GREEDY) -> ScheduledRequest:
    return ScheduledRequest(rid, [token], start, table, True, params, [1, 2, 3], [token], num_spec_tokens=num_spec)


# --- staging ---------------------------------------------------------------------------------
def test_staging_pads_short_proposals_and_the_bucket() -> None:
    a = decode("a", 7, start=5, table=[3, 9, 4])          # positions 5..9 fit blocks 3, 9, 4 (12 slots)
    b = decode("b", 8, start=2, table=[6, 2])
    batch = stage_verify_batch([a, b], [[11, 12], []], sizes=(1, 4), query_len=5, block_size=BS, pad_block=50,
                               max_width=30)
    assert batch is not None and (batch.size, batch.num_seqs, batch.query_len) == (4, 2, 5)
    n = 4 * 5
    ids, pos, slots = batch.tokens[:n], batch.tokens[n:2 * n], batch.tokens[2 * n:]
    pad_slot = 50 * BS
    assert ids[:10] == [7, 11, 12, PAD_TOKEN, PAD_TOKEN, 8, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]
    assert pos[:10] == [5, 6, 7, 5, 5, 2, 2, 2, 2, 2]
    # Real tokens into their own slots (position p: block table[p // 4], offset p % 4), padding into the pad slot.
    assert slots[:5] == [9 * BS + 1, 9 * BS + 2, 9 * BS + 3, pad_slot, pad_slot]
    assert slots[5:10] == [6 * BS + 2] + [pad_slot] * 4
    assert ids[10:] == [PAD_TOKEN] * 10 and pos[10:] == [0] * 10 and slots[10:] == [pad_slot] * 10
    assert batch.seq_lens == [10, 7, 5, 5]   # start + Q; bucket rows a context of Q
    # Tables reach start + Q positions (the padded queries' context), padded with the pad block.
    assert batch.width == 3
    assert batch.tables == [3, 9, 4, 6, 2, 50] + [50] * 6
    assert batch.num_real == [3, 1] and batch.row_starts() == [0, 5]


@pytest.mark.parametrize("case", ["prefill", "unsampled", "too_many_drafts", "no_drafts", "no_bucket",
                                  "short_table", "too_wide"])
def test_steps_the_graphs_do_not_run_are_left_to_the_eager_pass(case: str) -> None:
    a = decode("a", 7, start=5, table=[3, 9, 4])
    scheduled, drafts, sizes, width = [a], [[1, 2]], (1, 2), 30
    if case == "prefill":
        scheduled = [ScheduledRequest("p", [1, 2, 3], 0, [5], True, GREEDY, [1, 2, 3], []), a]
        drafts = [[], [1, 2]]
    elif case == "unsampled":
        scheduled = [ScheduledRequest("a", [7], 5, [3, 9], False, GREEDY, [1], [], num_spec_tokens=2)]
    elif case == "too_many_drafts":
        drafts = [[1, 2, 3, 4, 5]]
    elif case == "no_drafts":
        drafts = [[]]
    elif case == "no_bucket":
        scheduled, drafts = [a, a, a], [[1], [1], [1]]
    elif case == "short_table":
        scheduled, drafts = [decode("a", 7, start=5, table=[3, 9])], [[1, 2, 3]]   # position 8: a third block
    elif case == "too_wide":
        width = 2
    assert stage_verify_batch(scheduled, drafts, sizes=sizes, query_len=5, block_size=BS, pad_block=50,
                              max_width=width) is None


def test_verify_buckets_stay_within_the_step_budget() -> None:
    assert verify_batch_sizes(8, 2048, 5) == (1, 2, 4, 8)
    assert verify_batch_sizes(32, 64, 5) == (1, 2, 4, 8)      # 16 x 5 > 64: cut drafts, eager
    assert verify_batch_sizes(4, 2, 5) == (1,)


def test_no_verification_graphs_on_cpu_or_without_graphs(target) -> None:
    cfg, weights = target
    runner = ModelRunner(ModelConfig.from_hf(cfg), RUNNER, weights)
    assert runner.graphs is None and verify_graphs_for(runner, 4) is None
    spec = build_spec_runner(SpecConfig(method="ngram", num_speculative_tokens=4), runner)
    assert spec.verify_graphs is None


# --- static attention ------------------------------------------------------------------------
def test_static_uniform_attention_equals_the_eager_varlen_path() -> None:
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, q_len = 4, 2, 8, 3
    cache = torch.randn(2, 12, BS, hkv, d, generator=g)
    tables = torch.tensor([[1, 5, 7, 0, 0], [2, 3, 0, 0, 0]])
    seq_lens = torch.tensor([11, 6])
    starts = [8, 3]
    q = torch.randn(2 * q_len, hq, d, generator=g)
    k = torch.randn(2 * q_len, hkv, d, generator=g)
    v = torch.randn(2 * q_len, hkv, d, generator=g)
    slots = torch.tensor([int(tables[i, p // BS]) * BS + p % BS
                          for i in range(2) for p in range(starts[i], starts[i] + q_len)])
    qsl = torch.arange(3) * q_len
    for window in (None, 4):
        eager = paged_attention(q, k, v, cache.clone(), AttentionMetadata(slots, qsl, seq_lens, tables), 0.3, window)
        static_cache = cache.clone()
        meta = AttentionMetadata(slots, qsl, seq_lens, tables, static_query_len=q_len)
        static = paged_attention(q, k, v, static_cache, meta, 0.3, window)
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="static metadata"):
        AttentionMetadata(slots[:4], qsl, seq_lens, tables, static_query_len=q_len)


def _triton_static_verify_case() -> None:
    """Under the interpreter: the Triton attention over static verification metadata (tables
    wider than the contexts, as the graphs stage them) equals the reference's eager path."""
    from kernel_batches import make_paged_batch

    from resident.worker.kernels import paged_attention as triton_attention
    from resident.worker.kernels import reference

    hq, hkv, d, q_len = 6, 2, 32, 3
    batch = make_paged_batch([q_len] * 3, [6, 0, 50], num_kv_heads=hkv, head_dim=d, block_size=BS,
                             dtype=torch.float32, seed=21)
    m = batch.meta
    wide = torch.zeros(3, m.block_tables.shape[1] + 5, dtype=torch.int64)
    wide[:, :m.block_tables.shape[1]] = m.block_tables
    static = AttentionMetadata(slot_mapping=m.slot_mapping, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                               block_tables=wide, static_query_len=q_len)
    q = torch.randn(3 * q_len, hq, d, generator=torch.Generator().manual_seed(22))
    for window in (None, 5):
        want = reference.paged_attention(q, batch.kv_cache.clone(), m, d ** -0.5, window)
        got = triton_attention.paged_attention(q, batch.kv_cache, static, d ** -0.5, window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        ref_static = reference.paged_attention(q, batch.kv_cache.clone(), static, d ** -0.5, window)
        torch.testing.assert_close(ref_static, want, atol=2e-5, rtol=0)


def test_triton_attention_over_static_verification_metadata(tmp_path) -> None:
    from test_kernels import run_in_interpreter

    results = run_in_interpreter(__file__, tmp_path)
    assert results == {"static_verify": "ok"}, results


# --- the runner over static inputs vs eager ---------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[dict, dict]:
    path = make_tiny_model(tmp_path_factory.mktemp("specg") / "target", "llama", num_hidden_layers=3, init_std=0.3)
    return json.loads((path / "config.json").read_text()), fused_weights_from_hf_folder(path)


def static_graphs(runner: ModelRunner, k: int) -> VerifyGraphs:
    """What verify_graphs_for builds on a GPU, run eagerly over the static buffers."""
    return VerifyGraphs(runner._forward_logits, num_speculative_tokens=k, max_num_seqs=ENGINE.max_num_seqs,
                        max_num_batched_tokens=ENGINE.max_num_batched_tokens,
                        max_blocks_per_seq=runner.max_blocks_per_seq, block_size=BS, pad_block=NUM_BLOCKS,
                        device=runner.device, capture=False)


def test_static_verification_writes_the_eager_passs_kv_and_logits(target) -> None:
    cfg, weights = target
    mc = ModelConfig.from_hf(cfg)
    runners = [ModelRunner(mc, RUNNER, weights) for _ in range(2)]
    prompts = [[5, 9, 13, 2, 40, 41, 7], [100, 3, 3, 8]]
    tables = [[0, 1, 2, 3], [10, 11, 12]]
    drafts = [[17, 18, 19], [21]]   # K = 4: both padded
    with torch.inference_mode():
        for r in runners:
            prefill = [ScheduledRequest(f"r{i}", p, 0, t, True, GREEDY, p, []) for i, (p, t) in
                       enumerate(zip(prompts, tables))]
            r.forward_logits(prefill, [1, 1])
        step = [decode(f"r{i}", 4 + i, len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]
        chunks = [ScheduledRequest(s.request_id, [s.token_ids[0], *d], s.start_pos, s.block_table, True, GREEDY,
                                   s.prompt_token_ids, s.output_token_ids) for s, d in zip(step, drafts)]
        eager = runners[0].forward_logits(chunks, [4, 2])
        vg = static_graphs(runners[1], 4)
        batch = vg.stage(step, drafts)
        assert batch is not None and batch.size == 2
        static = vg.run(batch)
    assert static.shape == (2 * 5, mc.vocab_size)
    torch.testing.assert_close(static[0:4], eager[0:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(static[5:7], eager[4:6], atol=1e-4, rtol=1e-4)
    # Every slot a request owns holds the same KV; the padded positions only touched the pad block.
    used = sorted({b for t in tables for b in t})
    for a, b in zip(runners[0].kv_cache.tensors, runners[1].kv_cache.tensors):
        torch.testing.assert_close(a[:, used], b[:, used], atol=1e-5, rtol=1e-5)
        others = [i for i in range(NUM_BLOCKS) if i not in used]
        assert not b[:, others].any()


# --- end to end: greedy output equals plain decoding -----------------------------------------
def make_engine(target, spec: SpecConfig | None, draft: dict | None = None, static: bool = True) -> LLMEngine:
    cfg, weights = target
    runner = ModelRunner(ModelConfig.from_hf(cfg), RUNNER, weights)
    if spec is None:
        return LLMEngine(ENGINE, runner)
    spec_runner = build_spec_runner(spec, runner, cfg if spec.method == "draft" else None, draft, seed=0)
    if static:
        spec_runner.verify_graphs = static_graphs(runner, spec.num_speculative_tokens)
    return LLMEngine(ENGINE, spec_runner, num_speculative_tokens=spec.num_speculative_tokens)


def batch_prompts(n: int) -> list[list[int]]:
    pattern = [11, 42, 7, 99, 5, 23]
    g = torch.Generator().manual_seed(7)
    rand = [torch.randint(0, 256, (m,), generator=g).tolist() for m in (5, 13, 22)]
    return ([pattern * 3] + rand)[:n]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("batch", [1, 3])
def test_static_verification_keeps_greedy_output(target, method: str, batch: int) -> None:
    # Different lengths: near its end a request gets fewer drafts than K (padded).
    reqs = {str(i): (p, SamplingParams(temperature=0.0, max_tokens=38 - 3 * i, ignore_eos=True))
            for i, p in enumerate(batch_prompts(batch))}
    plain = run(make_engine(target, None), reqs)
    if method == "ngram":   # proposals mostly shorter than K: padding
        spec = SpecConfig(method="ngram", num_speculative_tokens=5, ngram_prompt_lookup_max=2)
        engine = make_engine(target, spec)
    else:
        noisy = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
                 for k, v in target[1].items()}
        engine = make_engine(target, SpecConfig(method="draft", num_speculative_tokens=4, draft_model="d"), noisy)
    vg, staged = engine.runner.verify_graphs, []
    stage = vg.stage
    vg.stage = lambda *a: staged.append(stage(*a)) or staged[-1]
    out = run(engine, reqs)
    for rid in reqs:
        assert tokens(out[rid]) == tokens(plain[rid])
    padded = any(n < vg.query_len for b in staged if b is not None for n in b.num_real)
    assert padded or (method, batch) == ("draft", 1), "no proposal was padded"
    counts = engine.runner.verify_counts
    assert counts["graphed"] > 0 and counts["eager"] <= counts["graphed"]   # eager only beside prefills
    stats = engine.stats()
    assert stats.spec_num_accepted < stats.spec_num_proposed   # rejections: rolled back
    if method == "draft":
        assert stats.spec_num_accepted > 0


def test_a_failed_capture_falls_back_to_eager_verification(target, caplog) -> None:
    reqs = {str(i): (p, GREEDY) for i, p in enumerate(batch_prompts(2))}
    plain = run(make_engine(target, None), reqs)
    engine = make_engine(target, SpecConfig(method="ngram", num_speculative_tokens=3))
    engine.runner.verify_graphs.capturing = True   # capturing on CPU raises: the runner must carry on eagerly
    with caplog.at_level("WARNING"):
        out = run(engine, reqs)
    for rid in reqs:
        assert tokens(out[rid]) == tokens(plain[rid])
    assert engine.runner.verify_graphs is None and engine.runner.verify_counts["graphed"] == 0
    assert engine.runner.verify_counts["eager"] > 0
    assert "verification runs eagerly from now on" in caplog.text


# --- chained greedy draft passes ---------------------------------------------------------------
def test_chain_staging_advances_positions_over_the_same_tables() -> None:
    a = decode("a", 7, start=5, table=[3, 9, 4], num_spec=4)   # passes feed drafts at positions 6, 7, 8
    b = decode("b", 8, start=2, table=[6, 2], num_spec=4)      # 3, 4, 5
    assert chainable([a, b], 4) and not chainable([a, b], 1)
    assert not chainable([a, decode("c", 1, 0, [1], num_spec=3)], 4)
    assert not chainable([decode("s", 1, 0, [1], params=SamplingParams(temperature=0.5))], 4)
    assert not chainable([decode("p", 1, 0, [1], params=SamplingParams(temperature=0.0, repetition_penalty=1.2))], 4)
    staged = stage_chain([a, b], 3, size=4, block_size=BS, pad_block=50, max_width=10)
    assert staged is not None
    vecs, tables = staged
    assert len(vecs) == 3 * 4 * 4 and tables == [3, 9, 4, 6, 2, 50] + [50] * 6
    first = vecs[:16]
    assert first[:4] == [0, 0, 0, 0]                                    # ids: written on the device
    assert first[4:8] == [6, 3, 0, 0]                                    # positions (bucket rows: 0)
    assert first[8:12] == [9 * BS + 2, 6 * BS + 3, 200, 200]             # slots (bucket rows: the pad slot)
    assert first[12:16] == [7, 4, 1, 1]                                  # context lengths
    assert vecs[32 + 4:32 + 6] == [8, 5] and vecs[32 + 8:32 + 10] == [4 * BS + 0, 2 * BS + 1]
    assert stage_chain([a, b], 3, size=4, block_size=BS, pad_block=50, max_width=2) is None
    assert stage_chain([decode("a", 7, 5, [3, 9])], 3, size=1, block_size=BS, pad_block=50, max_width=10) is None


def cpu_decode_graphs(runner: ModelRunner) -> DecodeGraphs:
    """A CPU stand-in for the draft's decode graphs: the recorded forward run eagerly over the
    static buffers (capturing needs CUDA)."""
    g = DecodeGraphs(runner._forward_logits, max_num_seqs=ENGINE.max_num_seqs,
                     max_blocks_per_seq=runner.max_blocks_per_seq, pad_slot=NUM_BLOCKS * BS, pad_block=NUM_BLOCKS,
                     device=runner.device)
    g.run = lambda size, staged, tables: (g.load(size, staged, tables), g.eager_logits(size))[1]
    runner.graphs, runner.pad_block = g, NUM_BLOCKS
    return g


def test_chained_greedy_draft_passes_propose_what_the_loop_proposes(target) -> None:
    reqs = {str(i): (p, SamplingParams(temperature=0.0, max_tokens=38 - 3 * i, ignore_eos=True))
            for i, p in enumerate(batch_prompts(3))}
    plain = run(make_engine(target, None), reqs)
    noisy = {k: v + 0.02 * v.std() * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
             for k, v in target[1].items()}
    spec = SpecConfig(method="draft", num_speculative_tokens=4, draft_model="d")
    loop = make_engine(target, spec, noisy)
    loop_out = run(loop, reqs)
    chained = make_engine(target, spec, noisy)
    cpu_decode_graphs(chained.runner.draft_runner)
    out = run(chained, reqs)
    for rid in reqs:
        assert tokens(out[rid]) == tokens(plain[rid]) == tokens(loop_out[rid])
    assert chained.runner.proposer._chain.num_chained_passes > 0
    assert loop.runner.proposer._chain.num_chained_passes == 0
    a, b = loop.stats(), chained.stats()
    assert (a.spec_num_proposed, a.spec_num_accepted) == (b.spec_num_proposed, b.spec_num_accepted)


def test_static_verification_with_rejection_sampling_is_reproducible(target) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=30, seed=1234, ignore_eos=True, logprobs=2)
    spec = SpecConfig(method="draft", num_speculative_tokens=3, draft_model="d")
    runs = []
    for static in (True, True, False):
        engine = make_engine(target, spec, target[1], static=static)
        out = run(engine, {"s": (batch_prompts(2)[1], params), "x": (batch_prompts(1)[0], GREEDY)})
        assert all(len(o.logprobs) == len(o.new_token_ids) for o in out["s"])
        runs.append(tokens(out["s"]))
        assert (engine.runner.verify_counts["graphed"] > 0) == static
    assert runs[0] == runs[1] and len(runs[0]) == 30
    assert runs[2] == runs[0]   # the same distribution draws, whichever way verification ran


if __name__ == "__main__":   # the Triton interpreter subprocess of the test above
    from test_kernels import run_cases

    run_cases({"static_verify": _triton_static_verify_case}, sys.argv[1])
