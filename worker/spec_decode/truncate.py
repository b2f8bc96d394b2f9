"""A draft checkpoint cut from a target: its first N decoder layers, the same embeddings,
final norm, LM head and tokenizer — a same-vocabulary draft needing no download (the
bench's draft for SmolLM2-135M)."""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"\.layers\.(\d+)\.")
#: Tokenizer and template files copied beside the draft's weights.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def write_truncated_checkpoint(source: str | Path, dest: str | Path, num_layers: int) -> Path:
    """Write an HF folder at `dest` holding `source`'s first num_layers layers (safetensors)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, dest = Path(source), Path(dest)
    config = json.loads((source / "config.json").read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= num_layers <= total:
        raise ValueError(f"{source} has {total} layers; the draft needs 1..{total}, got {num_layers}")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {source}; pass an HF checkpoint folder")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = st.get_tensor(name)
    dest.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):   # per-layer lists follow the cut
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    for name in _SIDE_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    logger.info("wrote a %d-of-%d-layer draft of %s to %s", num_layers, total, source, dest)
    return dest
