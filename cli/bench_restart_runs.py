"""The timed starts of `resident bench restart` and how they repeat.

One start of each kind: HF transformers (a script in a subprocess that reports its phases),
`resident serve` (ready, first token and /metrics phases, plus the lines of its log that say
where the time went), and the floor (`import torch`, and a CUDA context on cuda, as wall time
and on the process's own clock). `paired` puts a floor process right before each start;
`run_interleaved` runs the variants' starts in turns and reduces each variant to medians.
"""
from __future__ import annotations

import json
import logging
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

_ATTACH = re.compile(r"attached \S+ from the preload daemon in ([0-9.]+) s")
_ATTACH_BREAKDOWN = re.compile(r"attached \S+ from the preload daemon in [0-9.]+ s \(lease \S+; ([^)]+ ms)\)")
#: Worker log lines kept per run: how kv_alloc split (and whether the activation headroom came
#: from the KV profile cache), and the CUDA context made while torch imported.
_KV_BREAKDOWN = re.compile(r"kv_alloc breakdown: (.*)")
_HEADROOM = re.compile(r"kv_alloc breakdown: plan [0-9.]+ s, headroom ([a-z]+)")
_PREINIT = re.compile(r"CUDA context (?:of|pre-creation for) cuda:\d+ .*")
#: The import phase's parts, Triton's start-up work in the background, the warm-up's two passes.
_IMPORTS = re.compile(r"import breakdown: (.*)")
_TRITON = re.compile(r"Triton start-up work .*")
_GEMMS = re.compile(r"GEMM prefetch.*")
_WEIGHTS = re.compile(r"weights breakdown: (.*)")
_WARMUP = re.compile(r"warm-up forward passes done in (.*)")
_CPU = re.compile(r"start-up CPU \(s, [^)]*\): (.*)")
#: Tensor parallel (worker/tp_executor.py): the group's formation on rank 0, each other rank's start.
_TP_GROUP = re.compile(r"tensor-parallel group of \d+ ranks formed in ([0-9.]+) s")
_TP_RANK = re.compile(r"rank (\d+) start-up phases: import=([0-9.]+) group=([0-9.]+) shard=([0-9.]+) source=(\w+)")
_HF_RESULT = "RESIDENT_HF_RESULT "
_HF_SCRIPT = r'''
import json, sys, time
path, device, dtype, t_exec = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
import torch
import transformers
t_import = time.time()
if device == "cuda":
    torch.cuda.init()
    torch.zeros(1, device="cuda")
t_ctx = time.time()
kw = {"dtype": "auto" if dtype == "auto" else getattr(torch, dtype)}
note = ""
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=device, **kw)
except (ImportError, ValueError) as e:  # device_map may need accelerate
    note = f"device_map={device} failed ({e}); loaded, then moved with .to()"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
if device == "cuda":
    torch.cuda.synchronize()
t_weights = time.time()
try:  # a server needs the tokenizer too (resident's worker loads it before /ready)
    ids = transformers.AutoTokenizer.from_pretrained(path)("Hello", return_tensors="pt")["input_ids"].to(device)
except (OSError, ValueError) as e:
    note += f"; no tokenizer ({e}): token ids given"
    ids = torch.tensor([[1, 42, 71, 78, 78, 81]], device=device)
t_loaded = time.time()
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                         do_sample=False, pad_token_id=0)
if device == "cuda":
    torch.cuda.synchronize()
t_tok = time.time()
print("RESIDENT_HF_RESULT " + json.dumps({
    "ready_s": t_loaded - t_exec, "first_token_s": t_tok - t_exec, "new_tokens": int(out.shape[1] - ids.shape[1]),
    "phases": {"import": t_import - t_exec, "cuda_init": t_ctx - t_import, "weights": t_weights - t_ctx,
               "tokenizer": t_loaded - t_weights, "first_token": t_tok - t_loaded},
    "transformers": transformers.__version__, "note": note}),
    flush=True)
'''


def median_s(argv: list[str], runs: int, env: dict[str, str]) -> float:
    """Median wall time of `argv` run `runs` times (the wall-clock floor: teardown included)."""
    times = []
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
        times.append(time.monotonic() - t)
    return statistics.median(times)


#: The floor on the worker's own clock: seconds from the kernel's start of the process (as the
#: worker's "import" phase counts them) to `import torch` done, then to a CUDA context made.
_FLOOR_SCRIPT = r"""
import os, sys, time
def age():
    ticks = int(open("/proc/self/stat").read().rpartition(")")[2].split()[19])
    return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
import torch
t_import = age()
t_cuda = 0.0
if sys.argv[1] == "cuda":
    torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    t_cuda = age() - t_import
print(t_import, t_cuda)
"""


