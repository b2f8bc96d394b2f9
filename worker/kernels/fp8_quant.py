"""Dynamic per-tensor fp8 activation quantization (Triton), bit-identical to the reference.

`layers.linear.quantize_fp8_per_tensor_dynamic` is the oracle: scale = max(amax|x| / 448,
1e-12) in float32, x_q = clamp(x / scale, -448, 448) cast to float8_e4m3fn. As eager torch
ops that is five or six kernels and extra passes over x (cast, abs, amax, div, clamp, div,
clamp, cast) before every fp8 GEMM; here it is one launch (two on the fallback path):

- small (M * K <= SMALL_MAX_NUMEL, decode at batch 1..4 on 4k-14k wide layers): one
  program reads x twice — once for amax, once to quantize — the second read from L2.
- coop (larger inputs on CUDA whose grid fits the GPU: decode batches up to ~64 on
  Llama-8B widths): `_quantize_coop_kernel`. Each program of the grid
  (cdiv(M, BLOCK_M), cdiv(K, BLOCK_K)) loads its tile once into registers, stores the tile's
  maximum in its own slot of a workspace, waits at a grid-wide barrier, reduces all slots to
  the tensor's maximum, derives the scale (program 0 stores it for the GEMM) and quantizes the
  tile it still holds. One launch instead of two: in a decode graph the cost of this step is
  launch latency, not bandwidth (128 linears a step).
- two (the fallback: in Triton's CPU interpreter, on CPU tensors, or when the grid has more
  programs than the GPU has multiprocessors): `_absmax_kernel` stores each tile's maximum in
  its slot (one float per program: no atomics, nothing to zero first — a memset per linear
  cost as much as a third launch in decode graphs); `_quantize_kernel` then reads every slot,
  derives the scale and quantizes its tile, reading x a second time.

The grid barrier (`_grid_barrier`) is sense-reversing, over a persistent int32 state
[count, generation] that every launch leaves at count 0, so nothing is zeroed per call. Each
program reads the generation (acquire) *before* arriving — it cannot move until this program
has arrived — then arrives with `atomic_add(count, 1)` (acq_rel: it also publishes the slot
store, made CTA-wide by a block barrier first). The last to arrive resets count to 0 and
bumps the generation (release); the others spin until the generation differs from what they
read, then read the slots through L2 (`.cg`). Why it is safe:

- every program must be resident at once, or those spinning would wait for programs that
  never get an SM: the coop path is taken only when the grid has at most as many programs as
  the device has multiprocessors (each SM holds at least one of them; other streams' kernels
  only delay the last ones, as they finish without waiting on this one), never in Triton's
  interpreter (it runs programs one after another) and never for CPU tensors;
- two launches sharing one state must never run concurrently: there is one state per
  (device, stream) — `torch.cuda.current_stream()`, the capture stream while capturing — and
  launches on one stream run one after another. Back to back, the next launch finds count 0;
  the generation only grows (wrapping is harmless: waiters compare for equality). A CUDA
  graph keeps the pointer of its capture stream's state and replays leave it as they found
  it; graphs captured on one stream must not be replayed concurrently with each other or with
  eager work on that stream (the engine replays on one stream);
- the states are slots of one zeroed int32 arena per device (`MAX_COOP_STREAMS` slots),
  created by the first eager coop call and synchronized once, kept for the life of the
  process (a deliberate module-level cache: a rebuilt engine reuses them, left at count 0).
  A capture never allocates one (the zeroing would only be a node of that graph, and another
  graph captured on the same stream could replay first and find garbage): a capture before
  any eager coop call on its device, or beyond MAX_COOP_STREAMS streams, takes the two-kernel
  path. Under MPS with a thread-percentage limit the SM count overstates what this process may
  use; force `path="two"` there.

The kernels that produce a linear's input can quantize it themselves: the fused add + RMSNorm
(`rmsnorm.add_rms_norm_fp8_into`) and SiLU-and-mul (`activation.silu_and_mul_fp8_into`) use this
module's pieces — their coop kernels store their tiles' maxima, then `_grid_scale` (barrier,
slots, scale) and `_quantize_tile`, launched with `coop_launch_state`; their two paths store the
values and maxima, then `quantize_from_partials` (this module's second kernel).

Every program derives the scale from amax with the reference's float32 steps (IEEE
division `div_rn`, never the approximate one), so the scale and every quantized value
equal the CPU reference's bit for bit, on every path. (The same reference run eagerly on
CUDA can be one ulp off in the scale: torch divides a CUDA tensor by a Python scalar as a
multiplication by its reciprocal.) The quantized values are stored in the output
pointer's element type: float8_e4m3fn for the GEMM; a float32 output gives the clamped
x / scale before the cast (how the tests check the math in Triton's CPU interpreter, whose
fp8 cast rounds wrongly).
"""
from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from resident.worker.kernels import pdl
from resident.worker.kernels._util import check_dtype, check_last_dim_contiguous, check_same_device, next_pow2
from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

