"""Per-step host time of decode: everything `LLMEngine.step()` does besides the forward pass.

Run: `OMP_NUM_THREADS=1 python tests/worker/bench_host_step.py [--batch-sizes 1,64] [--profile]`.
Not a test (no timed assertions); a rerunnable measurement for the engine loop's host work
(scheduler, input staging, sampling, output processing), which on a GPU shows as the gap
between CUDA graph replays (`resident bench throughput --profile`).

The runner is the real ModelRunner over a tiny random Llama (hidden 64, 2 layers, vocab
32000 like a real tokenizer), with its decode path switched to a CUDA-graph stand-in on
CPU: the staged inputs are loaded into the static buffers (as `DecodeGraphs.load` does) and
fixed random logits come back in place of the replay. So a step runs the production decode
path's host code — `_prepare_graph`, the one staging buffer, the sampler, the scheduler and
the engine's output processing — with no forward pass at all. Batches of `--context`-token
prompts are prefilled eagerly (real forward), then `--steps` greedy decode steps are timed
(the median step is reported).

On CPU the sampler's argmax over [batch, vocab] logits and the logits copy are real work
(GPU kernels on a GPU, not host time there), and in a step they run slower than alone (cold
caches), so at vocab 32000 and batch 64 they swamp the Python host time; subtracting their
stand-alone time is only a rough correction. `--vocab 256` measures the host work itself.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures_models import make_tiny_model  # noqa: E402
from weights_util import fused_weights_from_hf_folder  # noqa: E402

from resident.worker.config import ModelConfig  # noqa: E402
from resident.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from resident.worker.engine import LLMEngine  # noqa: E402
from resident.worker.engine_config import EngineConfig  # noqa: E402
from resident.worker.model_runner import ModelRunner  # noqa: E402
from resident.worker.sampling_params import SamplingParams  # noqa: E402

VOCAB = 32000   # default; --vocab 256 leaves out most of the CPU's argmax (a GPU kernel)


class FakeReplay(DecodeGraphs):
    """DecodeGraphs on CPU: loads the staged batch like the real one, replays nothing."""

    def __init__(self, vocab: int, **kw) -> None:
        super().__init__(lambda *a: None, **kw)
        self.logits = torch.randn(max(self.sizes), vocab, generator=torch.Generator().manual_seed(0))

    def run(self, size, staged, staged_tables):
        self.load(size, staged, staged_tables)
        self.num_replays += 1
        return self.logits[:size]


def build_engine(model_dir: Path, batch: int, context: int, steps: int, vocab: int) -> LLMEngine:
    import json

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    bs = 16
    max_len = context + steps + 64
    per_seq = -(-max_len // bs)
    # One block more than the engine's: the padding sink, as on a GPU.
    ec = EngineConfig(block_size=bs, num_kv_blocks=per_seq * batch + 1, max_num_seqs=batch,
                      max_num_batched_tokens=2048, max_model_len=max_len, enable_prefix_caching=True)
    runner = ModelRunner(cfg, ec, fused_weights_from_hf_folder(model_dir))
    runner.pad_block = ec.num_kv_blocks - 1
    runner.graphs = FakeReplay(vocab, max_num_seqs=batch, max_blocks_per_seq=ec.max_num_blocks_per_seq,
                               pad_slot=runner.pad_block * bs, pad_block=runner.pad_block,
                               device=runner.device, mode="eager")
    engine = LLMEngine(ec, runner)
    engine.scheduler.block_manager.num_blocks -= 1   # keep the padding block out of the engine's hands
    engine.scheduler.block_manager._free_queue.pop(runner.pad_block)
    return engine


def measure(model_dir: Path, batch: int, context: int, steps: int, profile: str | None, vocab: int) -> float:
    engine = build_engine(model_dir, batch, context, steps, vocab)
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(context)], params)
    while engine.scheduler.running == [] or any(r.num_output_tokens == 0 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == batch, "a step did not decode every request"
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats(profile).print_stats(30)
    return statistics.median(times)   # the median: this machine's other load shows as spikes


def stand_in_kernels_s(batch: int, vocab: int, repeats: int = 50) -> float:
    """What the sampler's tensor work on [batch, VOCAB] logits costs on this CPU (a kernel on a
    GPU, not host time there): the logits copy and the greedy argmax."""
    logits = torch.randn(batch, vocab)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        logits.clone().argmax(dim=-1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=VOCAB,
                    help="vocabulary of the tiny model; the CPU's argmax over it is not host time on a GPU")
    ap.add_argument("--profile", choices=["tottime", "cumulative"],
                    help="cProfile the timed steps (adds overhead), sorted by this column")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "m", "llama", vocab_size=args.vocab, max_position_embeddings=4096)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            step_s = measure(model_dir, b, args.context, args.steps, args.profile, args.vocab)
            kernels_s = stand_in_kernels_s(b, args.vocab)
            print(f"batch {b:3d}, context {args.context}, vocab {args.vocab}: median {step_s * 1e3:.3f} ms per "
                  f"decode step, of which "
                  f"{kernels_s * 1e3:.3f} ms the CPU's greedy argmax + logits copy (GPU kernels on a GPU): "
                  f"~{(step_s - kernels_s) * 1e3:.3f} ms host work")


if __name__ == "__main__":
    main()