def _floor_once(device: str, env: dict[str, str]) -> tuple[float, float]:
    """One process's (`import torch` done, then CUDA context made) seconds from its start, on
    its own clock (cuda context 0.0 on cpu)."""
    out = subprocess.run([sys.executable, "-c", _FLOOR_SCRIPT, device], check=True, env=env,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def in_process_floor(device: str, runs: int, env: dict[str, str]) -> dict[str, float]:
    """Medians of `import torch` (and CUDA context) measured from process start inside the
    process — comparable with the worker's import / cuda_context phases; the wall-clock floor
    also counts interpreter teardown."""
    imports, contexts = zip(*(_floor_once(device, env) for _ in range(runs)))
    floor = {"import_torch_from_start_s": statistics.median(imports)}
    if device == "cuda":
        floor["cuda_context_after_import_s"] = statistics.median(contexts)
    return floor


def hf_run(model: str, device: str, dtype: str, work: Path, env: dict[str, str], run: int) -> dict:
    """One start of HF transformers (`_HF_SCRIPT` in a subprocess): its ready, first token and phases."""
    script = work / "hf_first_token.py"
    script.write_text(_HF_SCRIPT)
    log_path = work / f"hf-{run}.log"
    t_exec = time.time()
    with open(log_path, "wb") as out:
        proc = subprocess.run([sys.executable, str(script), model, device, dtype, repr(t_exec)], env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log_path.read_text(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith(_HF_RESULT)), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"the HF transformers script exited with code {proc.returncode}:\n{tail}")
    return json.loads(line[len(_HF_RESULT):])


def serve_run(model: str, args: list[str], work: Path, env: dict[str, str], label: str, run: int) -> dict:
    """One start of `resident serve MODEL ARGS`: ready, first token and /metrics phases, with the
    attach time, the TP group's formation and the breakdown lines its log holds."""
    from resident.cli.serve_process import ServeProcess

    w = ServeProcess.start(model, args, work / f"{label}-{run}.log", env)
    try:
        ready = w.wait_ready(timeout_s=600)
        first = w.first_token_s()
        phases = w.phases()
    finally:
        w.kill()
    row = {"ready_s": ready, "first_token_s": first, "phases": phases}
    text = w.log_path.read_text(errors="replace")
    attaches = [float(a) for a in _ATTACH.findall(text)]
    if attaches:
        row["attach_s"] = attaches[0]   # rank 0's (it attaches first); every rank's below under TP
    tp_group = _TP_GROUP.search(text)
    if tp_group:
        row["tp_group_s"] = float(tp_group.group(1))
        row["attach_s_per_rank"] = attaches
        row["tp_ranks"] = [{"rank": int(r), "import_s": float(i), "group_s": float(g), "shard_s": float(sh),
                            "source": src} for r, i, g, sh, src in _TP_RANK.findall(text)]
    for key, pattern, group in (("attach_breakdown", _ATTACH_BREAKDOWN, 1),
                                ("kv_alloc_breakdown", _KV_BREAKDOWN, 1), ("headroom", _HEADROOM, 1),
                                ("cuda_preinit", _PREINIT, 0), ("import_breakdown", _IMPORTS, 1),
                                ("triton_prefetch", _TRITON, 0), ("gemm_prefetch", _GEMMS, 0),
                                ("weights_breakdown", _WEIGHTS, 1),
                                ("warmup_breakdown", _WARMUP, 1), ("cpu_breakdown", _CPU, 1)):
        found = pattern.search(text)
        if found:
            row[key] = found.group(group)
    return row


def _summary(rows: list[dict]) -> dict:
    """A variant's rows with their medians (and each row's seconds after the imports)."""
    out: dict = {"runs": rows}
    for r in rows:   # everything after the imports: the part of a start that is resident's own
        if "import" in r.get("phases", {}):
            r["after_imports_s"] = r["ready_s"] - r["phases"]["import"]
    for k in ("ready_s", "first_token_s", "attach_s", "tp_group_s", "floor_s", "above_floor_s", "after_imports_s"):
        vals = [r[k] for r in rows if k in r]
        if vals:
            out[k] = statistics.median(vals)
    keys = list(dict.fromkeys(k for r in rows for k in r["phases"]))
    out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in keys}
    return out


def paired(device: str, env: dict[str, str], once):
    """`once` with a floor process run right before each start (`_floor_once`): the row gets
    that floor ("floor_s": torch imported + CUDA context, on the floor process's own clock) and
    "above_floor_s" = ready_s - floor_s. The hosts' own `import torch` drifts by up to 1.5 s
    between calls and 0.8 s within one (the H200 machines), so a floor measured once before
    all runs can be off by more than the goal (0.5 s); pairs measured back to back are not."""
    def run(i: int) -> dict:
        imported, context = _floor_once(device, env)
        row = once(i)
        row["floor_s"] = imported + context
        row["above_floor_s"] = row["ready_s"] - row["floor_s"]
        return row

    return run


def run_variant(name: str, runs: int, once) -> dict:
    """`runs` starts of one variant, as `run_interleaved` summarizes them."""
    return run_interleaved(runs, {name: once})[name]


def run_interleaved(runs: int, onces: dict) -> dict[str, dict]:
    """Run i of every variant, then run i + 1 of each: variants compared on one host see the
    same drift (the H200 hosts' start-up times drift by tenths of a second within a call).
    A variant that fails keeps its rows so far and its error; the others go on."""
    rows: dict[str, list[dict]] = {name: [] for name in onces}
    errors: dict[str, str] = {}
    for i in range(runs):
        for name, once in onces.items():
            if name in errors:
                continue
            try:
                rows[name].append(once(i))
            except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
                log.error("variant %s, run %d failed: %s", name, i, e)
                errors[name] = f"{type(e).__name__}: {e}"
    out = {}
    for name in onces:
        summary = _summary(rows[name]) if rows[name] else {}
        out[name] = {"error": errors[name], **summary} if name in errors else summary
    return out
