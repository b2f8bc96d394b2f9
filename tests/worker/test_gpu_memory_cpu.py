"""GPU-path logic that needs no GPU: the --gpu-memory-utilization arithmetic and fit error,
the VMM KV layout, CUDA-graph batch buckets, and the padded static-decode batch a graph
replays (run eagerly on CPU: the real rows' logits must equal an unpadded eager step's)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.cuda_graphs import (DecodeGraphs, bucket_for, capture_all, capture_at_start, check_mode,
                                         graph_batch_sizes, startup_sizes)
from resident.worker.engine_config import EngineConfig
from resident.worker.input_batch import HostToDevice
from resident.worker.kv_sizing import GpuMemoryBudget, KVLayout, ModelDoesNotFit, kv_blocks_for_budget
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams
from resident.worker.serve_config import ServeConfig

GiB, MiB = 1 << 30, 1 << 20
# Llama-3-8B: 32 layers, 8 kv heads x 128, bf16, 16-token blocks -> 32 KiB per block per (layer, k|v).
LLAMA8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, itemsize=2, granularity=2 * MiB)


def test_budget_is_utilization_minus_everything_already_used_minus_headroom() -> None:
    b = GpuMemoryBudget(total_bytes=140 * GiB, used_bytes=17 * GiB, utilization=0.9, headroom_bytes=3 * GiB)
    assert b.limit_bytes == int(140 * GiB * 0.9)
    assert b.kv_bytes == int(140 * GiB * 0.9) - 20 * GiB
    layout = KVLayout(**LLAMA8B, max_num_blocks=8192 * 64)
    blocks = kv_blocks_for_budget(b, layout, min_blocks=512)
    # 2 x 32 segments, each mapped in whole 2 MiB pages, one block kept back for graph padding.
    per_segment = b.kv_bytes // 64 // (2 * MiB) * (2 * MiB)
    assert blocks == per_segment // (32 * 1024) - 1
    assert layout.total_bytes(blocks + 1) <= b.kv_bytes


def test_kv_cache_is_capped_by_what_the_sequences_can_use() -> None:
    b = GpuMemoryBudget(total_bytes=140 * GiB, used_bytes=1 * GiB, utilization=1.0, headroom_bytes=0)
    layout = KVLayout(**LLAMA8B, max_num_blocks=1000)
    assert kv_blocks_for_budget(b, layout, min_blocks=10) == 999


def test_fit_error_names_the_bytes_and_the_flags() -> None:
    # 16 GB of weights on an 80 GB card at 20 %: nothing is left for the KV cache.
    b = GpuMemoryBudget(total_bytes=80 * GiB, used_bytes=17 * GiB, utilization=0.2, headroom_bytes=2 * GiB)
    layout = KVLayout(**LLAMA8B, max_num_blocks=8192)
    with pytest.raises(ModelDoesNotFit) as e:
        kv_blocks_for_budget(b, layout, min_blocks=512)
    msg = str(e.value)
    for needle in ("does not fit", "MiB", "--gpu-memory-utilization", "--max-model-len", "in use 17.00 GiB"):
        assert needle in msg, msg
    # Just enough: 512 blocks (+1 padding) of 32 KiB in 64 segments of whole 2 MiB pages.
    need = layout.total_bytes(513)
    ok = GpuMemoryBudget(total_bytes=80 * GiB, used_bytes=17 * GiB, utilization=1.0,
                         headroom_bytes=63 * GiB - need)
    assert kv_blocks_for_budget(ok, layout, min_blocks=512) >= 512


@pytest.mark.parametrize("util", [0.0, -0.1, 1.5])
def test_utilization_outside_0_1_is_refused(util) -> None:
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        GpuMemoryBudget(total_bytes=GiB, used_bytes=0, utilization=util, headroom_bytes=0)
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        ServeConfig(model="m", preload="off", gpu_memory_utilization=util)


def test_serve_config_checks_device_and_graph_mode() -> None:
    assert ServeConfig(model="m", preload="off").device == "auto"
    for device in ("cpu", "cuda", "cuda:3", "auto"):
        ServeConfig(model="m", preload="off", device=device)
    with pytest.raises(ValueError, match="auto | cpu | cuda"):
        ServeConfig(model="m", preload="off", device="gpu0")
    with pytest.raises(ValueError, match="eager, lazy, off"):
        ServeConfig(model="m", preload="off", cuda_graphs="sometimes")
    assert check_mode("off") == "off"


def test_layout_segments_leave_room_to_grow() -> None:
    layout = KVLayout(**LLAMA8B, max_num_blocks=1000)
    assert layout.block_bytes == 32 * 1024
    assert layout.segment_bytes == 32 * MiB  # 1000 x 32 KiB rounded up to 2 MiB pages
    assert layout.reserve_bytes == 64 * 32 * MiB
    assert layout.mapped_segment_bytes(1) == 2 * MiB
    assert layout.mapped_segment_bytes(64) == 2 * MiB and layout.mapped_segment_bytes(65) == 4 * MiB
    assert layout.blocks_in(layout.total_bytes(65)) == 128  # the rounding is used, not wasted
    with pytest.raises(ValueError, match="outside"):
        layout.mapped_segment_bytes(1001)


def test_graph_buckets() -> None:
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(1) == (1,)
    sizes = graph_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert bucket_for(21, sizes) is None


def test_sizes_captured_at_start_per_mode() -> None:
    sizes = graph_batch_sizes(24)
    assert startup_sizes(sizes, "eager") == (1, 2, 4, 8, 16, 24)
    assert startup_sizes(sizes, "lazy") == (1, 2, 4, 8)
    assert startup_sizes(sizes, "off") == ()
    captured: list[int] = []
    assert capture_at_start(captured.append, sizes, "lazy") >= 0
    assert captured == [8, 4, 2, 1]   # largest first: the others' memory comes from its pool
    captured.clear()
    assert capture_all(captured.append, (2, 16, 1)) >= 0
    assert captured == [16, 2, 1]


def test_host_to_device_splits_one_buffer_and_grows() -> None:
    h2d = HostToDevice(torch.device("cpu"), capacity=4)
    a, b, c = h2d.send([[1, 2, 3], [], [4, 5, 6, 7, 8]])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [] and c.tolist() == [4, 5, 6, 7, 8]
    assert h2d.capacity >= 8


# --- the padded static-decode batch, eagerly on CPU --------------------------------------
BS = 4
ENGINE = EngineConfig(block_size=BS, num_kv_blocks=80, max_model_len=64, max_num_seqs=12,
                      max_num_batched_tokens=512)


def _graph_runner(model_dir) -> tuple[ModelRunner, ModelRunner]:
    mc = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    weights = fused_weights_from_hf_folder(model_dir)
    eager = ModelRunner(mc, ENGINE, weights)
    padded = ModelRunner(mc, ENGINE, weights)
    # A CPU runner has no padding block: lend it the last block, which no request here uses.
    padded.pad_block = ENGINE.num_kv_blocks - 1
    padded.graphs = DecodeGraphs(padded._forward_logits, max_num_seqs=ENGINE.max_num_seqs,
                                 max_blocks_per_seq=ENGINE.max_num_blocks_per_seq, pad_slot=padded.pad_block * BS,
                                 pad_block=padded.pad_block, device=torch.device("cpu"), mode="lazy")
    return eager, padded


def _static_logits(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> torch.Tensor:
    batch = runner._prepare(scheduled)
    assert batch.graph_size == bucket_for(len(scheduled), runner.graphs.sizes)
    runner.graphs.load(batch.graph_size, batch.graph_vec, batch.graph_tables)
    with torch.inference_mode():
        return runner.graphs.eager_logits(batch.graph_size)[: len(scheduled)]


def test_padded_static_decode_equals_the_eager_step(tiny_model) -> None:
    """Decode batches of 1..9 requests padded to their bucket (stale table entries from larger
    earlier batches included) give the eager step's logits for every real row."""
    eager, padded = _graph_runner(tiny_model("mistral", sliding_window=12))
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0)
    n = 9
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(n)]
    seqs = [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(n)]
    prefill = [ScheduledRequest(f"r{i}", s, 0, tables[i], True, greedy, s, []) for i, s in enumerate(seqs)]
    out = SchedulerOutput(prefill, sum(map(len, seqs)))
    assert torch.equal(eager.logits(out), padded.logits(out))  # prefill: both eager
    for size in (9, 3, 1, 5, 9, 2):
        rows = rng.sample(range(n), size)
        step = []
        for i in rows:
            tok = rng.randrange(256)
            step.append(ScheduledRequest(f"r{i}", [tok], len(seqs[i]), tables[i], True, greedy, seqs[i], []))
            seqs[i].append(tok)
        want = eager.logits(SchedulerOutput(step, size))
        got = _static_logits(padded, step)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The padding rows wrote only into the padding block.
    pad = padded.pad_block
    for t_eager, t_padded in zip(eager.kv_cache.tensors, padded.kv_cache.tensors):
        torch.testing.assert_close(t_padded[:, :pad], t_eager[:, :pad], atol=1e-5, rtol=1e-5)
