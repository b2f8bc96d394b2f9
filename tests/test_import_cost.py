"""What `resident serve` imports before it is ready, and the CUDA context made during the imports.

A worker's restart is bounded below by `import torch`; everything else it imports before
/ready adds to every restart. These tests run a real `resident serve` (tiny model, CPU)
with CPython's import profiler on (`PYTHONPROFILEIMPORTTIME`, written to the log as
modules load) and read which modules were imported before the "ready in" line — for a
cold start (--preload off) and for a restart attached to a daemon. A heavy library on that
path (transformers, the GGUF reader, plotting, the grpc code generator, ...) fails them.

The CUDA context pre-creation (worker/cuda_preinit.py) runs in a thread during the imports;
off a GPU it must stay harmless, on a GPU it must leave torch on the same primary context.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serve_helpers import daemon_helpers, servable_tiny_model, serve_env, start_serve, stop_serve  # noqa: E402

from resident.worker.cuda_preinit import ContextPreinit, device_index_for, start_context_preinit  # noqa: E402

#: Never needed to serve: a model folder is read by resident's own safetensors/tokenizer code.
HEAVY = ("transformers", "accelerate", "gguf", "huggingface_hub", "safetensors", "matplotlib", "pandas", "scipy",
         "sklearn", "openai", "numba", "IPython", "psutil",
         # structured outputs: imported on the first guided request, never to start
         "xgrammar", "tvm_ffi", "pydantic")
#: Needed only after /ready: chat templates (jinja2) are compiled for the first chat request,
#: in a thread once the worker is ready (startup.compile_chat_template_after_ready).
AFTER_READY = ("jinja2", "markupsafe", "resident.worker.chat_template")
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| ( *)(\S+)$")


def _imported_before_ready(log: Path) -> list[str]:
    modules = []
    for line in log.read_text(errors="replace").splitlines():
        if " resident.worker.entrypoint: ready in " in line:
            return modules
        m = _IMPORT_LINE.match(line)
        if m:
            modules.append(m.group(2))
    raise AssertionError(f"no 'ready in' line in {log}:\n{log.read_text()[-3000:]}")


def _check_lean(modules: list[str], triton_allowed: bool = False) -> None:
    tops = {m.split(".")[0] for m in modules}
    heavy = sorted(tops & set(HEAVY + (() if triton_allowed else ("triton",))))
    assert not heavy, (f"`resident serve` imported {heavy} before /ready: every restart pays for them; import "
                       f"them where they are used (after ready, or only in the command that needs them)")
    early = sorted((tops | set(modules)) & set(AFTER_READY))
    assert not early, (f"`resident serve` imported {early} before /ready; they serve only requests (chat "
                       f"templates): import them where a template is compiled")
    assert "torch" in tops and "aiohttp" in tops, "the import profile was not captured"


def test_cold_serve_imports_nothing_heavy_before_ready(tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "m")
    log = tmp_path / "serve.log"
    proc = start_serve(model, log, "--preload", "off", env=serve_env(PYTHONPROFILEIMPORTTIME="1"))
    stop_serve(proc)
    _check_lean(_imported_before_ready(log))


def test_attached_restart_imports_nothing_heavy_before_ready(tmp_path, short_tmp) -> None:
    model = servable_tiny_model(tmp_path / "m")
    d = daemon_helpers().start_daemon(short_tmp)
    try:
        log = tmp_path / "serve.log"
        proc = start_serve(model, log, "--preload", "auto", "--socket", d.socket,
                           env=serve_env(PYTHONPROFILEIMPORTTIME="1"))
        stop_serve(proc)
    finally:
        d.stop()
    modules = _imported_before_ready(log)
    assert "resident.daemon.client" in modules, "the worker did not attach through the daemon client"
    _check_lean(modules)
    # The import phase splits into its parts (resident bench restart's floor is `import torch`).
    assert re.search(r"import breakdown: [0-9.]+ s to the serve command .*, torch [0-9.]+ s, worker modules [0-9.]+ s",
                     log.read_text()), log.read_text()[-3000:]


def test_the_chat_template_is_compiled_after_ready(tmp_path) -> None:
    from fixtures_tokenizer import write_tiny_tokenizer

    from resident.worker.startup import Worker, compile_chat_template_after_ready
    from resident.worker.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer = Tokenizer.from_folder(tmp_path)
    worker = Worker(store=None, engine=None, serving=None, tokenizer=tokenizer)
    thread = compile_chat_template_after_ready(worker)
    assert thread is not None
    thread.join(60)
    assert "default" in tokenizer._compiled
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert compile_chat_template_after_ready(Worker(store=None, engine=None, serving=None)) is None


def test_the_cli_itself_imports_neither_torch_nor_the_worker() -> None:
    code = ("import sys; from resident.cli.main import cli; from resident.cli import serve; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'aiohttp', 'grpc', 'jinja2'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# --- the CUDA context made while torch imports -------------------------------------------------
def test_preinit_targets_the_device_torch_will_use() -> None:
    assert device_index_for("cpu") is None and start_context_preinit("cpu") is None
    assert device_index_for("auto") == 0 and device_index_for("cuda") == 0 and device_index_for("cuda:3") == 3
    with pytest.raises(ValueError, match=">= 0"):
        ContextPreinit(-1)


def test_preinit_without_a_visible_gpu_only_records_why() -> None:
    # Its own process: the driver reads CUDA_VISIBLE_DEVICES once, at its first cuInit.
    code = ("from resident.worker.cuda_preinit import ContextPreinit; p = ContextPreinit(0).start(); "
            "print(p.join(), p.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=serve_env(CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("False ") and "skipped" in out.stdout, out.stdout


@pytest.mark.gpu
def test_preinit_context_is_the_one_torch_uses() -> None:
    code = """
from resident.worker.cuda_preinit import start_context_preinit
p = start_context_preinit("cuda:0")
import torch
assert p.join(), p.describe()
from cuda.bindings import driver as drv
_, dev = drv.cuDeviceGet(0)
_, primary = drv.cuDevicePrimaryCtxRetain(dev)
torch.cuda.set_device(0)
x = torch.ones(4, device="cuda") * 2
_, current = drv.cuCtxGetCurrent()
assert int(current) == int(primary), (current, primary)
assert x.sum().item() == 8.0
print("ok", round(p.seconds, 3))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_serve_logs_the_overlapped_context(tmp_path) -> None:
    model = servable_tiny_model(tmp_path / "m")
    env = serve_env(PYTHONPROFILEIMPORTTIME="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    log = tmp_path / "serve.log"
    proc = start_serve(model, log, "--preload", "off", "--device", "cuda", env=env)
    stop_serve(proc)
    text = log.read_text()
    assert "overlapped with the imports" in text
    # Triton's once-per-process work (libtriton hash, ptxas, driver) ran in the background thread.
    assert "Triton start-up work done in the background" in text, text[-3000:]
    _check_lean(_imported_before_ready(log), triton_allowed=True)
