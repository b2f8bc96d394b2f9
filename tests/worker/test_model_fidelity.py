"""Fidelity against HF transformers on identical weights, in float32.

For tiny random checkpoints of each supported architecture and for the real SmolLM2-135M,
through the ModelRunner (paged KV cache, chunked prefill, batched decode, shuffled block
tables), with weights built two ways: fused with torch.cat (the layout rules alone) and
through the daemon's loader into host_shm memfds mapped as a client maps them.

- teacher-forced logits over prompt + a 64-token greedy continuation within 1e-3 of HF's;
- greedy tokens identical wherever HF's top-2 margin exceeds 1e-3, both teacher-forced
  and when generating freely through `execute` (up to HF's first near-tie).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fixtures_models import make_tiny_model
from weights_util import fused_weights_from_hf_folder

from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-3
MARGIN = 1e-3
NUM_CONTINUATION = 64
BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_CONTINUATION)

TINY = {
    "llama": {},
    "llama3": {},
    "qwen2": {},
    "qwen3": {},
    # A window shorter than the sequence, so the sliding-window mask is exercised.
    "mistral": {"sliding_window": 24},
}
SOURCES = ("fused_cat", "daemon_loader")


@dataclass
class Reference:
    path: Path
    config: dict
    prompts: list[list[int]]            # two prompts, run side by side in one batch
    continuations: list[list[int]]      # HF greedy continuations
    logits: list[torch.Tensor]          # HF teacher-forced logits over prompt + continuation


def hf_reference(path: Path, prompts: list[list[int]]) -> Reference:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    continuations, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            cont = [tok]
            for _ in range(NUM_CONTINUATION - 1):
                out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
                cont.append(tok)
            continuations.append(cont)
            logits.append(model(torch.tensor([prompt + cont])).logits[0].float())
    config = json.loads((path / "config.json").read_text())
    return Reference(path, config, prompts, continuations, logits)


def load_weights(path: Path, source: str) -> dict[str, torch.Tensor]:
    if source == "fused_cat":
        return fused_weights_from_hf_folder(path, torch.float32)
    from resident.daemon.loader import LoadSpec, load
    from resident.daemon.memory import get_backend

    backend = get_backend("host_shm")
    loaded = load(LoadSpec(model=str(path), dtype="float32"), backend)
    try:
        slabs = [type(backend).import_slab(s.desc, s.export_fd()) for s in loaded.slabs]
    finally:
        for s in loaded.slabs:
            s.close()
    return loaded.table.views(slabs)


def make_runner(config: dict, path: Path, source: str, longest: int) -> ModelRunner:
    per_seq = -(-longest // BLOCK_SIZE)
    engine_config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=4 * per_seq + 2, max_model_len=longest)
    return ModelRunner(ModelConfig.from_hf(config), engine_config, load_weights(path, source))


def shuffled_tables(num_blocks: int, per_seq: int, count: int, seed: int) -> list[list[int]]:
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    return [blocks[i * per_seq:(i + 1) * per_seq] for i in range(count)]


def teacher_forced(runner: ModelRunner, sequences: list[list[int]], tables: list[list[int]],
                   chunks: list[int]) -> list[torch.Tensor]:
    """Logits for every position of each sequence, run side by side in chunks then 1-token steps."""
    done = [0] * len(sequences)
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    step = 0
    while any(d < len(s) for d, s in zip(done, sequences)):
        scheduled = []
        for i, seq in enumerate(sequences):
            if done[i] >= len(seq):
                continue
            n = chunks[step] if step < len(chunks) else 1
            # Sequences take different chunk lengths, so prefill and decode share batches.
            n = max(1, min(n + 3 * i, len(seq) - done[i]))
            toks = seq[done[i]:done[i] + n]
            scheduled.append(ScheduledRequest(f"r{i}", toks, done[i], tables[i], False, GREEDY, seq, []))
        logits = runner.logits(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled)))
        offset = 0
        for s in scheduled:
            i = int(s.request_id[1:])
            got[i].append(logits[offset:offset + len(s.token_ids)])
            offset += len(s.token_ids)
            done[i] += len(s.token_ids)
        step += 1
    return [torch.cat(g) for g in got]


def generate(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> list[list[int]]:
    """Greedy generation through execute(): two-chunk prefill, then batched decode."""
    outputs: list[list[int]] = [[] for _ in prompts]
    cut = [len(p) // 2 for p in prompts]
    first = [ScheduledRequest(f"g{i}", p[:cut[i]], 0, tables[i], False, GREEDY, p, []) for i, p in enumerate(prompts)]
    assert runner.execute(SchedulerOutput(first, sum(cut))).sampled == {}
    pending = [(p[cut[i]:], cut[i]) for i, p in enumerate(prompts)]
    while any(len(o) < NUM_CONTINUATION for o in outputs):
        scheduled = [
            ScheduledRequest(f"g{i}", toks, start, tables[i], True, GREEDY, prompts[i], outputs[i])
            for i, (toks, start) in enumerate(pending) if len(outputs[i]) < NUM_CONTINUATION
        ]
        sampled = runner.execute(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled))).sampled
        for s in scheduled:
            i = int(s.request_id[1:])
            tok = sampled[s.request_id]
            start = s.start_pos + len(s.token_ids)
            outputs[i].append(tok)
            pending[i] = ([tok], start)
    return outputs


def check_fidelity(ref: Reference, source: str, chunks: list[int]) -> None:
    longest = max(len(p) + NUM_CONTINUATION for p in ref.prompts)
    runner = make_runner(ref.config, ref.path, source, longest)
    sequences = [p + c for p, c in zip(ref.prompts, ref.continuations)]
    per_seq = runner.engine_config.max_num_blocks_per_seq
    tables = shuffled_tables(runner.num_blocks, per_seq, 4, seed=len(sequences[0]))
    ours = teacher_forced(runner, sequences, tables[:2], chunks)
    for seq, mine, theirs in zip(sequences, ours, ref.logits):
        assert mine.shape == theirs.shape
        err = (mine - theirs).abs().max().item()
        assert err <= LOGIT_TOL, f"max |logit diff| {err:.2e} > {LOGIT_TOL}"
        top2 = theirs.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > MARGIN
        assert decisive.float().mean() > 0.9, "reference logits too flat for a meaningful greedy check"
        assert torch.equal(mine.argmax(-1)[decisive], theirs.argmax(-1)[decisive])

    generated = generate(runner, ref.prompts, tables[2:])
    for prompt, cont, gen, theirs in zip(ref.prompts, ref.continuations, generated, ref.logits):
        top2 = theirs[len(prompt) - 1:].topk(2, dim=-1).values
        near_tie = ((top2[:, 0] - top2[:, 1]) <= MARGIN).nonzero()
        upto = int(near_tie[0]) + 1 if len(near_tie) else NUM_CONTINUATION
        assert gen[:upto] == cont[:upto]


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_reference(request, tmp_path_factory) -> Reference:
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, **TINY[arch])
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (21, 13)]
    return hf_reference(path, prompts)


@pytest.mark.parametrize("source", SOURCES)
def test_tiny_models_match_hf(tiny_reference: Reference, source: str) -> None:
    check_fidelity(tiny_reference, source, chunks=[7, 9, 20])


@pytest.fixture(scope="module")
def smollm2_reference(default_model_dir: Path) -> Reference:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    texts = [
        "The capital of France is Paris. The capital of Germany is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
    ]
    return hf_reference(default_model_dir, [tok.encode(t).ids for t in texts])


@pytest.mark.parametrize("source", SOURCES)
def test_smollm2_matches_hf(smollm2_reference: Reference, source: str) -> None:
    check_fidelity(smollm2_reference, source, chunks=[5, 11, 17])


def test_sliding_window_is_applied(tmp_path: Path) -> None:
    """The Mistral window changes logits beyond it (so the fidelity check is not vacuous)."""
    path = make_tiny_model(tmp_path / "w", "mistral", sliding_window=24)
    config = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_hf(config).sliding_windows == (24, 24)
    windowed = make_runner(config, path, "fused_cat", 64)
    full = make_runner({**config, "sliding_window": None}, path, "fused_cat", 64)
    prompt = [torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3)).tolist()]
    table = [list(range(windowed.engine_config.max_num_blocks_per_seq))]
    a = teacher_forced(windowed, prompt, table, [60])[0]
    b = teacher_forced(full, prompt, table, [60])[0]
    assert torch.allclose(a[:24], b[:24], atol=1e-5)
    assert (a[30:] - b[30:]).abs().max() > 1e-2
