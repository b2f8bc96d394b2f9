"""`resident bench attach`: attach latency vs model size on host_shm, and load throughput.

For each size it writes a synthetic Llama-shaped bf16 checkpoint (random weights,
safetensors + config.json) to a temporary folder, loads it into a private daemon (load
throughput = resident bytes / load time as the daemon reports it), then attaches it
`--repeats` times, each from a fresh client session. Attach latency is the wall time of
`Client.attach`: the Attach RPC, receiving the slab fds, mapping them and validating the
tensor table; the session's hello (`connect`) is timed separately. `--fresh` more attaches
each run in a new Python process that has imported torch (as a worker has) but nothing of
resident: what a restarted worker pays — `Client()` with its imports, then the first attach
with the lazy imports behind it. `--layers` sets the layer count (48 layers = a 291-entry
table, the Llama-3-8B table's size with fp8 scales).
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from resident.cli.bench_common import output_file
from resident.cli.common import SIZE, format_bytes, format_table, gb_per_s, parse_size

log = logging.getLogger(__name__)

NUM_LAYERS = 8
#: hidden sizes are multiples of this; heads of 64 where the head count divides by 4 (GQA 4:1)
HIDDEN_STEP = 64


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-3-like shape (GQA 4:1, intermediate 4x hidden, vocab 8x hidden, untied)."""

    hidden_size: int
    num_hidden_layers: int = NUM_LAYERS

    def __post_init__(self) -> None:
        if self.hidden_size <= 0 or self.hidden_size % HIDDEN_STEP:
            raise ValueError(f"hidden_size must be a positive multiple of {HIDDEN_STEP}, got {self.hidden_size}")
        if self.num_hidden_layers <= 0:
            raise ValueError(f"num_hidden_layers must be positive, got {self.num_hidden_layers}")

    @property
    def intermediate_size(self) -> int:
        return 4 * self.hidden_size

    @property
    def vocab_size(self) -> int:
        return 8 * self.hidden_size

    @property
    def num_attention_heads(self) -> int:
        heads = self.hidden_size // 64
        return heads if heads % 4 == 0 else 4

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads // 4

    @classmethod
    def for_bytes(cls, nbytes: int, bytes_per_param: int = 2, num_hidden_layers: int = NUM_LAYERS) -> LlamaShape:
        # params ≈ layers * 14.5 h² (q; k, v at 1/4; o; gate, up, down) + 16 h² (embed + lm_head)
        h = math.sqrt(nbytes / bytes_per_param / (num_hidden_layers * 14.5 + 16))
        return cls(hidden_size=max(HIDDEN_STEP, round(h / HIDDEN_STEP) * HIDDEN_STEP),
                   num_hidden_layers=num_hidden_layers)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (v, h)
        return shapes

    def config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        }