#: At most this many elements go through the one-program kernel.
SMALL_MAX_NUMEL = 16384
#: Elements per program of the large paths (tile held in registers by the coop kernel).
TILE_NUMEL = 8192
MAX_BLOCK_K = 2048
#: Paths `quantize_fp8_into(path=...)` can force.
PATHS = ("small", "two", "coop")
#: Barrier states per device (one per stream that runs the coop kernel); past it: two kernels.
MAX_COOP_STREAMS = 256


def check_fused_output(what: str, x: torch.Tensor, out: torch.Tensor, shape: tuple[int, int], path: str | None,
                       paths: tuple[str, ...]) -> None:
    """The checks a producer that quantizes its own output (rmsnorm's and activation's fused
    fp8 ops) makes of `out` [M, N] (`shape`) and a forced `path`; ValueError naming the problem."""
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"cannot quantize an empty activation {tuple(x.shape)}")
    if tuple(out.shape) != tuple(shape) or out.dtype not in (FP8_DTYPE, torch.float32):
        raise ValueError(f"out must be {FP8_DTYPE} (or float32 for tests) of shape {tuple(shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    check_last_dim_contiguous("out", out)
    check_same_device(x=x, out=out)
    if path is not None and path not in paths:
        raise ValueError(f"unknown fused {what} + fp8 path {path!r}; valid: {', '.join(paths)}")


@triton.jit
def _scale_from_amax(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    return tl.maximum(tl.math.div_rn(amax, tl.full([], FP8_MAX, tl.float32)), MIN_SCALE)


@triton.jit
def _quantize_tile(x, scale, FP8_MAX: tl.constexpr):
    q = tl.math.div_rn(x, tl.zeros(x.shape, tl.float32) + scale)   # div_rn takes same-shape operands
    return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)


@triton.jit
def _quantize_small_kernel(x_ptr, out_ptr, scale_ptr, M, K, stride_x, stride_out,
                           BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl.enter(PDL)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for m in range(M):
        row = m * stride_x
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
    scale = _scale_from_amax(tl.max(acc, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr, scale)
    for m in range(M):
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = _quantize_tile(x, scale, FP8_MAX)
            tl.store(out_ptr + m * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=cols < K)


@triton.jit
def _absmax_kernel(x_ptr, partial_ptr, M, K, stride_x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    tile_max = tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0)
    tl.store(partial_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile_max)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, partial_ptr, num_partials, M, K, stride_x, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slots = tl.arange(0, BLOCK_P)
    amax = tl.max(tl.load(partial_ptr + slots, mask=slots < num_partials, other=0.0), axis=0)
    scale = _scale_from_amax(amax, FP8_MAX, MIN_SCALE)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_ptr, scale)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    q = _quantize_tile(x.to(tl.float32), scale, FP8_MAX)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _grid_barrier(state_ptr, num_programs):
    """Sense-reversing grid barrier on [count, generation] (see the module doc); leaves count 0."""
    tl.debug_barrier()                                               # the whole CTA's stores precede the arrival
    generation = tl.atomic_add(state_ptr + 1, 0, sem="acquire")      # before arriving: it cannot move yet
    arrived = tl.atomic_add(state_ptr, 1, sem="acq_rel")
    if arrived == num_programs - 1:
        tl.atomic_xchg(state_ptr, 0, sem="relaxed")                  # ordered before the release below
        tl.atomic_add(state_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(state_ptr + 1, 0, sem="acquire") == generation:
            pass
    tl.debug_barrier()


@triton.jit
def _grid_scale(scale_ptr, partial_ptr, state_ptr, num_partials, BLOCK_P: tl.constexpr, FP8_MAX: tl.constexpr,
                MIN_SCALE: tl.constexpr):
    """The tensor's scale, in every program of a cooperative grid whose programs have each stored
    their tile's maximum in their slot: wait at the grid barrier, reduce all slots (program 0
    stores the scale for the GEMM). Shared by the fused producers (`rmsnorm`, `activation`)."""
    _grid_barrier(state_ptr, num_partials)
    slots = tl.arange(0, BLOCK_P)
    # .cg: the slots other SMs wrote are read from L2, never from a stale L1 line.
    amax = tl.max(tl.load(partial_ptr + slots, mask=slots < num_partials, other=0.0, cache_modifier=".cg"), axis=0)
    scale = _scale_from_amax(amax, FP8_MAX, MIN_SCALE)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale)
    return scale


@triton.jit
def _quantize_coop_kernel(x_ptr, out_ptr, scale_ptr, partial_ptr, state_ptr, num_partials, M, K, stride_x,
                          stride_out, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tile_max = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_k, tile_max)
    scale = _grid_scale(scale_ptr, partial_ptr, state_ptr, num_partials, BLOCK_P, FP8_MAX, MIN_SCALE)
    q = _quantize_tile(x, scale, FP8_MAX)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty),
             mask=mask)


