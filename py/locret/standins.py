"""Tiny stand-ins of the models users bring, built here the way their real models are built.

Every test of the default model runs plain RoPE. The models the Locret paper ran, and that users bring, do not:
Phi-3-mini-128K uses LongRoPE with an attention factor, Llama-3.1 llama3 frequency factors, Qwen2 models YaRN (and
q/k/v biases), StableLM-style models NEOX rotation of part of each head. A stand-in is a random-weight Hugging Face
model (transformers) with that model's RoPE configuration and small shapes, converted to GGUF with the pinned
llama.cpp tree's own ``convert_hf_to_gguf.py``, plus random retaining heads in the published checkpoint layout,
converted by our converter. The tokenizer is the default model's (read from its GGUF through transformers).

Weights are rounded to float16 before saving, so the float16 GGUF holds exactly the weights the Hugging Face model
computes with: the PyTorch references in the tests see the same model llama.cpp runs. Builds are cached in
``$LOCRET_CACHE_DIR/standins`` under a key of their specification and never committed.

``scripts/make_standins.py`` builds them from the command line.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cachelock, models
from ._library import REPO_ROOT

# bump when the way stand-ins are built changes (cached builds are then rebuilt)
BUILDER_VERSION = 1

VOCAB = 49152  # the default model's tokenizer
TREE = REPO_ROOT / "third_party" / "llama.cpp"

# SmolLM2's pre-tokenizer (digits split one by one, then byte-level BPE), which llama.cpp knows as "smollm";
# transformers' GGUF reader writes a plain byte-level one
SMOLLM_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


class StandinError(RuntimeError):
    """A stand-in cannot be built."""


@dataclass(frozen=True)
class StandinSpec:
    name: str
    hf_class: str       # transformers model class
    gguf_arch: str      # general.architecture that llama.cpp's converter writes
    stands_for: str     # the real model whose RoPE it reproduces
    config: dict = field(default_factory=dict)  # the transformers config


def _common(**kw) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                num_attention_heads=4, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return base


def _longrope(orig: int) -> dict:
    # LongRoPE's per-pair factors (16 pairs for head size 32): the long set rescales the low frequencies strongly
    return {"rope_type": "longrope", "original_max_position_embeddings": orig,
            "long_factor": [round(1.0 + 0.45 * i, 4) for i in range(16)],
            "short_factor": [round(1.0 + 0.04 * i, 4) for i in range(16)]}


SPECS: dict[str, StandinSpec] = {s.name: s for s in [
    # Phi-3-mini-128K: LongRoPE, original context 4096, 128K window; llama.cpp writes both factor sets and
    # rope.scaling.attn_factor = sqrt(1 + ln(32) / ln(4096)) ~ 1.19; fused QKV projection; NEOX rotation
    StandinSpec("phi3-longrope", "Phi3ForCausalLM", "phi3", "Phi-3-mini-128K (short factors: cells <= 4096)",
                _common(num_key_value_heads=4, max_position_embeddings=131072, rope_theta=10000.0,
                        original_max_position_embeddings=4096, rope_scaling=_longrope(4096),
                        tie_word_embeddings=True, pad_token_id=2)),
    # the same with an original context of 128 tokens, so that small test budgets (256+ cells) use the long factors;
    # attention factor sqrt(1 + ln(1024) / ln(128)) ~ 1.56
    StandinSpec("phi3-longrope-long", "Phi3ForCausalLM", "phi3", "Phi-3-mini-128K (long factors: cells > original)",
                _common(num_key_value_heads=4, max_position_embeddings=131072, rope_theta=10000.0,
                        original_max_position_embeddings=128, rope_scaling=_longrope(128),
                        tie_word_embeddings=True, pad_token_id=2)),
    # Llama-3.1: llama3 rope_freqs (factor 8, low/high frequency factors 1 and 4, original context 8192), theta
    # 500000, grouped-query attention; llama.cpp permutes Wq/Wk rows (normal rotation)
    StandinSpec("llama3-rope", "LlamaForCausalLM", "llama", "Llama-3.1-8B-Instruct",
                _common(num_key_value_heads=2, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                        tie_word_embeddings=True)),
    # Qwen2 with YaRN (factor 4 over 4096 tokens: ramp between interpolated and extrapolated frequencies, mscale
    # 1 + 0.1 ln 4), q/k/v biases, NEOX rotation
    StandinSpec("qwen2-yarn", "Qwen2ForCausalLM", "qwen2", "Qwen2 / Qwen2.5 with YaRN",
                _common(num_key_value_heads=2, max_position_embeddings=16384, rope_theta=1000000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
                        tie_word_embeddings=True)),
    # StableLM-2: NEOX rotation of a quarter of each head (partial_rotary_factor 0.25), q/k/v biases, LayerNorm,
    # grouped-query attention, parallel residual off
    StandinSpec("stablelm-partial", "StableLmForCausalLM", "stablelm", "StableLM-2 (partial NEOX rotary)",
                _common(num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                        partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=False,
                        tie_word_embeddings=False)),
]}


@dataclass(frozen=True)
class Standin:
    name: str
    spec: StandinSpec
    folder: Path

    @property
    def hf_dir(self) -> Path:
        return self.folder / "hf"

    @property
    def gguf(self) -> Path:
        return self.folder / f"{self.name}.gguf"

    @property
    def heads_checkpoint(self) -> Path:
        return self.folder / "heads.safetensors"

    @property
    def heads(self) -> Path:
        return self.folder / "heads.gguf"


def cache_folder() -> Path:
    return models.cache_dir() / "standins"


def _key(spec: StandinSpec) -> str:
    import torch
    import transformers

    blob = json.dumps({"spec": asdict(spec), "builder": BUILDER_VERSION, "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build(name: str, *, log=None) -> Standin:
    """The stand-in `name` (see SPECS), built into the cache if it is not there yet."""
    if name not in SPECS:
        raise StandinError(f"unknown stand-in {name!r}; known: {', '.join(SPECS)}")
    spec = SPECS[name]
    folder = cache_folder() / f"{name}-{_key(spec)}"
    standin = Standin(name, spec, folder)
    cachelock.build_folder_once(folder, (folder / "done").is_file, lambda staging: _build_into(standin, staging, log))
    return standin


def _build_into(standin: Standin, staging: Path, log) -> None:
    name, spec = standin.name, standin.spec
    log = log or (lambda msg: print(f"locret.standins: {msg}", file=sys.stderr, flush=True))
    if not (TREE / "convert_hf_to_gguf.py").is_file():
        raise StandinError(f"the llama.cpp tree is not prepared at {TREE}: run `bash scripts/setup.sh`")
    staged = Standin(name, spec, staging)
    log(f"building {name} ({spec.stands_for})")
    _save_hf_model(spec, staged.hf_dir)
    _convert_model(staged.hf_dir, staged.gguf)
    _make_heads(staged)
    (staging / "done").write_text(json.dumps(asdict(spec), indent=1))


def _save_hf_model(spec: StandinSpec, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, spec.hf_class.replace("ForCausalLM", "Config"))(**spec.config)
    model = getattr(transformers, spec.hf_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            # a little larger than the default init, so that attention is not uniform; float16-exact (see above)
            p.copy_((p * 4.0 if p.dim() == 2 else p).half().float())
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(out)


def _save_tokenizer(out: Path) -> None:
    from . import hf_gguf

    default = models.resolve(models.DEFAULT_MODEL)
    tok = hf_gguf.load_tokenizer(default)
    tok.save_pretrained(out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # Phi-3's converter reads a GPT-2 style vocabulary from it
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# transformers maps some model types to their own tokenizer class (a Qwen2 config gets Qwen2Tokenizer, which splits
# text the Qwen way); the stand-ins carry the default model's tokenizer, so the converter reads tokenizer.json as is
_CONVERT_LAUNCHER = """
import runpy, sys
from pathlib import Path
import transformers
from transformers import PreTrainedTokenizerFast
def _tokenizer(path, *args, **kwargs):
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))
transformers.AutoTokenizer.from_pretrained = _tokenizer
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).parent))  # the converter imports its conversion/ package
runpy.run_path(script, run_name="__main__")
"""


def _run(cmd: list, what: str, env: dict | None = None) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise StandinError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _convert_model(hf_dir: Path, out: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TREE / "gguf-py"), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    _run([sys.executable, "-c", _CONVERT_LAUNCHER, TREE / "convert_hf_to_gguf.py", hf_dir, "--outfile", out,
          "--outtype", "f16"], f"llama.cpp's convert_hf_to_gguf.py on {hf_dir.name}", env)


def _make_heads(s: Standin) -> None:
    convert = [sys.executable, "-m", "locret", "convert"]
    _run(convert + ["make-random", "--base", s.gguf, "--d-r", "64", "--seed", "5", "-o", s.heads_checkpoint],
         "random heads")
    _run(convert + ["--base", s.gguf, "--heads", s.heads_checkpoint, "-o", s.heads], "heads conversion")
