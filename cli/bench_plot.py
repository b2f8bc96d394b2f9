"""Stacked bars of start-up phases for `resident bench restart --plot`.

PNG through matplotlib (imported only here); SVG written directly, so a picture can be
made where matplotlib is not installed (a .png request then falls back to .svg, with a
warning naming the fix).
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

LABELS = {"hf": "(a) HF transformers", "cold": "(b) resident, --preload off", "warm": "(c) resident + daemon",
          "warm-fe": "(d) (c) + --frontend process"}
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac"]


def segments(result: dict) -> list[tuple[str, float]]:
    """(phase, seconds) from exec to the first token, in order; the unmeasured rest up to
    ready is "other" and the part after ready is "first token"."""
    phases = result.get("phases", {})
    segs = [(k, float(v)) for k, v in phases.items() if k not in ("total", "first_token") and v > 0]
    rest = result["ready_s"] - sum(v for _, v in segs)
    if rest > 0.005:
        segs.append(("other", rest))
    segs.append(("first token", max(0.0, result["first_token_s"] - result["ready_s"])))
    return segs


def _bars(results: dict, variants: list[str]) -> list[tuple[str, list[tuple[str, float]]]]:
    return [(LABELS.get(v, v), segments(results[v])) for v in variants if "ready_s" in results.get(v, {})]


def _colors(bars) -> dict[str, str]:
    names = list(dict.fromkeys(name for _, segs in bars for name, _ in segs))
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def _title(results: dict) -> str:
    floor = results.get("floor", {})
    f = floor.get("import_torch_cuda_init_s", floor.get("import_torch_s"))
    model = Path(results.get("model", "")).name
    return (f"exec -> first token, {model} on {results.get('gpu') or results.get('device')}"
            + (f" (floor: import torch{' + CUDA init' if 'import_torch_cuda_init_s' in floor else ''} {f:.2f} s)"
               if f else ""))


def plot_target(path: Path) -> Path:
    """The file `plot_phases` will write for `path`: itself, or its .svg twin when `path` needs
    matplotlib and it is not installed (so a bench can say so before its run, not after)."""
    import importlib.util

    if path.suffix.lower() == ".svg" or importlib.util.find_spec("matplotlib") is not None:
        return path
    return path.with_suffix(".svg")


def plot_phases(results: dict, variants: list[str], path: Path) -> Path:
    """Draw the bars to `path` (.png or .svg); returns the file written."""
    bars = _bars(results, variants)
    if not bars:
        raise ValueError("no variant finished; nothing to plot")
    if path.suffix.lower() == ".svg":
        return _svg(results, bars, path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fallback = path.with_suffix(".svg")
        log.warning("matplotlib is not installed (pip install matplotlib for PNG); writing %s instead", fallback)
        return _svg(results, bars, fallback)
    colors = _colors(bars)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.9 * len(bars)))
    seen = set()
    for y, (label, segs) in enumerate(bars):
        left = 0.0
        for name, v in segs:
            ax.barh(y, v, left=left, color=colors[name], edgecolor="white",
                    label=name if name not in seen else None)
            seen.add(name)
            if v > 0.04 * max(sum(x for _, x in s) for _, s in bars):
                ax.text(left + v / 2, y, f"{v:.2f}", ha="center", va="center", fontsize=8, color="white")
            left += v
        ax.text(left, y, f"  {left:.2f} s", va="center", fontsize=9)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from exec")
    ax.set_title(_title(results), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)   # beside the bars, never over them
    ax.set_xlim(0, 1.15 * max(sum(v for _, v in segs) for _, segs in bars))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _svg(results: dict, bars, path: Path) -> Path:
    colors = _colors(bars)
    width, left_margin, bar_h, gap, top = 900, 230, 28, 18, 40
    longest = max(sum(v for _, v in segs) for _, segs in bars) or 1.0
    scale = (width - left_margin - 80) / longest
    legend_y = top + len(bars) * (bar_h + gap) + 10
    height = legend_y + 20 * ((len(colors) + 3) // 4) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="22" font-size="13">{_esc(_title(results))}</text>']
    for i, (label, segs) in enumerate(bars):
        y = top + i * (bar_h + gap)
        out.append(f'<text x="{left_margin - 8}" y="{y + bar_h * 0.65}" font-size="12" text-anchor="end">'
                   f'{_esc(label)}</text>')
        x = float(left_margin)
        for name, v in segs:
            w = v * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{bar_h}" fill="{colors[name]}">'
                       f'<title>{_esc(name)}: {v:.3f} s</title></rect>')
            if w > 34:
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + bar_h * 0.65}" font-size="10" fill="white" '
                           f'text-anchor="middle">{v:.2f}</text>')
            x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + bar_h * 0.65}" font-size="12">{x / scale - left_margin / scale:.2f} s'
                   '</text>')
    for j, (name, color) in enumerate(colors.items()):
        lx, ly = 10 + (j % 4) * 220, legend_y + (j // 4) * 20
        out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{lx + 18}" y="{ly + 11}" font-size="11">{_esc(name)}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
    return path


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