def write_checkpoint(folder: Path, shape: LlamaShape, seed: int = 0) -> int:
    """Random bf16 weights (norms near 1) as model.safetensors + config.json; returns bytes."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, dims in shape.tensor_shapes().items():
        t = torch.randn(dims, generator=gen, dtype=torch.float32)
        tensors[name] = (1.0 + 0.1 * t if "norm" in name else 0.02 * t).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=2))
    return sum(t.nbytes for t in tensors.values())


def _stats_ms(samples_s: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples_s)
    p90 = ms[min(len(ms) - 1, math.ceil(0.9 * len(ms)) - 1)]
    return {"median": statistics.median(ms), "p90": p90, "min": ms[0], "max": ms[-1], "samples": ms}


@dataclass
class SizeResult:
    requested_bytes: int
    checkpoint_bytes: int
    resident_bytes: int
    num_tensors: int
    hidden_size: int
    load_s: float
    load_wall_s: float
    load_gb_s: float
    connect_ms: dict
    attach_ms: dict
    fresh_connect_ms: dict | None = None
    fresh_attach_ms: dict | None = None


#: Run in a fresh interpreter: torch first (untimed; a worker has it), then Client() and attach.
_FRESH_SCRIPT = """
import json, sys, time
import torch
t0 = time.perf_counter()
from resident.daemon.client import Client
client = Client(sys.argv[1], client_name="bench-attach-fresh")
t1 = time.perf_counter()
model = client.attach(sys.argv[2], expected_key=sys.argv[3])
t2 = time.perf_counter()
n = len(model.tensors)
client.close()
print(json.dumps({"connect_s": t1 - t0, "attach_s": t2 - t1, "num_tensors": n}))
"""


def _fresh_attaches(socket: str, name: str, key: str, repeats: int, num_tensors: int) -> tuple[dict, dict]:
    connect_s, attach_s = [], []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", _FRESH_SCRIPT, socket, name, key], capture_output=True,
                           text=True, timeout=300, env=env)
        if r.returncode != 0:
            raise click.ClickException(f"fresh-process attach of {name} failed: {r.stderr.strip()[-2000:]}")
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        if doc["num_tensors"] != num_tensors:
            raise click.ClickException(f"fresh-process attach of {name} returned {doc['num_tensors']} tensors, "
                                       f"expected {num_tensors}")
        connect_s.append(doc["connect_s"])
        attach_s.append(doc["attach_s"])
    return _stats_ms(connect_s), _stats_ms(attach_s)


def _measure(client_cls, socket: str, folder: Path, name: str, requested: int, shape: LlamaShape,
             checkpoint_bytes: int, repeats: int, fresh: int = 0) -> SizeResult:
    with client_cls(socket, client_name="bench-attach-loader") as loader:
        t = time.perf_counter()
        final = None
        for event in loader.load(str(folder), name=name):
            if event.done:
                final = event
        load_wall_s = time.perf_counter() - t
    if final is None:
        raise click.ClickException(f"the daemon ended the load of {folder} without a result")
    info = final.model
    load_s = final.elapsed_s or load_wall_s
    connect_s, attach_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client = client_cls(socket, client_name="bench-attach")
        t1 = time.perf_counter()
        try:
            attached = client.attach(name, expected_key=info.key)
            t2 = time.perf_counter()
            if len(attached.tensors) != info.num_tensors:
                raise click.ClickException(f"attach of {name} returned {len(attached.tensors)} tensors, "
                                           f"expected {info.num_tensors}")
        finally:
            client.close()
        connect_s.append(t1 - t0)
        attach_s.append(t2 - t1)
    fresh_connect = fresh_attach = None
    if fresh:
        fresh_connect, fresh_attach = _fresh_attaches(socket, name, info.key, fresh, info.num_tensors)
    return SizeResult(
        requested_bytes=requested, checkpoint_bytes=checkpoint_bytes, resident_bytes=info.nbytes,
        num_tensors=info.num_tensors, hidden_size=shape.hidden_size, load_s=load_s,
        load_wall_s=load_wall_s, load_gb_s=gb_per_s(info.nbytes, load_s),
        connect_ms=_stats_ms(connect_s), attach_ms=_stats_ms(attach_s),
        fresh_connect_ms=fresh_connect, fresh_attach_ms=fresh_attach,
    )


def _machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()}


def _parse_sizes(text: str) -> list[tuple[str, int]]:
    """'16MiB,1GiB' -> [('16MiB', 16777216), ('1GiB', 1073741824)]."""
    labels = [s.strip() for s in text.split(",") if s.strip()]
    try:
        sizes = [(label, parse_size(label)) for label in labels]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sizes") from None
    if not sizes or any(n <= 0 for _, n in sizes):
        raise click.BadParameter("give one or more positive sizes, e.g. 16MiB,256MiB,1GiB", param_hint="--sizes")
    return sizes


@click.command("attach")
@click.option("--sizes", default="16MiB,256MiB,1GiB", show_default=True,
              help="Comma-separated checkpoint sizes (bf16), e.g. 1MiB,64MiB,2GiB.")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="Attaches per size, each from a fresh client session.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              default=None,
              help="Write the results as JSON to this file.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the synthetic checkpoints (default: a temporary folder, removed after).")
@click.option("--max-bytes", type=SIZE, default=0, help="Daemon --max-bytes (default: unlimited).")
@click.option("--layers", type=click.IntRange(min=1), default=NUM_LAYERS, show_default=True,
              help="Decoder layers of the synthetic model (table entries: 6 per layer + 3; 48 gives 291).")
@click.option("--fresh", type=click.IntRange(min=0), default=3, show_default=True,
              help="More attaches per size, each from a new process that has imported torch only "
                   "(Client() with its imports, then the first attach).")
def bench_attach(sizes: str, repeats: int, json_path: Path | None, work_dir: Path | None, max_bytes: int,
                 layers: int, fresh: int) -> None:
    """Attach latency vs model size on host_shm, and load throughput in GB/s."""
    from resident.cli.daemon_process import DaemonStartError, start_detached, wait_exit
    from resident.daemon.client import Client
    from resident.daemon.config import DaemonConfig
    from resident.daemon.errors import DaemonError

    requested = _parse_sizes(sizes)
    sock_dir = Path(tempfile.mkdtemp(prefix="rsb-", dir="/tmp"))   # short: Unix socket path limit
    data_dir = work_dir or Path(tempfile.mkdtemp(prefix="resident-bench-attach-"))
    config = DaemonConfig(socket=str(sock_dir / "preload.sock"), http="", backend="host_shm",
                          max_bytes=max_bytes)
    results: list[SizeResult] = []
    pid = 0
    try:
        folders = []
        for label, size in requested:
            shape = LlamaShape.for_bytes(size, num_hidden_layers=layers)
            folder = data_dir / f"llama-{label}"
            t = time.perf_counter()
            nbytes = write_checkpoint(folder, shape)
            click.echo(f"wrote {folder.name}: {format_bytes(nbytes)} (hidden {shape.hidden_size}) "
                       f"in {time.perf_counter() - t:.1f} s", err=True)
            folders.append((size, shape, folder, nbytes))
        try:
            pid = start_detached(config, str(sock_dir / "daemon.log"), timeout_s=120.0).pid
        except DaemonStartError as e:
            raise click.ClickException(str(e)) from None
        for size, shape, folder, nbytes in folders:
            try:
                r = _measure(Client, config.socket, folder, folder.name, size, shape, nbytes, repeats, fresh)
            except DaemonError as e:   # e.g. a --max-bytes below the checkpoint: the message says what to raise
                raise click.ClickException(f"{folder.name}: {e}") from None
            click.echo(f"{folder.name}: load {r.load_gb_s:.2f} GB/s, attach median "
                       f"{r.attach_ms['median']:.2f} ms", err=True)
            results.append(r)
    finally:
        if pid:
            try:
                with Client(config.socket, client_name="bench-attach") as c:
                    c.shutdown()
            except Exception as e:  # noqa: BLE001 - fall back to a signal below
                log.warning("Shutdown of the bench daemon failed (%s); sending SIGTERM", e)
                os.kill(pid, 15)
            wait_exit(pid, config.socket, 30.0)
        shutil.rmtree(sock_dir, ignore_errors=True)
        if work_dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)

    def fresh_ms(stats: dict | None) -> str:
        return f"{stats['median']:.2f}" if stats else "-"

    rows = [(format_bytes(r.resident_bytes), r.num_tensors, f"{r.load_s:.3f}", f"{r.load_gb_s:.2f}",
             f"{r.connect_ms['median']:.2f}", f"{r.attach_ms['median']:.2f}", f"{r.attach_ms['p90']:.2f}",
             fresh_ms(r.fresh_connect_ms), fresh_ms(r.fresh_attach_ms))
            for r in results]
    click.echo(format_table(("SIZE", "TENSORS", "LOAD S", "LOAD GB/S", "CONNECT MS", "ATTACH MS p50",
                             "ATTACH MS p90", "FRESH CONNECT MS", "FRESH ATTACH MS"), rows))
    if json_path is not None:
        doc = {"benchmark": "attach", "backend": "host_shm", "repeats": repeats, "fresh": fresh, "layers": layers,
               "machine": _machine(),
               "results": [asdict(r) for r in results]}
        json_path.write_text(json.dumps(doc, indent=2))
        click.echo(f"wrote {json_path}")
