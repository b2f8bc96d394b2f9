"""`resident bench ...` with bad inputs: each is refused before any work with one line naming the
problem and the fix (no traceback, no results lost at the end of a run), and a bench ended with
SIGTERM (a `timeout` around it) leaves none of its daemons or workers behind."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from resident.cli import bench_throughput
from resident.cli.bench import bench

# Every bench with a MODEL argument, with the options that keep a run that slipped through short.
_MODEL_BENCHES = {
    "throughput": ["--batch-sizes", "1", "--context", "8", "--steps", "1", "--warmup-steps", "0"],
    "perplexity": ["--quantization", "none", "--max-tokens", "16"],
    "speculative": ["--batch-sizes", "1", "--max-tokens", "2", "--modes", "plain", "--workloads", "chat"],
    "restart": ["--runs", "1", "--variants", "cold"],
    "rollout": ["--duration", "0.5", "--clients", "1", "--replicas", "1"],
    "handover": ["--workers", "0"],
}


def _bench(*args: str):
    return CliRunner().invoke(bench, list(args))


def _one_line_error(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    for n in needles:
        assert n in r.output, r.output
    return r.output


@pytest.mark.parametrize("name", sorted(_MODEL_BENCHES))
def test_a_json_path_in_a_missing_folder_is_refused_before_the_run(name, tiny_model, tmp_path):
    model = tiny_model("llama")
    out = tmp_path / "no-such-folder" / "r.json"
    r = _bench(name, str(model), *_MODEL_BENCHES[name], "--json", str(out))
    _one_line_error(r, "--json", f"folder {out.parent} does not exist")


@pytest.mark.parametrize("name", ["attach", "kernels"])
def test_benches_without_a_model_refuse_a_missing_json_folder_too(name, tmp_path):
    r = _bench(name, "--json", str(tmp_path / "missing" / "r.json"))
    _one_line_error(r, "--json", "does not exist")


def test_an_existing_json_file_is_kept_until_the_run_writes_it(tiny_model, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("earlier results")
    r = _bench("throughput", str(tmp_path / "nothing-here"), "--json", str(out))
    assert r.exit_code == 2
    assert out.read_text() == "earlier results"


@pytest.mark.parametrize("name", sorted(_MODEL_BENCHES))
def test_a_folder_that_is_not_a_model_is_refused_naming_it(name, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    r = _bench(name, str(tmp_path), *_MODEL_BENCHES[name])
    _one_line_error(r, "has no config.json", "resident bench checkpoint")


def test_a_draft_that_is_not_a_model_is_refused(tiny_model, tmp_path):
    r = _bench("speculative", str(tiny_model("llama")), "--draft", str(tmp_path))
    _one_line_error(r, "--draft", "has no config.json")


def test_more_draft_layers_than_the_model_has_is_a_usage_error(tiny_model):
    r = _bench("speculative", str(tiny_model("llama")), "--draft-layers", "99", *_MODEL_BENCHES["speculative"][:-4])
    _one_line_error(r, "--draft-layers", "layers", "give a --draft model")


def test_perplexity_refuses_an_unknown_quantization_and_dtype(tiny_model):
    model = str(tiny_model("llama"))
    _one_line_error(_bench("perplexity", model, "--quantization", "none,int3"), "unknown quantization 'int3'",
                    "fp8_per_tensor")
    _one_line_error(_bench("perplexity", model, "--dtype", "float7"), "float7")


def test_restart_refuses_an_unknown_quantization_before_starting_anything(tiny_model):
    _one_line_error(_bench("restart", str(tiny_model("llama")), "--quantization", "int3"),
                    "unknown quantization 'int3'")


def test_restart_refuses_a_plot_with_an_unknown_extension(tiny_model, tmp_path):
    r = _bench("restart", str(tiny_model("llama")), "--plot", str(tmp_path / "phases.xyz"))
    _one_line_error(r, "--plot", ".png or .svg")


def test_restart_on_cuda_without_a_gpu_says_so(tiny_model):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is usable here")
    _one_line_error(_bench("restart", str(tiny_model("llama")), "--device", "cuda"), "no CUDA GPU", "--device cpu")


def test_throughput_refuses_a_context_past_the_models_positions(tiny_model):
    model = tiny_model("llama")   # max_position_embeddings 512
    r = _bench("throughput", str(model), "--context", "1000", "--steps", "1", "--warmup-steps", "0")
    _one_line_error(r, "--context", "512 positions")


def test_throughput_out_of_memory_is_one_line_naming_the_flags(tiny_model, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError("cannot allocate the KV cache (...)")

    monkeypatch.setattr(bench_throughput, "run_throughput", out_of_memory)
    r = _bench("throughput", str(tiny_model("llama")), "--batch-sizes", "1", "--context", "8")
    assert r.exit_code == 1, r.output
    assert "cannot allocate the KV cache" in r.output and "lower --context or the largest --batch-sizes" in r.output


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_sigterm_to_a_bench_stops_the_daemon_it_started(tiny_model, tmp_path):
    """`timeout 600 resident bench handover` (tests/h200.sh): the daemon it spawned is stopped."""
    import psutil

    model = tiny_model("llama")
    p = subprocess.Popen([sys.executable, "-m", "resident.cli.main", "bench", "handover", str(model),
                          "--workers", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    daemons: list = []
    try:
        deadline = time.monotonic() + 120
        while not daemons and p.poll() is None and time.monotonic() < deadline:
            daemons = [c for c in _descendants(p.pid) if "preload" in " ".join(c.cmdline())]
            time.sleep(0.05)
        assert daemons, "the bench started no daemon"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(daemons, timeout=30)
        assert not alive, [a.cmdline() for a in alive]
        out = p.stdout.read().decode()
        assert "bench handover interrupted; logs in " in out, out
        shutil.rmtree(out.split("bench handover interrupted; logs in ")[1].split()[0])
    finally:   # without the fix the daemon outlives the bench: stop it here
        for c in [*_descendants(p.pid), *daemons]:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_the_sigterm_handler_is_given_back_when_the_bench_ends(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    _bench("throughput", str(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("name, flag", [("rollout", "--think"), ("rollout", "--duration"),
                                        ("rollout", "--ready-timeout"), ("handover", "--timeout")])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_nan_or_inf_seconds_are_refused(name, flag, value, tiny_model):
    r = _bench(name, str(tiny_model("llama")), flag, value)
    _one_line_error(r, flag, f"finite number of seconds, not {value}")


def test_an_unknown_command_names_the_close_and_the_valid_ones():
    from resident.cli.main import cli

    r = CliRunner().invoke(cli, ["prepare"])
    _one_line_error(r, "No such command 'prepare'", "Did you mean prepare-model?", "Commands: bench, demo")
    r = _bench("spec")
    _one_line_error(r, "Did you mean speculative?", "attach, checkpoint")
    r = _bench("tp")
    assert "Did you mean" not in r.output
    _one_line_error(r, "No such command 'tp'", "throughput")


@pytest.mark.parametrize("name", ["restart", "rollout", "handover"])
def test_serve_args_with_an_unclosed_quote_are_refused(name, tiny_model):
    r = _bench(name, str(tiny_model("llama")), "--serve-args", '--served-model-name "unclosed')
    _one_line_error(r, "--serve-args", "No closing quotation")


def test_perplexity_refuses_a_text_that_is_not_utf8(tiny_model, tmp_path):
    text = tmp_path / "weights.bin"
    text.write_bytes(b"ok \xff\xfe\xfd")
    r = _bench("perplexity", str(tiny_model("llama")), "--quantization", "none", "--text", str(text))
    _one_line_error(r, "--text", "is not UTF-8 text")


def test_attach_over_max_bytes_is_one_line_naming_the_fix(tmp_path):
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "attach", "--sizes", "1MiB",
                        "--repeats", "1", "--fresh", "0", "--layers", "1", "--max-bytes", "1KiB",
                        "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "more than --max-bytes" in r.stderr and "raise --max-bytes" in r.stderr


def test_throughput_with_a_tp_size_that_does_not_divide_the_heads_is_a_usage_error(tiny_model):
    r = _bench("throughput", str(tiny_model("llama")), "--tensor-parallel-size", "3", "--batch-sizes", "1",
               "--context", "8", "--steps", "1", "--warmup-steps", "0")
    _one_line_error(r, "--tensor-parallel-size 3 does not divide")


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path):
    """A full disk (a 64 KiB file size limit stands in for it) or a read-only OUT ended
    `bench checkpoint` in an OSError traceback, with the partial shard left behind."""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))

    out = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "checkpoint", str(out), "--shape", "tiny",
                        "--device", "cpu"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                       preexec_fn=small_files)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot write the checkpoint to {out}: File too large; nothing was kept; choose another OUT" in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["throughput", "speculative"])
@pytest.mark.parametrize("sizes", ["", "0", "a,b"])
def test_bad_batch_sizes_name_the_flag(name, sizes, tiny_model):
    """The error said only "Invalid value: expected positive integers, got ''", naming no option."""
    r = _bench(name, str(tiny_model("llama")), "--batch-sizes", sizes)
    _one_line_error(r, "Invalid value for --batch-sizes", repr(sizes))


def test_restart_says_before_the_run_that_a_png_will_be_an_svg_without_matplotlib(tiny_model, tmp_path, monkeypatch):
    """Without matplotlib a .png/.jpg --plot falls back to .svg: said at the start, not only after
    the whole run (the quantization error stops this run right after the option checks)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    r = _bench("restart", str(tiny_model("llama")), "--plot", str(tmp_path / "phases.jpg"), "--quantization", "int3")
    _one_line_error(r, "unknown quantization 'int3'")
    assert f"matplotlib is not installed (pip install matplotlib), so the picture will be {tmp_path / 'phases.svg'}" \
        in r.output, r.output