NO_STATE_REASON = (f"a CUDA graph capture before any eager coop call on this device, or more than "
                   f"{MAX_COOP_STREAMS} streams")
#: Triton decides at decoration (import) time whether kernels are interpreted.
_INTERPRETED = not isinstance(_quantize_coop_kernel, JITFunction)
# Barrier states, never freed (see the module doc): device index -> [MAX_COOP_STREAMS, 2] int32
# arena zeroed once; (device index, stream handle) -> its slot of the arena.
_COOP_ARENAS: dict[int, torch.Tensor] = {}
_COOP_STATES: dict[tuple[int, int], torch.Tensor] = {}
_COOP_LOCK = threading.Lock()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _coop_state(device: torch.device) -> torch.Tensor | None:
    """The barrier state [count, generation] of the current stream on `device`, or None when
    none can be had without allocating inside a CUDA graph capture (or all slots are taken)."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    state = _COOP_STATES.get(key)
    if state is not None:
        return state
    with _COOP_LOCK:
        if key in _COOP_STATES:
            return _COOP_STATES[key]
        arena = _COOP_ARENAS.get(device.index)
        if arena is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            arena = torch.zeros(MAX_COOP_STREAMS, 2, dtype=torch.int32, device=device)
            stream.synchronize()        # zero before any stream's kernel uses a slot
            _COOP_ARENAS[device.index] = arena
        taken = sum(1 for dev, _ in _COOP_STATES if dev == device.index)
        if taken >= MAX_COOP_STREAMS:
            return None
        _COOP_STATES[key] = state = arena[taken]
        return state


def _large_grid(m: int, k: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_M, BLOCK_K, grid) of the large paths."""
    block_k = min(next_pow2(k), MAX_BLOCK_K)
    block_m = max(1, min(next_pow2(m), TILE_NUMEL // block_k))
    return block_m, block_k, (triton.cdiv(m, block_m), triton.cdiv(k, block_k))


def coop_grid_unsupported_reason(x: torch.Tensor, num_programs: int) -> str | None:
    """Why a cooperative kernel (one with `_grid_barrier`) of `num_programs` programs cannot run
    on x's device here (None: it can, given a barrier state)."""
    if _INTERPRETED:
        return ("Triton's CPU interpreter (TRITON_INTERPRET=1) runs the programs one after another, "
                "so the coop kernel's grid barrier would wait forever")
    if x.device.type != "cuda":
        return f"x is on {x.device}; the coop kernel's grid barrier needs a CUDA device"
    num_sms = _num_sms(x.device.index)
    if num_programs > num_sms:
        return (f"its grid of {num_programs} programs exceeds the device's {num_sms} multiprocessors: "
                f"not every program would be resident at once and the grid barrier could deadlock")
    return None


def coop_unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the one-launch cooperative kernel cannot quantize x [M, K] here (None: it can, given
    a barrier state)."""
    _, _, grid = _large_grid(*x.shape)
    return coop_grid_unsupported_reason(x, grid[0] * grid[1])


def coop_block_p(x: torch.Tensor) -> int:
    """BLOCK_P (slots each program reads) of a fused producer's cooperative launch on x's device:
    room for as many programs as a grid that fits can have, so one build serves every batch size."""
    return next_pow2(_num_sms(x.device.index))


def coop_launch_state(x: torch.Tensor, num_programs: int, forced: bool) -> torch.Tensor | None:
    """The barrier state for a cooperative launch of `num_programs` programs on x's device, or None
    when the caller must take its non-cooperative path; `forced` (path='coop' asked for) raises
    the ValueError saying why instead."""
    reason = coop_grid_unsupported_reason(x, num_programs)
    if reason is None:
        state = _coop_state(x.device)
        if state is not None:
            return state
        reason = f"no barrier state for this stream ({NO_STATE_REASON})"
    if forced:
        raise ValueError(f"path='coop' cannot run: {reason}; use path='two'")
    return None


def takes_small_path(m: int, k: int) -> bool:
    """Whether x [m, k] is quantized by the one-program path by default (`choose_path`)."""
    return m * k <= SMALL_MAX_NUMEL


def choose_path(x: torch.Tensor) -> str:
    """The path `quantize_fp8_into` takes for x [M, K] by default: small, coop or two."""
    if takes_small_path(x.shape[0], x.shape[1]):
        return "small"
    return "two" if coop_unsupported_reason(x) is not None else "coop"


def _resolve_path(x: torch.Tensor, small: bool | None, path: str | None) -> str:
    if small is not None:
        if path is not None:
            raise ValueError("quantize_fp8_into takes `small` or `path`, not both (small=True is path='small', "
                             "small=False path='two')")
        path = "small" if small else "two"
    if path is None:
        return choose_path(x)
    if path not in PATHS:
        raise ValueError(f"unknown fp8 quantization path {path!r}; valid: {', '.join(PATHS)}")
    if path == "coop" and (reason := coop_unsupported_reason(x)) is not None:
        raise ValueError(f"path='coop' cannot run: {reason}; use path='two'")
    return path


def quantize_from_partials(x: torch.Tensor, out: torch.Tensor, buf: torch.Tensor, num_partials: int) -> None:
    """The two-kernel path's second launch: buf[1:1 + num_partials] hold maxima of |x| that together
    cover x [M, K] (written by `_absmax_kernel`, or by a fused producer of x); derive the scale into
    buf[0] and quantize x into `out`."""
    block_m, block_k, grid = _large_grid(*x.shape)
    pdl_opts = pdl.launch(x.device, x.shape[0])
    _quantize_kernel[grid](x, out, buf, buf[1:], num_partials, x.shape[0], x.shape[1], x.stride(0), out.stride(0),
                           BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_P=next_pow2(num_partials), FP8_MAX=FP8_MAX,
                           MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=8)


def quantize_fp8_into(x: torch.Tensor, out: torch.Tensor, small: bool | None = None, *,
                      path: str | None = None) -> torch.Tensor:
    """Quantize x [M, K] into `out` [M, K] (float8_e4m3fn; float32 for tests); returns the
    float32 scale as a 0-dim tensor. `path` forces one of PATHS (small: one program; two: the
    two-kernel path; coop: the one-launch cooperative kernel, a ValueError where it cannot run);
    None picks as `choose_path`. `small=True/False` is the older spelling of path='small'/'two'."""
    check_dtype("x", x)
    if x.dim() != 2 or out.shape != x.shape:
        raise ValueError(f"quantize_fp8_into expects x [M, K] and out of the same shape, got {tuple(x.shape)} "
                         f"and {tuple(out.shape)}")
    if out.dtype not in (FP8_DTYPE, torch.float32):
        raise TypeError(f"out must be {FP8_DTYPE} (or float32 for tests), got {out.dtype}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("out", out)
    check_same_device(x=x, out=out)
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"cannot quantize an empty activation {tuple(x.shape)}")
    forced = path is not None or small is not None
    path = _resolve_path(x, small, path)
    # buf[0]: the scale (what the GEMM reads); the large paths' per-program maxima follow it.
    if path == "small":
        buf = torch.empty(2, dtype=torch.float32, device=x.device)
        pdl_opts = pdl.launch(x.device, m)
        _quantize_small_kernel[(1,)](x, out, buf, m, k, x.stride(0), out.stride(0),
                                     BLOCK_K=min(next_pow2(k), MAX_BLOCK_K), FP8_MAX=FP8_MAX,
                                     MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=8)
        return buf[0]
    block_m, block_k, grid = _large_grid(m, k)
    num_partials = grid[0] * grid[1]
    buf = torch.empty(1 + num_partials, dtype=torch.float32, device=x.device)   # every slot is written
    if path == "coop" and (state := coop_launch_state(x, num_partials, forced)) is not None:
        pdl_opts = pdl.launch(x.device, m)
        _quantize_coop_kernel[grid](x, out, buf, buf[1:], state, num_partials, m, k, x.stride(0), out.stride(0),
                                    BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_P=next_pow2(num_partials),
                                    FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, **pdl_opts, num_warps=8)
        return buf[0]
    pdl_opts = pdl.launch(x.device, m)
    _absmax_kernel[grid](x, buf[1:], m, k, x.stride(0), BLOCK_M=block_m, BLOCK_K=block_k, **pdl_opts, num_warps=8)
    quantize_from_partials(x, out, buf, num_partials)
    return buf[0]


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q float8_e4m3fn [M, K] contiguous, scale float32 0-dim): the reference's
    `quantize_fp8_per_tensor_dynamic`, fused."""
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return out, quantize_fp8_into(x, out)


__all__ = ["PATHS", "SMALL_MAX_NUMEL", "choose_path", "coop_block_p", "coop_grid_unsupported_reason",
           "coop_launch_state", "coop_unsupported_reason", "quantize_fp8_into", "quantize_fp8_per_tensor",
           "quantize_from_partials", "takes_small_path"]
